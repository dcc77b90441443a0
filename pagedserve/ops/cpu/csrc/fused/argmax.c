/*
 * Greedy sampling in C: the index of the largest value of each bf16 row of the logits, as
 * torch.max(dim) (the first maximum on ties, the first NaN in a row that has one). The row's first
 * columns are scanned by the AVX512-BF16 or the AVX2 unit where the CPU has them (fused.h), the
 * rest here. Portable: built without ISA flags.
 */
#include <math.h>
#include <stdint.h>

#include "../common/cpu.h"
#include "fused.h"

/* Continues a scan from column start (no NaN before it): the first NaN wins. */
static int64_t argmax_row_scalar(const uint16_t* p, int64_t cols, int64_t start, int64_t best_i) {
    float best = bf16_to_f32(p[best_i]);
    for (int64_t c = start; c < cols; c++) {
        const float v = bf16_to_f32(p[c]);
        if (isnan(v)) return c;
        if (v > best) {
            best = v;
            best_i = c;
        }
    }
    return best_i;
}

static int64_t argmax_row_first_nan(const uint16_t* p, int64_t cols) {
    for (int64_t c = 0; c < cols; c++)
        if (isnan(bf16_to_f32(p[c]))) return c;
    return -1;
}

/* Index of the largest value of each bf16 row (the first one on ties, as torch.max(dim) and
 * argmax; the first NaN when a row has one, as torch). x: [rows, cols] with a row stride
 * (elements); out: [rows] int64. Greedy sampling of a [64, 49152] batch: one 6 MB read. */
PS_EXPORT void argmax_bf16_rows(const uint16_t* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
    const int isa = ps_cpu_isa();
    (void)isa; /* no ISA units off x86-64 */
#pragma omp parallel for schedule(static) if (rows * cols >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* p = x + r * row_stride;
        int64_t best_i = 0, c = 1;
#ifdef PS_X86
        if (cols >= 32 && isa >= PS_ISA_AVX2) {
            const int nan = isa >= PS_ISA_AVX512BF16 ? fo_argmax_head_avx512bf16(p, cols, &best_i, &c)
                                                     : fo_argmax_head_avx2(p, cols, &best_i, &c);
            if (nan) {
                out[r] = argmax_row_first_nan(p, cols);
                continue;
            }
        }
#endif
        const int64_t nan_i = c == 1 ? argmax_row_first_nan(p, cols) : -1;
        out[r] = nan_i >= 0 ? nan_i : argmax_row_scalar(p, cols, c, best_i);
    }
}
