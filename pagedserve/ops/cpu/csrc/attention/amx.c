/*
 * Paged attention with AMX tiles, bf16 queries, a bf16 or int8 (kv_int8.h) cache, head_dim 64
 * (paged_attention.c takes its AVX-512 paths elsewhere). An int8
 * cache's rows are widened to bf16 exactly (|x| <= 127); each key's scale multiplies its score
 * and each value row's scale its probability before P is rounded to bf16.
 *
 * A task is up to 16 query rows of one KV head: the GQA group (G rows) of T query tokens of one
 * sequence (T = 1 for decode, 16 / G for a prefill chunk). Two passes over the cached context,
 * block by block through the block table, as in the AVX-512 task:
 * - scores: S^T [16 keys x rows] = K block [16 x 64] . Q^T, with the K block read straight from
 *   the cache as the A tile and Q^T in AMX's pair-interleaved (VNNI) order as the B tile;
 * - per row, softmax in fp32 over that row's own keys (causal: token_lens), probabilities
 *   rounded to bf16 and zero after the row's last key;
 * - P.V: out [rows x 64] = P [rows x 32 keys] . V [32 keys x 64], V re-laid out into key pairs
 *   per 32 keys by unpacking two rows (so the output's dims come in the unpack order, undone
 *   once per task; rows after the context's last key zeroed, never read as garbage).
 * Every output element is computed by the same sequence of tile operations whatever the other
 * rows of its task are, so a row's result does not depend on chunking or batching: a prefill
 * row equals the decode row of the same position.
 *
 * An AMX unit (build.py's flags), called by paged_attention.c only on CPUs with AMX-BF16 once
 * Linux granted the tile state.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common/amx.h"
#include "rows.h"

#ifndef PA_PF_KEYS
#define PA_PF_KEYS 64  /* keys ahead to prefetch (a multiple of 16) */
#endif

/* tmm0: a K block (A, 16 keys x 32 dims) or 32 keys of V in pairs (B, 16 key pairs x 16 dims
 * x 2); tmm1: Q^T (B, 16 dim pairs x R rows x 2); tmm2: S^T (C, 16 keys x R); tmm3: P (A, R x
 * 32 keys); tmm4..7: out (C, R x 16 dims each, 64 dims). */
static void pa_config(amx_tilecfg* c, int R) {
    memset(c, 0, sizeof(*c));
    c->palette_id = 1;
    c->rows[0] = 16; c->colsb[0] = 64;
    c->rows[1] = 16; c->colsb[1] = (uint16_t)(R * 4);
    c->rows[2] = 16; c->colsb[2] = (uint16_t)(R * 4);
    for (int t = 3; t < 8; t++) { c->rows[t] = (uint8_t)R; c->colsb[t] = 64; }
}

/* Buffers of one thread (floats/uint16 counts for a context of up to max_n keys). */
typedef struct {
    float* st;      /* [n_pad][16] scores, key-major (column r = row r) */
    float* row;     /* [n_pad] one row's scores */
    uint16_t* p;    /* [16][n_pad] bf16 probabilities */
    float* ks;      /* int8 cache: [n_pad] each key's scale times the softmax scale */
    float* vs;      /* int8 cache: [n_pad] each value row's scale */
    uint16_t kbuf[16][64];      /* int8 cache: 16 keys widened to bf16 (exact) */
    uint16_t qt[2][16][16][2];  /* Q^T per 32 dims: [pair][row][2] */
    uint16_t vp[4][16][32];     /* V of 32 keys: [dims chunk][key pair][dim, key], dims as unpacked */
    float out[16][64];
} pa_bufs;

/* Where one KV head's rows are: bf16 [num_blocks, num_kv_heads, block_size, 64], or the int8
 * cells of kv_int8.h (64 int8 per row, then one float32 scale per row). */
typedef struct {
    const char *k, *v;
    int64_t block_bytes, head_bytes, row_bytes, block_size;
    int64_t scale_off;  /* int8: bytes from a cell to its scales; -1: bf16 */
} pa_cache;

static inline const char* pa_row(const pa_cache* c, const char* base, const int64_t* table, int64_t k) {
    return base + table[k / c->block_size] * c->block_bytes + c->head_bytes + (k % c->block_size) * c->row_bytes;
}

static inline const float* pa_scales(const pa_cache* c, const char* base, const int64_t* table, int64_t k) {
    return (const float*)(base + table[k / c->block_size] * c->block_bytes + c->head_bytes + c->scale_off) + k % c->block_size;
}

