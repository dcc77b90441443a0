/*
 * Fused element-wise ops of a Llama decoder layer for the CPU: each replaces 5-10 small PyTorch
 * ops (and their per-op dispatch cost, which dominates a decode step's non-matmul time) with
 * one pass over the rows. They reproduce HF transformers' rounding order exactly:
 *
 *   add_rms_norm   residual = x + residual (rounded to the storage type), then
 *                  out = weight * to_dtype(residual_f32 * rsqrt(mean(residual_f32^2) + eps))
 *                  (LlamaRMSNorm: fp32 statistics, rounded to the storage type before the
 *                  weight product, which is rounded again).
 *   silu_mul       out = to_dtype(silu(gate)) * up, silu in fp32.
 *   rope_write_kv  q, k = q*cos + rotate_half(q)*sin with cos/sin rounded to the storage type
 *                  and every product and the sum rounded (HF's apply_rotary_pos_emb in bf16);
 *                  q goes to a contiguous output, k and v straight to their cache slots.
 *
 * Compiled with -ffp-contract=off: a fused multiply-add would round once where PyTorch rounds
 * twice, and float32 outputs are compared with HF's.
 *
 * Storage types: float32 (is_bf16 = 0) or bfloat16 (raw uint16). Rows are contiguous unless a
 * row stride (elements) is given. bf16 rows run AVX512-BF16 loops where the CPU has them, else
 * fused_ops_avx2.h's AVX2 loops (the scalar loop's bits), else the scalar loop. The greedy
 * argmax is in argmax_rows.c, included at the end.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kv_int8.h"
#include "avx2_math.h"
#include "fused_ops_avx2.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float load(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float f, int is_bf16) {
    if (is_bf16)
        ((uint16_t*)p)[i] = f32_to_bf16(f);
    else
        ((float*)p)[i] = f;
}

/* Value as stored: rounded to bf16 when the storage type is bf16. */
static inline float rnd(float f, int is_bf16) { return is_bf16 ? round_bf16(f) : f; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_VEC 1
static inline __m512 ld16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void st16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
/* round each lane to bf16 (nearest even) and back to fp32 */
static inline __m512 rnd16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif

#define MAX_DIM 16384
/* Below this many elements a row loop is cheaper than waking the thread pool
 * (docs/perf-history.md, "AVX2 rows for the element-wise ops"). */
#define PAR_MIN_ELEMS 16384

/* x, residual, out: [rows, dim]; weight: [dim]. residual may be NULL (first layer: the
 * residual is x itself and is written to residual_out if that is not NULL). */
void add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t dim,
                  float eps, int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        float rr[MAX_DIM]; /* callers guarantee dim <= MAX_DIM */
        const int64_t base = t * dim;
        int64_t i = 0;
        float sumsq = 0.f;
#ifdef HAVE_BF16_VEC
        if (is_bf16 && dim % 16 == 0) {
            const uint16_t* x16 = (const uint16_t*)x + base;
            uint16_t* r16 = residual ? (uint16_t*)residual + base : NULL;
            __m512 acc = _mm512_setzero_ps();
            for (; i < dim; i += 16) {
                __m512 v = ld16(x16 + i);
                if (r16) {
                    v = rnd16(_mm512_add_ps(v, ld16(r16 + i)));
                    st16(r16 + i, v);
                }
                _mm512_storeu_ps(rr + i, v);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
            }
            sumsq = _mm512_reduce_add_ps(acc);
            const __m512 inv = _mm512_set1_ps(1.f / sqrtf(sumsq / (float)dim + eps));
            const uint16_t* w16 = (const uint16_t*)weight;
            uint16_t* o16 = (uint16_t*)out + base;
            for (int64_t j = 0; j < dim; j += 16)
                st16(o16 + j, _mm512_mul_ps(ld16(w16 + j), rnd16(_mm512_mul_ps(_mm512_loadu_ps(rr + j), inv))));
            continue;
        }
#elif defined(HAVE_AVX2_ROWS)
        if (is_bf16 && dim % 16 == 0) {
            add_rms_norm_row_avx2((const uint16_t*)x + base, residual ? (uint16_t*)residual + base : NULL,
                                  (const uint16_t*)weight, (uint16_t*)out + base, dim, eps, rr);
            continue;
        }
#endif
        for (i = 0; i < dim; i++) {
            float v = load(x, base + i, is_bf16);
            if (residual) {
                v = rnd(v + load(residual, base + i, is_bf16), is_bf16);
                store(residual, base + i, v, is_bf16);
            }
            rr[i] = v;
        }
        /* Sum of squares in 16 lanes (the vectorised order), then across lanes. */
        float lanes[16] = {0};
        i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += rr[i + l] * rr[i + l];
        for (int l = 0; l < 16; l++) sumsq += lanes[l];
        for (; i < dim; i++) sumsq += rr[i] * rr[i];
        const float inv = 1.f / sqrtf(sumsq / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) {
            const float h = rnd(rr[j] * inv, is_bf16);
            store(out, base + j, load(weight, j, is_bf16) * h, is_bf16);
        }
    }
}

