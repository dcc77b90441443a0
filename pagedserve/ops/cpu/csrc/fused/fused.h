/* What the fused element-wise ops' units share: limits, the scalar load/store/round of one value
 * (float32 or bf16 storage), and the rows of each ISA unit, which fused_ops.c and argmax.c call
 * once they have checked the CPU (cpu.h):
 *   AVX2 + FMA, without AVX512-BF16: avx2.c (the scalar loop's bits; silu with exp256)
 *   AVX512-BF16:                     avx512bf16.c
 *   AVX-512 (the int8 quantizer):    avx512.c
 * All built with -ffp-contract=off: a fused multiply-add would round once where PyTorch rounds
 * twice. */
#ifndef PAGEDSERVE_FUSED_H
#define PAGEDSERVE_FUSED_H
#include <stdint.h>

#include "../common/bf16.h"

#define MAX_DIM 16384
/* Below this many elements a row loop is cheaper than waking the thread pool
 * (docs/perf-history.md, "AVX2 rows for the element-wise ops"). */
#define PAR_MIN_ELEMS 16384

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float load(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float f, int is_bf16) {
    if (is_bf16)
        ((uint16_t*)p)[i] = f32_to_bf16(f);
    else
        ((float*)p)[i] = f;
}

/* Value as stored: rounded to bf16 when the storage type is bf16. */
static inline float rnd(float f, int is_bf16) { return is_bf16 ? round_bf16(f) : f; }

/* One row of add_rms_norm, bf16, dim % 16 == 0: residual (r16, may be NULL) = x + residual; out =
 * weight * rnd(residual * rsqrt(mean(residual^2) + eps)). rr: dim floats of scratch. */
void fo_add_rms_norm_row_avx2(const uint16_t* x16, uint16_t* r16, const uint16_t* w16, uint16_t* o16, int64_t dim,
                              float eps, float* rr);
void fo_add_rms_norm_row_avx512bf16(const uint16_t* x16, uint16_t* r16, const uint16_t* w16, uint16_t* o16, int64_t dim,
                                    float eps, float* rr);

/* silu_mul's vector part of one bf16 row (g16: gate, u16: up, o16: out); returns how many values
 * it did (the scalar loop does the rest). */
int64_t fo_silu_mul_row_avx2(const uint16_t* g16, const uint16_t* u16, uint16_t* o16, int64_t inter);
int64_t fo_silu_mul_row_avx512bf16(const uint16_t* g16, const uint16_t* u16, uint16_t* o16, int64_t inter);

/* n float32 (n % 8 == 0) rounded to bf16 and back, src -> dst. */
void fo_round_rows_avx2(const float* src, float* dst, int64_t n);

/* One head of rope_write_kv, head_dim = 2 * half bf16 (half % 8 == 0 for AVX2, % 16 for
 * AVX512-BF16): o = rnd(rnd(x * cos) + rnd(rotate_half(x) * sin)), cr and sr the rounded cos and
 * sin rows. */
void fo_rope_head_avx2(const uint16_t* x16, uint16_t* o16, const float* cr, const float* sr, int64_t half);
void fo_rope_head_avx512bf16(const uint16_t* x16, uint16_t* o16, const float* cr, const float* sr, int64_t half);

/* argmax_bf16_rows' scan of a row's first columns (cols >= 32): 1 when a NaN was seen (the caller
 * then finds the first NaN), else 0 with *best_i the first column holding the maximum of the
 * columns scanned, [0, *c_end). */
int fo_argmax_head_avx2(const uint16_t* p, int64_t cols, int64_t* best_i, int64_t* c_end);
int fo_argmax_head_avx512bf16(const uint16_t* p, int64_t cols, int64_t* best_i, int64_t* c_end);

/* kv_int8.h's quantize_row_q8 on 16 lanes. */
void fo_quantize_row_q8_avx512(const float* x, int64_t d, int8_t* out, float* scale);

/* rope_write_kv (kv_int8 = 0) or rope_write_kv_q8 (1), for the one-call step (decode_step.c). */
void fo_rope_write_kv(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                      const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache, void* v_cache,
                      int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int is_bf16,
                      int kv_int8);

/* The exported ops (fused_ops.c, argmax.c), also called by decode_step.c. */
void add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t dim, float eps,
                  int is_bf16);
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int is_bf16);

#endif