/* 64 int8 -> 64 bf16 (exact: |x| <= 127), as two vectors of 32. */
static inline void pa_widen_q8(const int8_t* src, __m512i dst[2]) {
    __m512 f[4];
    for (int i = 0; i < 4; i++) f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16 * i))));
    dst[0] = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
    dst[1] = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
}

/* R = nt * G rows: tokens q_tok[0..nt) (row r = token r / G, head r % G of KV head kh), each
 * attending to its first lens[i] keys of the sequence's block table, from pa_first_key under a
 * sliding window (window > 0). Buffers are indexed by key; a window's task starts at the 16 keys
 * (scores) or 32 keys (P.V) holding its first key: keys before the window in the scores' first
 * 16 (its own block) are loaded but their scores never used, values before it never read (zero
 * rows), their probabilities zero. softcap: Gemma 2's logit cap on the scaled scores (0: none). */
static void pa_task_amx(const uint16_t* q, const int64_t* q_tok, const int64_t* lens, int nt, int G, int64_t num_heads,
                        int64_t kh, const pa_cache* c, const int64_t* table, float scale, int64_t window, float softcap,
                        uint16_t* out, pa_bufs* b) {
    const int64_t D = 64;
    const int q8 = c->scale_off >= 0;
    const int pf_lines = (int)(16 * c->row_bytes / 64);
    const int R = nt * G;
    int64_t n_max = 0;
    for (int i = 0; i < nt; i++) n_max = lens[i] > n_max ? lens[i] : n_max;
    const int64_t n_pad = (n_max + 31) / 32 * 32;
    int64_t lo_min = n_max;  /* the first key any row reads */
    for (int i = 0; i < nt; i++) lo_min = pa_first_key(lens[i], window) < lo_min ? pa_first_key(lens[i], window) : lo_min;
    const int64_t k_start = lo_min / 16 * 16, p_start = lo_min / 32 * 32;
    memset(b->qt, 0, sizeof(b->qt));
    for (int r = 0; r < R; r++) {
        const uint16_t* qr = q + (q_tok[r / G] * num_heads + kh * G + r % G) * D;
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 16; p++) {
                b->qt[h][p][r][0] = qr[32 * h + 2 * p];
                b->qt[h][p][r][1] = qr[32 * h + 2 * p + 1];
            }
    }
    /* scores, 16 keys per block row of the table (block_size 16: one cache block) */
    const int64_t n16 = (n_max + 15) / 16 * 16;
    for (int64_t k0 = k_start; k0 < n_max; k0 += 16) {
        const char* kb = pa_row(c, c->k, table, k0);
        /* tile loads wait for the tile's previous use, so the stream never runs ahead by
         * itself: fetch the keys PA_PF_KEYS ahead into L1 */
        const int64_t kf = k0 + PA_PF_KEYS, vf = kf - n16 + k_start;  /* then the first values */
        if (kf < n_max || (vf >= k_start && vf < n_max)) {
            const char* f = kf < n_max ? pa_row(c, c->k, table, kf) : pa_row(c, c->v, table, vf);
            for (int l = 0; l < pf_lines; l++) _mm_prefetch(f + 64 * l, _MM_HINT_T0);
        }
        if (q8) {  /* widen the 16 keys; keep their scales (times the softmax scale) and the values' */
            for (int i = 0; i < 16; i++) {
                __m512i w[2];
                pa_widen_q8((const int8_t*)kb + i * D, w);
                _mm512_storeu_si512((void*)b->kbuf[i], w[0]);
                _mm512_storeu_si512((void*)(b->kbuf[i] + 32), w[1]);
            }
            const int64_t valid = n_max - k0 < 16 ? n_max - k0 : 16;
            const float *ksrc = pa_scales(c, c->k, table, k0), *vsrc = pa_scales(c, c->v, table, k0);
            for (int64_t i = 0; i < valid; i++) {
                b->ks[k0 + i] = ksrc[i] * scale;
                b->vs[k0 + i] = vsrc[i];
            }
            kb = (const char*)b->kbuf;
        }
        _tile_zero(2);
        for (int h = 0; h < 2; h++) {
            _tile_loadd(0, kb + 64 * h, D * 2);
            _tile_loadd(1, b->qt[h], 64);
            _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, b->st + k0 * 16, 64);
    }
    /* softmax per row over its own keys; P zero before and after them */
    for (int r = 0; r < R; r++) {
        const int64_t n = lens[r / G], lo = pa_first_key(n, window);
        const __m512i col = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                                _mm512_set1_epi32(16)), _mm512_set1_epi32(r));
        const __m512 sv = _mm512_set1_ps(scale);
        int64_t k = lo;
        for (; k + 16 <= n; k += 16)  /* column r of 16 key rows of S^T */
            _mm512_storeu_ps(b->row + k, _mm512_mul_ps(_mm512_i32gather_ps(col, b->st + k * 16, 4), q8 ? _mm512_loadu_ps(b->ks + k) : sv));
        for (; k < n; k++) b->row[k] = b->st[k * 16 + r] * (q8 ? b->ks[k] : scale);
        softcap_rows(b->row + lo, 1, n - lo, 0, softcap);
        softmax_rows(b->row + lo, 1, n - lo);
        uint16_t* pr = b->p + r * n_pad;
        k = lo;
        if (q8)  /* each value row's scale folded into its probability */
            for (; k < n; k++) b->row[k] *= b->vs[k];
        for (k = p_start; k < lo; k++) pr[k] = 0;
        for (; k + 16 <= n; k += 16)
            _mm256_storeu_si256((__m256i*)(pr + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b->row + k)));
        for (; k < n; k++) pr[k] = f32_to_bf16(b->row[k]);
        for (; k < n_pad; k++) pr[k] = 0;
    }
    /* P.V, 32 keys at a time */
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t k0 = p_start; k0 < n_pad; k0 += 32) {
        for (int64_t k = k0 + PA_PF_KEYS; k < k0 + PA_PF_KEYS + 32 && k < n_max; k += 16) {
            const char* f = pa_row(c, c->v, table, k);
            for (int l = 0; l < pf_lines; l++) _mm_prefetch(f + 64 * l, _MM_HINT_T0);
        }
        for (int half = 0; half < 2; half++) {  /* 16 keys: one cache block or a part of one */
            const int64_t ks = k0 + 16 * half;
            const int64_t valid = n_max - ks < 0 ? 0 : (n_max - ks < 16 ? n_max - ks : 16);
            const int64_t skip = lo_min > ks ? lo_min - ks : 0;  /* keys before the window: zero rows */
            const char* vb = valid > skip ? pa_row(c, c->v, table, ks) : NULL;
            for (int j = 0; j < 8; j++) {
                __m512i x[2], y[2];
                for (int e = 0; e < 2; e++) {
                    __m512i* dst = e ? y : x;
                    const int keep = 2 * j + e >= skip && 2 * j + e < valid;
                    if (keep && q8) {
                        pa_widen_q8((const int8_t*)vb + (2 * j + e) * D, dst);
                    } else if (keep) {
                        const uint16_t* vr = (const uint16_t*)(vb + (2 * j + e) * c->row_bytes);
                        dst[0] = _mm512_loadu_si512((const void*)vr);
                        dst[1] = _mm512_loadu_si512((const void*)(vr + 32));
                    } else {
                        dst[0] = dst[1] = _mm512_setzero_si512();
                    }
                }
                const int p = 8 * half + j;
                for (int h = 0; h < 2; h++) {
                    /* per 128-bit lane L: pairs of dims 32h + 8L + 0..3 (lo), + 4..7 (hi) */
                    _mm512_storeu_si512((void*)b->vp[2 * h][p], _mm512_unpacklo_epi16(x[h], y[h]));
                    _mm512_storeu_si512((void*)b->vp[2 * h + 1][p], _mm512_unpackhi_epi16(x[h], y[h]));
                }
            }
        }
        _tile_loadd(3, b->p + k0, n_pad * 2);
        _tile_loadd(0, b->vp[0], 64);
        _tile_dpbf16ps(4, 3, 0);
        _tile_loadd(0, b->vp[1], 64);
        _tile_dpbf16ps(5, 3, 0);
        _tile_loadd(0, b->vp[2], 64);
        _tile_dpbf16ps(6, 3, 0);
        _tile_loadd(0, b->vp[3], 64);
        _tile_dpbf16ps(7, 3, 0);
    }
    _tile_stored(4, &b->out[0][0], 256);
    _tile_stored(5, &b->out[0][16], 256);
    _tile_stored(6, &b->out[0][32], 256);
    _tile_stored(7, &b->out[0][48], 256);
    for (int r = 0; r < R; r++) {
        /* column j of out tile t = 2h + half holds dim 32h + 8(j / 4) + 4 half + j % 4 */
        float row[64];
        for (int t = 0; t < 4; t++)
            for (int j = 0; j < 16; j++) row[32 * (t / 2) + 8 * (j / 4) + 4 * (t % 2) + j % 4] = b->out[r][16 * t + j];
        uint16_t* o = out + (q_tok[r / G] * num_heads + kh * G + r % G) * D;
        for (int v = 0; v < 4; v++)
            _mm256_storeu_si256((__m256i*)(o + 16 * v), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + 16 * v)));
    }
}

