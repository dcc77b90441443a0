/*
 * The bf16 matmuls as the Python side calls them (matmul.py): each checks that the CPU has its
 * ISA before calling into that ISA's unit (small_gemm.c, amx.c, avx2.c), and answers -1 (nothing
 * written) where it does not. Portable: built without ISA flags.
 */
#include <stdint.h>

#include "../common/cpu.h"
#include "gemm.h"

/* small_gemm.c's matmul: 0, or -1 when the shape is not supported or the CPU has no
 * AVX512-BF16. */
PS_EXPORT int small_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                              int64_t N, int64_t chain, int64_t body) {
#ifdef PS_X86
    if (ps_cpu_isa() >= PS_ISA_AVX512BF16) return ps_small_gemm_avx512bf16(x, M, K, w, bias, y, N, chain, body);
#endif
    (void)x; (void)M; (void)K; (void)w; (void)bias; (void)y; (void)N; (void)chain; (void)body;
    return -1;
}

/* 1 when the AMX matmul can run in this process (the CPU has AMX-BF16 and Linux granted the
 * tile state), else 0. */
PS_EXPORT int amx_gemm_available(void) { return ps_cpu_isa() >= PS_ISA_AMX && ps_amx_granted(); }

/* amx.c's matmul: 0, or -1 (nothing written) for an unsupported shape or where
 * amx_gemm_available() is 0. */
PS_EXPORT int amx_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                            int64_t N) {
#ifdef PS_X86
    if (amx_gemm_available()) return ps_amx_gemm(x, M, K, w, bias, y, N);
#endif
    (void)x; (void)M; (void)K; (void)w; (void)bias; (void)y; (void)N;
    return -1;
}

/* 1 when the CPU has AVX2 + FMA (avx2.c's matmul runs), else 0. */
PS_EXPORT int avx2_gemm_available(void) { return ps_cpu_isa() >= PS_ISA_AVX2; }

/* avx2.c's matmul: 0, -1 when a size is not positive or the CPU lacks AVX2 + FMA (nothing
 * written), -2 when out of memory. */
PS_EXPORT int avx2_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                             int64_t N) {
#ifdef PS_X86
    if (avx2_gemm_available()) return ps_avx2_gemm(x, M, K, w, bias, y, N);
#endif
    (void)x; (void)M; (void)K; (void)w; (void)bias; (void)y; (void)N;
    return -1;
}
