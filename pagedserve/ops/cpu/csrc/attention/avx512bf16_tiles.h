/* Prefill tiles: several consecutive query tokens of one sequence (a prefill chunk's rows, token
 * lengths n0, n0 + 1, ...) against the shared K/V, with every row's arithmetic the same as
 * decode_token_bf16's, so a row's bits do not depend on the tile it ran in.
 *
 * A row alone pays, per 16 keys, a 16 -> 1 horizontal reduction of its dot products (hsum16: 45
 * shuffles and adds for 32 vdpbf16ps) and reloads and re-pairs K and V. A tile pays those once:
 * - K: each 16-key group is transposed once into (dimension pair) x (16 keys); a row's 16 lane
 *   partials (lane l: dimension pairs l, 16 + l, ...) are then 16 vectors over the keys, summed
 *   in hsum16's own tree: ((p0 + p2) + (p1 + p3)) per four, then (Q0 + Q1) + (Q2 + Q3);
 * - V: each 16-key group is interleaved into (t, t + 1) pairs once for all rows.
 * A row's last, partial group is summed in the order bf16_scores_block's tail uses. */

#define TILE_MAX_ROWS 16

/* 16 x 16 dwords, rows r[j] -> columns r[c] (unpack 32, unpack 64, then two 128-bit lane shuffles). */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u[4i + k], 128-bit lane L: element 4L + k of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[4 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* 16 keys (rows of NV * 8 dword pairs at src) into kp[pair] = that pair of each key. */
static inline __attribute__((always_inline)) void transpose_keys16(const uint16_t* src, __m512i* kp, const int NV) {
    for (int c = 0; c < NV / 2; c++) {
        __m512i* r = kp + c * 16;
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512((const void*)(src + j * NV * 16 + c * 32));
        transpose16x16(r);
    }
}

/* Scores of one 16-key group for one query row (q: NV * 16 bf16) from the transposed keys, lane
 * j = key j: the lane partials of bf16_scores_block (lane l: dimension pairs l, 16 + l, ...)
 * summed in hsum16's tree when the row sees all 16 keys, else in reduce_add16's (its tail). */
static inline __attribute__((always_inline)) __m512 tile_scores16(const uint16_t* q, const __m512i* kp, int full, const int NV) {
    const int NC = NV / 2;
    __m512 p[16];
    for (int l = 0; l < 16; l++) {
        p[l] = _mm512_setzero_ps();
        for (int v = 0; v < NC; v++) {
            uint32_t pair;
            memcpy(&pair, q + 2 * (v * 16 + l), sizeof(pair));
            p[l] = _mm512_dpbf16_ps(p[l], (__m512bh)kp[v * 16 + l], (__m512bh)_mm512_set1_epi32((int)pair));
        }
    }
    if (full) {
        __m512 quad[4];
        for (int L = 0; L < 4; L++)
            quad[L] = _mm512_add_ps(_mm512_add_ps(p[4 * L], p[4 * L + 2]), _mm512_add_ps(p[4 * L + 1], p[4 * L + 3]));
        return _mm512_add_ps(_mm512_add_ps(quad[0], quad[1]), _mm512_add_ps(quad[2], quad[3]));
    }
    __m512 h[8], x[4];
    for (int i = 0; i < 8; i++) h[i] = _mm512_add_ps(p[8 + i], p[i]);
    for (int i = 0; i < 4; i++) x[i] = _mm512_add_ps(h[4 + i], h[i]);
    return _mm512_add_ps(_mm512_add_ps(x[0], x[2]), _mm512_add_ps(x[1], x[3]));
}

/* Where row r of a tile (n0 + r scores per query row, G query rows) starts in its scores / pbf. */
static inline int64_t tile_row_offset(int64_t G, int64_t n0, int64_t r) {
    return G * (r * n0 + r * (r - 1) / 2);
}

/* The first row of a tile (lengths n0, n0 + 1, ...) that sees key k0. */
static inline int64_t tile_first_row(int64_t n0, int64_t k0) {
    return k0 + 1 - n0 > 0 ? k0 + 1 - n0 : 0;
}

/* `rows` query tokens (q, out: rows x nkv * G rows of NV * 16) of one sequence, token r
 * attending to its first n0 + r tokens. scores, pbf: rows * G * (n0 + rows) each; acc: rows
 * accumulator sets. Block size a multiple of 16. */
static inline __attribute__((always_inline)) void prefill_tile_bf16(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n0, int64_t rows,
    int64_t block_size, int64_t block_stride, int64_t nkv, const int G, float scale,
    uint16_t* out, float* scores, uint16_t* pbf, __m512 (*acc)[4][8], const int NV) {
    const int64_t head_elems = block_size * NV * 16;
    const int64_t row_elems = nkv * G * NV * 16;  /* q / out values of one token */
    const int64_t n_last = n0 + rows - 1;
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512i kp[64];
    __m512i vp[8][8];
    for (int64_t h = 0; h < nkv; h++) {
        const int64_t hq = h * G * NV * 16;
        for (int64_t k0 = 0; k0 < n_last; k0 += 16) {  /* 16-key groups: blocks hold whole groups */
            const uint16_t* kb = kc + table[k0 / block_size] * block_stride + h * head_elems + (k0 % block_size) * NV * 16;
            const int64_t part = tile_first_row(n0, k0);
            transpose_keys16(kb, kp, NV);
            for (int64_t r = part; r < rows; r++) {
                const int64_t n = n0 + r, len = n - k0 < 16 ? n - k0 : 16;
                float* sc = scores + tile_row_offset(G, n0, r) + k0;
                const __mmask16 m = (__mmask16)((1u << len) - 1);
                for (int g = 0; g < G; g++)
                    _mm512_mask_storeu_ps(sc + g * n, m, _mm512_mul_ps(tile_scores16(q + r * row_elems + hq + g * NV * 16, kp, len == 16, NV), scale_v));
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t off = tile_row_offset(G, n0, r);
            bf16_probabilities(scores + off, pbf + off, G, n0 + r, 0.f);  /* no tiles with a softcap */
            zero_rows(acc[r], G, NV);
        }
        for (int64_t k0 = 0; k0 < n_last; k0 += 16) {
            const uint16_t* vb = vc + table[k0 / block_size] * block_stride + h * head_elems + (k0 % block_size) * NV * 16;
            const int64_t part = tile_first_row(n0, k0);
            for (int s = 0; s < 8; s++) {  /* (t, t + 1) pairs per dimension, as bf16_pv_block */
                const uint16_t* r0 = vb + 2 * s * NV * 16;
                for (int v = 0; v < NV / 2; v++) {
                    const __m512i x = _mm512_loadu_si512((const void*)(r0 + v * 32)), y = _mm512_loadu_si512((const void*)(r0 + NV * 16 + v * 32));
                    vp[s][2 * v] = _mm512_unpacklo_epi16(x, y);
                    vp[s][2 * v + 1] = _mm512_unpackhi_epi16(x, y);
                }
            }
            for (int64_t r = part; r < rows; r++) {
                const int64_t n = n0 + r, len = n - k0 < 16 ? n - k0 : 16;
                const uint16_t* pr = pbf + tile_row_offset(G, n0, r) + k0;
                __m512i odd[8];  /* an odd last key, paired with itself (probability 0), as bf16_pv_block */
                for (int v = 0; v < NV; v++) odd[v] = _mm512_setzero_si512(); /* never read unset (and -Wall sees it) */
                if (len & 1) {
                    const uint16_t* r0 = vb + (len - 1) * NV * 16;
                    for (int v = 0; v < NV / 2; v++) {
                        const __m512i x = _mm512_loadu_si512((const void*)(r0 + v * 32));
                        odd[2 * v] = _mm512_unpacklo_epi16(x, x);
                        odd[2 * v + 1] = _mm512_unpackhi_epi16(x, x);
                    }
                }
                for (int g = 0; g < G; g++) {
                    __m512 a[8];
                    for (int v = 0; v < NV; v++) a[v] = acc[r][g][v];
                    for (int s = 0; s < len / 2; s++) {
                        uint32_t pp;
                        memcpy(&pp, pr + g * n + 2 * s, sizeof(pp));
                        const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp);
                        for (int v = 0; v < NV; v++) a[v] = _mm512_dpbf16_ps(a[v], (__m512bh)vp[s][v], pv);
                    }
                    if (len & 1) {
                        const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pr[g * n + len - 1]);
                        for (int v = 0; v < NV; v++) a[v] = _mm512_dpbf16_ps(a[v], (__m512bh)odd[v], pv);
                    }
                    for (int v = 0; v < NV; v++) acc[r][g][v] = a[v];
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) bf16_store_rows(acc[r], out + r * row_elems + hq, G, NV);
    }
}
