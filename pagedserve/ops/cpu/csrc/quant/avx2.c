/*
 * The quantized-weight matmul and dequantization on AVX2 + FMA: 8 float32 lanes, 16 vector
 * registers. The shape of avx512.c's: a register tile of NR weight rows by MR (<= QV_MR) rows of
 * x, each 8 weights widened and dequantized once in registers for the tile's MR rows (the tile
 * keeps the NR widened weights and streams x), several tiles over the same NR weight rows for more
 * rows of x; one accumulator per (row of x, output), summed across lanes at the end; each tile
 * prefetches the next one's weights.
 *
 * Dequantization, bit-exact with QuantizedWeight.dequantize (-ffp-contract=off): int8 or nibble
 * -> int32 -> float32, times the scale, plus the min (if any). bits 4: the 16 bytes of 32 inputs
 * k0.. are read 8 at a time, bytes 0-7 giving inputs k0..k0+7 (low nibbles) and k0+16..k0+23
 * (high), bytes 8-15 inputs k0+8..k0+15 and k0+24..k0+31.
 *
 * An AVX2 unit (build.py's flags), called through qgemm.c only on CPUs with AVX2 + FMA.
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "an AVX2 unit: build it with -mavx2 -mfma (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "../common/avx2_math.h"
#include "../common/bf16.h"
#include "quant.h"

#define QV_MR 4 /* rows of x per register tile, at most */
#define QV_NR 4 /* weight rows per register tile, at most */
#define QV_INLINE static inline __attribute__((always_inline))
#define QV_UNROLL _Pragma("GCC unroll 16")

/* Eight weights as float32: the 8 bytes at p, their int8 values (bits 8) or their low (HIGH = 0)
 * or high (HIGH = 1) nibbles (bits 4), times s, plus mn when HAS_MIN. */
QV_INLINE __m256 qv_load8(const uint8_t* p, __m256 s, __m256 mn, const int BITS, const int HIGH, const int HAS_MIN) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)p);
    __m256i v;
    if (BITS == 8) {
        v = _mm256_cvtepi8_epi32(bytes);
    } else {
        v = _mm256_cvtepu8_epi32(bytes);
        v = HIGH ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    }
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s);
    return HAS_MIN ? _mm256_add_ps(f, mn) : f;
}

/* One sub-step: inputs k..k+7 (x at xk, rows K apart) times the weights at q (rows rb apart). */
QV_INLINE void qv_sub(__m256 acc[QV_MR][QV_NR], const float* xk, int64_t K, const uint8_t* q, int64_t rb, const __m256* s,
                      const __m256* mn, const int BITS, const int HIGH, const int MR, const int NR, const int HAS_MIN) {
    __m256 wv[QV_NR];
    QV_UNROLL for (int i = 0; i < NR; i++) wv[i] = qv_load8(q + i * rb, s[i], mn[i], BITS, HIGH, HAS_MIN);
    QV_UNROLL for (int m = 0; m < MR; m++) {
        const __m256 xv = _mm256_loadu_ps(xk + m * K);
        QV_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm256_fmadd_ps(xv, wv[i], acc[m][i]);
    }
}

/* The inputs [k0, k1) of one group (its scales: s, mn). */
QV_INLINE void qv_steps(__m256 acc[QV_MR][QV_NR], const float* xf, int64_t K, const uint8_t* q, int64_t rb, int64_t k0,
                        int64_t k1, const __m256* s, const __m256* mn, const int BITS, const int MR, const int NR,
                        const int HAS_MIN) {
    if (BITS == 4) {
        for (int64_t k = k0; k < k1; k += 32) {
            const uint8_t* qk = q + k / 2;
            qv_sub(acc, xf + k, K, qk, rb, s, mn, 4, 0, MR, NR, HAS_MIN);
            qv_sub(acc, xf + k + 8, K, qk + 8, rb, s, mn, 4, 0, MR, NR, HAS_MIN);
            qv_sub(acc, xf + k + 16, K, qk, rb, s, mn, 4, 1, MR, NR, HAS_MIN);
            qv_sub(acc, xf + k + 24, K, qk + 8, rb, s, mn, 4, 1, MR, NR, HAS_MIN);
        }
    } else {
        for (int64_t k = k0; k < k1; k += 16) {
            qv_sub(acc, xf + k, K, q + k, rb, s, mn, 8, 0, MR, NR, HAS_MIN);
            qv_sub(acc, xf + k + 8, K, q + k + 8, rb, s, mn, 8, 0, MR, NR, HAS_MIN);
        }
    }
}

