/*
 * Small-M bf16 matmul (decode with 1-64 sequences) straight from oneDNN's packed weights.
 *
 * A decode step with one sequence multiplies one row by every weight matrix: the work is
 * streaming the weights from memory (SmolLM2-135M: 265 MB per token), and oneDNN's brgemm
 * spends ~10 us of fixed cost per call on top (measured: 7.9 ms for a step's matmuls against a
 * 6.3 ms streaming floor). These loops read the same packed buffers oneDNN reorders the weights
 * into at load time (`PackedLinear`; layout AB16b64a2b = [N/64][K/2][64][2]: 64 outputs, then
 * pairs of k), one 64-output block at a time, so every block is one contiguous stream.
 *
 * Rows are taken 4 at a time per block (accumulators in registers); the block, K * 128 bytes,
 * is read from memory by the first group and from L1/L2 by the others, so up to 16 rows cost
 * little more than one (measured: all of SmolLM2's matmuls, 16 rows 10.0 ms vs oneDNN 10.6 ms;
 * 1 row 6.3 vs 7.4 ms on a slow-memory moment of the shared host). On AMD Zen 4 it also beats
 * oneDNN at 32-64 rows (1.08-1.29x at 32, 1.03-1.05x at 64 on 2 MiB pages: benchmarks/README.md).
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
 * Built with -ffp-contract=off (it shares a translation unit with the fused ops).
 */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <omp.h>

#define SG_NBLK 64       /* outputs per packed block */
#define SG_ROW_GROUP 4   /* rows per register-resident pass over a block */
#define SG_MAX_ROWS 64

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_SMALL_GEMM 1

static inline __m512 sg_bias16(const uint16_t* bias, int64_t n) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n))), 16));
}

/* Output block b of M <= 4 rows (fixed at compile time) of y = x @ W^T (+ bias); x and y point
 * at the group's first row, rows K and N elements apart. */
static inline __attribute__((always_inline)) void sg_block(const uint16_t* x, int64_t K, const uint16_t* w,
                                                             const uint16_t* bias, uint16_t* y, int64_t N, int64_t b,
                                                             int64_t chain, int64_t body, const int M) {
    const int64_t K2 = K / 2;
    const uint32_t* xp = (const uint32_t*)x; /* k pairs */
    {
        const uint16_t* wb = w + b * K * SG_NBLK;
        __m512 acc[SG_ROW_GROUP][4];
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K2;) {
            const int64_t k1 = k0 < body ? (k0 + chain < body ? k0 + chain : body) : K2;
            __m512 part[SG_ROW_GROUP][4];
            for (int m = 0; m < M; m++)
                for (int j = 0; j < 4; j++) part[m][j] = _mm512_setzero_ps();
            for (int64_t k = k0; k < k1; k++) {
                const uint16_t* wk = wb + k * (2 * SG_NBLK);
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
                const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
                const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
                for (int m = 0; m < M; m++) {
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * K2 + k]);
                    part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
                    part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
                    part[m][2] = _mm512_dpbf16_ps(part[m][2], xv, w2);
                    part[m][3] = _mm512_dpbf16_ps(part[m][3], xv, w3);
                }
            }
            for (int m = 0; m < M; m++)
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_add_ps(acc[m][j], part[m][j]);
            k0 = k1;
        }
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) {
                const int64_t n = b * SG_NBLK + j * 16;
                const __m512 v = bias ? _mm512_add_ps(acc[m][j], sg_bias16(bias, n)) : acc[m][j];
                _mm256_storeu_si256((__m256i*)(y + m * N + n), (__m256i)_mm512_cvtneps_pbh(v));
            }
    }
}

/* Output blocks [b0, b1): each block streamed from memory once, then reused from L1/L2 (K * 128
 * bytes, 72 KiB for K = 576) by the following groups of 4 rows. */
static void sg_range(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                     int64_t N, int64_t b0, int64_t b1, int64_t chain, int64_t body) {
    for (int64_t b = b0; b < b1; b++)
        for (int64_t r = 0; r < M; r += SG_ROW_GROUP) {
            const uint16_t* xr = x + r * K;
            uint16_t* yr = y + r * N;
            switch (M - r < SG_ROW_GROUP ? M - r : SG_ROW_GROUP) {
                case 1: sg_block(xr, K, w, bias, yr, N, b, chain, body, 1); break;
                case 2: sg_block(xr, K, w, bias, yr, N, b, chain, body, 2); break;
                case 3: sg_block(xr, K, w, bias, yr, N, b, chain, body, 3); break;
                default: sg_block(xr, K, w, bias, yr, N, b, chain, body, 4); break;
            }
        }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), bf16 in and out. w: oneDNN-packed [N/64][K/2][64][2];
 * partial sums of `chain` k pairs over the first `body` pairs, then one over the rest.
 * Requires 1 <= M <= 64, N % 64 == 0, K % 2 == 0, chain >= 1. Output blocks are split evenly
 * over the OpenMP threads. Returns 0, or -1 when the shape or the CPU is not supported
 * (nothing written). */
int small_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                    int64_t N, int64_t chain, int64_t body) {
#ifdef HAVE_SMALL_GEMM
    if (M < 1 || M > SG_MAX_ROWS || N % SG_NBLK || K % 2 || chain < 1 || body < 0 || body > K / 2) return -1;
    const int64_t nblocks = N / SG_NBLK;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = nblocks * t / nt, b1 = nblocks * (t + 1) / nt;
        if (b0 < b1) sg_range(x, M, K, w, bias, y, N, b0, b1, chain, body);
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)w; (void)bias; (void)y; (void)N; (void)chain; (void)body;
    return -1;
#endif
}
