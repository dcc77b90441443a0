#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Sixteen vectors -> one: lane i = sum of the lanes of a[i]. 45 shuffles/adds instead of 16
 * full horizontal reductions (~8 each). */
static inline __m512 hsum16(__m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++) {  /* per 128-bit lane L: partial sums of a[4j..4j+3] over lane L */
        __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
        c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* bfloat16 fast path for head_dim = 16 * NV (NV = 4 or 8) and small GQA groups, all with
 * vdpbf16ps (bf16 pairs multiplied, accumulated in fp32):
 * - scores: q.k straight from the cache, 16 tokens at a time with one transposing reduction;
 * - softmax in fp32, probabilities then rounded to bf16 (as PyTorch's CPU flash attention does
 *   before its P.V product);
 * - P.V: two V rows interleaved into (token t, token t+1) pairs per dimension and multiplied by
 *   the broadcast probability pair; the accumulators are in an interleaved dimension order
 *   that is undone once at the end.
 * The work is cut into per-block steps (bf16_scores_block, bf16_pv_block) so that it can be
 * ordered two ways with the same arithmetic on every value: per (query token, KV head)
 * (decode_task_bf16), or per query token with all KV heads of a block in turn
 * (decode_token_bf16), which reads each block's K and V for all heads as one contiguous stream
 * (num_kv_heads * block_size * head_dim values) instead of one head's slice of it: on AMD
 * Zen 4, 1.8x the read rate of the scattered slices (benchmarks/README.md). */

static inline __attribute__((always_inline)) void zero_rows(__m512 (*acc)[8], const int G, const int NV) {
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = _mm512_setzero_ps();
}

/* Scores of G query rows (q: G rows of NV * 16 bf16) against the `len` keys at kb (tokens
 * t0 .. t0 + len of the sequence) into scores[g * n + t0 + o], times scale. */
static inline __attribute__((always_inline)) void bf16_scores_block(
    const uint16_t* q, const uint16_t* kb, int64_t len, int64_t n, int64_t t0, const int G, float scale,
    float* scores, const int NV) {
    const int NC = NV / 2;  /* 32-value chunks of a head row */
    __m512bh qv[4][4];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NC; v++) qv[g][v] = (__m512bh)_mm512_loadu_si512((const void*)(q + g * NV * 16 + v * 32));
    const __m512 scale_v = _mm512_set1_ps(scale);
    int64_t o = 0;
    for (; o + 16 <= len; o += 16) {
        for (int g = 0; g < G; g++) {
            __m512 a[16];
            for (int r = 0; r < 16; r++) {
                a[r] = _mm512_setzero_ps();
                for (int v = 0; v < NC; v++)
                    a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512((const void*)(kb + (o + r) * NV * 16 + v * 32)), qv[g][v]);
            }
            _mm512_storeu_ps(scores + g * n + t0 + o, _mm512_mul_ps(hsum16(a), scale_v));
        }
    }
    for (; o < len; o++) {
        __m512bh kv[4];
        for (int v = 0; v < NC; v++) kv[v] = (__m512bh)_mm512_loadu_si512((const void*)(kb + o * NV * 16 + v * 32));
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int v = 0; v < NC; v++) acc = _mm512_dpbf16_ps(acc, kv[v], qv[g][v]);
            scores[g * n + t0 + o] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/* Softmax of G rows of n scores in place, then the probabilities rounded to bf16 into pbf. */
static inline void bf16_probabilities(float* scores, uint16_t* pbf, int64_t G, int64_t n) {
    softmax_rows(scores, G, n);
    int64_t i = 0;
    const int64_t total = G * n;
    for (; i + 16 <= total; i += 16)
        _mm256_storeu_si256((__m256i*)(pbf + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + i)));
    for (; i < total; i++) pbf[i] = f32_to_bf16(scores[i]);
}

/* acc[g] += P[g, t0 .. t0 + len) . V for the `len` value rows at vb (pbf: G rows of n). */
static inline __attribute__((always_inline)) void bf16_pv_block(
    __m512 (*acc)[8], const uint16_t* vb, const uint16_t* pbf, int64_t len, int64_t n, int64_t t0, const int G, const int NV) {
    const int NC = NV / 2;
    for (int64_t o = 0; o < len; o += 2) {
        const int has2 = o + 1 < len;
        const uint16_t* r0 = vb + o * NV * 16;
        const uint16_t* r1 = has2 ? r0 + NV * 16 : r0;  /* odd tail: paired with probability 0 */
        __m512i pairs[8];
        for (int v = 0; v < NC; v++) {
            const __m512i x = _mm512_loadu_si512((const void*)(r0 + v * 32)), y = _mm512_loadu_si512((const void*)(r1 + v * 32));
            pairs[2 * v] = _mm512_unpacklo_epi16(x, y);
            pairs[2 * v + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < G; g++) {
            const uint16_t* pg = pbf + g * n + t0 + o;
            uint32_t pp;
            if (has2) {
                memcpy(&pp, pg, sizeof(pp)); /* (p_t, p_t+1): one broadcast load */
            } else {
                pp = pg[0];
            }
            const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp);
            for (int v = 0; v < NV; v++) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], (__m512bh)pairs[v], pv);
        }
    }
}

