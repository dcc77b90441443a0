/*
 * The AVX2 path of paged attention per (query token, KV head) (avx2_task.h's task over one
 * head), and the generic task (generic_head.h) on rows.h's 8-lane helpers for the calls the AVX2
 * path does not take (int8 cache, head_dim % 8, GQA group > 12). The per-token tasks are
 * avx2_tokens.c.
 *
 * An AVX2 unit (build.py's flags: -mavx2 -mfma), called by paged_attention.c only on CPUs with
 * AVX2 + FMA and without AVX-512.
 */
#if !defined(__AVX2__) || !defined(__FMA__) || defined(__AVX512F__)
#error "an AVX2 unit: build it with -mavx2 -mfma, without AVX-512 (build.py)"
#endif
#include <stdint.h>

#include "avx2_task.h"
#include "generic_head.h"

/* One (query token, KV head) task, the group's rows kept on the stack. */
static void task_one_head_avx2(const void* q, const void* kc, const void* vc, const int64_t* table, int64_t n, int64_t lo,
                               int64_t block_size, int64_t block_stride, int64_t head_off, int64_t group, int64_t head_dim,
                               float scale, float softcap, void* out, float* scores, const int bf) {
    float qf[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    if (bf) task_avx2_any(q, kc, vc, table, n, lo, block_size, block_stride, head_off, 1, group, head_dim, scale, softcap, out, scores, qf, acc, 1);
    else task_avx2_any(q, kc, vc, table, n, lo, block_size, block_stride, head_off, 1, group, head_dim, scale, softcap, out, scores, qf, acc, 0);
}

void pa_head_avx2(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf) {
    (void)pbf;
    const int64_t esize = c->is_bf16 ? 2 : 4, group = c->group, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t rows_at = (t * c->num_heads + kh * group) * head_dim * esize;
    const int64_t n = c->token_lens[t];
    task_one_head_avx2((const char*)c->q + rows_at, c->k_cache, c->v_cache, table, n, pa_first_key(n, c->window), block_size,
                       c->num_kv_heads * block_size * head_dim, kh * block_size * head_dim, group, head_dim, c->scale,
                       c->softcap, (char*)c->out + rows_at, scores, c->is_bf16);
}

void pa_head_generic_avx2(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf) {
    (void)pbf;
    pa_generic_head(c, t, kh, table, scores);
}
