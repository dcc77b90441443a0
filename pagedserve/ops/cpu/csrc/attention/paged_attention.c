/*
 * Paged attention for the CPU, one query token at a time (decode rows and prefill chunks).
 *
 * PagedAttention (Kwon et al., SOSP 2023): each sequence's K/V lives in fixed-size blocks of a
 * shared pool, found through its block table. This kernel reads K/V straight from the pool:
 * no gather into a padded copy, no padding to the longest sequence. One OpenMP task per
 * (query token, KV head) computes the scores of the GQA group's query heads against the first
 * token_lens[t] cached tokens of the token's sequence (causal: a prefill token at position p
 * sees p + 1 tokens, its chunk's own K/V already written), a softmax in float32, and the
 * weighted sum of V. AMX, AVX512-BF16, AVX-512 or AVX2 + FMA where the CPU has them (asked at
 * run time, cpu.h; the paths: attention.h), plain C otherwise.
 *
 * Layouts (row-major):
 *   q, out       [num_tokens, num_heads, head_dim]
 *   k/v cache    [num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block, so
 *                one (token, KV head) task streams block_size * head_dim contiguous values)
 *   block_tables [num_seqs, max_blocks] (int64)
 *   token_seq    [num_tokens] (int64): the token's row of block_tables; NULL = row t (decode)
 *   token_lens   [num_tokens] (int64): tokens to attend to, the token itself included
 *   window       sliding window (paged_attention_window): token t reads only keys
 *                [max(0, token_lens[t] - window), token_lens[t]) (attention.h, pa_first_key)
 *   softcap      Gemma 2's logit cap (paged_attention_window): cap * tanh(s / cap) of the
 *                scaled scores before the softmax (rows.h, softcap_rows)
 * Storage types: float32 (f32) or bfloat16 (bf16, raw uint16).
 *
 * Portable: built without ISA flags; this file only picks the path, each ISA's code is its own
 * unit.
 */
#include <stdint.h>
#include <stdlib.h>

#include "../common/cpu.h"
#include "attention.h"

/* 1 when the AMX path may run: Linux granted the tile state and PAGEDSERVE_AMX is not 0. */
static int amx_ok(void) {
    static int ok = -1;
    int v = __atomic_load_n(&ok, __ATOMIC_RELAXED);
    if (v < 0) {
        const char* env = getenv("PAGEDSERVE_AMX");
        v = (env && env[0] == '0' && env[1] == 0) ? 0 : ps_amx_granted();
        __atomic_store_n(&ok, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Attention of num_tokens query tokens, each to the first token_lens[t] cached tokens of the
 * sequence whose block table is row token_seq[t] (token_seq NULL: row t, the decode case), the
 * last `window` of them when window > 0, by the best path this CPU has for the call's shape
 * (attention.h). Returns 0 on success, -1 when group or head_dim exceed the static limits or
 * window < 0, -2 on allocation failure. */
static int paged_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* out,
                           int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int is_bf16, int kv_int8, int64_t window, float softcap) {
    pa_call c = {q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens, num_heads,
                 num_kv_heads, head_dim, block_size, scale, is_bf16, kv_int8, num_heads / num_kv_heads, 1, window, softcap};
    if (c.group > MAX_GROUP || head_dim > MAX_HEAD_DIM || window < 0 || !(softcap >= 0.f)) return -1;
    const int isa = ps_cpu_isa();
#ifdef PS_X86
    if (isa >= PS_ISA_AMX && is_bf16 && head_dim == 64 && block_size % 16 == 0 && amx_ok()) return pa_amx(&c);
#endif
    for (int64_t t = 0; t < num_tokens; t++) c.max_n = token_lens[t] > c.max_n ? token_lens[t] : c.max_n;
    if (window > 0 && c.max_n > window) c.max_n = window;  /* keys a token reads: the score buffers' rows */
#ifdef PS_X86
    if (isa >= PS_ISA_AVX512BF16 && is_bf16 && pa_bf16_fast_shape(c.group, head_dim))
        return token_tasks_preferred(num_tokens, num_heads, num_kv_heads, c.max_n) ? pa_tokens_avx512bf16(&c)
                                                                                  : pa_heads(&c, pa_head_avx512bf16);
    /* the AVX2 tasks only where there is no AVX-512 (there its generic task is faster) */
    if (isa == PS_ISA_AVX2 && !kv_int8 && head_dim % 8 == 0 && c.group <= AVX2_MAX_GROUP)
        return token_tasks_preferred(num_tokens, num_heads, num_kv_heads, c.max_n) ? pa_tokens_avx2(&c)
                                                                                  : pa_heads(&c, pa_head_avx2);
    if (isa >= PS_ISA_AVX512) return pa_heads(&c, pa_head_generic_avx512);
    if (isa >= PS_ISA_AVX2) return pa_heads(&c, pa_head_generic_avx2);
#endif
    (void)isa;
    return pa_heads(&c, pa_head_generic_scalar);
}

PS_EXPORT int paged_attention_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                                  int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, float* out,
                                  int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 0, 0, 0, 0.f);
}

PS_EXPORT int paged_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                   const int64_t* block_tables, int64_t max_blocks, const int64_t* token_seq,
                                   const int64_t* token_lens, uint16_t* out, int64_t num_tokens, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 1, 0, 0, 0.f);
}

/* The same over an int8 cache (kv_int8.h): k_cache, v_cache [num_blocks, num_kv_heads,
 * Q8_BYTES(block_size, head_dim)] bytes; q and out float32 (f32) or bfloat16 (bf16). */
PS_EXPORT int paged_attention_q8_f32(const float* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                     int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, float* out,
                                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 0, 1, 0, 0.f);
}

PS_EXPORT int paged_attention_q8_bf16(const uint16_t* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                      int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                                      int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, 1, 1, 0, 0.f);
}

/* Any of the four above (is_bf16: q, out and a non-int8 cache bf16, else float32; kv_int8: the
 * int8 cache) under a sliding window of `window` tokens (0: full attention, as above) and with
 * Gemma 2's attention-logit cap `softcap` (scores cap * tanh(s / cap) after the scale; 0: none). */
PS_EXPORT int paged_attention_window(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                     int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* out,
                                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale, int is_bf16, int kv_int8, int64_t window, float softcap) {
    return paged_attention(q, k_cache, v_cache, block_tables, max_blocks, token_seq, token_lens, out, num_tokens,
                           num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, kv_int8, window, softcap);
}

/* 1 when bf16 attention with this GQA group size and head_dim runs a vectorised bf16 path
 * (a CPU with AVX512-BF16, or AVX2 + FMA without AVX-512), 0 when it would take the generic path. */
PS_EXPORT int paged_attention_bf16_fast_path(int64_t group, int64_t head_dim) {
    const int isa = ps_cpu_isa();
    if (isa >= PS_ISA_AVX512BF16) return pa_bf16_fast_shape(group, head_dim);
    if (isa == PS_ISA_AVX2) return group <= AVX2_MAX_GROUP && head_dim <= MAX_HEAD_DIM && head_dim % 8 == 0;
    return 0;
}
