/*
 * The shrink and expand loops (lora.h), written once and compiled by each unit with its ISA's
 * flags: lora.c (portable, the scalar suffix), avx2.c, avx512.c define PS_LORA_SUFFIX and include
 * this file. Plain loops the compiler vectorizes (-O3); every unit adds in the same order, so all
 * give the same bits.
 */
#include <stdint.h>

#include "../common/bf16.h"
#include "lora.h"

#ifndef PS_LORA_SUFFIX
#error "define PS_LORA_SUFFIX before including body.h"
#endif
#define PS_LORA_CAT2(a, b) a##_##b
#define PS_LORA_CAT(a, b) PS_LORA_CAT2(a, b)
#define PS_LORA_FN(name) PS_LORA_CAT(name, PS_LORA_SUFFIX)

#define PS_LORA_LANES 16

/* The lanes of one dot product added pairwise: (l, l + 8), then (l, l + 4), ... */
static inline float ps_lora_reduce(float* acc) {
    for (int w = PS_LORA_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

/* dot(a, x) over K as lora.h says; four rows at a time share the loads of a (same sums per row). */
void PS_LORA_FN(ps_lora_shrink)(const float* a, const float* xf, int64_t rows, int64_t K, float* h, int64_t ldh) {
    const int64_t K16 = K - K % PS_LORA_LANES;
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) {
        const float* x0 = xf + i * K;
        const float* x1 = x0 + K;
        const float* x2 = x1 + K;
        const float* x3 = x2 + K;
        float c0[PS_LORA_LANES] = {0}, c1[PS_LORA_LANES] = {0}, c2[PS_LORA_LANES] = {0}, c3[PS_LORA_LANES] = {0};
        for (int64_t k = 0; k < K16; k += PS_LORA_LANES)
            for (int l = 0; l < PS_LORA_LANES; l++) {
                const float av = a[k + l];
                c0[l] = c0[l] + av * x0[k + l];
                c1[l] = c1[l] + av * x1[k + l];
                c2[l] = c2[l] + av * x2[k + l];
                c3[l] = c3[l] + av * x3[k + l];
            }
        for (int64_t k = K16; k < K; k++) {
            const int l = (int)(k - K16);
            c0[l] = c0[l] + a[k] * x0[k];
            c1[l] = c1[l] + a[k] * x1[k];
            c2[l] = c2[l] + a[k] * x2[k];
            c3[l] = c3[l] + a[k] * x3[k];
        }
        h[i * ldh] = ps_lora_reduce(c0);
        h[(i + 1) * ldh] = ps_lora_reduce(c1);
        h[(i + 2) * ldh] = ps_lora_reduce(c2);
        h[(i + 3) * ldh] = ps_lora_reduce(c3);
    }
    for (; i < rows; i++) {
        const float* x0 = xf + i * K;
        float c0[PS_LORA_LANES] = {0};
        for (int64_t k = 0; k < K16; k += PS_LORA_LANES)
            for (int l = 0; l < PS_LORA_LANES; l++) c0[l] = c0[l] + a[k + l] * x0[k + l];
        for (int64_t k = K16; k < K; k++) c0[k - K16] = c0[k - K16] + a[k] * x0[k];
        h[i * ldh] = ps_lora_reduce(c0);
    }
}

/* out[out_rows[i], n] += sum_j bt[j, n] h[i, j] for n in [n0, n1), j in order from 0. */
void PS_LORA_FN(ps_lora_expand)(const float* bt, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh, int64_t rows,
                                const int64_t* out_rows, void* out, int64_t ldo, int bf16) {
    const int64_t nb = n1 - n0;
    for (int64_t i = 0; i < rows; i++) {
        float acc[PS_LORA_NB];
        const float* hi = h + i * ldh;
        for (int64_t n = 0; n < nb; n++) acc[n] = bt[n0 + n] * hi[0];
        for (int64_t j = 1; j < r; j++) {
            const float hj = hi[j];
            const float* b = bt + j * N + n0;
            for (int64_t n = 0; n < nb; n++) acc[n] = acc[n] + b[n] * hj;
        }
        if (bf16) {
            uint16_t* o = (uint16_t*)out + out_rows[i] * ldo + n0;
            for (int64_t n = 0; n < nb; n++) o[n] = f32_to_bf16(bf16_to_f32(o[n]) + acc[n]);
        } else {
            float* o = (float*)out + out_rows[i] * ldo + n0;
            for (int64_t n = 0; n < nb; n++) o[n] = o[n] + acc[n];
        }
    }
}
