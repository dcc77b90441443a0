/*
 * The AVX512-BF16 path of paged attention: bf16 queries, GQA group <= 4, head_dim 64 or 128, a
 * bf16 or an int8 cache (avx512bf16_q8.h); per (token, KV head), per query token, or per tile of
 * a prefill chunk's tokens (avx512bf16_tiles.h).
 *
 * An AVX512-BF16 unit (build.py's flags), called by paged_attention.c only on CPUs with
 * AVX512-BF16.
 */
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "an AVX512-BF16 unit: build it with the AVX512-BF16 flags (build.py)"
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

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

/* Sum of the 16 lanes in a fixed order, that of GCC's _mm512_reduce_add_ps (halves, then
 * quarters, then lanes (0 + 2) + (1 + 3)), written out so that the prefill tiles
 * (avx512bf16_tiles.h) can repeat it with keys in lanes whatever the compiler. */
static inline float reduce_add16(__m512 a) {
    const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), _mm512_castps512_ps256(a));
    const __m128 x = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(y) + _mm_cvtss_f32(_mm_shuffle_ps(y, y, 1));
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
 * Zen 4, 1.8x the read rate of the scattered slices (docs/perf-history.md, "AVX-512 BF16
 * without AMX"). */

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
            scores[g * n + t0 + o] = reduce_add16(acc) * scale;
        }
    }
}

/* Softmax of G rows of n scores in place (capped first: softcap_rows), then the probabilities
 * rounded to bf16 into pbf. */
static inline void bf16_probabilities(float* scores, uint16_t* pbf, int64_t G, int64_t n, float softcap) {
    softcap_rows(scores, G, n, n, softcap);
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

/* One (query token, KV head): the G query rows at q against tokens [lo, n) of the sequence (lo:
 * pa_first_key; head_off: the head's offset inside a block). scores, pbf: G * (n - lo) each. */
static inline __attribute__((always_inline)) void decode_task_bf16(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n, int64_t lo,
    int64_t block_size, int64_t block_stride, int64_t head_off, const int G, float scale, float softcap,
    uint16_t* out, float* scores, uint16_t* pbf, const int NV) {
    const int64_t blk_bytes = block_size * NV * 32;  /* one head of one block */
    const int64_t m = n - lo, row = NV * 16;          /* keys [lo, n): the window's */
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block(kc + table[b + PF_DIST] * block_stride + head_off, blk_bytes);
        bf16_scores_block(q, kc + table[b] * block_stride + head_off + (k0 % block_size) * row, len, m, k0 - lo, G, scale, scores, NV);
        k0 += len;
    }
    bf16_probabilities(scores, pbf, G, m, softcap);
    __m512 acc[4][8];  /* [g][2 * chunk + (0: unpacklo dims, 1: unpackhi dims)] */
    zero_rows(acc, G, NV);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block(vc + table[b + PF_DIST] * block_stride + head_off, blk_bytes);
        bf16_pv_block(acc, vc + table[b] * block_stride + head_off + (k0 % block_size) * row, pbf, len, m, k0 - lo, G, NV);
        k0 += len;
    }
    bf16_store_rows(acc, out, G, NV);
}

/* One query token, all nkv KV heads (q, out: nkv * G rows), each block's K (then V) of every
 * head in turn: the same per-row arithmetic as decode_task_bf16, so a row's result does not
 * depend on which of the two ran it. Keys [lo, n). scores, pbf: nkv * G * (n - lo) each; acc: nkv accumulator sets
 * (heap: 16 KiB for 8 heads in each of the 16 inlined instantiations would crowd a thread's stack). */
static inline __attribute__((always_inline)) void decode_token_bf16(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n, int64_t lo,
    int64_t block_size, int64_t block_stride, int64_t nkv, const int G, float scale, float softcap,
    uint16_t* out, float* scores, uint16_t* pbf, __m512 (*acc)[4][8], const int NV) {
    const int64_t head_elems = block_size * NV * 16, m = n - lo;  /* keys [lo, n): the window's */
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block(kc + table[b + PF_DIST] * block_stride, block_stride * 2);
        const uint16_t* kb = kc + table[b] * block_stride + (k0 % block_size) * NV * 16;
        for (int64_t h = 0; h < nkv; h++)
            bf16_scores_block(q + h * G * NV * 16, kb + h * head_elems, len, m, k0 - lo, G, scale, scores + h * G * m, NV);
        k0 += len;
    }
    for (int64_t h = 0; h < nkv; h++) bf16_probabilities(scores + h * G * m, pbf + h * G * m, G, m, softcap);
    for (int64_t h = 0; h < nkv; h++) zero_rows(acc[h], G, NV);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block(vc + table[b + PF_DIST] * block_stride, block_stride * 2);
        const uint16_t* vb = vc + table[b] * block_stride + (k0 % block_size) * NV * 16;
        for (int64_t h = 0; h < nkv; h++) bf16_pv_block(acc[h], vb + h * head_elems, pbf + h * G * m, len, m, k0 - lo, G, NV);
        k0 += len;
    }
    for (int64_t h = 0; h < nkv; h++) bf16_store_rows(acc[h], out + h * G * NV * 16, G, NV);
}

#include "avx512bf16_q8.h"
#include "avx512bf16_tiles.h"

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

/* Query-token tasks: one OpenMP task per decode token (decode_token_bf16 / decode_token_q8) or
 * per tile of a prefill chunk's tokens (prefill_tile_bf16), longest first (the choice and the
 * order: token_tasks.c). */

/* paged_attention's fast path (bf16 queries; bf16 or int8 cache) with one OpenMP task per query
 * token, or per tile of a prefill chunk's tokens (bf16 cache, block size a multiple of 16;
 * pa_bf16_fast_shape and token_tasks_preferred hold); max_n: the largest token_lens. Returns 0,
 * or -2 on allocation failure. */
