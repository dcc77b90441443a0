/*
 * bf16 matmul for CPUs with AVX2 + FMA and no bf16 arithmetic (AMD Zen 2/3, Intel client
 * cores), where oneDNN cannot pack bf16 weights and F.linear's bf16 path is slow.
 *
 * Weights stay bf16 in memory (half the bytes of float32: decode streams every weight once per
 * step) and are widened to float32 in registers (a shift of 16 bits, exact); x is widened once
 * per call; products are summed with FMA in float32. It is the classic register-blocked kernel
 * (6 rows x 16 outputs: 12 accumulators, as in BLIS's Haswell sgemm), reading a weight copy laid
 * out for it.
 *
 * Weight layout (`avx2_layout` in matmul.py): [ceil(N/16)][K][16] bf16: for each 16 outputs a
 * contiguous panel, k by k, zero-padded past N. Each panel is one sequential stream.
 *
 * Rounding: every output sums its K products in order k = 0, 1, ..., K-1 with one FMA each
 * (float32), then adds the bias and rounds once to bf16 (nearest even). A row's result depends
 * only on that row, never on M, the blocking or the thread count, so decode output is the same
 * alone or batched.
 *
 * Blocking: rows in blocks of `rows_per_block` (the widened rows, rows x K x 4 bytes, stay in
 * L2 while every panel passes), panels split evenly over the OpenMP threads.
 *
 * Panels are read as bf16 straight from memory, 16 weights (one k) a load, widened as the 8 even
 * outputs (a shift) and the 8 odd ones (a mask): two instructions for 16 weights where a
 * zero-extension and a shift per 8 took four. The tile's two accumulators of a row then hold the
 * even and the odd outputs, put back in place when stored; each output's sum is the same. A
 * panel's later row tiles read it from L1 (K x 32 bytes). Widening each panel once into a float32
 * buffer for all row tiles instead (twice the bytes, over L1 for K = 576) was slower at 8-64
 * rows and tied at 96-256 on a Zen 1, and 1.00-1.10x slower at 64-2,048 rows on a Zen 3
 * (docs/perf-history.md, "Issue 15 on an AVX2-only Zen 1" and "the hardware ceiling").
 *
 * An AVX2 unit (build.py's flags), called through gemm.c's avx2_gemm_bf16 only on CPUs with
 * AVX2 + FMA.
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "an AVX2 unit: build it with -mavx2 -mfma (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common/avx2_math.h"
#include "../common/bf16.h"
#include "gemm.h"

#define AG_NR 16                  /* outputs per panel */
#define AG_MR 6                   /* rows per register tile */
#define AG_BLOCK_BYTES (256 << 10) /* widened rows kept per block */

/* The first `valid` (<= 16) of 16 packed bf16 outputs into y. */
static inline void ag_put16(__m256i out, uint16_t* y, int64_t valid) {
    if (valid == AG_NR) {
        _mm256_storeu_si256((__m256i*)y, out);
    } else {
        uint16_t tmp[AG_NR];
        _mm256_storeu_si256((__m256i*)tmp, out);
        for (int64_t j = 0; j < valid; j++) y[j] = tmp[j];
    }
}

/* Store one row of a tile, its sums held as the tile's 8 even outputs (e) and 8 odd ones (o), as
 * bf16x16_load_eo gives them: + bias (bias_eo in the same order), each output rounded to bf16,
 * then the two put back in place in one pass into y[0 .. valid). */
static inline void ag_store_eo(__m256 e, __m256 o, const float* bias_eo, uint16_t* y, int64_t valid) {
    const __m256i re = bf16x8_round_lanes(_mm256_add_ps(e, _mm256_loadu_ps(bias_eo)));
    const __m256i ro = bf16x8_round_lanes(_mm256_add_ps(o, _mm256_loadu_ps(bias_eo + 8)));
    ag_put16(_mm256_or_si256(re, _mm256_slli_epi32(ro, 16)), y, valid);
}

/* Rows [0, M) (M <= AG_MR, fixed at compile time) of x (float32, rows K apart) times one bf16
 * panel wp (its even and odd outputs in the two accumulators of a row; bias_eo in that order):
 * outputs n0..n0+15 of y (rows N apart), only the first `valid` stored. The 12 accumulators are
 * named variables: as an array, GCC stored them to the stack on every k. */
