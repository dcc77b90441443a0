/*
 * The quantized-weight matmul and dequantization as the Python side calls them
 * (pagedserve/ops/cpu/quant_matmul.py): argument checks, x widened to float32 once, the ISA unit
 * this CPU has (avx512.c, avx2.c; cpu.h), else the scalar loops here. Portable: built without ISA
 * flags. The layout and the arithmetic: quant.h.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../common/bf16.h"
#include "../common/cpu.h"
#include "quant.h"

/* Below this many x elements (or weights, for qdequant) the loops run on the calling thread:
 * waking the pool costs more. */
#define QG_PAR_MIN 65536

/* Fill *w from the arguments; -1 when they do not describe a weight (N may be 0). */
static int qg_weight(ps_qweight* w, const void* qdata, int bits, int64_t group, const float* scales, const float* mins,
                     int64_t N, int64_t K) {
    if (!qdata || !scales || (bits != 4 && bits != 8) || N < 0 || K < 1 || group < 1) return -1;
    if (group % (bits == 4 ? 32 : 16) || K % group) return -1;
    w->q = (const uint8_t*)qdata;
    w->bits = bits;
    w->group = group;
    w->N = N;
    w->K = K;
    w->G = K / group;
    w->scales = scales;
    w->mins = mins;
    return 0;
}

/* The value q[n, k] (as QuantizedWeight.values). */
static inline int qg_value(const ps_qweight* w, int64_t n, int64_t k) {
    const uint8_t* row = w->q + n * ps_qrow_bytes(w);
    if (w->bits == 8) return (int)(int8_t)row[k];
    const uint8_t b = row[(k - k % 32) / 2 + k % 16];
    return k % 32 < 16 ? (b & 15) : (b >> 4);
}

/* Row n of the dense weight, float32: q * scale, then + min, as the reference rounds them. */
static void qg_row_scalar(const ps_qweight* w, int64_t n, float* dst) {
    for (int64_t g = 0; g < w->G; g++) {
        const float s = w->scales[n * w->G + g];
        const float* mn = w->mins ? w->mins + n * w->G + g : NULL;
        for (int64_t k = g * w->group; k < (g + 1) * w->group; k++) {
            float v = (float)qg_value(w, n, k) * s;
            if (mn) v = v + *mn;
            dst[k] = v;
        }
    }
}

/* The scalar path: each weight row dequantized once (a thread's buffer of K floats), then its dot
 * with every row of x, k in order. */
static int qg_scalar(const float* xf, int64_t M, const ps_qweight* w, void* out, int out_bf16, int64_t ldo) {
    int failed = 0;
#pragma omp parallel if (M * w->N * w->K >= PS_QG_PAR_MIN)
    {
        float* row = (float*)malloc(sizeof(float) * w->K);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < w->N; n++) {
            if (!row) continue;
            qg_row_scalar(w, n, row);
            for (int64_t m = 0; m < M; m++) {
                const float* xm = xf + m * w->K;
                float acc = 0.f;
                for (int64_t k = 0; k < w->K; k++) acc = acc + xm[k] * row[k];
                if (out_bf16)
                    ((uint16_t*)out)[m * ldo + n] = f32_to_bf16(acc);
                else
                    ((float*)out)[m * ldo + n] = acc;
            }
        }
        free(row);
    }
    return failed ? -2 : 0;
}

/* out[m, n] = sum_k x[m, k] * W[n, k] for m < M, n < N (quant.h). 0, -1 for a bad argument
 * (nothing written), -2 when out of memory. */
PS_EXPORT int qgemm(const void* x, int x_bf16, int64_t M, int64_t K, int64_t ldx, const void* qdata, int bits, int64_t group,
                    const float* scales, const float* mins, int64_t N, void* out, int out_bf16, int64_t ldo) {
    ps_qweight w;
    if (qg_weight(&w, qdata, bits, group, scales, mins, N, K) || M < 0 || ldx < K || ldo < N) return -1;
    if (M == 0 || N == 0) return 0;
    if (!x || !out) return -1;
    const float* xf = (const float*)x;
    float* buf = NULL;
    if (x_bf16 || ldx != K) { /* x as float32 rows K apart */
        buf = (float*)malloc(sizeof(float) * M * K);
        if (!buf) return -2;
#pragma omp parallel for schedule(static) if (M * K >= QG_PAR_MIN)
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++)
                buf[m * K + k] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[m * ldx + k]) : ((const float*)x)[m * ldx + k];
        xf = buf;
    }
    int rc;
#ifdef PS_X86
    const int isa = ps_cpu_isa();
    if (isa >= PS_ISA_AVX512)
        rc = ps_qgemm_avx512(xf, M, &w, out, out_bf16, ldo);
    else if (isa >= PS_ISA_AVX2)
        rc = ps_qgemm_avx2(xf, M, &w, out, out_bf16, ldo);
    else
#endif
        rc = qg_scalar(xf, M, &w, out, out_bf16, ldo);
    free(buf);
    return rc;
}

/* The dense weight [N, K] (rows K apart), float32 or bf16, bit-exact with
 * QuantizedWeight.dequantize(dtype). 0, or -1 for a bad argument (nothing written). */
PS_EXPORT int qdequant(const void* qdata, int bits, int64_t group, const float* scales, const float* mins, int64_t N, int64_t K,
                       void* out, int out_bf16) {
    ps_qweight w;
    if (qg_weight(&w, qdata, bits, group, scales, mins, N, K) || !out) return -1;
    if (N == 0) return 0;
#ifdef PS_X86
    const int isa = ps_cpu_isa();
#endif
#pragma omp parallel if (N * K >= QG_PAR_MIN)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
#ifdef PS_X86
        if (isa >= PS_ISA_AVX512)
            ps_qdequant_avx512(&w, n0, n1, out, out_bf16);
        else if (isa >= PS_ISA_AVX2)
            ps_qdequant_avx2(&w, n0, n1, out, out_bf16);
        else
#endif
            for (int64_t n = n0; n < n1; n++) {
                if (out_bf16) {
                    uint16_t* o = (uint16_t*)out + n * K;
                    for (int64_t k = 0; k < K; k++) {
                        const int64_t g = k / group;
                        float v = (float)qg_value(&w, n, k) * scales[n * w.G + g];
                        if (mins) v = v + mins[n * w.G + g];
                        o[k] = f32_to_bf16(v);
                    }
                } else {
                    qg_row_scalar(&w, n, (float*)out + n * K);
                }
            }
    }
    return 0;
}
