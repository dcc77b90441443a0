/*
 * Small-M bf16 matmul (decode with 1-64 sequences; more rows 64 at a time, as the one-call step's
 * prefill chunks have) straight from oneDNN's packed weights.
 *
 * A decode step with one sequence multiplies one row by every weight matrix: the work is
 * streaming the weights from memory (SmolLM2-135M: 265 MB per token), and oneDNN's brgemm
 * spends ~10 us of fixed cost per call on top (measured: 7.9 ms for a step's matmuls against a
 * 6.3 ms streaming floor). These loops read the same packed buffers oneDNN reorders the weights
 * into at load time (`PackedLinear`; layout AB16b64a2b = [N/64][K/2][64][2]: 64 outputs, then
 * pairs of k), one 64-output block at a time, so every block is one contiguous stream.
 *
 * Rows are taken 4 at a time (accumulators in registers). Up to 4 rows make one pass over each
 * block; more rows take the block 64 k pairs (16 KiB) at a time, every group of 4 rows passing
 * over that chunk from L1 while the next chunk is prefetched, so streaming the weights overlaps
 * the arithmetic. Measured on AMD Zen 4 against oneDNN (docs/perf-history.md, "AVX-512 BF16
 * without AMX"): SmolLM2's matmuls 2.1x at 1 row, 1.9x at 16, 1.15x at 64; Llama-3.2-1B's shapes 1.8x at 1 row, 1.5x at
 * 16, 1.1x at 64.
 *
 * Rounding: fp32 accumulation with vdpbf16ps over k pairs in order, in partial sums (one per
 * `chain` k pairs of the first `body` pairs, then one for the rest) added to a running total,
 * then one rounding to bf16 (nearest even). oneDNN's brgemm kernel sums the same way, with a
 * structure that depends on K (its K blocking and batch size; measured here, K = 576 sums
 * 512 + 64, 896: 512 + 384, 1536: 1024 + 512, 4864: 4 x 1024 + 768). The caller picks
 * (chain, body) per weight shape at load time by matching oneDNN's batched output bit for bit
 * (`cpu_kernels.calibrate_small_gemm`) and keeps oneDNN where nothing matches, so a sequence's
 * tokens do not depend on how many sequences were decoded with it. (oneDNN itself is not
 * invariant here: for K = 1536 its M = 1 results differ from its M >= 2 results in about one
 * output in 10^4; this path follows the batched ones.)
 *
 * An AVX512-BF16 unit (build.py's flags), called through gemm.c's small_gemm_bf16 only on CPUs
 * that have it. Built with -ffp-contract=off, as the rest of the decode library.
 */
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "an AVX512-BF16 unit: build it with the AVX512-BF16 flags (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "gemm.h"

#define SG_NBLK 64       /* outputs per packed block */
#define SG_ROW_GROUP 4   /* rows per register-resident pass over a block */
#define SG_MAX_ROWS 64
#define SG_KC 64         /* k pairs per chunk (16 KiB of a block) when more than 4 rows share it */

static inline __m512 sg_bias16(const uint16_t* bias, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n))), 16));
}

/* part[m][0..3] += row m's k pair k times the pair's 64 outputs (wk), for M <= 4 rows; between
 * the loads and the arithmetic, prefetches pf_bytes from pf into L2. */
static inline __attribute__((always_inline)) void sg_pair(__m512 part[SG_ROW_GROUP][4], const uint32_t* xp, int64_t K2, int64_t k,
                                                            const uint16_t* wk, const int M, const char* pf, int64_t pf_bytes) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int64_t off = 0; off < pf_bytes; off += 64) _mm_prefetch(pf + off, _MM_HINT_T1);
    for (int m = 0; m < M; m++) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * K2 + k]);
        part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
        part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
        part[m][2] = _mm512_dpbf16_ps(part[m][2], xv, w2);
        part[m][3] = _mm512_dpbf16_ps(part[m][3], xv, w3);
    }
}

