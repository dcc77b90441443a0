/*
 * The matmuls on quantized weights (pagedserve/ops/quantized.py's layout) and their dense
 * dequantization: qgemm.c checks the arguments and the CPU and calls the unit of the highest ISA
 * it has (avx512.c, avx2.c, else its own scalar loops). Another ISA (an AVX512-VNNI or AMX int8
 * path) would be one more unit with the two entry points below and one more case in qgemm.c.
 *
 * The weight W [N, K]: W[n, k] = q[n, k] * scales[n, k / group] (+ mins[n, k / group]), in float32,
 * a product and then a sum, as QuantizedWeight.dequantize rounds them (every unit is built with
 * -ffp-contract=off, so no unit fuses the two);
 *   bits 8: q int8 [N, K];
 *   bits 4: q uint8 [N, K / 2], in each 32 inputs k0..k0+31 the byte k0 / 2 + j holds input k0 + j
 *           in its low nibble and k0 + 16 + j in its high one (j < 16).
 * group: a multiple of 16 (of 32 for bits 4) dividing K; scales and mins float32 [N, K / group].
 * Rows of x and out are ldx and ldo elements apart, float32 or bf16 (out rounded to nearest even).
 */
#ifndef PAGEDSERVE_QUANT_H
#define PAGEDSERVE_QUANT_H
#include <stdint.h>

/* A quantized weight, as qgemm.c checked it. */
typedef struct {
    const uint8_t* q; /* int8 values (bits 8) or packed nibbles (bits 4) */
    int bits;
    int64_t group, N, K, G; /* G = K / group: scales per row */
    const float* scales;
    const float* mins; /* NULL: none */
} ps_qweight;

/* Below this many multiply-adds (M * N * K) a call runs on the calling thread: waking the pool
 * costs more (and on a busy host, a preempted thread stalls the whole call). */
#define PS_QG_PAR_MIN 131072

/* Bytes of q per row. */
static inline int64_t ps_qrow_bytes(const ps_qweight* w) { return w->bits == 4 ? w->K / 2 : w->K; }

/* The exported functions (qgemm.c); 0 on success, -1 for a bad argument (nothing written), -2
 * when out of memory. */
int qgemm(const void* x, int x_bf16, int64_t M, int64_t K, int64_t ldx, const void* qdata, int bits, int64_t group,
          const float* scales, const float* mins, int64_t N, void* out, int out_bf16, int64_t ldo);
int qdequant(const void* qdata, int bits, int64_t group, const float* scales, const float* mins, int64_t N, int64_t K,
             void* out, int out_bf16);

/* Each ISA unit's, called by qgemm.c once it has checked the arguments and the CPU:
 * xf: x widened to float32, M rows K apart; out[m * ldo + n] (bf16 when out_bf16). Every unit
 * computes each output as a float32 sum over k of x * W[n, k] (its own order), then one rounding
 * to bf16 where asked; the OpenMP loop is over the outputs n. A unit's sum for an output depends
 * on that row of x alone, never on M, the tiles or the threads: a row alone gives the bits it
 * gives batched (decode alone equals batched; tests/ops/test_quant_matmul.py checks it). */
int ps_qgemm_avx2(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo);
int ps_qgemm_avx512(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo);
/* Rows [n0, n1) of the dense weight into out (rows K apart), bit-exact with the scalar loop. */
void ps_qdequant_avx2(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16);
void ps_qdequant_avx512(const ps_qweight* w, int64_t n0, int64_t n1, void* out, int out_bf16);

#endif