static inline __attribute__((always_inline)) void ag_tile(const float* xf, int64_t K, const uint16_t* wp,
                                                           const float* bias_eo, uint16_t* y, int64_t N, int64_t n0,
                                                           int64_t valid, const int M) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *x0 = xf, *x1 = xf + K, *x2 = xf + 2 * K, *x3 = xf + 3 * K, *x4 = xf + 4 * K, *x5 = xf + 5 * K;
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        bf16x16_load_eo(wp + k * AG_NR, &w0, &w1);
        __m256 xv = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(xv, w0, c00);
        c01 = _mm256_fmadd_ps(xv, w1, c01);
        if (M > 1) { xv = _mm256_broadcast_ss(x1 + k); c10 = _mm256_fmadd_ps(xv, w0, c10); c11 = _mm256_fmadd_ps(xv, w1, c11); }
        if (M > 2) { xv = _mm256_broadcast_ss(x2 + k); c20 = _mm256_fmadd_ps(xv, w0, c20); c21 = _mm256_fmadd_ps(xv, w1, c21); }
        if (M > 3) { xv = _mm256_broadcast_ss(x3 + k); c30 = _mm256_fmadd_ps(xv, w0, c30); c31 = _mm256_fmadd_ps(xv, w1, c31); }
        if (M > 4) { xv = _mm256_broadcast_ss(x4 + k); c40 = _mm256_fmadd_ps(xv, w0, c40); c41 = _mm256_fmadd_ps(xv, w1, c41); }
        if (M > 5) { xv = _mm256_broadcast_ss(x5 + k); c50 = _mm256_fmadd_ps(xv, w0, c50); c51 = _mm256_fmadd_ps(xv, w1, c51); }
    }
    y += n0;
    ag_store_eo(c00, c01, bias_eo, y, valid);
    if (M > 1) ag_store_eo(c10, c11, bias_eo, y + N, valid);
    if (M > 2) ag_store_eo(c20, c21, bias_eo, y + 2 * N, valid);
    if (M > 3) ag_store_eo(c30, c31, bias_eo, y + 3 * N, valid);
    if (M > 4) ag_store_eo(c40, c41, bias_eo, y + 4 * N, valid);
    if (M > 5) ag_store_eo(c50, c51, bias_eo, y + 5 * N, valid);
}

/* One row times AG_WIDE consecutive panels (wp: the first; they are contiguous): 2 x AG_WIDE
 * independent FMA chains, where one panel alone has 2 and waits on FMA latency (a single row,
 * batch-1 decode, streams the weights ~1.8x faster so). Each output's sum is the same as in
 * ag_tile: k in order, then bias (bias_eo: even/odd order), one rounding. */
#define AG_WIDE 4
static void ag_row_wide(const float* xf, int64_t K, const uint16_t* wp, const float* bias_eo, uint16_t* y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int64_t ps = K * AG_NR; /* panel stride */
    for (int64_t k = 0; k < K; k++) {
        const __m256 xv = _mm256_broadcast_ss(xf + k);
        const uint16_t* w = wp + k * AG_NR;
        __m256 e, o;
        bf16x16_load_eo(w, &e, &o);
        a0 = _mm256_fmadd_ps(xv, e, a0);
        a1 = _mm256_fmadd_ps(xv, o, a1);
        bf16x16_load_eo(w + ps, &e, &o);
        a2 = _mm256_fmadd_ps(xv, e, a2);
        a3 = _mm256_fmadd_ps(xv, o, a3);
        bf16x16_load_eo(w + 2 * ps, &e, &o);
        a4 = _mm256_fmadd_ps(xv, e, a4);
        a5 = _mm256_fmadd_ps(xv, o, a5);
        bf16x16_load_eo(w + 3 * ps, &e, &o);
        a6 = _mm256_fmadd_ps(xv, e, a6);
        a7 = _mm256_fmadd_ps(xv, o, a7);
    }
    ag_store_eo(a0, a1, bias_eo, y, AG_NR);
    ag_store_eo(a2, a3, bias_eo + AG_NR, y + AG_NR, AG_NR);
    ag_store_eo(a4, a5, bias_eo + 2 * AG_NR, y + 2 * AG_NR, AG_NR);
    ag_store_eo(a6, a7, bias_eo + 3 * AG_NR, y + 3 * AG_NR, AG_NR);
}

/* M = 2 or 3 rows (compile-time) times two consecutive panels: 4M chains, where one panel has
 * 2M; sums as in ag_tile. */
