/*
 * The multi-LoRA delta (pagedserve/ops/cpu/lora_ops.py): for each row t of a batch whose adapter
 * slot s = row_slots[t] is >= 0,
 *     out[t, :] += (x[t, :] @ AT[s]) @ BT[s]
 * with AT[s] [K, R] = A[s] transposed and BT[s] [R, N] = B[s] transposed (the rank columns >=
 * ranks[s] unused). lora.c checks the arguments, groups the rows by slot (tiles of up to
 * PS_LORA_TILE rows of one slot), widens x to float32 and runs the two phases over the OpenMP
 * pool: the shrink h = x @ AT[s] (one task per tile and chunk of PS_LORA_JW rank columns) and the
 * expand out += h @ BT[s] (one task per tile and block of PS_LORA_NB outputs), each with the loops
 * (body.h) of the highest ISA this CPU has. Both vectorize across the columns of a row of AT or
 * BT, so no sum is ever split across vector lanes.
 *
 * The arithmetic, the same for every batch: h[j] = (s0 + s1) + (s2 + s3) in float32, s_p the sum
 * of AT[s, k, j] * x[t, k] over k = p, p + 4, p + 8, ... in order; the delta of output n is
 * ((BT[0, n] h[0] + BT[1, n] h[1]) + ...) in float32, j in order, added to out[t, n] widened to
 * float32 and rounded once (bf16: to nearest even). The weights AT and BT are float32 or bf16 (the
 * slots of a bf16 model: half the bytes to read), bf16 widened exactly to float32 as they are
 * loaded, so the sums are those of float32 weights of the same values, bit for bit. Each "sum + product" is one fused multiply-add
 * where the unit's ISA has FMA (built with -ffp-contract=fast: the AVX2 and AVX-512 units, which
 * give the same bits), two roundings in the portable unit on x86-64 (no FMA in its baseline). A
 * row's bits depend on that row alone (its x, its slot's weights), never on the other rows, the
 * tiles or the threads.
 */
#ifndef PAGEDSERVE_LORA_H
#define PAGEDSERVE_LORA_H
#include <stdint.h>

/* The partial sums of each rank value (the arithmetic above: changing it changes the bits). */
#define PS_LORA_KSPLIT 4
/* Rank columns per shrink task (one AVX-512 vector). */
#define PS_LORA_JW 16
/* Rows of one slot computed together (one pass over AT's and BT's rows for all of them). */
#define PS_LORA_TILE 8
/* Outputs per expand task. */
#define PS_LORA_NB 64
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more. */
#define PS_LORA_PAR_MIN 131072

/* out[t] += (x[t] @ AT[s]) @ BT[s] for each row t < T with s = row_slots[t] >= 0 (-1: no delta).
 * x: T rows of K, ldx apart; out: T rows of N, ldo apart; both float32 (bf16 = 0) or bf16 (raw
 * uint16, bf16 = 1). AT [num_slots, K, R], BT [num_slots, R, N], both contiguous, both float32
 * (w_bf16 = 0) or both bf16 (raw uint16, w_bf16 = 1);
 * ranks[s] in [0, R]: the rank columns of slot s in use (0: an empty slot, its rows untouched).
 * 0 on success; -1 for a bad argument (a slot outside [-1, num_slots), a rank outside [0, R], a
 * size or a leading dimension out of range, a NULL pointer; nothing written); -2 when out of
 * memory (nothing written). */
int lora_add_delta(const void* x, int64_t ldx, void* out, int64_t ldo, int bf16, int64_t T, const int32_t* row_slots,
                   int64_t num_slots, const int32_t* ranks, const void* AT, const void* BT, int w_bf16, int64_t R, int64_t K, int64_t N);

/* Each unit's loops (body.h), called by lora.c on checked arguments (at, bt: float32, or bf16 when
 * wbf16):
 * shrink: h[i * ldh + j] = sum_k at[k * R + j] xf[i * K + k] for i < rows, j0 <= j < j0 + jw
 *   (jw <= PS_LORA_JW; at: one slot's AT);
 * expand: for i < rows and n0 <= n < n1, out[out_rows[i] * ldo + n] += sum_{j < r} bt[j * N + n] *
 *   h[i * ldh + j] (rounded once to out's type). */
#define PS_LORA_DECLARE(isa)                                                                                                         \
    void ps_lora_shrink_##isa(const void* at, int wbf16, int64_t R, int64_t j0, int64_t jw, const float* xf, int64_t rows, int64_t K, \
                              float* h, int64_t ldh);                                                                                \
    void ps_lora_expand_##isa(const void* bt, int wbf16, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh,   \
                              int64_t rows, const int64_t* out_rows, void* out, int64_t ldo, int bf16);
PS_LORA_DECLARE(scalar)
PS_LORA_DECLARE(avx2)
PS_LORA_DECLARE(avx512)

#endif
