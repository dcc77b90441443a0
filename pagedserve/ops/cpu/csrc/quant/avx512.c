/*
 * The quantized-weight matmul and dequantization on AVX-512 (F/BW/VL/DQ): 16 float32 lanes.
 *
 * qgemm: a register tile of NR weight rows (outputs n) by MR rows of x, one float32 accumulator
 * vector per (row of x, output), summed across its 16 lanes at the end. Each 16 weights are
 * widened to float32 once in registers and used for all MR rows of the tile; MR is at most
 * QA_MR, and more rows of x take several tiles over the same NR weight rows, which are then in
 * L1/L2 (each weight byte comes from memory once per call). NR depends on MR (QA_CASES): as
 * many outputs as the 32 vector registers hold accumulators for. With few rows (MR <= 4) the
 * tile keeps the rows of x in registers and streams the weight rows ("x-stationary"), with more it
 * keeps the widened weights and streams x.
 *
 * With QA_PANEL_ROWS or more rows of x, panels of weight rows are dequantized once into a buffer
 * instead (qa_panels, below), for the same sums.
 *
 * Dequantization, bit-exact with QuantizedWeight.dequantize (the unit is built with
 * -ffp-contract=off):
 *   bits 4: per group and row a table T[v] = v * scale (+ min) for v = 0..15, each entry the
 *           reference's product and sum; 16 nibbles widened to 32-bit lanes index it with one
 *           vpermps (which reads the low 4 bits of each lane: the low nibble needs no mask).
 *   bits 8: int8 -> int32 -> float32, times the scale, plus the min (if any).
 * Products with x are summed with FMA (the accumulation order is the unit's own; the tests
 * compare with a float64 product). Each tile prefetches the next one's weights (qa_prefetch).
 *
 * An AVX-512 unit (build.py's flags), called through qgemm.c only on CPUs with AVX-512.
 */
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "an AVX-512 unit: build it with the AVX-512 flags (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "../common/bf16.h"
#include "quant.h"

#define QA_MR 8 /* rows of x per register tile, at most */
#define QA_NR 8 /* weight rows per register tile, at most */
#define QA_INLINE static inline __attribute__((always_inline))
#define QA_UNROLL _Pragma("GCC unroll 16")

/* Sixteen float32 -> bf16 (nearest even; NaN stays a quiet NaN, as f32_to_bf16), packed. */
QA_INLINE __m256i qa_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* The table of bits 4: v * scale (+ min), v = 0..15. */
QA_INLINE __m512 qa_table(float s, const float* mn) {
    const __m512 iota = _mm512_set_ps(15.f, 14.f, 13.f, 12.f, 11.f, 10.f, 9.f, 8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f, 1.f, 0.f);
    __m512 t = _mm512_mul_ps(iota, _mm512_set1_ps(s));
    if (mn) t = _mm512_add_ps(t, _mm512_set1_ps(*mn));
    return t;
}

/* Sixteen bytes of nibbles widened to 32-bit lanes (the low nibble of lane j: input k0 + j; the
 * high one, after a shift by 4: k0 + 16 + j). */
QA_INLINE __m512i qa_nibbles(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }

/* Sixteen int8 weights as float32: q * s (+ mn). */
QA_INLINE __m512 qa_int8(const uint8_t* p, __m512 s, __m512 mn, const int HAS_MIN) {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), s);
    return HAS_MIN ? _mm512_add_ps(v, mn) : v;
}

/* bits 8: the steps of 16 inputs of one group [k0, k1) (the scales of its rows: s, mn). */
QA_INLINE void qa_steps8(__m512 acc[QA_MR][QA_NR], const float* xf, int64_t K, const uint8_t* q, int64_t rb, int64_t k0,
                         int64_t k1, const __m512* s, const __m512* mn, const int MR, const int NR, const int HAS_MIN) {
    for (int64_t k = k0; k < k1; k += 16) {
        if (MR <= 4) {
            __m512 xv[QA_MR];
            QA_UNROLL for (int m = 0; m < MR; m++) xv[m] = _mm512_loadu_ps(xf + m * K + k);
            QA_UNROLL for (int i = 0; i < NR; i++) {
                const __m512 wv = qa_int8(q + i * rb + k, s[i], mn[i], HAS_MIN);
                QA_UNROLL for (int m = 0; m < MR; m++) acc[m][i] = _mm512_fmadd_ps(xv[m], wv, acc[m][i]);
            }
        } else {
            __m512 wv[QA_NR];
            QA_UNROLL for (int i = 0; i < NR; i++) wv[i] = qa_int8(q + i * rb + k, s[i], mn[i], HAS_MIN);
            QA_UNROLL for (int m = 0; m < MR; m++) {
                const __m512 xv = _mm512_loadu_ps(xf + m * K + k);
                QA_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm512_fmadd_ps(xv, wv[i], acc[m][i]);
            }
        }
    }
}