/* End (exclusive) of the partial sum that k pair k belongs to: `chain` pairs up to `body`, then
 * one to K2. */
static inline int64_t sg_seg_end(int64_t k, int64_t chain, int64_t body, int64_t K2) {
    if (k >= body) return K2;
    const int64_t e = (k / chain + 1) * chain;
    return e < body ? e : body;
}

/* y[n .. n+16) = acc (+ bias[n .. n+16)), rounded to bf16 (nearest even). */
static inline void sg_store16(uint16_t* y, __m512 acc, const uint16_t* bias, int64_t n) {
    const __m512 v = bias ? _mm512_add_ps(acc, sg_bias16(bias, n)) : acc;
    _mm256_storeu_si256((__m256i*)(y + n), (__m256i)_mm512_cvtneps_pbh(v));
}

/* Output block b of M <= 4 rows (fixed at compile time) of y = x @ W^T (+ bias); x and y point
 * at the group's first row, rows K and N elements apart. */
static inline __attribute__((always_inline)) void sg_block(const uint16_t* x, int64_t K, const uint16_t* w,
                                                             const uint16_t* bias, uint16_t* y, int64_t N, int64_t b,
                                                             int64_t chain, int64_t body, const int M) {
    const int64_t K2 = K / 2;
    const uint32_t* xp = (const uint32_t*)x; /* k pairs */
    const uint16_t* wb = w + b * K * SG_NBLK;
    __m512 acc[SG_ROW_GROUP][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K2;) {
        const int64_t k1 = sg_seg_end(k0, chain, body, K2);
        __m512 part[SG_ROW_GROUP][4];
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) part[m][j] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) sg_pair(part, xp, K2, k, wb + k * (2 * SG_NBLK), M, 0, 0);
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_add_ps(acc[m][j], part[m][j]);
        k0 = k1;
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) sg_store16(y + m * N, acc[m][j], bias, b * SG_NBLK + j * 16);
}

/* Pairs [c0, c1) of block `wb` for row group g of G (M <= 4 rows, fixed at compile time): the
 * rows' partial sums come in and go out through `part_mem` and completed ones are added to `acc`
 * (both fp32, [rows][64]), so a block's sums are the same operations in the same order as
 * sg_block's, only cut into chunks. Each group also prefetches its 1/G share of the next chunk. */
static inline __attribute__((always_inline)) void sg_chunk(const uint16_t* x, int64_t K, const uint16_t* wb,
                                                             int64_t c0, int64_t c1, int64_t chain, int64_t body,
                                                             float* acc, float* part_mem, const int M, int64_t g, int64_t G) {
    const int64_t K2 = K / 2;
    const uint32_t* xp = (const uint32_t*)x;
    const int64_t pf_step = 256 / G; /* bytes of the next chunk (256 a k pair) per k, this group's share */
    const char* pf = (const char*)(wb + c1 * 2 * SG_NBLK) + g * (c1 - c0) * pf_step;
    __m512 part[SG_ROW_GROUP][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) part[m][j] = _mm512_loadu_ps(part_mem + m * SG_NBLK + j * 16);
    for (int64_t k0 = c0; k0 < c1;) {
        const int64_t seg_end = sg_seg_end(k0, chain, body, K2);
        const int64_t k1 = seg_end < c1 ? seg_end : c1;
        for (int64_t k = k0; k < k1; k++) {
            /* the next chunk into L2, spread evenly over all G groups' passes over this one */
            sg_pair(part, xp, K2, k, wb + k * (2 * SG_NBLK), M, pf + (k - c0) * pf_step, pf_step);
        }
        if (k1 == seg_end)
            for (int m = 0; m < M; m++)
                for (int j = 0; j < 4; j++) {
                    float* a = acc + m * SG_NBLK + j * 16;
                    _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), part[m][j]));
                    part[m][j] = _mm512_setzero_ps();
                }
        k0 = k1;
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(part_mem + m * SG_NBLK + j * 16, part[m][j]);
}

