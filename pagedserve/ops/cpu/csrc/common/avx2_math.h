/* AVX2 helpers shared by the CPU kernels (8 float32 lanes): bf16 <-> float32 and exp. */
#ifndef PAGEDSERVE_AVX2_MATH_H
#define PAGEDSERVE_AVX2_MATH_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>

/* Eight bf16 values -> float32 (exact: a 16-bit shift). */
static inline __m256 bf16x8_load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* Eight float32 -> bf16 (nearest even; NaN stays a quiet NaN), as f32_to_bf16 in bf16.h, each in
 * the low 16 bits of its 32-bit lane (the high 16 are zero). */
static inline __m256i bf16x8_round_lanes(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* Eight float32 rounded to bf16 and back (f32_to_bf16, then bf16_to_f32). */
static inline __m256 bf16x8_rne(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_round_lanes(v), 16));
}

/* Eight float32 -> eight packed bf16, rounded as bf16x8_round_lanes. */
static inline __m128i bf16x8_round(__m256 v) {
    const __m256i r = bf16x8_round_lanes(v);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Sixteen bf16 (one 32-byte load) -> float32, exact: the even elements (0, 2, .., 14; a 16-bit
 * shift) in *even and the odd ones (a mask) in *odd: two instructions for 16 values, where
 * bf16x8_load takes two for 8. */
static inline void bf16x16_load_eo(const uint16_t* p, __m256* even, __m256* odd) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

/* exp(x), 8 lanes: 2^n (built in the exponent bits) times a degree-6 polynomial of 2^f, f in
 * [-0.5, 0.5] (relative error ~2e-7, the polynomial of the AVX-512 paths); 0 below 2^-126,
 * inf from 2^128. */
static inline __m256 exp256(__m256 x) {
    __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
    y = _mm256_min_ps(y, _mm256_set1_ps(128.f));
    const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.000154035303933816f), f, _mm256_set1_ps(0.00133335581464284f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00961812910762848f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0555041086648216f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.240226506959101f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.693147180559945f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#endif