/* The G rows of acc, in bf16 and natural dimension order, into out (G rows of NV * 16). */
static inline __attribute__((always_inline)) void bf16_store_rows(__m512 (*acc)[8], uint16_t* out, const int G, const int NV) {
    const int NC = NV / 2;
    for (int g = 0; g < G; g++) {
        float res[8][16];
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(res[v], acc[g][v]);
        float row[MAX_HEAD_DIM];
        /* unpacklo/hi on 128-bit lanes: element 4L+k of the lo (hi) result is dimension 8L+k
         * (8L+4+k) of its 32-dimension chunk. */
        for (int c = 0; c < NC; c++)
            for (int L = 0; L < 4; L++)
                for (int k = 0; k < 4; k++) {
                    row[c * 32 + 8 * L + k] = res[2 * c][4 * L + k];
                    row[c * 32 + 8 * L + 4 + k] = res[2 * c + 1][4 * L + k];
                }
        for (int v = 0; v < NV; v++)
            _mm256_storeu_si256((__m256i*)(out + g * NV * 16 + v * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + v * 16)));
    }
}

/* One (query token, KV head): the G query rows at q against the first n tokens of the
 * sequence (head_off: the head's offset inside a block). scores, pbf: G * n each. */
static inline __attribute__((always_inline)) void decode_task_bf16(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n,
    int64_t block_size, int64_t block_stride, int64_t head_off, const int G, float scale,
    uint16_t* out, float* scores, uint16_t* pbf, const int NV) {
    const int64_t blk_bytes = block_size * NV * 32;  /* one head of one block */
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + PF_DIST * block_size < n) prefetch_block(kc + table[t0 / block_size + PF_DIST] * block_stride + head_off, blk_bytes);
        bf16_scores_block(q, kc + table[t0 / block_size] * block_stride + head_off, len, n, t0, G, scale, scores, NV);
    }
    bf16_probabilities(scores, pbf, G, n);
    __m512 acc[4][8];  /* [g][2 * chunk + (0: unpacklo dims, 1: unpackhi dims)] */
    zero_rows(acc, G, NV);
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + PF_DIST * block_size < n) prefetch_block(vc + table[t0 / block_size + PF_DIST] * block_stride + head_off, blk_bytes);
        bf16_pv_block(acc, vc + table[t0 / block_size] * block_stride + head_off, pbf, len, n, t0, G, NV);
    }
    bf16_store_rows(acc, out, G, NV);
}

#define TOKEN_TASK_MAX_KV_HEADS 8

/* One query token, all nkv KV heads (q, out: nkv * G rows), each block's K (then V) of every
 * head in turn: the same per-row arithmetic as decode_task_bf16, so a row's result does not
 * depend on which of the two ran it. scores, pbf: nkv * G * n each; acc: nkv accumulator sets
 * (heap: 16 KiB for 8 heads in each of the 16 inlined instantiations would crowd a thread's stack). */
static inline __attribute__((always_inline)) void decode_token_bf16(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n,
    int64_t block_size, int64_t block_stride, int64_t nkv, const int G, float scale,
    uint16_t* out, float* scores, uint16_t* pbf, __m512 (*acc)[4][8], const int NV) {
    const int64_t head_elems = block_size * NV * 16;
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + PF_DIST * block_size < n) prefetch_block(kc + table[t0 / block_size + PF_DIST] * block_stride, block_stride * 2);
        const uint16_t* kb = kc + table[t0 / block_size] * block_stride;
        for (int64_t h = 0; h < nkv; h++)
            bf16_scores_block(q + h * G * NV * 16, kb + h * head_elems, len, n, t0, G, scale, scores + h * G * n, NV);
    }
    for (int64_t h = 0; h < nkv; h++) bf16_probabilities(scores + h * G * n, pbf + h * G * n, G, n);
    for (int64_t h = 0; h < nkv; h++) zero_rows(acc[h], G, NV);
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + PF_DIST * block_size < n) prefetch_block(vc + table[t0 / block_size + PF_DIST] * block_stride, block_stride * 2);
        const uint16_t* vb = vc + table[t0 / block_size] * block_stride;
        for (int64_t h = 0; h < nkv; h++) bf16_pv_block(acc[h], vb + h * head_elems, pbf + h * G * n, len, n, t0, G, NV);
    }
    for (int64_t h = 0; h < nkv; h++) bf16_store_rows(acc[h], out + h * G * NV * 16, G, NV);
}

#include "attention_avx512_q8.c"

