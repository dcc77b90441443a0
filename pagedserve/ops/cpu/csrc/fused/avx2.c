/*
 * AVX2 rows of the bf16 element-wise ops (8 float32 lanes), for CPUs without AVX512-BF16.
 * add_rms_norm's, RoPE's and the argmax's rows compute exactly what fused_ops.c's scalar loops
 * compute: the same float32 products and sums in the same order, rounded to bf16 at the same
 * points (nearest even, NaN kept), so a row's bits do not depend on which path ran it. One
 * exception: where two NaNs meet in one operation, which payload comes out may differ (it already
 * does between -O0 and -O3 builds of the scalar loop); a NaN stays a NaN. silu_mul's row takes
 * exp256 (avx2_math.h) for expf.
 *
 * An AVX2 unit (build.py's flags: -mavx2 -mfma, and -ffp-contract=off: no fused multiply-adds),
 * called by fused_ops.c and argmax.c only on CPUs with AVX2 + FMA.
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "an AVX2 unit: build it with -mavx2 -mfma (build.py)"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../common/avx2_math.h"
#include "fused.h"

/* The sum of squares runs in 16 lanes (two vectors of 8) added up lane 0 to 15, the scalar
 * loop's order. */
void fo_add_rms_norm_row_avx2(const uint16_t* x16, uint16_t* r16, const uint16_t* w16, uint16_t* o16, int64_t dim,
                              float eps, float* rr) {
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

void fo_round_rows_avx2(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, bf16x8_rne(_mm256_loadu_ps(src + i)));
}

/* The negation of rotate_half flips the sign bit, as the scalar minus does (0 - x would turn -0
 * into +0). */
void fo_rope_head_avx2(const uint16_t* x16, uint16_t* o16, const float* cr, const float* sr, int64_t half) {
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

/* silu_mul's steps of the scalar loop on 8 lanes, exp256 for expf. */
int64_t fo_silu_mul_row_avx2(const uint16_t* g16, const uint16_t* u16, uint16_t* o16, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
        const __m256 g = bf16x8_load(g16 + i), u = bf16x8_load(u16 + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm_storeu_si128((__m128i*)(o16 + i), bf16x8_round(_mm256_mul_ps(bf16x8_rne(s), u)));
    }
    return i;
}

/* Scans columns [0, c) of a bf16 row, c the largest multiple of 16 <= cols (cols >= 32), in two
 * sets of 8 lanes; each lane keeps its first maximum. Returns 1 when a NaN was seen (the caller
 * then finds the first NaN), else 0 with *best_i the first column holding the maximum of [0, c)
 * (the smallest index among the lanes that hold it) and *c_end = c. */
int fo_argmax_head_avx2(const uint16_t* p, int64_t cols, int64_t* best_i, int64_t* c_end) {
    __m256 b0 = bf16x8_load(p), b1 = bf16x8_load(p + 8);
    __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
    __m256i bi0 = i0, bi1 = i1;
    const __m256i step = _mm256_set1_epi32(16);
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(b0, b0, _CMP_UNORD_Q), _mm256_cmp_ps(b1, b1, _CMP_UNORD_Q));
    int64_t c = 16;
    for (; c + 16 <= cols; c += 16) {
        i0 = _mm256_add_epi32(i0, step);
        i1 = _mm256_add_epi32(i1, step);
        const __m256 v0 = bf16x8_load(p + c), v1 = bf16x8_load(p + c + 8);
        const __m256 g0 = _mm256_cmp_ps(v0, b0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, b1, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
        b0 = _mm256_blendv_ps(b0, v0, g0);
        b1 = _mm256_blendv_ps(b1, v1, g1);
        bi0 = _mm256_blendv_epi8(bi0, i0, _mm256_castps_si256(g0));
        bi1 = _mm256_blendv_epi8(bi1, i1, _mm256_castps_si256(g1));
    }
    if (_mm256_movemask_ps(nan)) return 1;
    float v[16];
    int32_t idx[16];
    _mm256_storeu_ps(v, b0);
    _mm256_storeu_ps(v + 8, b1);
    _mm256_storeu_si256((__m256i*)idx, bi0);
    _mm256_storeu_si256((__m256i*)(idx + 8), bi1);
    float m = v[0];
    for (int l = 1; l < 16; l++) m = v[l] > m ? v[l] : m;
    int64_t first = cols;
    for (int l = 0; l < 16; l++)
        if (v[l] == m && idx[l] < first) first = idx[l];
    *best_i = first;
    *c_end = c;
    return 0;
}
