/*
 * AVX512-BF16 rows of the bf16 element-wise ops (16 float32 lanes; bf16 rounding by
 * vcvtneps2bf16, nearest even). add_rms_norm's sum of squares adds its 16 lanes as a tree
 * (_mm512_reduce_add_ps), silu_mul takes exp512 for expf; RoPE and the argmax compute what the
 * scalar loops compute.
 *
 * An AVX512-BF16 unit (build.py's flags, and -ffp-contract=off: no fused multiply-adds), called
 * by fused_ops.c and argmax.c only on CPUs with AVX512-BF16.
 */
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "an AVX512-BF16 unit: build it with the AVX512-BF16 flags (build.py)"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "fused.h"

static inline __m512 ld16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void st16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
/* round each lane to bf16 (nearest even) and back to fp32 */
static inline __m512 rnd16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

void fo_add_rms_norm_row_avx512bf16(const uint16_t* x16, uint16_t* r16, const uint16_t* w16, uint16_t* o16, int64_t dim,
                                    float eps, float* rr) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = ld16(x16 + i);
        if (r16) {
            v = rnd16(_mm512_add_ps(v, ld16(r16 + i)));
            st16(r16 + i, v);
        }
        _mm512_storeu_ps(rr + i, v);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float sumsq = _mm512_reduce_add_ps(acc);
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(sumsq / (float)dim + eps));
    for (int64_t j = 0; j < dim; j += 16)
        st16(o16 + j, _mm512_mul_ps(ld16(w16 + j), rnd16(_mm512_mul_ps(_mm512_loadu_ps(rr + j), inv))));
}

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

int64_t fo_silu_mul_row_avx512bf16(const uint16_t* g16, const uint16_t* u16, uint16_t* o16, int64_t inter) {
    const __m512 one = _mm512_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) {
        __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(g16 + i))), 16));
        __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(u16 + i))), 16));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        /* round silu to bf16, multiply by up (exact in fp32), round again */
        __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s)), 16));
        _mm256_storeu_si256((__m256i*)(o16 + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, u)));
    }
    return i;
}

void fo_rope_head_avx512bf16(const uint16_t* x16, uint16_t* o16, const float* cr, const float* sr, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = ld16(x16 + i), x2 = ld16(x16 + half + i);
        const __m512 c1 = _mm512_loadu_ps(cr + i), s1 = _mm512_loadu_ps(sr + i);
        const __m512 c2 = _mm512_loadu_ps(cr + half + i), s2 = _mm512_loadu_ps(sr + half + i);
        /* the sign bit flipped, as HF's -x (0 - x would turn -0 into +0) */
        const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32((int)0x80000000u)));
        st16(o16 + i, _mm512_add_ps(rnd16(_mm512_mul_ps(x1, c1)), rnd16(_mm512_mul_ps(neg_x2, s1))));
        st16(o16 + half + i, _mm512_add_ps(rnd16(_mm512_mul_ps(x2, c2)), rnd16(_mm512_mul_ps(x1, s2))));
    }
}

/* 16 lanes, each keeping its first maximum; the earliest lane index among the lanes that hold the
 * row maximum is the first maximum of the columns scanned. */
int fo_argmax_head_avx512bf16(const uint16_t* p, int64_t cols, int64_t* best_i, int64_t* c_end) {
    __m512 best = ld16(p);
    __m512i best_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = best_idx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t c = 16;
    for (; c + 16 <= cols; c += 16) {
        idx = _mm512_add_epi32(idx, step);
        const __m512 v = ld16(p + c);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    }
    if (nan) return 1;
    const float m = _mm512_reduce_max_ps(best);
    const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    *best_i = _mm512_mask_reduce_min_epi32(at_max, best_idx);
    *c_end = c;
    return 0;
}
