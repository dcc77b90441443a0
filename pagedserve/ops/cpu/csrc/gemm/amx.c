/*
 * bf16 matmul with AMX tiles (Intel Sapphire Rapids and later), for any M; made for decode.
 *
 * A decode step streams every weight once from memory. oneDNN's AMX kernels do the arithmetic
 * fast but reach ~16 GB/s on this stream at M = 32 (a set-up cost per call, and weights read
 * in its own blocked order); this kernel reads an own copy of the weights laid out exactly in
 * the order the tiles consume them, one sequential stream per 32 outputs, so the hardware
 * prefetcher runs ahead.
 *
 * Weight layout (`amx_layout` in packed_linear.py): [N/32][K/32][2][16][16][2] bf16, i.e. for
 * each 32 outputs and each 32 k, two B tiles (16 outputs each) of 16 k-pair rows x 16 outputs
 * x 2 (AMX's VNNI order). One tile is 1 KiB; the 2 x K/32 tiles of 32 outputs are contiguous.
 *
 * Per 32 rows of x (two A tiles) and 32 outputs: four C tiles (fp32) accumulate over k with
 * TDPBF16PS, in order k = 0, 32, 64, ... (each product of a k pair added in fp32 by the tile
 * unit); then bias and one rounding to bf16 (nearest even). A row's result depends only on that
 * row, never on M or on the other rows, so decode output is the same alone or batched.
 *
 * The tile configuration is per thread; the one found on entry (oneDNN's, say) is restored on
 * exit, so the two can be called in any order on the same threads.
 *
 * An AMX unit (build.py's flags), called through gemm.c's amx_gemm_bf16 only where the CPU has
 * AMX-BF16 and Linux granted the tile state.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common/amx.h"
#include "gemm.h"

#ifndef AMX_UNIT_GROUP
#define AMX_UNIT_GROUP 16 /* units whose weights stay in L2 while every row of x passes */
#endif

/* Every tile 16 rows x 64 bytes: tmm0..3 C (x rows 0-15 / 16-31 of a chunk, times outputs 0-15 /
 * 16-31 of a unit) fp32; tmm4, tmm5 A (16 rows x 32 bf16); tmm6, tmm7 B (16 k pairs x 16
 * outputs x 2). A partial last row of tiles is read from a zero-padded copy, so one
 * configuration serves any M. */
static void amx_config(amx_tilecfg* c) {
    memset(c, 0, sizeof(*c));
    c->palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c->colsb[t] = 64;
        c->rows[t] = 16;
    }
}

/* c: [rows][32] fp32 (the two C tiles of a unit side by side) -> y rows, bias added. */
static inline void amx_store_rows(const float* c, int64_t rows, int64_t n0, const uint16_t* bias, uint16_t* y, int64_t N) {
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0 + 16))), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        __m512 v0 = _mm512_loadu_ps(c + r * 32), v1 = _mm512_loadu_ps(c + r * 32 + 16);
        if (bias) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        _mm256_storeu_si256((__m256i*)(y + r * N + n0), (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_storeu_si256((__m256i*)(y + r * N + n0 + 16), (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

/* Units [u0, u1) of 32 outputs for all M rows. Rows of 16 are read from x, the last partial
 * one from `tail` (16 rows, zero after the last row of x). Each unit's weights (K * 64 bytes)
 * come from memory for the first 32 rows and from L1/L2 for the others of a block of rows. */
static void amx_range(const uint16_t* x, const uint16_t* tail, int64_t M, int64_t K, const uint16_t* w,
                      const uint16_t* bias, uint16_t* y, int64_t N, int64_t u0, int64_t u1) {
    const int64_t KB = K / 32;
    float cbuf[32 * 32];
    for (int64_t ug = u0; ug < u1; ug += AMX_UNIT_GROUP)
    for (int64_t m0 = 0; m0 < M; m0 += 32)
    for (int64_t u = ug; u < u1 && u < ug + AMX_UNIT_GROUP; u++) {
        const char* wu = (const char*)(w + u * KB * 1024);
        {
            const int two = M - m0 > 16;
            const char* xa = (const char*)(m0 + 16 <= M ? x + m0 * K : tail);
            const char* xb = (const char*)(m0 + 32 <= M ? x + (m0 + 16) * K : tail);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < KB; kb++) {
                const char* wk = wu + kb * 2048;
                _mm_prefetch(wk + 8192, _MM_HINT_T0);
                _mm_prefetch(wk + 8192 + 1024, _MM_HINT_T0);
                _tile_loadd(4, xa + kb * 64, K * 2);
                _tile_loadd(6, wk, 64);
                _tile_loadd(7, wk + 1024, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, xb + kb * 64, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int64_t ra = M - m0 < 16 ? M - m0 : 16;
            _tile_stored(0, cbuf, 128);
            _tile_stored(1, cbuf + 16, 128);
            amx_store_rows(cbuf, ra, u * 32, bias, y + m0 * N, N);
            if (two) {
                const int64_t rb = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
                _tile_stored(2, cbuf, 128);
                _tile_stored(3, cbuf + 16, 128);
                amx_store_rows(cbuf, rb, u * 32, bias, y + (m0 + 16) * N, N);
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), bf16 in and out; w in the layout above. Requires
 * M >= 1, N % 32 == 0, K % 32 == 0 and the tile state granted. The units of 32 outputs are split
 * evenly over the OpenMP threads. Returns 0, or -1 (nothing written). */
int ps_amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N) {
    if (M < 1 || N % 32 || K % 32 || K <= 0) return -1;
    const int64_t units = N / 32, full = M / 16 * 16;
    uint16_t* tail = NULL;
    if (full != M) {  /* the tiles read 16 rows: the last partial row of tiles, zero-padded */
        tail = (uint16_t*)calloc(16 * K, sizeof(uint16_t));
        if (!tail) return -1;
        memcpy(tail, x + full * K, sizeof(uint16_t) * (M - full) * K);
    }
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        if (u0 < u1) {
            amx_tilecfg saved, cfg;
            amx_save(&saved);
            amx_config(&cfg);
            _tile_loadconfig(&cfg);
            amx_range(x, tail, M, K, w, bias, y, N, u0, u1);
            amx_restore(&saved);
        }
    }
    free(tail);
    return 0;
}
