/*
 * The multi-LoRA delta as the Python side calls it (pagedserve/ops/cpu/lora_ops.py): argument
 * checks, the rows grouped by adapter slot, x widened to float32, and the shrink and expand phases
 * (float32 or bf16 weights) over the OpenMP pool with the body of the highest ISA this CPU has
 * (avx512.c, avx2.c; cpu.h), else the portable one built here. Portable: built without ISA flags.
 * The arithmetic: lora.h.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../common/cpu.h"

#define PS_LORA_SUFFIX scalar
#include "body.h"

typedef void (*ps_lora_shrink_fn)(const void*, int, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);
typedef void (*ps_lora_expand_fn)(const void*, int, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const int64_t*,
                                  void*, int64_t, int);

/* A tile: up to PS_LORA_TILE rows of one slot, at positions [p0, p0 + rows) of the grouped order. */
typedef struct {
    int64_t slot, p0, rows, rank;
} ps_lora_tile;

PS_EXPORT int lora_add_delta(const void* x, int64_t ldx, void* out, int64_t ldo, int bf16, int64_t T, const int32_t* row_slots,
                             int64_t num_slots, const int32_t* ranks, const void* AT, const void* BT, int w_bf16, int64_t R, int64_t K,
                             int64_t N) {
    if (T < 0 || num_slots < 0 || R < 1 || K < 1 || N < 1 || (bf16 != 0 && bf16 != 1) || (w_bf16 != 0 && w_bf16 != 1)) return -1;
    if (T == 0) return 0;
    if (!x || !out || !row_slots || (num_slots > 0 && (!ranks || !AT || !BT))) return -1;
    if ((T > 1 && (ldx < K || ldo < N)) || ldx < 0 || ldo < 0) return -1;
    for (int64_t s = 0; s < num_slots; s++)
        if (ranks[s] < 0 || ranks[s] > R) return -1;
    /* Rows per slot (a counting sort: each slot's rows in their order). */
    int64_t* count = (int64_t*)calloc((size_t)num_slots + 1, sizeof(int64_t));
    if (!count) return -2;
    int64_t active = 0, num_tiles = 0;
    for (int64_t t = 0; t < T; t++) {
        const int32_t s = row_slots[t];
        if (s < -1 || s >= num_slots) {
            free(count);
            return -1;
        }
        if (s >= 0 && ranks[s] > 0) count[s + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) {
        num_tiles += (count[s + 1] + PS_LORA_TILE - 1) / PS_LORA_TILE;
        active += count[s + 1];
        count[s + 1] += count[s]; /* count[s]: the first position of slot s */
    }
    if (active == 0) {
        free(count);
        return 0;
    }
    int64_t* order = (int64_t*)malloc(sizeof(int64_t) * active);
    ps_lora_tile* tiles = (ps_lora_tile*)malloc(sizeof(ps_lora_tile) * num_tiles);
    float* xf = (float*)malloc(sizeof(float) * active * K);
    float* h = (float*)malloc(sizeof(float) * active * R);
    if (!order || !tiles || !xf || !h) {
        free(count), free(order), free(tiles), free(xf), free(h);
        return -2;
    }
    int64_t nt = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t p = count[s]; p < count[s + 1]; p += PS_LORA_TILE)
            tiles[nt++] = (ps_lora_tile){s, p, count[s + 1] - p < PS_LORA_TILE ? count[s + 1] - p : PS_LORA_TILE, ranks[s]};
    for (int64_t t = 0; t < T; t++) {
        const int32_t s = row_slots[t];
        if (s >= 0 && ranks[s] > 0) order[count[s]++] = t;
    }
    free(count);

    ps_lora_shrink_fn shrink = ps_lora_shrink_scalar;
    ps_lora_expand_fn expand = ps_lora_expand_scalar;
#ifdef PS_X86
    const int isa = ps_cpu_isa();
    if (isa >= PS_ISA_AVX512)
        shrink = ps_lora_shrink_avx512, expand = ps_lora_expand_avx512;
    else if (isa >= PS_ISA_AVX2)
        shrink = ps_lora_shrink_avx2, expand = ps_lora_expand_avx2;
#endif
    const int64_t nblocks = (N + PS_LORA_NB - 1) / PS_LORA_NB, nchunks = (R + PS_LORA_JW - 1) / PS_LORA_JW;
    const size_t wsz = w_bf16 ? sizeof(uint16_t) : sizeof(float); /* one slot's AT (BT): K * R (R * N) weights */
#pragma omp parallel if (active * R * (K + N) >= PS_LORA_PAR_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < active; p++) {
            float* dst = xf + p * K;
            if (bf16) {
                const uint16_t* src = (const uint16_t*)x + order[p] * ldx;
                for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
            } else {
                const float* src = (const float*)x + order[p] * ldx;
                for (int64_t k = 0; k < K; k++) dst[k] = src[k];
            }
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t i = 0; i < num_tiles; i++)
            for (int64_t c = 0; c < nchunks; c++) {
                const ps_lora_tile* tl = &tiles[i];
                const int64_t j0 = c * PS_LORA_JW;
                if (j0 < tl->rank) /* whole chunks up to R: the columns past the rank are zeros, unused */
                    shrink((const char*)AT + (size_t)(tl->slot * K * R) * wsz, w_bf16, R, j0, R - j0 < PS_LORA_JW ? R - j0 : PS_LORA_JW,
                           xf + tl->p0 * K, tl->rows, K, h + tl->p0 * R, R);
            }
#pragma omp for schedule(static) collapse(2)
        for (int64_t i = 0; i < num_tiles; i++)
            for (int64_t b = 0; b < nblocks; b++) {
                const ps_lora_tile* tl = &tiles[i];
                const int64_t n0 = b * PS_LORA_NB, n1 = n0 + PS_LORA_NB < N ? n0 + PS_LORA_NB : N;
                expand((const char*)BT + (size_t)(tl->slot * R * N) * wsz, w_bf16, N, n0, n1, tl->rank, h + tl->p0 * R, R, tl->rows,
                       order + tl->p0, out, ldo, bf16);
            }
    }
    free(order), free(tiles), free(xf), free(h);
    return 0;
}
