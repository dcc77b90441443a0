/* Prefill tiles for the AVX2 path (included by avx2_tokens.c, which schedules them): up to
 * AVX2_TILE_MAX_ROWS consecutive query tokens of one sequence with consecutive lengths (a
 * prefill chunk's rows) in one task, bf16 cache.
 *
 * A token alone widens every bf16 key and value it reads to float32 (a zero-extend and a shift
 * per 8 keys' values, or a shift and a mask per 16 values): about as many shuffle-port operations
 * as FMAs on the scores. In a tile each (block, KV head) slice of K, then of V, is widened once
 * into a float32 buffer in L1 for all its rows. The widening is exact and every row then takes
 * task_avx2's steps on the same float32 values (the same keys per pass, chains and reductions,
 * the same softmax over its own n keys), so a row's bits do not depend on its tile: chunking,
 * batching and preemption leave greedy output as it was (test_prefill_tiles_equal_rows_alone). */

#define AVX2_TILE_MAX_ROWS 16

/* len keys or values of one (block, KV head) slice (head_dim bf16 each) -> float32 at dst
 * (32-byte aligned): in order (eo = 0), or per 16 dimensions their 8 even then their 8 odd
 * values (eo = 1, head_dim % 16 == 0: pv_rows_bf16's order). Exact. */
static inline void widen_slice(const uint16_t* src, int64_t len, int64_t head_dim, float* dst, int eo) {
    const int64_t count = len * head_dim;
    if (eo) {
        for (int64_t i = 0; i < count; i += 16) {
            __m256 even, odd;
            bf16x16_load_eo(src + i, &even, &odd);
            _mm256_store_ps(dst + i, even);
            _mm256_store_ps(dst + i + 8, odd);
        }
    } else {
        for (int64_t i = 0; i < count; i += 8) _mm256_store_ps(dst + i, bf16x8_load(src + i));
    }
}

/* Scores of keys o .. o + 3 (k: key o, float32, head_dim apart) for NR (1 or 2) query rows (q,
 * qs floats apart), stored at sc (rows n apart): each the sums qk_keys makes (per lane one FMA
 * chain over the 8-value pieces in order), reduced in task_avx2's tree for group G (store_sums':
 * the same for 4 or 8 keys a pass, G <= 3; hsum256 per key above). The keys and the row's piece
 * stay in registers: 6 loads for 8 FMAs, where qk_keys, its query rows folded into the FMAs,
 * makes 16 for 12 (a Zen 3 core loads two 32-byte vectors a cycle). */
static inline __attribute__((always_inline)) void qk_rows_keys4(const float* q, int64_t qs, const float* k, int64_t nc,
                                                                 int64_t head_dim, float* sc, int64_t n, const int NR,
                                                                 const int G) {
    __m256 a[2][4];
    for (int i = 0; i < NR; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        __m256 kv[4];
        for (int r = 0; r < 4; r++) kv[r] = _mm256_load_ps(k + r * head_dim + 8 * c);
        __asm__("" : "+x"(kv[0]), "+x"(kv[1]), "+x"(kv[2]), "+x"(kv[3]));
        for (int i = 0; i < NR; i++) {
            __m256 qv = _mm256_load_ps(q + i * qs + 8 * c);
            __asm__("" : "+x"(qv));
            for (int r = 0; r < 4; r++) a[i][r] = _mm256_fmadd_ps(kv[r], qv, a[i][r]);
        }
    }
    for (int i = 0; i < NR; i++) {
        if (G <= 3) store_sums(a[i], sc + i * n, 4);
        else for (int r = 0; r < 4; r++) sc[i * n + r] = hsum256(a[i][r]);
    }
}

/* Of a tile whose token r sees its first n0 + r keys, the tokens that see key t0 (from *first)
 * and, among them, those that see all of the block starting there (from *full). */
static inline void tile_block_rows(int64_t t0, int64_t n0, int64_t rows, int64_t block_size, int64_t* first, int64_t* full) {
    const int64_t f = t0 + 1 > n0 ? t0 + 1 - n0 : 0;
    const int64_t w = t0 + block_size - n0;
    *first = f;
    *full = w < f ? f : w > rows ? rows : w;
}

/* rows consecutive query tokens of one sequence, token r attending to its first n0 + r cached
 * tokens, over all nkv KV heads; bf16 q, cache and out; group G <= 12 (compile-time), head_dim
 * % 8 == 0. q, out: [rows, nkv * G, head_dim]; cache blocks through table at block_stride
 * elements. Per KV head: every row's scores block by block from keys widened once into kvf,
 * softmax per row, then P.V likewise from widened values. Buffers (float32, 32-byte aligned):
 * qf and acc rows * G * head_dim, kvf block_size * head_dim, scores rows * G * (n0 + rows - 1). */
