/* The LoRA delta loops (body.h) built with AVX-512 flags (build.py); run only when ps_cpu_isa()
 * says so (lora.c). 512-bit vectors even where -mtune prefers 256 (the same sums either way). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif
#define PS_LORA_SUFFIX avx512
#define PS_LORA_GROUP 4 /* 4 rows at a time: 16 of the 32 vector registers hold their sums */
#include "body.h"
