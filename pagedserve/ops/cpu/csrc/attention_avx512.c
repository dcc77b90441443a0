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

/* Sum of the 16 lanes in a fixed order, that of GCC's _mm512_reduce_add_ps (halves, then
 * quarters, then lanes (0 + 2) + (1 + 3)), written out so that the prefill tiles
 * (attention_avx512_tiles.c) can repeat it with keys in lanes whatever the compiler. */
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
#include "attention_avx512_tiles.c"

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

#include "attention_avx512_tokens.c"
#endif
