/*
 * The call as one OpenMP task per (query token, KV head), each given its thread's score buffer;
 * the task itself (generic, AVX2 or AVX512-BF16) is the caller's choice (paged_attention.c).
 * Portable: built without ISA flags.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

int pa_heads(const pa_call* c, pa_head_task task) {
    const int64_t group = c->group, max_n = c->max_n, num_tokens = c->num_tokens, num_kv_heads = c->num_kv_heads;
    int failed = 0;
#pragma omp parallel
    {
    /* fp32 scores, then (bf16 path) the probabilities in bf16 */
    float* scores = (float*)malloc(sizeof(float) * group * max_n + sizeof(uint16_t) * group * max_n);
    uint16_t* pbf = scores ? (uint16_t*)(scores + group * max_n) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            if (scores == NULL) continue;
            task(c, t, kh, c->block_tables + (c->token_seq ? c->token_seq[t] : t) * c->max_blocks, scores, pbf);
        }
    }
    free(scores);
    }
    return failed ? -2 : 0;
}
