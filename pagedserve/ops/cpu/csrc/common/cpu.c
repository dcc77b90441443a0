/* Run-time CPU checks (cpu.h). Portable: built without ISA flags. */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int detect(void) {
    int level = PS_ISA_SCALAR;
#ifdef PS_X86
    /* libgcc's checks include the OS's support of the YMM / ZMM / tile state (XCR0) */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        level = PS_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
            && __builtin_cpu_supports("avx512dq")) {
            level = PS_ISA_AVX512;
            if (__builtin_cpu_supports("avx512bf16")) {
                level = PS_ISA_AVX512BF16;
                if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")) level = PS_ISA_AMX;
            }
        }
    }
#endif
#ifdef PS_ISA_CAP
    if (level > PS_ISA_CAP) level = PS_ISA_CAP;
#endif
    const char* cap = getenv("PAGEDSERVE_CPU_ISA");
    if (cap && *cap) {
        static const char* const names[] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};
        for (int i = 0; i < (int)(sizeof(names) / sizeof(names[0])); i++)
            if (strcmp(cap, names[i]) == 0 && i < level) level = i;
    }
    return level;
}

int ps_cpu_isa(void) {
    static int level = -1; /* racing first calls compute the same value */
    int l = __atomic_load_n(&level, __ATOMIC_RELAXED);
    if (l < 0) {
        l = detect();
        __atomic_store_n(&level, l, __ATOMIC_RELAXED);
    }
    return l;
}

int ps_amx_granted(void) {
    static int granted = -1;
    int g = __atomic_load_n(&granted, __ATOMIC_RELAXED);
    if (g < 0) {
#if defined(PS_X86) && defined(__linux__)
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        g = ps_cpu_isa() >= PS_ISA_AMX && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
        g = 0;
#endif
        __atomic_store_n(&granted, g, __ATOMIC_RELAXED);
    }
    return g;
}