/* Prefetch the next tile's share of group g (inputs [k0, k1)), as avx512.c's qa_prefetch. */
QV_INLINE void qv_prefetch(const uint8_t* q, const float* sc, const float* mins, int64_t G, int64_t K, int64_t g, int64_t k0,
                           int64_t k1, const int BITS, const int NR) {
    const int64_t rb = BITS == 4 ? K / 2 : K;
    const char* next = (const char*)(q + NR * rb);
    const int64_t b0 = BITS == 4 ? k0 * NR / 2 : k0 * NR, b1 = BITS == 4 ? k1 * NR / 2 : k1 * NR;
    for (int64_t b = b0; b < b1; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    _mm_prefetch((const char*)(sc + NR * G + g * NR), _MM_HINT_T0);
    if (mins) _mm_prefetch((const char*)(mins + NR * G + g * NR), _MM_HINT_T0);
}

/* Outputs [n0, n0 + NR) of rows [0, MR) of x (xf: float32, rows K apart) into out (rows ldo
 * apart, from its output n0 of its row 0). */
QV_INLINE void qv_tile(const float* xf, const ps_qweight* w, int64_t n0, void* out, int out_bf16, int64_t ldo, const int BITS,
                       const int MR, const int NR) {
    const int64_t K = w->K, G = w->G, group = w->group, rb = BITS == 4 ? K / 2 : K;
    const uint8_t* q = w->q + n0 * rb;
    const float* sc = w->scales + n0 * G;
    const float* mins = w->mins ? w->mins + n0 * G : NULL;
    __m256 acc[QV_MR][QV_NR];
    QV_UNROLL for (int m = 0; m < MR; m++) QV_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        qv_prefetch(q, sc, mins, G, K, g, g * group, (g + 1) * group, BITS, NR);
        __m256 s[QV_NR], mn[QV_NR];
        QV_UNROLL for (int i = 0; i < NR; i++) {
            s[i] = _mm256_set1_ps(sc[i * G + g]);
            mn[i] = _mm256_set1_ps(mins ? mins[i * G + g] : 0.f);
        }
        if (mins)
            qv_steps(acc, xf, K, q, rb, g * group, (g + 1) * group, s, mn, BITS, MR, NR, 1);
        else
            qv_steps(acc, xf, K, q, rb, g * group, (g + 1) * group, s, mn, BITS, MR, NR, 0);
    }
    QV_UNROLL for (int m = 0; m < MR; m++) QV_UNROLL for (int i = 0; i < NR; i++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m][i]), _mm256_extractf128_ps(acc[m][i], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        const float r = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
        if (out_bf16)
            ((uint16_t*)out)[m * ldo + n0 + i] = f32_to_bf16(r);
        else
            ((float*)out)[m * ldo + n0 + i] = r;
    }
}

/* NR for MR rows of x (a tile of one row less, for the balanced tiles of M > QV_MR, shares it);
 * NR = 1 for the outputs past the last whole NR. */
#define QV_NRF(MR) ((MR) <= 2 ? 4 : (MR) == 3 ? 3 : 2)

typedef void (*qv_tile_fn)(const float*, const ps_qweight*, int64_t, void*, int, int64_t);
#define QV_DEF(BITS, MR, NR) \
    static void qv_tile_##BITS##_##MR##_##NR(const float* xf, const ps_qweight* w, int64_t n0, void* out, int ob, int64_t ldo) { \
        qv_tile(xf, w, n0, out, ob, ldo, BITS, MR, NR);                                                                          \
    }
#define QV_DEFS(B) \
    QV_DEF(B, 1, 1) QV_DEF(B, 2, 1) QV_DEF(B, 3, 1) QV_DEF(B, 4, 1) QV_DEF(B, 1, 4) QV_DEF(B, 2, 4) QV_DEF(B, 3, 3) QV_DEF(B, 4, 2) \
    QV_DEF(B, 2, 3) QV_DEF(B, 3, 2)
QV_DEFS(4)
QV_DEFS(8)

