/* The LoRA delta loops (body.h) built with AVX2 + FMA flags (build.py); run only when ps_cpu_isa()
 * says so (lora.c). */
#define PS_LORA_SUFFIX avx2
#include "body.h"
