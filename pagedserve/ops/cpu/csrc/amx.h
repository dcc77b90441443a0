/*
 * What the AMX kernels (amx_gemm.c, attention_amx.c) share: the tile configuration (palette 1),
 * Linux's permission for the tile state, and leaving a thread's configuration as it was found,
 * so they can be called in any order with oneDNN's AMX kernels on the same threads.
 */
#ifndef PAGEDSERVE_AMX_H
#define PAGEDSERVE_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: 1 when Linux lets this process use the tiles. */
static inline int amx_request_tiles(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* The configuration a thread had before a kernel loaded its own, and its restoration after. */
static inline void amx_save(amx_tilecfg* saved) { _tile_storeconfig(saved); }

static inline void amx_restore(const amx_tilecfg* saved) {
    if (saved->palette_id)
        _tile_loadconfig(saved);
    else
        _tile_release();
}
#endif
#endif
