/*
 * The AVX2 path of paged attention over query-token tasks: one OpenMP task per query token over
 * all its KV heads (avx2_task.h's task with nkv = num_kv_heads), or per tile of a prefill chunk's
 * tokens (avx2_tiles.h, bf16 cache), longest first, when token_tasks_preferred holds
 * (token_tasks.c).
 *
 * An AVX2 unit (build.py's flags: -mavx2 -mfma), called by paged_attention.c only on CPUs with
 * AVX2 + FMA and without AVX-512.
 */
#if !defined(__AVX2__) || !defined(__FMA__) || defined(__AVX512F__)
#error "an AVX2 unit: build it with -mavx2 -mfma, without AVX-512 (build.py)"
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_task.h"
#include "avx2_tiles.h"

/* Query-token tasks for the AVX2 path: one OpenMP task per query token over all its KV heads
 * (task_avx2 with nkv = num_kv_heads), or per tile of a prefill chunk's tokens (tile_avx2, bf16
 * cache), longest first, when token_tasks_preferred holds (token_tasks.c). Each block's K and V are then read as one contiguous stream of
 * num_kv_heads * block_size * head_dim values instead of one head's 2 KiB slice per task
 * (docs/perf-history.md, "Issue 15 on an AVX2-only Zen 1"). */

/* Tokens a tile takes for this call: within the token tasks' score budget, at most
 * AVX2_TILE_MAX_ROWS, and few enough that every thread gets 4 tasks; 1 (no tiles) for decodes
 * (token_seq NULL), float32 caches (nothing to widen), and sliding windows or a softcap (masked:
 * a tile's rows read keys from 0 and take no cap; its rows then run one token a task). */
static int64_t avx2_tile_rows(const int64_t* token_seq, int is_bf16, int64_t num_tokens, int64_t group, int64_t max_n,
                              int masked) {
    if (token_seq == NULL || !is_bf16 || masked) return 1;
    int64_t rows = TOKEN_TASK_MAX_SCORES / (group * max_n);
    const int64_t spread = num_tokens / (TOKEN_TASKS_PER_THREAD * omp_get_max_threads());
    rows = rows < spread ? rows : spread;
    rows = rows < AVX2_TILE_MAX_ROWS ? rows : AVX2_TILE_MAX_ROWS;
    return rows < 2 ? 1 : rows;
}

/* paged_attention over token tasks (head_dim % 8 == 0, group <= AVX2_MAX_GROUP, no int8 cache);
 * max_n: the most keys a token reads; window: the sliding window (0: none); softcap: the logit
 * cap (0: none). Returns 0, or -2 on allocation failure. */
static int paged_attention_tokens_avx2(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                       int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* out,
                                       int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int is_bf16, int64_t max_n, int64_t window,
                                       float softcap) {
    const int64_t group = num_heads / num_kv_heads, esize = is_bf16 ? 2 : 4;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;  /* elements */
    const int64_t tile_rows = avx2_tile_rows(token_seq, is_bf16, num_tokens, group, max_n, window > 0 || softcap > 0.f);
    /* per thread: a token's qf and acc rows, then a tile's qf, acc and widened slice */
    const int64_t token_floats = MAX_HEAD_DIM * 2 * num_heads;
    const int64_t tile_floats = tile_rows > 1 ? 2 * tile_rows * group * head_dim + block_size * head_dim : 0;
    const int64_t score_floats = (num_heads > tile_rows * group ? num_heads : tile_rows * group) * max_n;
    int64_t* tasks;
    const int64_t num_tasks = token_task_list(token_seq, token_lens, num_tokens, tile_rows, window, &tasks);
    if (num_tasks < 0) return -2;
    int failed = 0;
#pragma omp parallel
    {
    float* buf = (float*)aligned_alloc(32, sizeof(float) * (token_floats + tile_floats));
    float* scores = buf ? (float*)malloc(sizeof(float) * score_floats) : NULL;
    float (*qf)[MAX_HEAD_DIM] = (float (*)[MAX_HEAD_DIM])buf;
    float (*acc)[MAX_HEAD_DIM] = scores ? qf + num_heads : NULL;
    float* tile_qf = scores ? buf + token_floats : NULL;
    float* tile_acc = scores ? tile_qf + tile_rows * group * head_dim : NULL;
    float* kvf = scores ? tile_acc + tile_rows * group * head_dim : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; i++) {
        if (scores == NULL) continue;
        const int64_t t = tasks[3 * i + 1], rows = tasks[3 * i + 2];
        const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
        const char* qp = (const char*)q + t * num_heads * head_dim * esize;
        char* op = (char*)out + t * num_heads * head_dim * esize;
        const int64_t lo = pa_first_key(token_lens[t], window);
        if (rows > 1)
            tile_avx2_any((const uint16_t*)qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], rows,
                          block_size, block_stride, num_kv_heads, group, head_dim, scale, (uint16_t*)op, scores, tile_qf,
                          tile_acc, kvf);
        else if (is_bf16)
            task_avx2_any(qp, k_cache, v_cache, table, token_lens[t], lo, block_size, block_stride, 0, num_kv_heads, group, head_dim,
                          scale, softcap, op, scores, qf, acc, 1);
        else
            task_avx2_any(qp, k_cache, v_cache, table, token_lens[t], lo, block_size, block_stride, 0, num_kv_heads, group, head_dim,
                          scale, softcap, op, scores, qf, acc, 0);
    }
    free(scores);
    free(buf);
    }
    free(tasks);
    return failed ? -2 : 0;
}

int pa_tokens_avx2(const pa_call* c) {
    return paged_attention_tokens_avx2(c->q, c->k_cache, c->v_cache, c->block_tables, c->max_blocks, c->token_seq, c->token_lens,
                                       c->out, c->num_tokens, c->num_heads, c->num_kv_heads, c->head_dim, c->block_size,
                                       c->scale, c->is_bf16, c->max_n, c->window, c->softcap);
}