#define HAVE_BF16_FAST_PATH 1
static inline int fast_path_shape(int64_t group, int64_t head_dim) {
    return group <= 4 && (head_dim == 64 || head_dim == 128);
}

/* TASK(G, NV) for a fast-path shape, one instantiation per (group, head_dim / 16): compile-time
 * constants for the task, so its loops unroll and the accumulators can stay in registers. */
#define FAST_PATH_DISPATCH(group, head_dim, TASK)                  \
    switch (((head_dim) == 64 ? 0 : 4) + ((group) < 4 ? (group) : 4)) { \
        case 1: TASK(1, 4); break;                                 \
        case 2: TASK(2, 4); break;                                 \
        case 3: TASK(3, 4); break;                                 \
        case 4: TASK(4, 4); break;                                 \
        case 5: TASK(1, 8); break;                                 \
        case 6: TASK(2, 8); break;                                 \
        case 7: TASK(3, 8); break;                                 \
        default: TASK(4, 8); break;                                \
    }

/* Query tokens per thread from which a call runs one task per token (decode_token_bf16) rather
 * than per (token, KV head): enough tasks to share between the threads. */
#ifndef TOKEN_TASKS_PER_THREAD
#define TOKEN_TASKS_PER_THREAD 4
#endif
/* Most scores (num_heads * context) a token task keeps: 6 bytes each, 768 KiB, within a 1 MiB L2.
 * Measured on Zen 4 with 32 query / 8 KV heads: 2,000-4,000 tokens of context 1.29-1.36x the
 * per-head tasks, 6,000-8,000 tokens (1.5 MiB of scores) 0.89-1.00x. */
#define TOKEN_TASK_MAX_SCORES (1 << 17)

/* qsort order of (length, index) pairs: longer first, then lower index. */
static int longer_first(const void* a, const void* b) {
    const int64_t* x = (const int64_t*)a;
    const int64_t* y = (const int64_t*)b;
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : (x[1] > y[1]);
}

static inline int token_tasks_preferred(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t max_n) {
    return num_kv_heads > 1 && num_kv_heads <= TOKEN_TASK_MAX_KV_HEADS && num_heads * max_n <= TOKEN_TASK_MAX_SCORES
        && num_tokens >= TOKEN_TASKS_PER_THREAD * omp_get_max_threads();
}

/* paged_attention's fast path (bf16 queries; bf16 or int8 cache) with one OpenMP task per query
 * token (fast_path_shape and token_tasks_preferred hold); max_n: the largest token_lens. Returns 0,
 * or -2 on allocation failure. */
static int paged_attention_tokens(const uint16_t* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                  int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                                  int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, int kv_int8, int64_t max_n) {
    const int64_t group = num_heads / num_kv_heads;
    /* elements of a bf16 block, or bytes of an int8 one */
    const int64_t block_stride = kv_int8 ? num_kv_heads * Q8_BYTES(block_size, head_dim) : num_kv_heads * block_size * head_dim;
    /* Longest tasks first (LPT): with tokens in batch order a long context last left one thread
     * working while the other waited. The order changes no token's arithmetic. */
    int64_t* order = (int64_t*)malloc(sizeof(int64_t) * 2 * num_tokens);
    if (order == NULL) return -2;
    for (int64_t t = 0; t < num_tokens; t++) {
        order[2 * t] = token_lens[t];
        order[2 * t + 1] = t;
    }
    qsort(order, (size_t)num_tokens, 2 * sizeof(int64_t), longer_first);
    int failed = 0;
#pragma omp parallel
    {
    __m512 (*acc)[4][8] = (__m512 (*)[4][8])aligned_alloc(64, sizeof(__m512) * TOKEN_TASK_MAX_KV_HEADS * 4 * 8);
    float* scores = acc ? (float*)malloc((sizeof(float) + sizeof(uint16_t)) * num_heads * max_n) : NULL;
    uint16_t* pbf = scores ? (uint16_t*)(scores + num_heads * max_n) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (scores == NULL) continue;
        const int64_t t = order[2 * i + 1];
        const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
        const uint16_t* qp = q + t * num_heads * head_dim;
        uint16_t* op = out + t * num_heads * head_dim;
#define TOKEN_TASK(G_, NV_)                                                                                                  \
        do {                                                                                                                 \
            if (kv_int8)                                                                                                     \
                decode_token_q8(qp, (const char*)k_cache, (const char*)v_cache, table, token_lens[t], block_size,         \
                                block_stride, num_kv_heads, G_, scale, op, scores, acc, NV_);                                     \
            else                                                                                                             \
                decode_token_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], block_size, \
                                  block_stride, num_kv_heads, G_, scale, op, scores, pbf, acc, NV_);                              \
        } while (0)
        FAST_PATH_DISPATCH(group, head_dim, TOKEN_TASK)
#undef TOKEN_TASK
    }
    free(scores);
    free(acc);
    }
    free(order);
    return failed ? -2 : 0;
}
#endif