static int paged_attention_tokens(const uint16_t* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                  int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                                  int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, int kv_int8, int64_t max_n, int64_t window,
                                  float softcap) {
    const int64_t group = num_heads / num_kv_heads;
    /* elements of a bf16 block, or bytes of an int8 one */
    const int64_t block_stride = kv_int8 ? num_kv_heads * Q8_BYTES(block_size, head_dim) : num_kv_heads * block_size * head_dim;
    /* a tile's scores (rows * group * max_n) within the token task's budget */
    int64_t tile_rows = TOKEN_TASK_MAX_SCORES / (group * max_n);
    tile_rows = tile_rows > TILE_MAX_ROWS ? TILE_MAX_ROWS : tile_rows;
    /* no tiles under a sliding window or softcap (a tile reads keys from 0, takes no cap): one
     * task per token */
    if (token_seq == NULL || kv_int8 || block_size % 16 != 0 || tile_rows < 2 || window > 0 || softcap > 0.f) tile_rows = 1;
    int64_t* tasks;
    const int64_t num_tasks = token_task_list(token_seq, token_lens, num_tokens, tile_rows, window, &tasks);
    if (num_tasks < 0) return -2;
    const int64_t score_elems = (num_heads > tile_rows * group ? num_heads : tile_rows * group) * max_n;
    int failed = 0;
#pragma omp parallel
    {
    __m512 (*acc)[4][8] = (__m512 (*)[4][8])aligned_alloc(64, sizeof(__m512) * (TOKEN_TASK_MAX_KV_HEADS > tile_rows ? TOKEN_TASK_MAX_KV_HEADS : tile_rows) * 4 * 8);
    float* scores = acc ? (float*)malloc((sizeof(float) + sizeof(uint16_t)) * score_elems) : NULL;
    uint16_t* pbf = scores ? (uint16_t*)(scores + score_elems) : NULL;
    if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; i++) {
        if (scores == NULL) continue;
        const int64_t t = tasks[3 * i + 1], rows = tasks[3 * i + 2];
        const int64_t* table = block_tables + (token_seq ? token_seq[t] : t) * max_blocks;
        const uint16_t* qp = q + t * num_heads * head_dim;
        uint16_t* op = out + t * num_heads * head_dim;
        const int64_t lo = pa_first_key(token_lens[t], window);
#define TOKEN_TASK(G_, NV_)                                                                                                  \
        do {                                                                                                                 \
            if (kv_int8)                                                                                                     \
                decode_token_q8(qp, (const char*)k_cache, (const char*)v_cache, table, token_lens[t], lo, block_size,         \
                                block_stride, num_kv_heads, G_, scale, softcap, op, scores, acc, NV_);                                     \
            else if (rows > 1)                                                                                               \
                prefill_tile_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], rows,       \
                                  block_size, block_stride, num_kv_heads, G_, scale, op, scores, pbf, acc, NV_);                \
            else                                                                                                             \
                decode_token_bf16(qp, (const uint16_t*)k_cache, (const uint16_t*)v_cache, table, token_lens[t], lo, block_size, \
                                  block_stride, num_kv_heads, G_, scale, softcap, op, scores, pbf, acc, NV_);                     \
        } while (0)
        FAST_PATH_DISPATCH(group, head_dim, TOKEN_TASK)
#undef TOKEN_TASK
    }
    free(scores);
    free(acc);
    }
    free(tasks);
    return failed ? -2 : 0;
}

int pa_tokens_avx512bf16(const pa_call* c) {
    return paged_attention_tokens((const uint16_t*)c->q, c->k_cache, c->v_cache, c->block_tables, c->max_blocks, c->token_seq,
                                  c->token_lens, (uint16_t*)c->out, c->num_tokens, c->num_heads, c->num_kv_heads, c->head_dim,
                                  c->block_size, c->scale, c->kv_int8, c->max_n, c->window, c->softcap);
}

/* One (query token, KV head) task (pa_head_task), for calls with too few tokens for token tasks. */
void pa_head_avx512bf16(const pa_call* c, int64_t t, int64_t kh, const int64_t* table, float* scores, uint16_t* pbf) {
    const int64_t group = c->group, head_dim = c->head_dim, block_size = c->block_size, n = c->token_lens[t];
    const int64_t lo = pa_first_key(n, c->window);
    const int64_t block_stride = c->num_kv_heads * block_size * head_dim; /* elements */
    const int64_t q8_bytes = Q8_BYTES(block_size, head_dim);              /* int8 cache: one (block, KV head) */
    const char* kc = (const char*)c->k_cache;
    const char* vc = (const char*)c->v_cache;
    const float scale = c->scale;
    const uint16_t* qp = (const uint16_t*)c->q + (t * c->num_heads + kh * group) * head_dim;
    uint16_t* op = (uint16_t*)c->out + (t * c->num_heads + kh * group) * head_dim;
#define TASK_Q8(G_, NV_) decode_task_q8(qp, kc, vc, table, n, lo, block_size, c->num_kv_heads * q8_bytes, kh * q8_bytes, G_, scale, c->softcap, op, scores, NV_)
#define TASK_BF16(G_, NV_) decode_task_bf16(qp, (const uint16_t*)kc, (const uint16_t*)vc, table, n, lo, block_size, block_stride, \
                                            kh * block_size * head_dim, G_, scale, c->softcap, op, scores, pbf, NV_)
    if (c->kv_int8) {
        FAST_PATH_DISPATCH(group, head_dim, TASK_Q8)
    } else {
        FAST_PATH_DISPATCH(group, head_dim, TASK_BF16)
    }
#undef TASK_Q8
#undef TASK_BF16
}