/* Prefetch the next tile's share of group g (inputs [k0, k1)): the tile's rows follow this one's
 * (NR rows of rb bytes each, then their scales and mins, NR * G floats each), so its share is
 * k0 / K of the way into each. Without it a core streamed cold weights ~30% slower than it
 * computes on cached ones (the hardware prefetchers follow NR interleaved rows poorly). */
QA_INLINE void qa_prefetch(const uint8_t* q, const float* sc, const float* mins, int64_t G, int64_t K, int64_t g, int64_t k0,
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
QA_INLINE void qa_tile(const float* xf, const ps_qweight* w, int64_t n0, void* out, int out_bf16, int64_t ldo, const int BITS,
                       const int MR, const int NR) {
    const int64_t K = w->K, G = w->G, group = w->group, rb = BITS == 4 ? K / 2 : K;
    const uint8_t* q = w->q + n0 * rb;
    const float* sc = w->scales + n0 * G;
    const float* mins = w->mins ? w->mins + n0 * G : NULL;
    __m512 acc[QA_MR][QA_NR];
    QA_UNROLL for (int m = 0; m < MR; m++) QA_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t k0 = g * group, k1 = k0 + group;
        qa_prefetch(q, sc, mins, G, K, g, k0, k1, BITS, NR);
        if (BITS == 4) {
            __m512 T[QA_NR];
            QA_UNROLL for (int i = 0; i < NR; i++) T[i] = qa_table(sc[i * G + g], mins ? mins + i * G + g : NULL);
            for (int64_t k = k0; k < k1; k += 32) {
                const uint8_t* qk = q + k / 2;
                const float* xk = xf + k;
                if (MR <= 4) {
                    __m512 xl[QA_MR], xh[QA_MR];
                    QA_UNROLL for (int m = 0; m < MR; m++) {
                        xl[m] = _mm512_loadu_ps(xk + m * K);
                        xh[m] = _mm512_loadu_ps(xk + m * K + 16);
                    }
                    QA_UNROLL for (int i = 0; i < NR; i++) {
                        const __m512i b = qa_nibbles(qk + i * rb);
                        const __m512 lo = _mm512_permutexvar_ps(b, T[i]);
                        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), T[i]);
                        QA_UNROLL for (int m = 0; m < MR; m++) {
                            acc[m][i] = _mm512_fmadd_ps(xl[m], lo, acc[m][i]);
                            acc[m][i] = _mm512_fmadd_ps(xh[m], hi, acc[m][i]);
                        }
                    }
                } else {
                    __m512 lo[QA_NR], hi[QA_NR];
                    QA_UNROLL for (int i = 0; i < NR; i++) {
                        const __m512i b = qa_nibbles(qk + i * rb);
                        lo[i] = _mm512_permutexvar_ps(b, T[i]);
                        hi[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), T[i]);
                    }
                    QA_UNROLL for (int m = 0; m < MR; m++) {
                        const __m512 xl = _mm512_loadu_ps(xk + m * K), xh = _mm512_loadu_ps(xk + m * K + 16);
                        QA_UNROLL for (int i = 0; i < NR; i++) {
                            acc[m][i] = _mm512_fmadd_ps(xl, lo[i], acc[m][i]);
                            acc[m][i] = _mm512_fmadd_ps(xh, hi[i], acc[m][i]);
                        }
                    }
                }
            }
        } else {
            __m512 s[QA_NR], mn[QA_NR];
            QA_UNROLL for (int i = 0; i < NR; i++) {
                s[i] = _mm512_set1_ps(sc[i * G + g]);
                mn[i] = _mm512_set1_ps(mins ? mins[i * G + g] : 0.f);
            }
            if (mins)
                qa_steps8(acc, xf, K, q, rb, k0, k1, s, mn, MR, NR, 1);
            else
                qa_steps8(acc, xf, K, q, rb, k0, k1, s, mn, MR, NR, 0);
        }
    }
    QA_UNROLL for (int m = 0; m < MR; m++) QA_UNROLL for (int i = 0; i < NR; i++) {
        const float r = _mm512_reduce_add_ps(acc[m][i]);
        if (out_bf16)
            ((uint16_t*)out)[m * ldo + n0 + i] = f32_to_bf16(r);
        else
            ((float*)out)[m * ldo + n0 + i] = r;
    }
}

