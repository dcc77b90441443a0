/*
 * Paged attention for the CPU, one query token at a time (decode rows and prefill chunks).
 *
 * PagedAttention (Kwon et al., SOSP 2023): each sequence's K/V lives in fixed-size blocks of a
 * shared pool, found through its block table. This kernel reads K/V straight from the pool:
 * no gather into a padded copy, no padding to the longest sequence. One OpenMP task per
 * (query token, KV head) computes the scores of the GQA group's query heads against the first
 * token_lens[t] cached tokens of the token's sequence (causal: a prefill token at position p
 * sees p + 1 tokens, its chunk's own K/V already written), a softmax in float32, and the
 * weighted sum of V. AVX-512 / AVX512-BF16 when the compiler targets them, else AVX2 + FMA
 * (attention_avx2.c: float32 caches), plain C otherwise.
 *
 * Layouts (row-major):
 *   q, out       [num_tokens, num_heads, head_dim]
 *   k/v cache    [num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block, so
 *                one (token, KV head) task streams block_size * head_dim contiguous values)
 *   block_tables [num_seqs, max_blocks] (int64)
 *   token_seq    [num_tokens] (int64): the token's row of block_tables; NULL = row t (decode)
 *   token_lens   [num_tokens] (int64): tokens to attend to, the token itself included
 * Storage types: float32 (f32) or bfloat16 (bf16, raw uint16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* AVX2 + FMA without AVX-512 (AMD Zen 2/3, Intel client cores): 8-lane versions of the helpers
 * below and a float32 task that scores 8 keys at a time. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#ifndef PF_DIST
#define PF_DIST 1
#endif

#include "bf16.h"
#include "kv_int8.h"
#include "avx2_math.h"

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

#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(HAVE_AVX2)
#include "attention_token_tasks.c"
#endif
#include "attention_avx512.c"

#include "attention_avx2.c"
#include "attention_amx.c"

/* Attention of num_tokens query tokens, each to the first token_lens[t] cached tokens of the
 * sequence whose block table is row token_seq[t] (token_seq NULL: row t, the decode case).
 * One OpenMP task per (query token, KV head), or per query token or tile of a prefill chunk's
 * tokens (attention_avx512_tokens.c, attention_avx2_tokens.c); each thread owns its score buffer.
 * Returns 0 on success, -1 when group or head_dim exceed the static limits, -2 on allocation failure. */
static int paged_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* out,
                           int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int is_bf16, int kv_int8) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
#ifdef HAVE_AMX_ATTENTION
    if (is_bf16 && head_dim == 64 && block_size % 16 == 0 && pa_amx_ok())
        return paged_attention_amx((const uint16_t*)q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens,
                                   (uint16_t*)out, num_tokens, num_heads, num_kv_heads, block_size, scale, kv_int8);
#endif
    int64_t max_n = 1;
    for (int64_t t = 0; t < num_tokens; t++) max_n = token_lens[t] > max_n ? token_lens[t] : max_n;
#ifdef HAVE_BF16_FAST_PATH
    if (is_bf16 && fast_path_shape(group, head_dim) && token_tasks_preferred(num_tokens, num_heads, num_kv_heads, max_n))
        return paged_attention_tokens((const uint16_t*)q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens,
                                      (uint16_t*)out, num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, kv_int8,
                                      max_n);
#endif
#ifdef HAVE_AVX2
    if (!kv_int8 && head_dim % 8 == 0 && group <= AVX2_MAX_GROUP && token_tasks_preferred(num_tokens, num_heads, num_kv_heads, max_n))
        return paged_attention_tokens_avx2(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                                           num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, max_n);
#endif
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;  /* elements */
    const int64_t q8_bytes = Q8_BYTES(block_size, head_dim);  /* int8 cache: one (block, KV head) */
    const char* kc = (const char*)k_cache;
    const char* vc = (const char*)v_cache;
    int failed = 0;
#pragma omp parallel
    {
    /* fp32 scores, then (bf16 path) the probabilities in bf16 */
    float* scores = (float*)malloc(sizeof(float) * group * max_n + sizeof(uint16_t) * group * max_n);
    uint16_t* pbf = scores ? (uint16_t*)(scores + group * max_n) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            if (scores == NULL) continue;
            const int64_t n = token_lens[t];
            const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
#ifdef HAVE_BF16_FAST_PATH
            if (is_bf16 && fast_path_shape(group, head_dim)) {
                const uint16_t* qp = (const uint16_t*)q + (t * num_heads + kh * group) * head_dim;
                uint16_t* op = (uint16_t*)out + (t * num_heads + kh * group) * head_dim;
#define TASK_Q8(G_, NV_) decode_task_q8(qp, kc, vc, table, n, block_size, num_kv_heads * q8_bytes, kh * q8_bytes, G_, scale, op, scores, NV_)
#define TASK_BF16(G_, NV_) decode_task_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, n, block_size, \
                                            block_stride, kh * block_size * head_dim, G_, scale, op, scores, pbf, NV_)
                if (kv_int8) {
                    FAST_PATH_DISPATCH(group, head_dim, TASK_Q8)
                } else {
                    FAST_PATH_DISPATCH(group, head_dim, TASK_BF16)
                }
#undef TASK_Q8
#undef TASK_BF16
                continue;
            }