static inline __attribute__((always_inline)) void ag_rows_pair(const float* xf, int64_t K, const uint16_t* wp,
                                                                const float* bias_eo, uint16_t* y, int64_t N, const int M) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const int64_t ps = K * AG_NR;
    for (int64_t k = 0; k < K; k++) {
        const uint16_t* w = wp + k * AG_NR;
        __m256 w0, w1, w2, w3;
        bf16x16_load_eo(w, &w0, &w1);
        bf16x16_load_eo(w + ps, &w2, &w3);
        __m256 xv = _mm256_broadcast_ss(xf + k);
        a0 = _mm256_fmadd_ps(xv, w0, a0); a1 = _mm256_fmadd_ps(xv, w1, a1);
        a2 = _mm256_fmadd_ps(xv, w2, a2); a3 = _mm256_fmadd_ps(xv, w3, a3);
        xv = _mm256_broadcast_ss(xf + K + k);
        b0 = _mm256_fmadd_ps(xv, w0, b0); b1 = _mm256_fmadd_ps(xv, w1, b1);
        b2 = _mm256_fmadd_ps(xv, w2, b2); b3 = _mm256_fmadd_ps(xv, w3, b3);
        if (M > 2) {
            xv = _mm256_broadcast_ss(xf + 2 * K + k);
            c0 = _mm256_fmadd_ps(xv, w0, c0); c1 = _mm256_fmadd_ps(xv, w1, c1);
            c2 = _mm256_fmadd_ps(xv, w2, c2); c3 = _mm256_fmadd_ps(xv, w3, c3);
        }
    }
    ag_store_eo(a0, a1, bias_eo, y, AG_NR);
    ag_store_eo(a2, a3, bias_eo + AG_NR, y + AG_NR, AG_NR);
    ag_store_eo(b0, b1, bias_eo, y + N, AG_NR);
    ag_store_eo(b2, b3, bias_eo + AG_NR, y + N + AG_NR, AG_NR);
    if (M > 2) {
        ag_store_eo(c0, c1, bias_eo, y + 2 * N, AG_NR);
        ag_store_eo(c2, c3, bias_eo + AG_NR, y + 2 * N + AG_NR, AG_NR);
    }
}

/* One panel for rows [0, mb) of the block, 6 rows a tile; bias_eo in even/odd order. */
static void ag_panel(const float* xf, int64_t mb, int64_t K, const uint16_t* wp, const float* bias_eo,
                     uint16_t* y, int64_t N, int64_t n0, int64_t valid) {
    for (int64_t m = 0; m < mb; m += AG_MR) {
        const float* xm = xf + m * K;
        uint16_t* ym = y + m * N;
        const int rows = mb - m < AG_MR ? (int)(mb - m) : AG_MR;
#define AG_CASE(R)                                               \
        case R:                                                  \
            ag_tile(xm, K, wp, bias_eo, ym, N, n0, valid, R);    \
            break;
        switch (rows) {
            AG_CASE(1) AG_CASE(2) AG_CASE(3) AG_CASE(4) AG_CASE(5)
            default: AG_CASE(6)
        }
#undef AG_CASE
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), bf16 in and out; w in the layout above. Returns 0, -1
 * when a size is not positive (nothing written), -2 when out of memory. */
int ps_avx2_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N) {
    if (M < 1 || K < 1 || N < 1) return -1;
    const int64_t panels = (N + AG_NR - 1) / AG_NR;
    int64_t rows = AG_BLOCK_BYTES / (K * 4);
    rows = rows < 4 * AG_MR ? 4 * AG_MR : rows - rows % AG_MR;
    if (rows > M) rows = M;
    float* xf = (float*)malloc(sizeof(float) * (rows * K + panels * AG_NR));
    if (!xf) return -2;
    float* bfe = xf + rows * K; /* bias widened, zero-padded to whole panels: each panel's 8 even outputs, then its 8 odd */
    if (!bias) { /* the usual case (Llama has none): a memset, not a scalar pass over N */
        memset(bfe, 0, sizeof(float) * panels * AG_NR);
    } else {
        for (int64_t n = 0; n < panels * AG_NR; n++)
            bfe[n - n % AG_NR + (n % 2) * (AG_NR / 2) + (n % AG_NR) / 2] = n < N ? bf16_to_f32(bias[n]) : 0.f;
    }
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t mb = M - r0 < rows ? M - r0 : rows;
        const uint16_t* xb = x + r0 * K;
        uint16_t* yb = y + r0 * N;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < mb * K; i += 8) {
                if (i + 8 <= mb * K) {
                    _mm256_storeu_ps(xf + i, bf16x8_load(xb + i));
                } else {
                    for (int64_t j = i; j < mb * K; j++) xf[j] = bf16_to_f32(xb[j]);
                }
            }
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            int64_t p = p0;
            /* 1-3 rows: full panels several at a time; the rest (and a partial last one) below */
            if (mb == 1)
                for (; p + AG_WIDE <= p1 && (p + AG_WIDE) * AG_NR <= N; p += AG_WIDE)
                    ag_row_wide(xf, K, w + p * K * AG_NR, bfe + p * AG_NR, yb + p * AG_NR);
            if (mb == 2 || mb == 3)
                for (; p + 2 <= p1 && (p + 2) * AG_NR <= N; p += 2) {
                    if (mb == 2) ag_rows_pair(xf, K, w + p * K * AG_NR, bfe + p * AG_NR, yb + p * AG_NR, N, 2);
                    else ag_rows_pair(xf, K, w + p * K * AG_NR, bfe + p * AG_NR, yb + p * AG_NR, N, 3);
                }
            for (; p < p1; p++) {
                const int64_t n0 = p * AG_NR, valid = N - n0 < AG_NR ? N - n0 : AG_NR;
                ag_panel(xf, mb, K, w + n0 * K, bfe + n0, yb, N, n0, valid);
            }
        }
    }
    free(xf);
    return 0;
}
