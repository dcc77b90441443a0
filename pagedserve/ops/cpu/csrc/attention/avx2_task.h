/*
 * The AVX2 attention task (task_avx2), for CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 1-3,
 * Intel client cores), for float32 and bf16 caches (bf16 keys and values are widened to float32
 * as they are loaded, exactly): scores of 8 keys per pass with one transposing reduction, softmax
 * in fp32, P.V in fp32. Each row is computed the same way whatever else is in the call, like
 * every other path of the kernel. Included by the AVX2 units: avx2.c (one task per (token, KV
 * head)) and avx2_tokens.c (per query token, or tile of a prefill chunk's tokens).
 */
#ifndef PAGEDSERVE_ATTENTION_AVX2_TASK_H
#define PAGEDSERVE_ATTENTION_AVX2_TASK_H
#include <stdint.h>
#include <string.h>

#include "rows.h"

/* Eight vectors -> one: lane r = sum of the lanes of a[r] (7 shuffles/adds for 8 reductions). */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* Eight values at element i of a float32 (bf = 0) or bf16 (bf = 1) array, as float32. */
static inline __attribute__((always_inline)) __m256 load8(const void* base, int64_t i, const int bf) {
    if (bf) return bf16x8_load((const uint16_t*)base + i);
    return _mm256_loadu_ps((const float*)base + i);
}

/* Lanes of R vectors summed, stored at dst[0 .. R). */
static inline __attribute__((always_inline)) void store_sums(const __m256* a, float* dst, const int R) {
    if (R == 8) {
        _mm256_storeu_ps(dst, hsum8x8(a));
    } else if (R == 4) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_storeu_ps(dst, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
        for (int r = 0; r < R; r++) dst[r] = hsum256(a[r]);
    }
}

/* Scores of keys o .. o + R - 1 of one block (k8: key o) for the G query rows of qf (qs floats
 * apart, 32-byte aligned), each key's 8-value pieces loaded once for all G rows: G x R running
 * FMA sums (at most 12 registers). */
static inline __attribute__((always_inline)) void qk_keys(const float* qf, int64_t qs, const char* k8, int64_t nc,
                                                           int64_t head_dim, float* scores, int64_t n, const int G,
                                                           const int R, const int bf) {
    __m256 a[12][8];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) a[g][r] = _mm256_setzero_ps();
    const int64_t esize = bf ? 2 : 4;
    for (int64_t c = 0; c < nc; c++) {
        __m256 kv[8];
        for (int r = 0; r < R; r++) kv[r] = load8(k8 + r * head_dim * esize, 8 * c, bf);
        for (int g = 0; g < G; g++) {
            const __m256 qv = _mm256_load_ps(qf + g * qs + 8 * c);
            for (int r = 0; r < R; r++) a[g][r] = _mm256_fmadd_ps(kv[r], qv, a[g][r]);
        }
    }
    for (int g = 0; g < G; g++) store_sums(a[g], scores + g * n, R);
}

/* acc[g][8c .. 8c + 8) += sum over keys o < len of p[g][o] * V[o] (vb: the block's first key;
 * acc rows as floats apart, 32-byte aligned), each V piece loaded once for all G rows; CH chains
 * per row (FMA latency). */
static inline __attribute__((always_inline)) void pv_block(float* acc, int64_t as, const float* p, int64_t n,
                                                            const char* vb, int64_t len, int64_t nc, int64_t head_dim,
                                                            const int G, const int CH, const int bf) {
    const int64_t esize = bf ? 2 : 4;
    for (int64_t c = 0; c < nc; c++) {
        __m256 s[12][2];
        for (int g = 0; g < G; g++) {
            s[g][0] = _mm256_load_ps(acc + g * as + 8 * c);
            if (CH > 1) s[g][1] = _mm256_setzero_ps();
        }
        int64_t o = 0;
        for (; o + CH <= len; o += CH)
            for (int h = 0; h < CH; h++) {
                const __m256 v = load8(vb + (o + h) * head_dim * esize, 8 * c, bf);
                for (int g = 0; g < G; g++) s[g][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * n + o + h), v, s[g][h]);
            }
        for (; o < len; o++) {
            const __m256 v = load8(vb + o * head_dim * esize, 8 * c, bf);
            for (int g = 0; g < G; g++) s[g][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * n + o), v, s[g][0]);
        }
        for (int g = 0; g < G; g++) _mm256_store_ps(acc + g * as + 8 * c, CH > 1 ? _mm256_add_ps(s[g][0], s[g][1]) : s[g][0]);
    }
}

