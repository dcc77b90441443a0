/*
 * AVX2 rows of fused_ops.c's bf16 element-wise ops (8 float32 lanes), for CPUs without
 * AVX512-BF16. Each computes exactly what fused_ops.c's scalar loop computes: the same float32
 * products and sums in the same order, rounded to bf16 at the same points (nearest even, NaN
 * kept), so a row's bits do not depend on which path ran it. One exception: where two NaNs meet in
 * one operation, which payload comes out may differ (it already does between -O0 and -O3 builds of
 * the scalar loop); a NaN stays a NaN. Included by fused_ops.c (built with -ffp-contract=off: no
 * fused multiply-adds).
 */
#ifndef PAGEDSERVE_FUSED_OPS_AVX2_H
#define PAGEDSERVE_FUSED_OPS_AVX2_H
#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BF16__))
#include <math.h>
#include <stdint.h>

#include "avx2_math.h"

#define HAVE_AVX2_ROWS 1

/* One row of add_rms_norm, dim % 16 == 0: residual (r16, may be NULL) = x + residual; out =
 * weight * rnd(residual * rsqrt(mean(residual^2) + eps)). The sum of squares runs in 16 lanes
 * (two vectors of 8) added up lane 0 to 15, the scalar loop's order. rr: dim floats of scratch. */
static inline void add_rms_norm_row_avx2(const uint16_t* x16, uint16_t* r16, const uint16_t* w16, uint16_t* o16,
                                         int64_t dim, float eps, float* rr) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t i = 0; i < dim; i += 16) {
        __m256 v0 = bf16x8_load(x16 + i), v1 = bf16x8_load(x16 + i + 8);
        if (r16) {
            v0 = bf16x8_rne(_mm256_add_ps(v0, bf16x8_load(r16 + i)));
            v1 = bf16x8_rne(_mm256_add_ps(v1, bf16x8_load(r16 + i + 8)));
            _mm_storeu_si128((__m128i*)(r16 + i), bf16x8_round(v0));
            _mm_storeu_si128((__m128i*)(r16 + i + 8), bf16x8_round(v1));
        }
        _mm256_storeu_ps(rr + i, v0);
        _mm256_storeu_ps(rr + i + 8, v1);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(v0, v0));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(v1, v1));
    }
    float lanes[16], sumsq = 0.f;
    _mm256_storeu_ps(lanes, acc0);
    _mm256_storeu_ps(lanes + 8, acc1);
    for (int l = 0; l < 16; l++) sumsq += lanes[l];
    const __m256 inv = _mm256_set1_ps(1.f / sqrtf(sumsq / (float)dim + eps));
    for (int64_t j = 0; j < dim; j += 8) {
        const __m256 h = bf16x8_rne(_mm256_mul_ps(_mm256_loadu_ps(rr + j), inv));
        _mm_storeu_si128((__m128i*)(o16 + j), bf16x8_round(_mm256_mul_ps(bf16x8_load(w16 + j), h)));
    }
}

/* n float32 (n % 8 == 0) rounded to bf16 and back, src -> dst. */
static inline void round_rows_avx2(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_rne(_mm256_loadu_ps(src + i)));
}

/* One head of rope_write_kv, half % 8 == 0: o = rnd(rnd(x * cos) + rnd(rotate_half(x) * sin)),
 * x16 and o16 head_dim = 2 * half bf16, cr and sr the rounded cos and sin rows. The negation of
 * rotate_half flips the sign bit, as the scalar minus does (0 - x would turn -0 into +0). */
static inline void rope_head_avx2(const uint16_t* x16, uint16_t* o16, const float* cr, const float* sr,
                                  int64_t half) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = bf16x8_load(x16 + i), x2 = bf16x8_load(x16 + half + i);
        const __m256 a1 = bf16x8_rne(_mm256_mul_ps(x1, _mm256_loadu_ps(cr + i)));
        const __m256 b1 = bf16x8_rne(_mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(sr + i)));
        _mm_storeu_si128((__m128i*)(o16 + i), bf16x8_round(_mm256_add_ps(a1, b1)));
        const __m256 a2 = bf16x8_rne(_mm256_mul_ps(x2, _mm256_loadu_ps(cr + half + i)));
        const __m256 b2 = bf16x8_rne(_mm256_mul_ps(x1, _mm256_loadu_ps(sr + half + i)));
        _mm_storeu_si128((__m128i*)(o16 + half + i), bf16x8_round(_mm256_add_ps(a2, b2)));
    }
}

#endif
#endif
