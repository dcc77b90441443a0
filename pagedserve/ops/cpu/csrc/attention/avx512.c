/* The generic attention task (generic_head.h) on rows.h's 16-lane helpers, for every call the
 * AMX and AVX512-BF16 paths do not take on a CPU with AVX-512.
 * An AVX-512 unit (build.py's flags), called by paged_attention.c only on CPUs with
 * AVX512F/BW/VL/DQ. */
#if !defined(__AVX512F__)
#error "an AVX-512 unit: build it with the AVX-512 flags (build.py)"
#endif
#include "rows.h"
#include "generic_head.h"

void pa_head_generic_avx512(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf) {
    (void)pbf;
    pa_generic_head(c, t, kh, table, scores);
}
