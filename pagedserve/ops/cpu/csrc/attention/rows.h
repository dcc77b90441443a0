/*
 * Row helpers of the attention units, at the ISA the including unit is built for: 16 lanes
 * (AVX-512: avx512.c, avx512bf16.c, amx.c), 8 lanes (AVX2 + FMA without AVX-512: avx2.c), or
 * plain C (scalar.c). Built with -ffp-contract=fast (attention accumulates in fp32 and may
 * contract).
 */
#ifndef PAGEDSERVE_ATTENTION_ROWS_H
#define PAGEDSERVE_ATTENTION_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* AVX2 + FMA without AVX-512 (AMD Zen 2/3, Intel client cores): 8-lane versions of the helpers. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif

#include "../common/avx2_math.h"
#include "../common/bf16.h"
#include "../common/kv_int8.h"
#include "attention.h"

#if defined(__AVX512F__) || defined(__AVX2__)
/* Ask for the next block's K or V (`bytes` contiguous bytes) while this one is being used: blocks
 * of a sequence are scattered over the pool, which defeats the hardware prefetcher at every block
 * boundary. First one load in each 4 KiB page it spans, then every line into L2. On the Zen 4
 * measured (a VM) software prefetches alone changed nothing: one that misses the TLB is
 * apparently dropped, and a pool of gigabytes misses it at nearly every block; the loads fill
 * the TLB so the prefetches land. Into L1 (_MM_HINT_T0) the prefetches fill the miss buffers the
 * current block's loads need. Decode attention over scattered blocks 1.5x, over W1's layout 1.4x;
 * the AVX2 path (built with -mno-avx512f on that Zen 4, not measured on an AVX2-only CPU)
 * 1.4-1.5x scattered, 1.75-2.0x in order (docs/perf-history.md, "decode attention fills the
 * TLB"). */
static inline void prefetch_block(const void* p, int64_t bytes) {
    const uintptr_t a0 = (uintptr_t)p, a1 = a0 + (uintptr_t)bytes - 1;
    for (uintptr_t page = a0 & ~(uintptr_t)4095; page <= a1; page += 4096)
        (void)*(volatile const char*)(page < a0 ? a0 : page);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T1);
}
#endif

/* Row of head_dim elements -> float32. */
static inline void load_row(const void* src, int is_bf16, int64_t d, float* dst) {
    if (is_bf16) {
        const uint16_t* s = (const uint16_t*)src;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i*)(s + i));
            __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
        }
#elif defined(HAVE_AVX2)
        for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, bf16x8_load(s + i));
#endif
        for (; i < d; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * d);
    }
}

#ifdef HAVE_AVX2
static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

#endif

static inline float dot(const float* a, const float* b, int64_t d) {
    int64_t i = 0;
    float s = 0.f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(HAVE_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    if (i + 8 <= d) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        i += 8;
    }
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float p, const float* x, float* y, int64_t d) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(HAVE_AVX2)
    __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < d; i++) y[i] += p * x[i];
}

/* exp(x) for a row of scores, in place; returns their sum. AVX-512: 2^(x log2 e) split into
 * 2^n (vscalefps) times a degree-6 polynomial of 2^f, f in [-0.5, 0.5] (relative error ~2e-7). */
static inline float exp_sum(float* x, int64_t n, float m) {
    int64_t i = 0;
    float sum = 0.f;
#ifdef __AVX512F__
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), mv = _mm512_set1_ps(m);
    const __m512 c1 = _mm512_set1_ps(0.693147180559945f), c2 = _mm512_set1_ps(0.240226506959101f),
                 c3 = _mm512_set1_ps(0.0555041086648216f), c4 = _mm512_set1_ps(0.00961812910762848f),
                 c5 = _mm512_set1_ps(0.00133335581464284f), c6 = _mm512_set1_ps(0.000154035303933816f),
                 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-126.f);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 y = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), log2e), lo);
        __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 f = _mm512_sub_ps(y, r);
        __m512 p = _mm512_fmadd_ps(c6, f, c5);
        p = _mm512_fmadd_ps(p, f, c4);
        p = _mm512_fmadd_ps(p, f, c3);
        p = _mm512_fmadd_ps(p, f, c2);
        p = _mm512_fmadd_ps(p, f, c1);
        p = _mm512_fmadd_ps(p, f, one);
        __m512 e = _mm512_scalef_ps(p, r);
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(HAVE_AVX2)
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum256(acc);
#endif
    for (; i < n; i++) { x[i] = expf(x[i] - m); sum += x[i]; }
    return sum;
}

/* Gemma 2's attention-logit softcap, in place: each of `rows` rows of n scaled scores (stride
 * floats apart) s -> cap * tanh(s / cap) (HF's eager order: after the scale, before the mask and
 * softmax); nothing for cap 0. Every unit calls it on a row's scores just before its softmax. */
static inline void softcap_rows(float* scores, int64_t rows, int64_t n, int64_t stride, float cap) {
    if (cap > 0.f)
        for (int64_t g = 0; g < rows; g++)
            for (int64_t t = 0; t < n; t++) scores[g * stride + t] = cap * tanhf(scores[g * stride + t] / cap);
}

/* In-place softmax of `rows` rows of n scores each (float32), stride floats apart. */
static inline void softmax_rows_strided(float* scores, int64_t rows, int64_t n, int64_t stride) {
    for (int64_t g = 0; g < rows; g++) {
        float* sc = scores + g * stride;
        float m = -INFINITY;
        int64_t t = 0;
#ifdef __AVX512F__
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sc + t));
        m = _mm512_reduce_max_ps(mv);
#elif defined(HAVE_AVX2)
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
        for (; t < n; t++) m = sc[t] > m ? sc[t] : m;
        const float inv = 1.f / exp_sum(sc, n, m);
        for (int64_t t = 0; t < n; t++) sc[t] *= inv;  /* vectorised by the compiler */
    }
}

static inline void softmax_rows(float* scores, int64_t rows, int64_t n) { softmax_rows_strided(scores, rows, n, n); }
#endif