/* The (MR, NR) tiles: NR for MR rows of x (the main tiles; a row count one less than a main
 * tile's, for the balanced tiles of M > QA_MR, shares its NR), and NR = 1 for the outputs past the
 * last whole NR. */
#define QA_NR4(MR) ((MR) <= 2 ? 8 : (MR) == 3 ? 6 : (MR) == 4 ? 4 : (MR) <= 7 ? 3 : 2)
#define QA_NR8(MR) ((MR) <= 2 ? 8 : (MR) == 3 ? 6 : (MR) == 4 ? 5 : (MR) <= 6 ? 4 : 3)

typedef void (*qa_tile_fn)(const float*, const ps_qweight*, int64_t, void*, int, int64_t);
#define QA_DEF(BITS, MR, NR) \
    static void qa_tile_##BITS##_##MR##_##NR(const float* xf, const ps_qweight* w, int64_t n0, void* out, int ob, int64_t ldo) { \
        qa_tile(xf, w, n0, out, ob, ldo, BITS, MR, NR);                                                                          \
    }
#define QA_DEFS(BITS)                                                                                                    \
    QA_DEF(BITS, 1, 1) QA_DEF(BITS, 2, 1) QA_DEF(BITS, 3, 1) QA_DEF(BITS, 4, 1) QA_DEF(BITS, 5, 1) QA_DEF(BITS, 6, 1) \
    QA_DEF(BITS, 7, 1) QA_DEF(BITS, 8, 1)
QA_DEFS(4)
QA_DEFS(8)
/* main tiles (MR, NR(MR)) and the balanced ones' (MR - 1, NR(MR)) for MR > 4 */
QA_DEF(4, 1, 8) QA_DEF(4, 2, 8) QA_DEF(4, 3, 6) QA_DEF(4, 4, 4) QA_DEF(4, 5, 3) QA_DEF(4, 6, 3) QA_DEF(4, 7, 3) QA_DEF(4, 8, 2)
QA_DEF(4, 4, 3) QA_DEF(4, 7, 2)
QA_DEF(8, 1, 8) QA_DEF(8, 2, 8) QA_DEF(8, 3, 6) QA_DEF(8, 4, 5) QA_DEF(8, 5, 4) QA_DEF(8, 6, 4) QA_DEF(8, 7, 3) QA_DEF(8, 8, 3)
QA_DEF(8, 4, 4) QA_DEF(8, 6, 3)

/* The tile for MR rows of x and NR weight rows (one of those defined above). */
static qa_tile_fn qa_pick(int bits, int MR, int NR) {
#define QA_PICK(B, R, N) \
    if (bits == B && MR == R && NR == N) return qa_tile_##B##_##R##_##N;
#define QA_PICK1(B) \
    QA_PICK(B, 1, 1) QA_PICK(B, 2, 1) QA_PICK(B, 3, 1) QA_PICK(B, 4, 1) QA_PICK(B, 5, 1) QA_PICK(B, 6, 1) QA_PICK(B, 7, 1) QA_PICK(B, 8, 1)
    QA_PICK1(4)
    QA_PICK1(8)
    QA_PICK(4, 1, 8) QA_PICK(4, 2, 8) QA_PICK(4, 3, 6) QA_PICK(4, 4, 4) QA_PICK(4, 5, 3) QA_PICK(4, 6, 3) QA_PICK(4, 7, 3)
    QA_PICK(4, 8, 2) QA_PICK(4, 4, 3) QA_PICK(4, 7, 2)
    QA_PICK(8, 1, 8) QA_PICK(8, 2, 8) QA_PICK(8, 3, 6) QA_PICK(8, 4, 5) QA_PICK(8, 5, 4) QA_PICK(8, 6, 4) QA_PICK(8, 7, 3)
    QA_PICK(8, 8, 3) QA_PICK(8, 4, 4) QA_PICK(8, 6, 3)
#undef QA_PICK
#undef QA_PICK1
    return 0;
}

static void qa_dequant_rows(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16);