/* The AMX path of paged_attention for bf16, head_dim 64, group <= 16, block_size a multiple of
 * 16. Tasks: (tile of tokens, KV head); a tile is one decode token, or up to 16 / group
 * consecutive tokens of one sequence. Returns 0, -2 on allocation failure. */
static int paged_attention_amx(const uint16_t* q, const void* kc, const void* vc, const int64_t* block_tables,
                               int64_t max_blocks, const int64_t* token_seq, const int64_t* token_lens, uint16_t* out,
                               int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                               float scale, int kv_int8, int64_t window, float softcap) {
    const int G = (int)(num_heads / num_kv_heads);
    const int T = token_seq ? 16 / G : 1;
    const int64_t cell = kv_int8 ? Q8_BYTES(block_size, 64) : block_size * 64 * 2;  /* one (block, KV head) */
    const pa_cache cache0 = {(const char*)kc, (const char*)vc, num_kv_heads * cell, 0, kv_int8 ? 64 : 128, block_size,
                             kv_int8 ? block_size * 64 : -1};
    int64_t max_n = 1;
    for (int64_t t = 0; t < num_tokens; t++) max_n = token_lens[t] > max_n ? token_lens[t] : max_n;
    const int64_t n_pad = (max_n + 31) / 32 * 32;
    /* tiles: runs of up to T tokens of the same sequence */
    int64_t* tile_start = (int64_t*)malloc(sizeof(int64_t) * (num_tokens + 1));
    if (!tile_start) return -2;
    int64_t ntiles = 0;
    for (int64_t t = 0; t < num_tokens;) {
        int64_t e = t + 1;
        while (token_seq && e < num_tokens && e - t < T && token_seq[e] == token_seq[t]) e++;
        tile_start[ntiles++] = t;
        t = e;
    }
    tile_start[ntiles] = num_tokens;
    int failed = 0;
#pragma omp parallel
    {
        pa_bufs* b = (pa_bufs*)malloc(sizeof(pa_bufs));
        float* fl = (float*)malloc(sizeof(float) * n_pad * 19 + sizeof(uint16_t) * 16 * n_pad);
        if (!b || !fl) {
#pragma omp atomic write
            failed = 1;
        }
        amx_tilecfg saved, cfg;
        int configured = -1;
        if (b && fl) {
            b->st = fl;
            b->row = fl + n_pad * 16;
            b->ks = fl + n_pad * 17;
            b->vs = fl + n_pad * 18;
            b->p = (uint16_t*)(fl + n_pad * 19);
            amx_save(&saved);
        }
        int64_t idx[16];
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = 0; i < ntiles; i++)
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                if (!b || !fl) continue;
                const int nt = (int)(tile_start[i + 1] - tile_start[i]);
                if (configured != nt * G) {
                    pa_config(&cfg, nt * G);
                    _tile_loadconfig(&cfg);
                    configured = nt * G;
                }
                for (int j = 0; j < nt; j++) idx[j] = tile_start[i] + j;
                const int64_t* table = block_tables + (token_seq ? token_seq[tile_start[i]] : tile_start[i]) * max_blocks;
                pa_cache c = cache0;
                c.head_bytes = kh * cell;
                pa_task_amx(q, idx, token_lens + tile_start[i], nt, G, num_heads, kh, &c, table, scale, window, softcap, out, b);
            }
        if (b && fl) {
            amx_restore(&saved);
        }
        free(fl);
        free(b);
    }
    free(tile_start);
    return failed ? -2 : 0;
}

int pa_amx(const pa_call* c) {
    return paged_attention_amx((const uint16_t*)c->q, c->k_cache, c->v_cache, c->block_tables, c->max_blocks, c->token_seq,
                               c->token_lens, (uint16_t*)c->out, c->num_tokens, c->num_heads, c->num_kv_heads, c->block_size,
                               c->scale, c->kv_int8, c->window, c->softcap);
}
