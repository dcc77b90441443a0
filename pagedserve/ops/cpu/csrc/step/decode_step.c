/*
 * A whole step of a Llama-family decoder in one call, in bf16 on the CPU: decodes, prefill
 * chunks or both, any number of tokens. With few sequences the step is a stream of small
 * matmuls and element-wise ops; issued one by one from Python, their dispatch (~10 us each,
 * ~9 per layer) costs as much as a third of the step. In a step that prefills beside decodes
 * the layer-by-layer path paid ~25 ms of Python, dispatch and allocation a step, with the
 * other OpenMP thread waiting (docs/perf-history.md, "steps that prefill run in the one-call C
 * step"). This loop runs the same ops in the same order as `DecoderLayer.forward_fused` (the
 * same C functions: add_rms_norm, rope_write_kv and silu_mul of fused/, the matmuls of gemm/
 * (AMX, AVX2 or small-M), and the paged attention kernel through a function pointer, since that
 * library is built with other floating-point flags), so its output is bit-identical to the
 * layer-by-layer path.
 *
 * Portable (built without ISA flags, -ffp-contract=off like the rest of the decode library): the
 * ops it calls check the CPU themselves.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common/cpu.h"
#include "../fused/fused.h"
#include "../gemm/gemm.h"

typedef int (*attention_fn)(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            const int64_t* block_tables, int64_t max_blocks, const int64_t* token_seq,
                            const int64_t* token_lens, uint16_t* out, int64_t num_tokens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale);

/* Entries per layer in the `layers` table (int64 addresses and small-M plans). */
enum {
    L_QKV_W, L_QKV_B, L_QKV_CHAIN, L_QKV_BODY,
    L_O_W, L_O_B, L_O_CHAIN, L_O_BODY,
    L_GU_W, L_GU_B, L_GU_CHAIN, L_GU_BODY,
    L_DOWN_W, L_DOWN_B, L_DOWN_CHAIN, L_DOWN_BODY,
    L_LN1, L_LN2, L_K_CACHE, L_V_CACHE,
    L_ENTRIES
};

PS_EXPORT int decode_layer_entries(void) { return L_ENTRIES; }

#define P16(v) ((uint16_t*)(intptr_t)(v))

/* One projection of the layer table, e = its 4 entries: the AMX matmul (plan (0, -1)), the
 * AVX2 one (plan (0, -2)) or the small-M one, each for any M. */
static int projection(const uint16_t* x, int64_t M, int64_t K, const int64_t* e, uint16_t* y, int64_t N) {
    if (e[2] == 0 && e[3] == -2) return avx2_gemm_bf16(x, M, K, P16(e[0]), P16(e[1]), y, N);
    if (e[2] == 0 && e[3] == -1) return amx_gemm_bf16(x, M, K, P16(e[0]), P16(e[1]), y, N);
    return small_gemm_bf16(x, M, K, P16(e[0]), P16(e[1]), y, N, e[2], e[3]);
}

/* x: [M, hidden] bf16, the embedded tokens on entry and the final normed hidden states on
 * return. layers: [num_layers, L_ENTRIES] int64 (packed weights, biases or 0, plans, RMSNorm
 * weights, this layer's K and V caches [num_blocks, num_kv_heads, block_size, head_dim], or with
 * kv_int8 the int8 layout of kv_int8.h; `attention` is then paged_attention_q8_bf16).
 * positions, slots, token_lens: [M] int64 (token_lens: how many tokens each token attends to,
 * its position + 1); block_tables: [num_seqs, max_blocks] int64; token_seq: [M] int64, each
 * token's row of block_tables, or NULL for row t (a decode step); cos, sin: float32
 * [max_positions, head_dim]. Returns 0, -1 for an unsupported shape, -2 when out of memory, -3
 * when attention fails; -1 also on a CPU without AVX2 + FMA (no matmul here then). */
PS_EXPORT int decode_layers_bf16(const int64_t* layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size, float eps,
                       float scale, uint16_t* x, const uint16_t* final_norm, const int64_t* positions,
                       const int64_t* slots, const float* cos, const float* sin, const int64_t* block_tables,
                       int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, void* attention,
                       int kv_int8) {
    if (ps_cpu_isa() < PS_ISA_AVX2 || M < 1 || hidden > MAX_DIM || head_dim > 1024) return -1;
    const attention_fn attn = (attention_fn)attention;
    const int64_t qs = num_heads * head_dim, kvs = num_kv_heads * head_dim, qkv_n = qs + 2 * kvs;
    uint16_t* buf = (uint16_t*)malloc(sizeof(uint16_t) * M * (3 * hidden + qkv_n + 2 * qs + 3 * inter));
    if (!buf) return -2;
    uint16_t *r = buf, *h = r + M * hidden, *d = h + M * hidden, *qkv = d + M * hidden, *q = qkv + M * qkv_n,
             *ao = q + M * qs, *gu = ao + M * qs, *act = gu + M * 2 * inter;
    int rc = 0;
    memcpy(r, x, sizeof(uint16_t) * M * hidden);
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const int64_t* L = layers + l * L_ENTRIES;
        if (l == 0)
            add_rms_norm(r, NULL, P16(L[L_LN1]), h, M, hidden, eps, 1);
        else
            add_rms_norm(d, r, P16(L[L_LN1]), h, M, hidden, eps, 1);
        if (projection(h, M, hidden, L + L_QKV_W, qkv, qkv_n)) { rc = -1; break; }
        fo_rope_write_kv(qkv, qkv_n, qkv + qs + kvs, qkv_n, positions, slots, cos, sin, q, P16(L[L_K_CACHE]),
                         P16(L[L_V_CACHE]), M, num_heads, num_kv_heads, head_dim, block_size, 1, kv_int8);
        if (attn(q, P16(L[L_K_CACHE]), P16(L[L_V_CACHE]), block_tables, max_blocks, token_seq, token_lens, ao, M, num_heads,
                 num_kv_heads, head_dim, block_size, scale)) { rc = -3; break; }
        if (projection(ao, M, qs, L + L_O_W, d, hidden)) { rc = -1; break; }
        add_rms_norm(d, r, P16(L[L_LN2]), h, M, hidden, eps, 1);
        if (projection(h, M, hidden, L + L_GU_W, gu, 2 * inter)) { rc = -1; break; }
        silu_mul(gu, act, M, inter, 1);
        if (projection(act, M, inter, L + L_DOWN_W, d, hidden)) { rc = -1; break; }
    }
    if (rc == 0) add_rms_norm(d, r, final_norm, x, M, hidden, eps, 1);
    free(buf);
    return rc;
}