/* ---- Many rows of x: each panel of weight rows dequantized once into a float32 buffer ----------
 *
 * From QA_PANEL_ROWS rows of x on, re-widening the weights for every QA_MR rows costs more than
 * writing them out once (one thread, 8 of SmolLM2's weights: even at 12 rows, 1.10x faster at 16,
 * 1.47x at 64): a thread dequantizes a panel of weight rows (as qa_dequant_rows, the
 * values qa_tile widens) into its buffer, then runs register tiles of QP_MR rows of x by QP_NR
 * outputs over it. Every output is the same sum as qa_tile's, bit for bit: its lanes add x * w
 * chunk by chunk (16 inputs) in k order with one FMA each, then _mm512_reduce_add_ps; so a row's
 * result never depends on how many rows share the call (decode alone equals batched). */
#ifndef QA_PANEL_ROWS
#define QA_PANEL_ROWS 12
#endif
#define QP_MR 6
#define QP_NR 4
#define QP_BUF_BYTES (512 << 10) /* a panel's float32 weights (L2) */

/* Outputs [n0, n0 + NR) (their float32 weights: wp, rows K apart) of rows [0, MR) of x. */
QA_INLINE void qp_tile(const float* xf, int64_t K, const float* wp, void* out, int out_bf16, int64_t ldo, int64_t n0,
                       const int MR, const int NR) {
    __m512 acc[QA_MR][QA_NR];
    QA_UNROLL for (int m = 0; m < MR; m++) QA_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[QA_NR];
        QA_UNROLL for (int i = 0; i < NR; i++) wv[i] = _mm512_loadu_ps(wp + i * K + k);
        QA_UNROLL for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_loadu_ps(xf + m * K + k);
            QA_UNROLL for (int i = 0; i < NR; i++) acc[m][i] = _mm512_fmadd_ps(xv, wv[i], acc[m][i]);
        }
    }
    QA_UNROLL for (int m = 0; m < MR; m++) QA_UNROLL for (int i = 0; i < NR; i++) {
        const float r = _mm512_reduce_add_ps(acc[m][i]);
        if (out_bf16)
            ((uint16_t*)out)[m * ldo + n0 + i] = f32_to_bf16(r);
        else
            ((float*)out)[m * ldo + n0 + i] = r;
    }
}

typedef void (*qp_tile_fn)(const float*, int64_t, const float*, void*, int, int64_t, int64_t);
#define QP_DEF(MR, NR)                                                                                              \
    static void qp_tile_##MR##_##NR(const float* xf, int64_t K, const float* wp, void* out, int ob, int64_t ldo, \
                                    int64_t n0) {                                                                 \
        qp_tile(xf, K, wp, out, ob, ldo, n0, MR, NR);                                                             \
    }
QP_DEF(1, 1) QP_DEF(2, 1) QP_DEF(3, 1) QP_DEF(4, 1) QP_DEF(5, 1) QP_DEF(6, 1)
QP_DEF(1, 4) QP_DEF(2, 4) QP_DEF(3, 4) QP_DEF(4, 4) QP_DEF(5, 4) QP_DEF(6, 4)
static const qp_tile_fn qp_tiles[2][QP_MR] = {
    {qp_tile_1_1, qp_tile_2_1, qp_tile_3_1, qp_tile_4_1, qp_tile_5_1, qp_tile_6_1},
    {qp_tile_1_4, qp_tile_2_4, qp_tile_3_4, qp_tile_4_4, qp_tile_5_4, qp_tile_6_4},
};

static int qa_panels(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo) {
    const int64_t N = w->N, K = w->K;
    /* panels of np rows: as many as the buffer holds, at least one per thread (a multiple of
     * the thread count where there are enough rows) */
    const int64_t nt = omp_get_max_threads();
    int64_t panels = (N * K * 4 + QP_BUF_BYTES - 1) / QP_BUF_BYTES;
    panels = (panels + nt - 1) / nt * nt;
    int64_t np = (N + panels - 1) / panels;
    np = (np + QP_NR - 1) / QP_NR * QP_NR;
    panels = (N + np - 1) / np;
    const size_t osz = out_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel if (panels > 1)
    {
        float* buf = (float*)_mm_malloc(sizeof(float) * np * K, 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf) continue;
            const int64_t n0 = p * np, rows = N - n0 < np ? N - n0 : np;
            qa_dequant_rows(w, n0, n0 + rows, buf, 0);
            for (int64_t m0 = 0; m0 < M; m0 += QP_MR) {
                const int mr = (int)(M - m0 < QP_MR ? M - m0 : QP_MR);
                const float* xm = xf + m0 * K;
                char* om = (char*)out + m0 * ldo * osz;
                int64_t i = 0;
                for (; i + QP_NR <= rows; i += QP_NR) qp_tiles[1][mr - 1](xm, K, buf + i * K, om, out_bf16, ldo, n0 + i);
                for (; i < rows; i++) qp_tiles[0][mr - 1](xm, K, buf + i * K, om, out_bf16, ldo, n0 + i);
            }
        }
        _mm_free(buf);
    }
    return failed ? -2 : 0;
}