/* pv_block for a bf16 cache with head_dim % 16 == 0 and G <= 3 rows: 16 dimensions a pass, one
 * 32-byte load per key giving the even and the odd dimensions (bf16x16_load_eo: two instructions
 * for 16, where load8 takes two for 8), and the probabilities broadcast half as often. acc keeps
 * each 16 dimensions as their 8 even, then their 8 odd values (task_avx2 reorders them when it
 * rounds); every dimension sums the same products in the same chains as pv_block, so the result
 * is bit-identical. W = 1: vb holds the block's values already widened to float32 in that order
 * (16 floats per 16 dimensions: 8 even, 8 odd; a prefill tile's, avx2_tiles.h). */
static inline __attribute__((always_inline)) void pv_rows_bf16(float* acc, int64_t as, const float* p, int64_t n,
                                                                const void* vb, int64_t len, int64_t head_dim,
                                                                const int G, const int CH, const int W) {
#define PV_LOAD_EO(o_)                                                                              \
    do {                                                                                            \
        if (W) { /* held in registers: GCC would otherwise reload them for every row */            \
            ve = _mm256_load_ps((const float*)vb + (o_) * head_dim + c);                            \
            vo = _mm256_load_ps((const float*)vb + (o_) * head_dim + c + 8);                        \
            __asm__("" : "+x"(ve), "+x"(vo));                                                       \
        } else {                                                                                    \
            bf16x16_load_eo((const uint16_t*)vb + (o_) * head_dim + c, &ve, &vo);                   \
        }                                                                                           \
    } while (0)
    for (int64_t c = 0; c < head_dim; c += 16) {
        __m256 se[3][2], so[3][2], ve, vo;
        for (int g = 0; g < G; g++) {
            se[g][0] = _mm256_load_ps(acc + g * as + c);
            so[g][0] = _mm256_load_ps(acc + g * as + c + 8);
            if (CH > 1) se[g][1] = so[g][1] = _mm256_setzero_ps();
        }
        int64_t o = 0;
        for (; o + CH <= len; o += CH)
            for (int h = 0; h < CH; h++) {
                PV_LOAD_EO(o + h);
                for (int g = 0; g < G; g++) {
                    const __m256 pb = _mm256_broadcast_ss(p + g * n + o + h);
                    se[g][h] = _mm256_fmadd_ps(pb, ve, se[g][h]);
                    so[g][h] = _mm256_fmadd_ps(pb, vo, so[g][h]);
                }
            }
        for (; o < len; o++) {  /* as pv_block: the last odd key joins the first chain */
            PV_LOAD_EO(o);
            for (int g = 0; g < G; g++) {
                const __m256 pb = _mm256_broadcast_ss(p + g * n + o);
                se[g][0] = _mm256_fmadd_ps(pb, ve, se[g][0]);
                so[g][0] = _mm256_fmadd_ps(pb, vo, so[g][0]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_store_ps(acc + g * as + c, CH > 1 ? _mm256_add_ps(se[g][0], se[g][1]) : se[g][0]);
            _mm256_store_ps(acc + g * as + c + 8, CH > 1 ? _mm256_add_ps(so[g][0], so[g][1]) : so[g][0]);
        }
    }
#undef PV_LOAD_EO
}

/* pv_rows_bf16 over a group of any size, 3 rows at a time: 3 rows x even/odd x 2 chains = 12
 * running sums, 15 of the 16 registers with the two value vectors and a broadcast. CH stays the
 * group's, so the chains are pv_block's. */
static inline __attribute__((always_inline)) void pv_block_bf16(float* acc, int64_t as, const float* p, int64_t n,
                                                                 const void* vb, int64_t len, int64_t head_dim,
                                                                 const int G, const int CH, const int W) {
    for (int g0 = 0; g0 < G; g0 += 3) {
        if (G - g0 >= 3) pv_rows_bf16(acc + g0 * as, as, p + g0 * n, n, vb, len, head_dim, 3, CH, W);
        else if (G - g0 == 2) pv_rows_bf16(acc + g0 * as, as, p + g0 * n, n, vb, len, head_dim, 2, CH, W);
        else pv_rows_bf16(acc + g0 * as, as, p + g0 * n, n, vb, len, head_dim, 1, CH, W);
    }
}

/* Scores of keys 0 .. len - 1 of one (block, KV head) slice kb (float32, bf = 0, or bf16) for G
 * query rows (qf, qs floats apart) into sc (rows n apart): R keys a pass, the rest one at a time
 * through dot. task_avx2 and a prefill tile's rows that see part of a block both score here,
 * so a row's scores are the same bits on either path. */
static inline __attribute__((always_inline)) void slice_scores(const float* qf, int64_t qs, const char* kb, int64_t len,
                                                                int64_t nc, int64_t head_dim, float* sc, int64_t n,
                                                                const int G, const int R, const int bf) {
    const int64_t esize = bf ? 2 : 4;
    float row[MAX_HEAD_DIM];
    int64_t o = 0;
    for (; o + R <= len; o += R) qk_keys(qf, qs, kb + o * head_dim * esize, nc, head_dim, sc + o, n, G, R, bf);
    for (; o < len; o++) {
        load_row(kb + o * head_dim * esize, bf, head_dim, row);
        for (int g = 0; g < G; g++) sc[g * n + o] = dot(qf + g * qs, row, head_dim);
    }
}

/* acc += P.V over keys 0 .. len - 1 of one slice vb for G rows: the 16-wide pass where PV16
 * (bf16 values, or with W = 1 values widened in its order), else pv_block (float32 or bf16
 * values). */
static inline __attribute__((always_inline)) void slice_pv(float* acc, int64_t as, const float* p, int64_t n, const void* vb,
                                                            int64_t len, int64_t nc, int64_t head_dim, const int G, const int CH,
                                                            const int PV16, const int bf, const int W) {
    if (PV16) pv_block_bf16(acc, as, p, n, vb, len, head_dim, G, CH, W);
    else pv_block(acc, as, p, n, (const char*)vb, len, nc, head_dim, G, CH, bf);
}

/* A query row (float32 or bf16) -> float32 times scale, into qf. */
static inline void load_scaled_row(const void* q, int bf, int64_t head_dim, float scale, float* qf) {
    load_row(q, bf, head_dim, qf);
    for (int64_t d = 0; d < head_dim; d++) qf[d] *= scale;
}

/* An output row from its float32 sums: rounded to bf16 (bf = 1; with PV16 the sums hold each 16
 * dimensions as 8 even, then 8 odd values, pv_rows_bf16's order) or copied (float32). */
static inline void store_row(const float* acc, void* out, int64_t head_dim, int PV16, int bf) {
    uint16_t* op = (uint16_t*)out;
    if (PV16) {
        for (int64_t c = 0; c < head_dim; c += 16)
            for (int j = 0; j < 8; j++) {
                op[c + 2 * j] = f32_to_bf16(acc[c + j]);
                op[c + 2 * j + 1] = f32_to_bf16(acc[c + 8 + j]);
            }
    } else if (bf) {
        for (int64_t d = 0; d < head_dim; d++) op[d] = f32_to_bf16(acc[d]);
    } else {
        memcpy(out, acc, sizeof(float) * head_dim);
    }
}

/* Keys or values per pass and FMA chains of a group of G query rows (task_avx2, tile_avx2). */
#define AVX2_KEYS_PER_PASS(G) ((G) == 1 ? 8 : (G) <= 3 ? 4 : (G) <= 6 ? 2 : 1)
#define AVX2_CHAINS(G) ((G) <= 6 ? 2 : 1)

/* One query token's attention over nkv consecutive KV heads from head_off (nkv = 1: one (token,
 * KV head) task; all heads: a token task that reads each block's K, then V, for every head in
 * turn, one contiguous stream instead of one head's slice of it), head_dim % 8 == 0, group
 * G <= 12 (compile-time). q, out: the nkv * G query rows [nkv * G, head_dim]; kc/vc blocks found
 * through table at block_stride elements; q, caches and out all float32 (bf = 0) or all bf16
 * (bf = 1). Scores of R keys per pass (R x G running FMA sums, reduced together); softmax in
 * fp32; P.V accumulated in fp32, rounded once into out. A row's steps do not depend on nkv, so
 * its result is bit-identical either way. qf, acc: nkv * G rows (32-byte aligned); scores:
 * nkv * G * (n - lo). Keys [lo, n) (lo: pa_first_key under a sliding window, else 0); softcap:
 * Gemma 2's logit cap (0: none). */
static inline __attribute__((always_inline)) void task_avx2(const void* q, const void* kc, const void* vc, const int64_t* table,
                                                             int64_t n, int64_t lo, int64_t block_size, int64_t block_stride,
                                                             int64_t head_off, int64_t nkv, int64_t head_dim, float scale, float softcap,
                                                             void* out, float* scores,
                                                             float (*qf)[MAX_HEAD_DIM], float (*acc)[MAX_HEAD_DIM],
                                                             const int G, const int bf) {
    const int R = AVX2_KEYS_PER_PASS(G), CH = AVX2_CHAINS(G);
    const int PV16 = bf && head_dim % 16 == 0;
    const int64_t nc = head_dim / 8, esize = bf ? 2 : 4, rows = nkv * G;
    const int64_t head_bytes = block_size * head_dim * esize, bytes = nkv * head_bytes;
    for (int64_t r = 0; r < rows; r++) load_scaled_row((const char*)q + r * head_dim * esize, bf, head_dim, scale, qf[r]);
    /* keys [lo, n), scores rows of m: the window's first block read from lo on, none before it */
    const int64_t m = n - lo;
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t off = k0 % block_size, len = pa_run(k0, n, block_size), nb = k0 / block_size + 1;
        const char* kb = (const char*)kc + (table[k0 / block_size] * block_stride + head_off + off * head_dim) * esize;
        if (nb * block_size < n) prefetch_block((const char*)kc + (table[nb] * block_stride + head_off) * esize, bytes);
        else prefetch_block((const char*)vc + (table[lo / block_size] * block_stride + head_off) * esize, bytes);
        for (int64_t h = 0; h < nkv; h++) {
            slice_scores(qf[h * G], MAX_HEAD_DIM, kb + h * head_bytes, len, nc, head_dim, scores + h * G * m + k0 - lo, m, G, R, bf);
        }
        k0 += len;
    }
    softcap_rows(scores, rows, m, m, softcap);
    softmax_rows(scores, rows, m);
    for (int64_t r = 0; r < rows; r++) memset(acc[r], 0, sizeof(float) * head_dim);
    for (int64_t k0 = lo; k0 < n;) {
        const int64_t off = k0 % block_size, len = pa_run(k0, n, block_size), nb = k0 / block_size + 1;
        const char* vb = (const char*)vc + (table[k0 / block_size] * block_stride + head_off + off * head_dim) * esize;
        if (nb * block_size < n) prefetch_block((const char*)vc + (table[nb] * block_stride + head_off) * esize, bytes);
        for (int64_t h = 0; h < nkv; h++)
            slice_pv(acc[h * G], MAX_HEAD_DIM, scores + h * G * m + k0 - lo, m, vb + h * head_bytes, len, nc, head_dim, G, CH, PV16, bf, 0);
        k0 += len;
    }
    for (int64_t r = 0; r < rows; r++) store_row(acc[r], (char*)out + r * head_dim * esize, head_dim, PV16, bf);
}

/* task_avx2 for a group size known at run time (1 .. 12; larger groups take the generic path). */
static inline __attribute__((always_inline)) void task_avx2_any(const void* q, const void* kc, const void* vc, const int64_t* table,
                                                                 int64_t n, int64_t lo, int64_t block_size, int64_t block_stride,
                                                                 int64_t head_off, int64_t nkv, int64_t group, int64_t head_dim,
                                                                 float scale, float softcap, void* out, float* scores, float (*qf)[MAX_HEAD_DIM],
                                                                 float (*acc)[MAX_HEAD_DIM], const int bf) {
#define TASK_G(G_) case G_: task_avx2(q, kc, vc, table, n, lo, block_size, block_stride, head_off, nkv, head_dim, scale, softcap, out, scores, qf, acc, G_, bf); break;
    switch (group) {
        TASK_G(1) TASK_G(2) TASK_G(3) TASK_G(4) TASK_G(5) TASK_G(6)
        TASK_G(7) TASK_G(8) TASK_G(9) TASK_G(10) TASK_G(11) TASK_G(12)
    }
#undef TASK_G
}
#endif