/* Output blocks [b0, b1). Up to 4 rows: one register-resident pass per block (sg_block). More
 * rows: the block is taken SG_KC pairs at a time (16 KiB, held in L1) and every group of 4 rows
 * passes over that chunk while the next one is prefetched into L2, so the weights stream from
 * memory during the arithmetic. (Before, one group streamed a whole block, K * 128 bytes, 1 MiB
 * for K = 8192, with the arithmetic waiting on memory, and the others reread it from L2 with the
 * memory idle: 1.4-1.5x slower at 16-32 rows: docs/perf-history.md, "the small-M kernel
 * streams while it computes".) */
static void sg_range(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                     int64_t N, int64_t b0, int64_t b1, int64_t chain, int64_t body) {
    if (M <= SG_ROW_GROUP) {
        for (int64_t b = b0; b < b1; b++) switch (M) {
                case 1: sg_block(x, K, w, bias, y, N, b, chain, body, 1); break;
                case 2: sg_block(x, K, w, bias, y, N, b, chain, body, 2); break;
                case 3: sg_block(x, K, w, bias, y, N, b, chain, body, 3); break;
                default: sg_block(x, K, w, bias, y, N, b, chain, body, 4); break;
            }
        return;
    }
    const int64_t K2 = K / 2, G = (M + SG_ROW_GROUP - 1) / SG_ROW_GROUP;
    float acc[SG_MAX_ROWS * SG_NBLK] __attribute__((aligned(64)));
    float part[SG_MAX_ROWS * SG_NBLK] __attribute__((aligned(64)));
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t* wb = w + b * K * SG_NBLK;
        for (int64_t i = 0; i < M * SG_NBLK; i++) acc[i] = part[i] = 0.0f;
        for (int64_t c0 = 0; c0 < K2; c0 += SG_KC) {
            const int64_t c1 = c0 + SG_KC < K2 ? c0 + SG_KC : K2;
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = g * SG_ROW_GROUP;
                const uint16_t* xr = x + r * K;
                float *ar = acc + r * SG_NBLK, *pr = part + r * SG_NBLK;
                switch (M - r < SG_ROW_GROUP ? M - r : SG_ROW_GROUP) {
                    case 1: sg_chunk(xr, K, wb, c0, c1, chain, body, ar, pr, 1, g, G); break;
                    case 2: sg_chunk(xr, K, wb, c0, c1, chain, body, ar, pr, 2, g, G); break;
                    case 3: sg_chunk(xr, K, wb, c0, c1, chain, body, ar, pr, 3, g, G); break;
                    default: sg_chunk(xr, K, wb, c0, c1, chain, body, ar, pr, 4, g, G); break;
                }
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) sg_store16(y + m * N, _mm512_load_ps(acc + m * SG_NBLK + j * 16), bias, b * SG_NBLK + j * 16);
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), bf16 in and out. w: oneDNN-packed [N/64][K/2][64][2];
 * partial sums of `chain` k pairs over the first `body` pairs, then one over the rest.
 * Requires M >= 1, N % 64 == 0, K % 2 == 0, chain >= 1. Output blocks are split evenly over the
 * OpenMP threads; past 64 rows each thread takes its blocks for 64 rows at a time (the rows'
 * panel stays in L2 while the blocks stream), every row the same operations as alone. Returns
 * 0, or -1 when the shape is not supported (nothing written). */
int ps_small_gemm_avx512bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                             int64_t N, int64_t chain, int64_t body) {
    if (M < 1 || N % SG_NBLK || K % 2 || chain < 1 || body < 0 || body > K / 2) return -1;
    const int64_t nblocks = N / SG_NBLK;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = nblocks * t / nt, b1 = nblocks * (t + 1) / nt;
        for (int64_t r = 0; r < M && b0 < b1; r += SG_MAX_ROWS)
            sg_range(x + r * K, M - r < SG_MAX_ROWS ? M - r : SG_MAX_ROWS, K, w, bias, y + r * N, N, b0, b1, chain, body);
    }
    return 0;
}