#if defined(__AVX512F__)
/* exp(x), 16 lanes: 2^n (vscalefps) times a degree-6 polynomial of 2^f, f in [-0.5, 0.5]
 * (relative error ~2e-7); saturates to 0 below 2^-126 and to inf above 2^128. */
static inline __m512 exp512(__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
    const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, r);
    __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(0.000154035303933816f), f), _mm512_set1_ps(0.00133335581464284f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.00961812910762848f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.0555041086648216f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.240226506959101f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.693147180559945f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, r);
}
#endif

/* gate_up: [rows, 2 * inter] (gate then up); out: [rows, inter]. */
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t gb = t * 2 * inter, ob = t * inter;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (is_bf16) {
            const uint16_t* g16 = (const uint16_t*)gate_up + gb;
            const uint16_t* u16 = g16 + inter;
            uint16_t* o16 = (uint16_t*)out + ob;
            const __m512 one = _mm512_set1_ps(1.f);
            for (; i + 16 <= inter; i += 16) {
                __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(g16 + i))), 16));
                __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(u16 + i))), 16));
                __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                /* round silu to bf16, multiply by up (exact in fp32), round again */
                __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s)), 16));
                _mm256_storeu_si256((__m256i*)(o16 + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, u)));
            }
        }
#elif defined(HAVE_AVX2_ROWS)
        if (is_bf16) { /* the same steps, 8 lanes */
            const uint16_t* g16 = (const uint16_t*)gate_up + gb;
            const uint16_t* u16 = g16 + inter;
            uint16_t* o16 = (uint16_t*)out + ob;
            const __m256 one = _mm256_set1_ps(1.f);
            for (; i + 8 <= inter; i += 8) {
                const __m256 g = bf16x8_load(g16 + i), u = bf16x8_load(u16 + i);
                const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
                _mm_storeu_si128((__m128i*)(o16 + i), bf16x8_round(_mm256_mul_ps(bf16x8_rne(s), u)));
            }
        }
#endif
        for (; i < inter; i++) {
            const float g = load(gate_up, gb + i, is_bf16);
            const float s = rnd(g / (1.f + expf(-g)), is_bf16);
            store(out, ob + i, s * load(gate_up, gb + inter + i, is_bf16), is_bf16);
        }
    }
}

/* qk: [rows, num_heads + num_kv_heads, head_dim] with row stride qk_stride (elements);
 * v: [rows, num_kv_heads, head_dim] with row stride v_stride; positions, slots: [rows] int64;
 * cos, sin: float32 [max_positions, head_dim]; q_out: [rows, num_heads, head_dim] contiguous;
 * k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]. */