#endif
#ifdef HAVE_AVX2
            if (!kv_int8 && head_dim % 8 == 0 && group <= AVX2_MAX_GROUP) {
                task_one_head_avx2((const char*)q + (t * num_heads + kh * group) * head_dim * esize, k_cache, v_cache, table, n,
                                   block_size, block_stride, kh * block_size * head_dim, group, head_dim, scale,
                                   (char*)out + (t * num_heads + kh * group) * head_dim * esize, scores, is_bf16);
                continue;
            }
#endif
            float qf[MAX_GROUP][MAX_HEAD_DIM];
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float row[MAX_HEAD_DIM];
            for (int64_t g = 0; g < group; g++) {
                load_row((const char*)q + ((t * num_heads + kh * group + g) * head_dim) * esize, is_bf16, head_dim, qf[g]);
                for (int64_t d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.f; }
            }
            for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                const char* kb = kv_int8 ? kc + (table[t0 / block_size] * num_kv_heads + kh) * q8_bytes
                                         : kc + (table[t0 / block_size] * block_stride + kh * block_size * head_dim) * esize;
                const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                for (int64_t o = 0; o < len; o++) {
                    if (kv_int8)
                        dequantize_row_q8((const int8_t*)kb + o * head_dim, ((const float*)(kb + block_size * head_dim))[o], head_dim, row);
                    else
                        load_row(kb + o * head_dim * esize, is_bf16, head_dim, row);
                    for (int64_t g = 0; g < group; g++) scores[g * n + t0 + o] = dot(qf[g], row, head_dim);
                }
            }
            softmax_rows(scores, group, n);
            for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                const char* vb = kv_int8 ? vc + (table[t0 / block_size] * num_kv_heads + kh) * q8_bytes
                                         : vc + (table[t0 / block_size] * block_stride + kh * block_size * head_dim) * esize;
                const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                for (int64_t o = 0; o < len; o++) {
                    if (kv_int8)
                        dequantize_row_q8((const int8_t*)vb + o * head_dim, ((const float*)(vb + block_size * head_dim))[o], head_dim, row);
                    else
                        load_row(vb + o * head_dim * esize, is_bf16, head_dim, row);
                    for (int64_t g = 0; g < group; g++) axpy(scores[g * n + t0 + o], row, acc[g], head_dim);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                char* op = (char*)out + ((t * num_heads + kh * group + g) * head_dim) * esize;
                if (is_bf16) {
                    for (int64_t d = 0; d < head_dim; d++) ((uint16_t*)op)[d] = f32_to_bf16(acc[g][d]);
                } else {
                    memcpy(op, acc[g], sizeof(float) * head_dim);
                }
            }
        }
    }
    free(scores);
    }
    return failed ? -2 : 0;
}

int paged_attention_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                        int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, float* out,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 0, 0);
}

int paged_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                         const int64_t* block_tables, int64_t max_blocks, const int64_t* token_seq,
                         const int64_t* token_lens, uint16_t* out, int64_t num_tokens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 1, 0);
}

/* The same over an int8 cache (kv_int8.h): k_cache, v_cache [num_blocks, num_kv_heads,
 * Q8_BYTES(block_size, head_dim)] bytes; q and out float32 (f32) or bfloat16 (bf16). */
int paged_attention_q8_f32(const float* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, float* out,
                           int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 0, 1);
}

int paged_attention_q8_bf16(const uint16_t* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 1, 1);
}

/* 1 when bf16 attention with this GQA group size and head_dim runs a vectorised bf16 path
 * (built for a CPU with AVX512-BF16, or AVX2 + FMA), 0 when it would take the generic path. */
int paged_attention_bf16_fast_path(int64_t group, int64_t head_dim) {
#ifdef HAVE_BF16_FAST_PATH
    return fast_path_shape(group, head_dim);
#elif defined(HAVE_AVX2)
    return group <= AVX2_MAX_GROUP && head_dim <= MAX_HEAD_DIM && head_dim % 8 == 0;
#else
    (void)group;
    (void)head_dim;
    return 0;
#endif
}
