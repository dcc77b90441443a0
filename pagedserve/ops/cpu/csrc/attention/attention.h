/*
 * What the units of the paged attention kernel share: one call's arguments (pa_call), the
 * static limits, and each unit's entry points, which paged_attention.c calls once it has checked
 * the CPU (cpu.h). The paths, best first:
 *   amx.c         AMX tiles: bf16, head_dim 64, block size a multiple of 16
 *   avx512bf16.c  AVX512-BF16: bf16 queries, GQA group <= 4, head_dim 64 or 128 (bf16 or int8 cache)
 *   avx2.c        AVX2 + FMA, CPUs without AVX-512: head_dim % 8 == 0, group <= 12, no int8 cache
 *                 (avx2_task.h's task; per query token and prefill tiles: avx2_tokens.c)
 *   generic       every other call: generic_head.h on rows.h's helpers, built per ISA
 *                 (avx512.c: 16 lanes, avx2.c: 8 lanes, scalar.c)
 * One OpenMP task per (query token, KV head) (heads.c), or per query token or tile of a prefill
 * chunk's tokens (token_tasks.c decides). A sliding window (pa_first_key: each path walks only the
 * window's keys, pa_run) and Gemma 2's logit softcap (rows.h, softcap_rows) hold on every path;
 * with either, prefill chunks run one task per token instead of tiles (AMX keeps its tiles).
 */
#ifndef PAGEDSERVE_ATTENTION_H
#define PAGEDSERVE_ATTENTION_H
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#ifndef PF_DIST
#define PF_DIST 1
#endif
#define AVX2_MAX_GROUP 12 /* larger GQA groups take the generic path */

/* One call (layouts: paged_attention.c). */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t* block_tables;
    int64_t max_blocks;
    const int64_t *token_seq, *token_lens;
    void* out;
    int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int is_bf16, kv_int8;
    int64_t group; /* num_heads / num_kv_heads */
    int64_t max_n; /* the most keys a token reads (token_lens capped by window), at least 1 */
    int64_t window; /* sliding window in tokens (pa_first_key); 0: full attention */
    float softcap;  /* Gemma 2's attention-logit cap (rows.h, softcap_rows); 0: none */
} pa_call;

/* The first key a query token with n keys (position n - 1) reads under a sliding window: HF's
 * rule (Mistral, Gemma 2/3), key k seen from position p iff p - window < k <= p, so keys
 * [max(0, n - window), n); 0 for window 0 (full attention). Keys before it are never read: their
 * blocks may be freed and reused, or hold garbage. */
static inline int64_t pa_first_key(int64_t n, int64_t window) {
    return window > 0 && n > window ? n - window : 0;
}

/* Keys from k0 (k0 < n) that lie in k0's block: as many as the block holds after k0, at most
 * n - k0. Every unit walks a window [lo, n) block by block in such runs. */
static inline int64_t pa_run(int64_t k0, int64_t n, int64_t block_size) {
    const int64_t rest = block_size - k0 % block_size;
    return n - k0 < rest ? n - k0 : rest;
}

/* The AVX512-BF16 path's shapes. */
static inline int pa_bf16_fast_shape(int64_t group, int64_t head_dim) {
    return group <= 4 && (head_dim == 64 || head_dim == 128);
}

/* One (query token t, KV head kh) task: the group's query rows of token t against the first
 * token_lens[t] tokens of its sequence (table: its row of block_tables), from pa_first_key under
 * a window. scores, pbf: this thread's buffers of group * max_n floats and bf16 values. */
typedef void (*pa_head_task)(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);

/* heads.c: `task` for every (query token, KV head), one OpenMP task each. Returns 0, or -2 on
 * allocation failure. */
int pa_heads(const pa_call* c, pa_head_task task);

/* token_tasks.c: when a call runs one task per query token (or tile of a prefill chunk's tokens)
 * and the order of those tasks. */
#define TOKEN_TASK_MAX_KV_HEADS 8 /* most KV heads a token task takes (AVX-512: a set of accumulators per head) */
/* Query tokens per thread from which a call runs one task per token rather than per (token, KV
 * head): enough tasks to share between the threads. */
#ifndef TOKEN_TASKS_PER_THREAD
#define TOKEN_TASKS_PER_THREAD 4
#endif
/* Most scores (num_heads * context) a token task keeps: 6 bytes each, 768 KiB, within a 1 MiB L2.
 * Measured on Zen 4 with 32 query / 8 KV heads: 2,000-4,000 tokens of context 1.29-1.36x the
 * per-head tasks, 6,000-8,000 tokens (1.5 MiB of scores) 0.89-1.00x. */
#define TOKEN_TASK_MAX_SCORES (1 << 17)
int token_tasks_preferred(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t max_n);
int64_t token_task_list(const int64_t* token_seq, const int64_t* token_lens, int64_t num_tokens, int64_t tile_rows,
                        int64_t window, int64_t** tasks);

/* The generic task (generic_head.h) at each ISA. */
void pa_head_generic_scalar(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);
void pa_head_generic_avx2(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);
void pa_head_generic_avx512(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);

/* avx2.c: the AVX2 task per (token, KV head); avx2_tokens.c: the call over token tasks. */
void pa_head_avx2(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);
int pa_tokens_avx2(const pa_call* c);

/* avx512bf16.c: the same for the AVX512-BF16 path. */
void pa_head_avx512bf16(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf);
int pa_tokens_avx512bf16(const pa_call* c);

/* amx.c: the whole call on AMX tiles (the tile state granted). */
int pa_amx(const pa_call* c);

#endif