static inline void rope_write_kv_impl(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                   const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache,
                   void* v_cache, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int is_bf16, int kv_int8) {
    const int64_t half = head_dim / 2;
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t q8_bytes = Q8_BYTES(block_size, head_dim);
#pragma omp parallel for schedule(static) if (rows * (num_heads + 2 * num_kv_heads) * head_dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float* c = cos + positions[t] * head_dim;
        const float* s = sin + positions[t] * head_dim;
        float cr[1024], sr[1024];
        uint16_t krow[1024]; /* int8 cache: one K row in the storage type before quantization */
        int64_t i0 = 0;
#ifdef HAVE_AVX2_ROWS
        if (is_bf16) {
            i0 = head_dim - head_dim % 8;
            round_rows_avx2(c, cr, i0);
            round_rows_avx2(s, sr, i0);
        }
#endif
        for (int64_t i = i0; i < head_dim; i++) {
            cr[i] = rnd(c[i], is_bf16);
            sr[i] = rnd(s[i], is_bf16);
        }
        const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            const int64_t src = t * qk_stride + h * head_dim;
            char* dst_base;
            int64_t dst;
            int vec_done = 0;
            if (h < num_heads) {
                dst_base = (char*)q_out;
                dst = (t * num_heads + h) * head_dim;
            } else if (kv_int8) {
                dst_base = (char*)krow; /* float32 rows need 4 bytes a value: krow holds 2048 bytes */
                dst = 0;
            } else {
                dst_base = (char*)k_cache;
                dst = ((blk * num_kv_heads + (h - num_heads)) * block_size + off) * head_dim;
            }
#ifdef HAVE_BF16_VEC
            if (is_bf16 && half > 0 && head_dim == 2 * half && half % 16 == 0) {
                const uint16_t* x16 = (const uint16_t*)qk + src;
                uint16_t* o16 = (uint16_t*)dst_base + dst;
                for (int64_t i = 0; i < half; i += 16) {
                    const __m512 x1 = ld16(x16 + i), x2 = ld16(x16 + half + i);
                    const __m512 c1 = _mm512_loadu_ps(cr + i), s1 = _mm512_loadu_ps(sr + i);
                    const __m512 c2 = _mm512_loadu_ps(cr + half + i), s2 = _mm512_loadu_ps(sr + half + i);
                    /* the sign bit flipped, as HF's -x (0 - x would turn -0 into +0) */
                    const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32((int)0x80000000u)));
                    st16(o16 + i, _mm512_add_ps(rnd16(_mm512_mul_ps(x1, c1)), rnd16(_mm512_mul_ps(neg_x2, s1))));
                    st16(o16 + half + i, _mm512_add_ps(rnd16(_mm512_mul_ps(x2, c2)), rnd16(_mm512_mul_ps(x1, s2))));
                }
                vec_done = 1;
            }
#elif defined(HAVE_AVX2_ROWS)
            if (is_bf16 && half > 0 && head_dim == 2 * half && half % 8 == 0) {
                rope_head_avx2((const uint16_t*)qk + src, (uint16_t*)dst_base + dst, cr, sr, half);
                vec_done = 1;
            }
#endif
            for (int64_t i = 0; i < head_dim && !vec_done; i++) {
                const float x = load(qk, src + i, is_bf16);
                const float rot = i < half ? -load(qk, src + i + half, is_bf16) : load(qk, src + i - half, is_bf16);
                const float a = rnd(x * cr[i], is_bf16);
                const float b = rnd(rot * sr[i], is_bf16);
                store(dst_base, dst + i, a + b, is_bf16);
            }
            if (kv_int8 && h >= num_heads) {
                float kf[512];
                char* cell = (char*)k_cache + (blk * num_kv_heads + (h - num_heads)) * q8_bytes;
                for (int64_t i = 0; i < head_dim; i++) kf[i] = load(krow, i, is_bf16);
                quantize_row_q8(kf, head_dim, (int8_t*)cell + off * head_dim, (float*)(cell + block_size * head_dim) + off);
            }
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            if (kv_int8) {
                float vf[512];
                char* cell = (char*)v_cache + (blk * num_kv_heads + h) * q8_bytes;
                for (int64_t i = 0; i < head_dim; i++) vf[i] = load(v, t * v_stride + h * head_dim + i, is_bf16);
                quantize_row_q8(vf, head_dim, (int8_t*)cell + off * head_dim, (float*)(cell + block_size * head_dim) + off);
                continue;
            }
            const int64_t dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim;
            memcpy((char*)v_cache + dst * esize, (const char*)v + (t * v_stride + h * head_dim) * esize, head_dim * esize);
        }
    }
}

/* qk, v, positions, slots, cos, sin, q_out as rope_write_kv_impl; k_cache, v_cache: [num_blocks,
 * num_kv_heads, block_size, head_dim] in the storage type. */
void rope_write_kv(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                   const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache,
                   void* v_cache, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int is_bf16) {
    rope_write_kv_impl(qk, qk_stride, v, v_stride, positions, slots, cos, sin, q_out, k_cache, v_cache, rows,
                       num_heads, num_kv_heads, head_dim, block_size, is_bf16, 0);
}

/* The same with an int8 cache (kv_int8.h): k_cache, v_cache [num_blocks, num_kv_heads,
 * Q8_BYTES(block_size, head_dim)] bytes; head_dim <= 512. */
void rope_write_kv_q8(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                      const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache,
                      void* v_cache, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int is_bf16) {
    rope_write_kv_impl(qk, qk_stride, v, v_stride, positions, slots, cos, sin, q_out, k_cache, v_cache, rows,
                       num_heads, num_kv_heads, head_dim, block_size, is_bf16, 1);
}

#include "argmax_rows.c"
