/* The generic attention task in plain C (generic_head.h), for CPUs without AVX2 + FMA.
 * Portable: built without ISA flags. */
#include "rows.h"
#include "generic_head.h"

void pa_head_generic_scalar(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf) {
    (void)pbf;
    pa_generic_head(c, t, kh, table, scores);
}
