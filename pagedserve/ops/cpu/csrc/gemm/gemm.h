/* The bf16 matmuls: y[M, N] = x[M, K] @ W^T (+ bias[N], or NULL), bf16 in and out, W in each
 * unit's layout (see the unit). */
#ifndef PAGEDSERVE_GEMM_H
#define PAGEDSERVE_GEMM_H
#include <stdint.h>

/* The exported ones (gemm.c), which check the CPU: also called by decode_step.c. */
int small_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                    int64_t N, int64_t chain, int64_t body);
int amx_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N);
int avx2_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N);

/* The ISA units' own, called by gemm.c once it has checked the CPU. */

/* small_gemm.c (AVX512-BF16): oneDNN's packed weights, partial sums of `chain` k pairs over the
 * first `body` pairs. */
int ps_small_gemm_avx512bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                             int64_t N, int64_t chain, int64_t body);
/* amx.c (AMX-BF16): the tile state must have been granted (ps_amx_granted). */
int ps_amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N);
/* avx2.c (AVX2 + FMA) */
int ps_avx2_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N);

#endif
