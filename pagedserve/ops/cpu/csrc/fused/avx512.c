/*
 * The int8 KV-cache quantizer (kv_int8.h) on 16 lanes, for rope_write_kv_q8 on CPUs with AVX-512
 * (the same values as the scalar loop for every row without NaN).
 *
 * An AVX-512 unit (build.py's flags), called by fused_ops.c only on CPUs with AVX512F/BW/VL/DQ.
 */
#if !defined(__AVX512F__)
#error "an AVX-512 unit: build it with the AVX-512 flags (build.py)"
#endif
#include <stdint.h>

#include "../common/kv_int8.h"
#include "fused.h"

void fo_quantize_row_q8_avx512(const float* x, int64_t d, int8_t* out, float* scale) { quantize_row_q8(x, d, out, scale); }