static qv_tile_fn qv_pick(int bits, int MR, int NR) {
#define QV_PICK(B, R, N) \
    if (bits == B && MR == R && NR == N) return qv_tile_##B##_##R##_##N;
#define QV_PICKS(B)                                                                                                      \
    QV_PICK(B, 1, 1) QV_PICK(B, 2, 1) QV_PICK(B, 3, 1) QV_PICK(B, 4, 1) QV_PICK(B, 1, 4) QV_PICK(B, 2, 4) QV_PICK(B, 3, 3) \
    QV_PICK(B, 4, 2) QV_PICK(B, 2, 3) QV_PICK(B, 3, 2)
    QV_PICKS(4)
    QV_PICKS(8)
#undef QV_PICK
#undef QV_PICKS
    return 0;
}

int ps_qgemm_avx2(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo) {
    /* rows of x in `tiles` balanced tiles of mr or mr - 1 rows, every tile over the same NR outputs */
    const int64_t tiles = (M + QV_MR - 1) / QV_MR;
    const int mr = (int)((M + tiles - 1) / tiles);
    const int nr = QV_NRF(mr);
    qv_tile_fn full[2] = {qv_pick(w->bits, mr, nr), qv_pick(w->bits, mr - 1 > 0 ? mr - 1 : 1, nr)};
    qv_tile_fn tail[2] = {qv_pick(w->bits, mr, 1), qv_pick(w->bits, mr - 1 > 0 ? mr - 1 : 1, 1)};
    const int64_t blocks = w->N / nr, units = blocks + w->N % nr; /* whole tiles, then single outputs */
    const size_t osz = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (units > 1 && M * w->N * w->K >= PS_QG_PAR_MIN)
    for (int64_t u = 0; u < units; u++) {
        const int64_t n0 = u < blocks ? u * nr : blocks * nr + (u - blocks);
        qv_tile_fn* fns = u < blocks ? full : tail;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t rows = (M - m0) / (tiles - t) + ((M - m0) % (tiles - t) ? 1 : 0); /* mr, then mr - 1 */
            fns[rows == mr ? 0 : 1](xf + m0 * w->K, w, n0, (char*)out + (m0 * ldo) * osz, out_bf16, ldo);
            m0 += rows;
        }
    }
    return 0;
}

/* Eight floats into out at k: float32, or rounded to bf16. */
QV_INLINE void qv_put8(void* out, int64_t k, __m256 v, int out_bf16) {
    if (out_bf16)
        _mm_storeu_si128((__m128i*)((uint16_t*)out + k), bf16x8_round(v));
    else
        _mm256_storeu_ps((float*)out + k, v);
}

void ps_qdequant_avx2(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16) {
    const int64_t K = w->K, G = w->G, group = w->group, rb = ps_qrow_bytes(w);
    const size_t osz = out_bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* q = w->q + n * rb;
        char* o = (char*)out + n * K * osz;
        for (int64_t g = 0; g < G; g++) {
            const __m256 s = _mm256_set1_ps(w->scales[n * G + g]);
            const __m256 mn = _mm256_set1_ps(w->mins ? w->mins[n * G + g] : 0.f);
            const int hm = w->mins != NULL;
            if (w->bits == 4) {
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    const uint8_t* qk = q + k / 2;
                    qv_put8(o, k, hm ? qv_load8(qk, s, mn, 4, 0, 1) : qv_load8(qk, s, mn, 4, 0, 0), out_bf16);
                    qv_put8(o, k + 8, hm ? qv_load8(qk + 8, s, mn, 4, 0, 1) : qv_load8(qk + 8, s, mn, 4, 0, 0), out_bf16);
                    qv_put8(o, k + 16, hm ? qv_load8(qk, s, mn, 4, 1, 1) : qv_load8(qk, s, mn, 4, 1, 0), out_bf16);
                    qv_put8(o, k + 24, hm ? qv_load8(qk + 8, s, mn, 4, 1, 1) : qv_load8(qk + 8, s, mn, 4, 1, 0), out_bf16);
                }
            } else {
                for (int64_t k = g * group; k < (g + 1) * group; k += 8)
                    qv_put8(o, k, hm ? qv_load8(q + k, s, mn, 8, 0, 1) : qv_load8(q + k, s, mn, 8, 0, 0), out_bf16);
            }
        }
    }
}
