/* The int8 KV cache layout and its quantizer, shared by the RoPE + cache write (fused/) and the
 * attention kernel (attention/). The loops run on 16 lanes in the units built for AVX-512.
 *
 * One (block, KV head) of K or V is Q8_BYTES(block_size, head_dim) contiguous bytes:
 *   int8   values [block_size][head_dim]   (symmetric, round to nearest even, clamped to +-127)
 *   float  scales [block_size]             (one per token: max |x| / 127)
 * so a cache of one layer's K or V is [num_blocks][num_kv_heads][Q8_BYTES] and x ~= value * scale.
 * The scale of a row is computed from the row as it would be stored in the model's dtype (the
 * bf16-rounded K after RoPE, V as projected), so the int8 cache quantizes exactly what the bf16
 * cache would hold. */
#ifndef PAGEDSERVE_KV_INT8_H
#define PAGEDSERVE_KV_INT8_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define Q8_BYTES(block_size, head_dim) ((block_size) * (head_dim) + 4 * (block_size))
#define Q8_TINY 1e-30f /* rows with max |x| at or below this are stored as zeros */

/* x [d] float32 -> out [d] int8 and *scale; the same float32 operations as the PyTorch
 * reference (pagedserve/ops/kv_int8.py): inv = 127 / amax, q = round_half_even(x * inv). */
static inline void quantize_row_q8(const float* x, int64_t d, int8_t* out, float* scale) {
    float amax = 0.f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > Q8_TINY ? 127.f / amax : 0.f; /* a tiny row: 127 / amax would overflow */
    *scale = amax / 127.f;
    i = 0;
#ifdef __AVX512F__
    const __m512 iv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (; i + 16 <= d; i += 16) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
#endif
    for (; i < d; i++) out[i] = (int8_t)fminf(fmaxf(rintf(x[i] * inv), -127.f), 127.f);
}

/* One stored row back to float32: out[i] = value[i] * scale. */
static inline void dequantize_row_q8(const int8_t* v, float scale, int64_t d, float* out) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(v + i)))), s));
#endif
    for (; i < d; i++) out[i] = (float)v[i] * scale;
}
#endif