static inline __attribute__((always_inline)) void tile_avx2(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                                             const int64_t* table, int64_t n0, int64_t rows, int64_t block_size,
                                                             int64_t block_stride, int64_t nkv, int64_t head_dim, float scale,
                                                             uint16_t* out, float* scores, float* qf, float* acc, float* kvf,
                                                             const int G) {
    const int R = AVX2_KEYS_PER_PASS(G), CH = AVX2_CHAINS(G);
    const int PV16 = head_dim % 16 == 0;
    const int64_t nc = head_dim / 8, nmax = n0 + rows - 1, token_stride = nkv * G * head_dim, rs = G * head_dim;
    const int64_t slice = block_size * head_dim;  /* one (block, KV head): elements */
    for (int64_t h = 0; h < nkv; h++) {
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < G; g++)
                load_scaled_row(q + r * token_stride + (h * G + g) * head_dim, 1, head_dim, scale, qf + r * rs + g * head_dim);
        for (int64_t t0 = 0; t0 < nmax; t0 += block_size) {
            const int64_t blen = nmax - t0 < block_size ? nmax - t0 : block_size;
            if (t0 + block_size < nmax) prefetch_block(kc + table[t0 / block_size + 1] * block_stride + h * slice, slice * 2);
            widen_slice(kc + table[t0 / block_size] * block_stride + h * slice, blen, head_dim, kvf, 0);
            /* rows that see the whole block can be paired when block_size % 8 == 0 (all its keys in
             * full passes); the others are scored token by token */
            int64_t r_first, r_full;
            tile_block_rows(t0, n0, rows, block_size, &r_first, &r_full);
            if (block_size % 8 != 0) r_full = rows;
            for (int64_t r = r_first; r < r_full; r++) {
                const int64_t len = n0 + r - t0 < block_size ? n0 + r - t0 : block_size;
                slice_scores(qf + r * rs, head_dim, (const char*)kvf, len, nc, head_dim, scores + r * G * nmax + t0, nmax, G, R, 0);
            }
            int64_t i = r_full * G;  /* query rows (token, head of the group) in order */
            for (; i + 2 <= rows * G; i += 2)
                for (int64_t o = 0; o < block_size; o += 4)
                    qk_rows_keys4(qf + i * head_dim, head_dim, kvf + o * head_dim, nc, head_dim, scores + i * nmax + t0 + o, nmax, 2, G);
            if (i < rows * G)
                for (int64_t o = 0; o < block_size; o += 4)
                    qk_rows_keys4(qf + i * head_dim, head_dim, kvf + o * head_dim, nc, head_dim, scores + i * nmax + t0 + o, nmax, 1, G);
        }
        for (int64_t r = 0; r < rows; r++) softmax_rows_strided(scores + r * G * nmax, G, n0 + r, nmax);
        memset(acc, 0, sizeof(float) * rows * rs);
        for (int64_t t0 = 0; t0 < nmax; t0 += block_size) {
            const int64_t blen = nmax - t0 < block_size ? nmax - t0 : block_size;
            if (t0 + block_size < nmax) prefetch_block(vc + table[t0 / block_size + 1] * block_stride + h * slice, slice * 2);
            widen_slice(vc + table[t0 / block_size] * block_stride + h * slice, blen, head_dim, kvf, PV16);
            int64_t r_first, r_full;
            tile_block_rows(t0, n0, rows, block_size, &r_first, &r_full);
            for (int64_t r = r_first; r < r_full; r++)
                slice_pv(acc + r * rs, head_dim, scores + r * G * nmax + t0, nmax, kvf, n0 + r - t0, nc, head_dim, G, CH, PV16, 0, 1);
            /* rows that see the whole block, 3 at a time whatever their token (the group's chains) */
            for (int64_t i = r_full * G; i < rows * G; i += 3) {
                float* a = acc + i * head_dim;
                const float* p = scores + i * nmax + t0;
                if (rows * G - i >= 3) slice_pv(a, head_dim, p, nmax, kvf, block_size, nc, head_dim, 3, CH, PV16, 0, 1);
                else if (rows * G - i == 2) slice_pv(a, head_dim, p, nmax, kvf, block_size, nc, head_dim, 2, CH, PV16, 0, 1);
                else slice_pv(a, head_dim, p, nmax, kvf, block_size, nc, head_dim, 1, CH, PV16, 0, 1);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < G; g++)
                store_row(acc + r * rs + g * head_dim, out + r * token_stride + (h * G + g) * head_dim, head_dim, PV16, 1);
    }
}

/* tile_avx2 for a group size known at run time (1 .. AVX2_MAX_GROUP). */
static void tile_avx2_any(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n0,
                          int64_t rows, int64_t block_size, int64_t block_stride, int64_t nkv, int64_t group, int64_t head_dim,
                          float scale, uint16_t* out, float* scores, float* qf, float* acc, float* kvf) {
#define TILE_G(G_) case G_: tile_avx2(q, kc, vc, table, n0, rows, block_size, block_stride, nkv, head_dim, scale, out, scores, qf, acc, kvf, G_); break;
    switch (group) {
        TILE_G(1) TILE_G(2) TILE_G(3) TILE_G(4) TILE_G(5) TILE_G(6)
        TILE_G(7) TILE_G(8) TILE_G(9) TILE_G(10) TILE_G(11) TILE_G(12)
    }
#undef TILE_G
}
