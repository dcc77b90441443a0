/*
 * The generic attention task, for every shape and storage type (f32 or bf16 queries; f32, bf16
 * or int8 cache): the group's query rows scaled, a dot product per cached token, softmax in fp32
 * (rows.h), the weighted sum of V in fp32, rounded once into out. Under a sliding window only
 * the keys [pa_first_key, n) are read. Compiled by scalar.c, avx2.c
 * and avx512.c, each with its ISA's rows.h helpers (include rows.h first).
 */
#ifndef PAGEDSERVE_ATTENTION_GENERIC_HEAD_H
#define PAGEDSERVE_ATTENTION_GENERIC_HEAD_H

/* One (query token t, KV head kh) task (pa_head_task); scores: group * max_n floats (rows of
 * the m keys the token reads). */
static inline void pa_generic_head(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores) {
    const void* q = c->q;
    void* out = c->out;
    const char* kc = (const char*)c->k_cache;
    const char* vc = (const char*)c->v_cache;
    const int64_t num_heads = c->num_heads, num_kv_heads = c->num_kv_heads, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t group = c->group, n = c->token_lens[t];
    const int is_bf16 = c->is_bf16, kv_int8 = c->kv_int8;
    const float scale = c->scale;
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t block_stride = num_kv_heads * block_size * head_dim; /* elements */
    const int64_t q8_bytes = Q8_BYTES(block_size, head_dim);           /* int8 cache: one (block, KV head) */
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float row[MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++) {
        load_row((const char*)q + ((t * num_heads + kh * group + g) * head_dim) * esize, is_bf16, head_dim, qf[g]);
        for (int64_t d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.f; }
    }
    /* keys [lo, n): the window's first block read from lo on, none before it */
    const int64_t lo = pa_first_key(n, c->window), m = n - lo;
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t blk = table[k0 / block_size], off = k0 % block_size, len = pa_run(k0, n, block_size);
        const char* kb = kv_int8 ? kc + (blk * num_kv_heads + kh) * q8_bytes
                                 : kc + (blk * block_stride + kh * block_size * head_dim) * esize;
        for (int64_t o = off; o < off + len; o++) {
            if (kv_int8)
                dequantize_row_q8((const int8_t*)kb + o * head_dim, ((const float*)(kb + block_size * head_dim))[o], head_dim, row);
            else
                load_row(kb + o * head_dim * esize, is_bf16, head_dim, row);
            for (int64_t g = 0; g < group; g++) scores[g * m + k0 - lo + o - off] = dot(qf[g], row, head_dim);
        }
        k0 += len;
    }
    softcap_rows(scores, group, m, m, c->softcap);
    softmax_rows(scores, group, m);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t blk = table[k0 / block_size], off = k0 % block_size, len = pa_run(k0, n, block_size);
        const char* vb = kv_int8 ? vc + (blk * num_kv_heads + kh) * q8_bytes
                                 : vc + (blk * block_stride + kh * block_size * head_dim) * esize;
        for (int64_t o = off; o < off + len; o++) {
            if (kv_int8)
                dequantize_row_q8((const int8_t*)vb + o * head_dim, ((const float*)(vb + block_size * head_dim))[o], head_dim, row);
            else
                load_row(vb + o * head_dim * esize, is_bf16, head_dim, row);
            for (int64_t g = 0; g < group; g++) axpy(scores[g * m + k0 - lo + o - off], row, acc[g], head_dim);
        }
        k0 += len;
    }
    for (int64_t g = 0; g < group; g++) {
        char* op = (char*)out + ((t * num_heads + kh * group + g) * head_dim) * esize;
        if (is_bf16) {
            for (int64_t d = 0; d < head_dim; d++) ((uint16_t*)op)[d] = f32_to_bf16(acc[g][d]);
        } else {
            memcpy(op, acc[g], sizeof(float) * head_dim);
        }
    }
}
#endif
