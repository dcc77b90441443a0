/*
 * What the AMX units (gemm/amx.c, attention/amx.c) share: the tile configuration (palette 1)
 * and leaving a thread's configuration as it was found, so they can be called in any order with
 * oneDNN's AMX kernels on the same threads. Linux's permission for the tile state is asked by
 * ps_amx_granted() (cpu.h), before any AMX unit runs.
 */
#ifndef PAGEDSERVE_AMX_H
#define PAGEDSERVE_AMX_H
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "an AMX unit: build it with -mamx-tile -mamx-bf16 and the AVX512-BF16 flags (build.py)"
#endif
#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* The configuration a thread had before a kernel loaded its own, and its restoration after. */
static inline void amx_save(amx_tilecfg* saved) { _tile_storeconfig(saved); }

static inline void amx_restore(const amx_tilecfg* saved) {
    if (saved->palette_id)
        _tile_loadconfig(saved);
    else
        _tile_release();
}
#endif
