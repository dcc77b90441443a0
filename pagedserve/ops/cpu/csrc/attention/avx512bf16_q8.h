/* Included by avx512bf16.c: the attention tasks over an int8 KV cache. */
/* The same task over an int8 cache (kv_int8.h), for bf16 queries and outputs: K rows widened to
 * fp32 (16 at a time, through an L1 buffer) against the query in fp32, the score times the
 * row's scale; softmax in fp32; P.V with each probability times its V row's scale, kept in fp32
 * (no bf16 rounding of P). Twice the arithmetic of the bf16 task for half its bytes. Cut into
 * per-block steps like the bf16 task, for the same two task orders. */

/* The G query rows at q (bf16), widened to fp32. */
static inline __attribute__((always_inline)) void q8_load_query(const uint16_t* q, __m512 (*qf)[8], const int G, const int NV) {
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++)
            qf[g][v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(q + g * NV * 16 + v * 16))), 16));
}

/* Scores of the G rows of qf against the `len` int8 keys of one cell from its key `off` (into
 * scores from t0, rows n apart). */
static inline __attribute__((always_inline)) void q8_scores_block(
    __m512 (*qf)[8], const char* cell, int64_t block_size, int64_t off, int64_t len, int64_t n, int64_t t0, const int G,
    float scale, float* scores, float* kbuf, const int NV) {
    const int64_t hd = NV * 16;
    const int8_t* kv = (const int8_t*)cell + off * hd;
    const float* ks = (const float*)(cell + block_size * hd) + off;
    int64_t o = 0;
    for (; o + 16 <= len; o += 16) {
        for (int r = 0; r < 16; r++)
            for (int v = 0; v < NV; v++)
                _mm512_storeu_ps(kbuf + r * hd + v * 16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(kv + (o + r) * hd + v * 16)))));
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(ks + o), _mm512_set1_ps(scale));
        for (int g = 0; g < G; g++) {
            __m512 a[16];
            for (int r = 0; r < 16; r++) {
                a[r] = _mm512_mul_ps(_mm512_loadu_ps(kbuf + r * hd), qf[g][0]);
                for (int v = 1; v < NV; v++) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(kbuf + r * hd + v * 16), qf[g][v], a[r]);
            }
            _mm512_storeu_ps(scores + g * n + t0 + o, _mm512_mul_ps(hsum16(a), sv));
        }
    }
    for (; o < len; o++) {
        __m512 kr[8];
        for (int v = 0; v < NV; v++) kr[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(kv + o * hd + v * 16))));
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_mul_ps(kr[0], qf[g][0]);
            for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(kr[v], qf[g][v], acc);
            scores[g * n + t0 + o] = _mm512_reduce_add_ps(acc) * (ks[o] * scale);
        }
    }
}

/* acc[g] += P[g, t0 .. t0 + len) . V for the `len` int8 value rows of one cell from its row `off`. */
static inline __attribute__((always_inline)) void q8_pv_block(
    __m512 (*acc)[8], const char* cell, int64_t block_size, int64_t off, int64_t len, int64_t n, int64_t t0,
    const float* scores, const int G, const int NV) {
    const int8_t* vv = (const int8_t*)cell + off * NV * 16;
    const float* vs = (const float*)(cell + block_size * NV * 16) + off;
    for (int64_t o = 0; o < len; o++) {
        __m512 vr[8];
        for (int v = 0; v < NV; v++) vr[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(vv + o * NV * 16 + v * 16))));
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * n + t0 + o] * vs[o]);
            for (int v = 0; v < NV; v++) acc[g][v] = _mm512_fmadd_ps(p, vr[v], acc[g][v]);
        }
    }
}

static inline __attribute__((always_inline)) void q8_store_rows(__m512 (*acc)[8], uint16_t* out, const int G, const int NV) {
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++)
            _mm256_storeu_si256((__m256i*)(out + g * NV * 16 + v * 16), (__m256i)_mm512_cvtneps_pbh(acc[g][v]));
}

/* One (query token, KV head) over the int8 cache, keys [lo, n); scores: G * (n - lo). */
static inline __attribute__((always_inline)) void decode_task_q8(
    const uint16_t* q, const char* kc, const char* vc, const int64_t* table, int64_t n, int64_t lo, int64_t block_size,
    int64_t block_stride, int64_t head_off, const int G, float scale, float softcap, uint16_t* out, float* scores,
    const int NV) {
    const int64_t cell_bytes = Q8_BYTES(block_size, NV * 16);
    __m512 qf[4][8];
    q8_load_query(q, qf, G, NV);
    float kbuf[16 * 128];
    const int64_t m = n - lo;  /* keys [lo, n): the window's */
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block((const uint16_t*)(kc + table[b + PF_DIST] * block_stride + head_off), cell_bytes);
        q8_scores_block(qf, kc + table[b] * block_stride + head_off, block_size, k0 % block_size, len, m, k0 - lo, G, scale, scores, kbuf, NV);
        k0 += len;
    }
    softcap_rows(scores, G, m, m, softcap);
    softmax_rows(scores, G, m);
    __m512 acc[4][8];
    zero_rows(acc, G, NV);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block((const uint16_t*)(vc + table[b + PF_DIST] * block_stride + head_off), cell_bytes);
        q8_pv_block(acc, vc + table[b] * block_stride + head_off, block_size, k0 % block_size, len, m, k0 - lo, scores, G, NV);
        k0 += len;
    }
    q8_store_rows(acc, out, G, NV);
}

/* One query token, all nkv KV heads, over the int8 cache (cells of a block are adjacent:
 * block_stride = nkv cells); scores: nkv * G * n; acc as for decode_token_bf16. Same per-row
 * arithmetic as decode_task_q8. */
static inline __attribute__((always_inline)) void decode_token_q8(
    const uint16_t* q, const char* kc, const char* vc, const int64_t* table, int64_t n, int64_t lo, int64_t block_size,
    int64_t block_stride, int64_t nkv, const int G, float scale, float softcap, uint16_t* out, float* scores, __m512 (*acc)[4][8],
    const int NV) {
    const int64_t cell_bytes = Q8_BYTES(block_size, NV * 16);
    float kbuf[16 * 128];
    const int64_t m = n - lo;  /* keys [lo, n): the window's */
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block((const uint16_t*)(kc + table[b + PF_DIST] * block_stride), block_stride);
        for (int64_t h = 0; h < nkv; h++) {
            __m512 qf[4][8];
            q8_load_query(q + h * G * NV * 16, qf, G, NV);
            q8_scores_block(qf, kc + table[b] * block_stride + h * cell_bytes, block_size, k0 % block_size, len, m, k0 - lo, G,
                            scale, scores + h * G * m, kbuf, NV);
        }
        k0 += len;
    }
    for (int64_t h = 0; h < nkv; h++) {
        softcap_rows(scores + h * G * m, G, m, m, softcap);
        softmax_rows(scores + h * G * m, G, m);
    }
    for (int64_t h = 0; h < nkv; h++) zero_rows(acc[h], G, NV);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t len = pa_run(k0, n, block_size), b = k0 / block_size;
        if ((b + PF_DIST) * block_size < n) prefetch_block((const uint16_t*)(vc + table[b + PF_DIST] * block_stride), block_stride);
        for (int64_t h = 0; h < nkv; h++)
            q8_pv_block(acc[h], vc + table[b] * block_stride + h * cell_bytes, block_size, k0 % block_size, len, m, k0 - lo,
                        scores + h * G * m, G, NV);
        k0 += len;
    }
    for (int64_t h = 0; h < nkv; h++) q8_store_rows(acc[h], out + h * G * NV * 16, G, NV);
}
