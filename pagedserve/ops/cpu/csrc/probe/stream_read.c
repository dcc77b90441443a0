/*
 * Read nbytes (a multiple of 256) with every OpenMP thread, each its contiguous share, with
 * 512-bit loads (AVX-512), 256-bit ones (AVX2) or, elsewhere, one byte per cache line; returns a
 * sum of what was read so the loads are not optimised away. Used by `bench latency` to measure
 * the memory read bandwidth the decode weight stream is up against.
 *
 * Portable: built without ISA flags; the vector loops are avx512.c and avx2.c.
 */
#include <stdint.h>

#include "../common/cpu.h"

float ps_stream_read_avx512(const void* buf, int64_t nbytes);
float ps_stream_read_avx2(const void* buf, int64_t nbytes);

PS_EXPORT float stream_read(const void* buf, int64_t nbytes) {
#ifdef PS_X86
    if (ps_cpu_isa() >= PS_ISA_AVX512) return ps_stream_read_avx512(buf, nbytes);
    if (ps_cpu_isa() >= PS_ISA_AVX2) return ps_stream_read_avx2(buf, nbytes);
#endif
    float total = 0.f;
    for (int64_t i = 0; i < nbytes; i += 64) total += ((const unsigned char*)buf)[i];
    return total;
}
