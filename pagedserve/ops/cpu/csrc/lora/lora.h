/*
 * The multi-LoRA delta (pagedserve/ops/cpu/lora_ops.py): for each row t of a batch whose adapter
 * slot s = row_slots[t] is >= 0,
 *     out[t, :] += B[s] @ (A[s] @ x[t, :])
 * with A[s] [R, K] (rows >= ranks[s] unused) and B[s] stored transposed, BT[s] [R, N]. lora.c
 * checks the arguments, groups the rows by slot (tiles of up to PS_LORA_TILE rows of one slot),
 * widens x to float32 and runs the two phases over the OpenMP pool: the shrink h = A[s] @ x (one
 * task per tile and rank row) and the expand out += h @ BT[s] (one task per tile and block of
 * PS_LORA_NB outputs), each with the body (body.h) of the highest ISA this CPU has.
 *
 * The arithmetic, identical in every unit (all built with -ffp-contract=off, so no unit fuses a
 * product and a sum) and for every batch: h[j] = sum_k A[s, j, k] * x[t, k] in float32, k spread
 * over 16 lanes (lane l sums k = l, l + 16, ... in order), the lanes then added pairwise (8, 4, 2,
 * 1); the delta of output n is ((BT[0, n] h[0] + BT[1, n] h[1]) + ...) in float32, j in order,
 * added to out[t, n] widened to float32 and rounded once (bf16: to nearest even). A row's bits
 * depend on that row alone (its x, its slot's weights), never on the other rows, the tiles or the
 * threads, nor on the ISA unit.
 */
#ifndef PAGEDSERVE_LORA_H
#define PAGEDSERVE_LORA_H
#include <stdint.h>

/* Rows of one slot computed together (one read of A's and BT's rows for all of them). */
#define PS_LORA_TILE 8
/* Outputs per expand task. */
#define PS_LORA_NB 64
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more. */
#define PS_LORA_PAR_MIN 131072

/* out[t] += B[s] @ (A[s] @ x[t]) for each row t < T with s = row_slots[t] >= 0 (-1: no delta).
 * x: T rows of K, ldx apart; out: T rows of N, ldo apart; both float32 (bf16 = 0) or bf16 (raw
 * uint16, bf16 = 1). A float32 [num_slots, R, K], BT float32 [num_slots, R, N], both contiguous;
 * ranks[s] in [0, R]: the rank rows of slot s in use (0: an empty slot, its rows untouched).
 * 0 on success; -1 for a bad argument (a slot outside [-1, num_slots), a rank outside [0, R], a
 * size or a leading dimension out of range, a NULL pointer; nothing written); -2 when out of
 * memory (nothing written). */
int lora_add_delta(const void* x, int64_t ldx, void* out, int64_t ldo, int bf16, int64_t T, const int32_t* row_slots,
                   int64_t num_slots, const int32_t* ranks, const float* A, const float* BT, int64_t R, int64_t K, int64_t N);

/* Each unit's body (body.h), called by lora.c on checked arguments:
 * shrink: h[i * ldh] = dot(a, xf + i * K) for i < rows (a: one rank row of A, K floats);
 * expand: for i < rows and n0 <= n < n1, out[out_rows[i] * ldo + n] += sum_{j < r} bt[j * N + n] *
 * h[i * ldh + j] (rounded once to out's type). */
void ps_lora_shrink_scalar(const float* a, const float* xf, int64_t rows, int64_t K, float* h, int64_t ldh);
void ps_lora_shrink_avx2(const float* a, const float* xf, int64_t rows, int64_t K, float* h, int64_t ldh);
void ps_lora_shrink_avx512(const float* a, const float* xf, int64_t rows, int64_t K, float* h, int64_t ldh);
void ps_lora_expand_scalar(const float* bt, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh, int64_t rows,
                           const int64_t* out_rows, void* out, int64_t ldo, int bf16);
void ps_lora_expand_avx2(const float* bt, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh, int64_t rows,
                         const int64_t* out_rows, void* out, int64_t ldo, int bf16);
void ps_lora_expand_avx512(const float* bt, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh, int64_t rows,
                           const int64_t* out_rows, void* out, int64_t ldo, int bf16);

#endif
