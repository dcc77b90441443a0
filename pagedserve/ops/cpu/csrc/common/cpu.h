/*
 * Which instruction set the kernels may use on this CPU, asked at run time.
 *
 * Every ISA's code is its own translation unit, compiled with that ISA's -m flags on any x86-64
 * host (build.py); the portable units (built for the baseline of the architecture) ask
 * ps_cpu_isa() before calling into one, so code for an ISA the CPU lacks never runs. The levels
 * are cumulative, as on every CPU that has them:
 *   PS_ISA_AVX2        AVX2 + FMA                                  (units built -mavx2 -mfma)
 *   PS_ISA_AVX512      + AVX512F/BW/VL/DQ                          (+ -mavx512f/bw/vl/dq)
 *   PS_ISA_AVX512BF16  + AVX512-BF16                               (+ -mavx512bf16)
 *   PS_ISA_AMX         + AMX-TILE, AMX-BF16 (Linux must still grant the tile state: ps_amx_granted)
 * PAGEDSERVE_CPU_ISA=scalar|avx2|avx512|avx512bf16|amx caps the level (read once per library), so
 * a host can run the paths of an older CPU; so does a build with -DPS_ISA_CAP=<level> (e.g.
 * PS_ISA_AVX512BF16: a library without its AMX paths, to compare against).
 */
#ifndef PAGEDSERVE_CPU_H
#define PAGEDSERVE_CPU_H

/* The functions ctypes calls; everything else stays inside its library (-fvisibility=hidden). */
#define PS_EXPORT __attribute__((visibility("default")))

#if defined(__x86_64__)
#define PS_X86 1 /* the ISA units exist only here (build.py builds them on x86-64 only) */
#endif

enum { PS_ISA_SCALAR = 0, PS_ISA_AVX2, PS_ISA_AVX512, PS_ISA_AVX512BF16, PS_ISA_AMX };

/* The highest level this CPU (and its OS: the vector state is enabled) supports, capped by
 * PAGEDSERVE_CPU_ISA. */
int ps_cpu_isa(void);

/* 1 when Linux lets this process use the AMX tile state (asked once), else 0. Only meaningful
 * when ps_cpu_isa() >= PS_ISA_AMX. */
int ps_amx_granted(void);

#endif