int ps_qgemm_avx512(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo) {
    if (M >= QA_PANEL_ROWS) return qa_panels(xf, M, w, out, out_bf16, ldo);
    /* rows of x in `tiles` balanced tiles of mr or mr - 1 rows, every tile over the same NR outputs */
    const int64_t tiles = (M + QA_MR - 1) / QA_MR;
    const int mr = (int)((M + tiles - 1) / tiles);
    const int nr = w->bits == 4 ? QA_NR4(mr) : QA_NR8(mr);
    qa_tile_fn full[2] = {qa_pick(w->bits, mr, nr), qa_pick(w->bits, mr - 1 > 0 ? mr - 1 : 1, nr)};
    qa_tile_fn tail[2] = {qa_pick(w->bits, mr, 1), qa_pick(w->bits, mr - 1 > 0 ? mr - 1 : 1, 1)};
    const int64_t blocks = w->N / nr, units = blocks + w->N % nr; /* whole tiles, then single outputs */
    const size_t osz = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (units > 1 && M * w->N * w->K >= PS_QG_PAR_MIN)
    for (int64_t u = 0; u < units; u++) {
        const int64_t n0 = u < blocks ? u * nr : blocks * nr + (u - blocks);
        qa_tile_fn* fns = u < blocks ? full : tail;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t rows = (M - m0) / (tiles - t) + ((M - m0) % (tiles - t) ? 1 : 0); /* mr, then mr - 1 */
            fns[rows == mr ? 0 : 1](xf + m0 * w->K, w, n0, (char*)out + (m0 * ldo) * osz, out_bf16, ldo);
            m0 += rows;
        }
    }
    return 0;
}

/* Rows [n0, n1) of the dense weight, row n0 at out (rows K apart). The same values as qa_tile
 * widens in registers (the same table, or the same int8 product and sum). */
static void qa_dequant_rows(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16) {
    const int64_t K = w->K, G = w->G, group = w->group, rb = ps_qrow_bytes(w);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* q = w->q + n * rb;
        float* of = (float*)out + (n - n0) * K;
        uint16_t* oh = (uint16_t*)out + (n - n0) * K;
        for (int64_t g = 0; g < G; g++) {
            const float s = w->scales[n * G + g];
            const float* mn = w->mins ? w->mins + n * G + g : NULL;
            const __m512 T = qa_table(s, mn), sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(mn ? *mn : 0.f);
            for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                __m512 a, b;
                if (w->bits == 4) {
                    const __m512i nib = qa_nibbles(q + k / 2);
                    a = _mm512_permutexvar_ps(nib, T);
                    b = _mm512_permutexvar_ps(_mm512_srli_epi32(nib, 4), T);
                } else {
                    a = mn ? qa_int8(q + k, sv, mv, 1) : qa_int8(q + k, sv, mv, 0);
                    if (k + 16 == (g + 1) * group) { /* a group of 16 (or 48, ...): its last 16 */
                        if (out_bf16)
                            _mm256_storeu_si256((__m256i*)(oh + k), qa_bf16x16(a));
                        else
                            _mm512_storeu_ps(of + k, a);
                        break;
                    }
                    b = mn ? qa_int8(q + k + 16, sv, mv, 1) : qa_int8(q + k + 16, sv, mv, 0);
                }
                if (out_bf16) {
                    _mm256_storeu_si256((__m256i*)(oh + k), qa_bf16x16(a));
                    _mm256_storeu_si256((__m256i*)(oh + k + 16), qa_bf16x16(b));
                } else {
                    _mm512_storeu_ps(of + k, a);
                    _mm512_storeu_ps(of + k + 16, b);
                }
            }
        }
    }
}

void ps_qdequant_avx512(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16) {
    qa_dequant_rows(w, n0, n1, (char*)out + n0 * w->K * (out_bf16 ? 2 : 4), out_bf16);
}
