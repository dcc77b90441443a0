/*
 * The shrink and expand loops (lora.h), written once and compiled by each unit with its ISA's
 * flags: lora.c (portable, the scalar suffix), avx2.c, avx512.c define PS_LORA_SUFFIX and include
 * this file. Vector-extension loops over 16 columns at a time (registers of any width); every unit
 * adds in the same order (lora.h). Each loop is written once for float32 and bf16 weights (an
 * always-inlined body with the weight type a constant; the exported function picks the copy).
 */
#include <stdint.h>

#include "../common/bf16.h"
#include "lora.h"

#ifndef PS_LORA_SUFFIX
#error "define PS_LORA_SUFFIX before including body.h"
#endif
#define PS_LORA_CAT2(a, b) a##_##b
#define PS_LORA_CAT(a, b) PS_LORA_CAT2(a, b)
#define PS_LORA_FN(name) PS_LORA_CAT(name, PS_LORA_SUFFIX)

#ifndef PS_LORA_GROUP
#define PS_LORA_GROUP 1 /* rows at a time sharing the loads of AT and BT: 1 or 4 (registers permitting) */
#endif

/* 16 floats as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2 ones, four
 * SSE ones; the accumulators stay in registers. PS_LORA_LD loads 16 floats from any address. */
typedef float ps_lora_v16 __attribute__((vector_size(64)));
typedef float ps_lora_v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define PS_LORA_LD(p) (*(const ps_lora_v16u*)(p))
#define PS_LORA_ST(p, v) (*(ps_lora_v16u*)(p) = (v))
/* 16 uint32 (bf16 pairs, or bf16 widened), in registers and at any 2-byte aligned address. */
typedef uint32_t ps_lora_u16 __attribute__((vector_size(64)));
typedef uint32_t ps_lora_u16u __attribute__((vector_size(64), aligned(2), may_alias));
/* 16 bf16 (raw uint16) from any address widened to 16 floats, exactly: each zero-extended to 32
 * bits and shifted into the high half, the bits then read as floats. AVX-512: one vpmovzxwd from
 * memory and one vpslld; AVX2: two of each; the portable unit: the vector extension's unpacks and
 * shifts (GCC's generic form of the first two splits the load into halves and reinserts them). */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define PS_LORA_LDH(p) ((ps_lora_v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#elif defined(__AVX2__)
typedef union {
    __m256i h[2];
    ps_lora_v16 v;
} ps_lora_h2;
#define PS_LORA_LDH(p)                                                                                      \
    ({                                                                                                      \
        const uint16_t* ps_lora_p_ = (p);                                                                   \
        ps_lora_h2 ps_lora_r_;                                                                              \
        ps_lora_r_.h[0] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)ps_lora_p_)), 16);       \
        ps_lora_r_.h[1] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(ps_lora_p_ + 8))), 16); \
        ps_lora_r_.v;                                                                                       \
    })
#else
typedef uint16_t ps_lora_h16u __attribute__((vector_size(32), aligned(2), may_alias));
#define PS_LORA_LDH(p) ((ps_lora_v16)(__builtin_convertvector(*(const ps_lora_h16u*)(p), ps_lora_u16) << 16))
#endif

/* The weights: float32 (wb = 0) or bf16 (wb = 1, a compile-time constant in each inlined copy of
 * the loops below), addressed in elements from wf / wh (the same address as float* and uint16_t*):
 * 16 at a time widened to a vector, or one widened to a float. Widening is exact, so a bf16 slot
 * gives the bits of a float32 slot holding the same values. */
#define PS_LORA_LDW(off) (wb ? PS_LORA_LDH(wh + (off)) : (ps_lora_v16)PS_LORA_LD(wf + (off)))
#define PS_LORA_W1(off) (wb ? bf16_to_f32(wh[off]) : wf[off])
#define PS_LORA_INLINE static inline __attribute__((always_inline))

/* One row's four partial sums of a full chunk over k = k0 .. k0 + 3 (lora.h's arithmetic). */
#define PS_LORA_SHRINK_STEP(c, x, k0)          \
    c##0 = c##0 + a0 * (x)[k0];                \
    c##1 = c##1 + a1 * (x)[(k0) + 1];          \
    c##2 = c##2 + a2 * (x)[(k0) + 2];          \
    c##3 = c##3 + a3 * (x)[(k0) + 3];
/* The tail k = K4 + p (p < 3) into partial sum p. */
#define PS_LORA_SHRINK_TAIL(c, x, k, p) \
    if ((p) == 0)                       \
        c##0 = c##0 + a * (x)[k];       \
    else if ((p) == 1)                  \
        c##1 = c##1 + a * (x)[k];       \
    else                                \
        c##2 = c##2 + a * (x)[k];

/* bf16 weights: the weights a later task reads, fetched ahead (in a decode step the factors
 * stream from L3 or memory, and a task's rows of AT or BT are a strided walk): the shrink, the
 * chunk's row k + PS_LORA_PF_K on; the expand, the next block's part of row j of BT (the task after
 * this one on this thread, static schedule). Measured on streamed SmolLM2-135M slots: qkv 1.13x, o
 * 1.04x, gate_up and down even; float32 weights showed no clear gain, so they run as they did. */
#define PS_LORA_PF_K 16
#define PS_LORA_PREFETCH_SHRINK(k)                                                                  \
    if (wb && (k) + PS_LORA_PF_K + 3 < K) {                                                         \
        __builtin_prefetch(wh + ((k) + PS_LORA_PF_K) * R), __builtin_prefetch(wh + ((k) + PS_LORA_PF_K + 1) * R); \
        __builtin_prefetch(wh + ((k) + PS_LORA_PF_K + 2) * R), __builtin_prefetch(wh + ((k) + PS_LORA_PF_K + 3) * R); \
    }
#define PS_LORA_PREFETCH_EXPAND(bj)                                              \
    if (wb && pf_next) __builtin_prefetch(wh + (bj) + 64), __builtin_prefetch(wh + (bj) + 96);

/* h[i * ldh + j] for j in [j0, j0 + jw) (jw <= PS_LORA_JW), i < rows: the dot of x's row i with
 * column j of at (rows R apart) as lora.h says: partial sum p over k = p, p + 4, ... in order, then
 * (s0 + s1) + (s2 + s3); the 16 j of a chunk side by side in one vector, no horizontal sums. Every
 * path (4 rows, 1 row, a narrower chunk) computes each row's values the same way. */
PS_LORA_INLINE void ps_lora_shrink_body(const void* at, const int wb, int64_t R, int64_t j0, int64_t jw, const float* xf, int64_t rows,
                                        int64_t K, float* h, int64_t ldh) {
    const int64_t K4 = K - K % PS_LORA_KSPLIT;
    const float* wf = (const float*)at + j0;
    const uint16_t* wh = (const uint16_t*)at + j0;
    const ps_lora_v16 z = {0};
    int64_t i = 0;
    if (jw == PS_LORA_JW) {
#if PS_LORA_GROUP == 4
        for (; i + 4 <= rows; i += 4) {
            const float *x0 = xf + i * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            ps_lora_v16 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
            ps_lora_v16 c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
            for (int64_t k = 0; k < K4; k += 4) {
                PS_LORA_PREFETCH_SHRINK(k)
                const ps_lora_v16 a0 = PS_LORA_LDW(k * R), a1 = PS_LORA_LDW((k + 1) * R);
                const ps_lora_v16 a2 = PS_LORA_LDW((k + 2) * R), a3 = PS_LORA_LDW((k + 3) * R);
                PS_LORA_SHRINK_STEP(c0, x0, k)
                PS_LORA_SHRINK_STEP(c1, x1, k)
                PS_LORA_SHRINK_STEP(c2, x2, k)
                PS_LORA_SHRINK_STEP(c3, x3, k)
            }
            for (int64_t k = K4; k < K; k++) {
                const ps_lora_v16 a = PS_LORA_LDW(k * R);
                PS_LORA_SHRINK_TAIL(c0, x0, k, k - K4)
                PS_LORA_SHRINK_TAIL(c1, x1, k, k - K4)
                PS_LORA_SHRINK_TAIL(c2, x2, k, k - K4)
                PS_LORA_SHRINK_TAIL(c3, x3, k, k - K4)
            }
            PS_LORA_ST(h + i * ldh + j0, (c00 + c01) + (c02 + c03));
            PS_LORA_ST(h + (i + 1) * ldh + j0, (c10 + c11) + (c12 + c13));
            PS_LORA_ST(h + (i + 2) * ldh + j0, (c20 + c21) + (c22 + c23));
            PS_LORA_ST(h + (i + 3) * ldh + j0, (c30 + c31) + (c32 + c33));
        }
#endif
        for (; i < rows; i++) {
            const float* x0 = xf + i * K;
            ps_lora_v16 c00 = z, c01 = z, c02 = z, c03 = z;
            for (int64_t k = 0; k < K4; k += 4) {
                PS_LORA_PREFETCH_SHRINK(k)
                const ps_lora_v16 a0 = PS_LORA_LDW(k * R), a1 = PS_LORA_LDW((k + 1) * R);
                const ps_lora_v16 a2 = PS_LORA_LDW((k + 2) * R), a3 = PS_LORA_LDW((k + 3) * R);
                PS_LORA_SHRINK_STEP(c0, x0, k)
            }
            for (int64_t k = K4; k < K; k++) {
                const ps_lora_v16 a = PS_LORA_LDW(k * R);
                PS_LORA_SHRINK_TAIL(c0, x0, k, k - K4)
            }
            PS_LORA_ST(h + i * ldh + j0, (c00 + c01) + (c02 + c03));
        }
        return;
    }
    for (; i < rows; i++) { /* a narrower chunk (R not a multiple of PS_LORA_JW): the same sums */
        const float* x0 = xf + i * K;
        float c[PS_LORA_KSPLIT][PS_LORA_JW] = {{0}};
        for (int64_t k = 0; k < K; k++) {
            float* cp = c[k % PS_LORA_KSPLIT];
            for (int64_t l = 0; l < jw; l++) cp[l] = cp[l] + PS_LORA_W1(k * R + l) * x0[k];
        }
        for (int64_t l = 0; l < jw; l++) h[i * ldh + j0 + l] = (c[0][l] + c[1][l]) + (c[2][l] + c[3][l]);
    }
}

void PS_LORA_FN(ps_lora_shrink)(const void* at, int wbf16, int64_t R, int64_t j0, int64_t jw, const float* xf, int64_t rows, int64_t K,
                                float* h, int64_t ldh) {
    if (wbf16)
        ps_lora_shrink_body(at, 1, R, j0, jw, xf, rows, K, h, ldh);
    else
        ps_lora_shrink_body(at, 0, R, j0, jw, xf, rows, K, h, ldh);
}

/* Row i's deltas of outputs [n0, n0 + nb) added to out: out + acc rounded once. */
static inline void ps_lora_store(const float* acc, int64_t nb, void* out, int64_t row, int64_t ldo, int64_t n0, int bf16) {
    if (bf16) {
        uint16_t* o = (uint16_t*)out + row * ldo + n0;
        for (int64_t n = 0; n < nb; n++) o[n] = f32_to_bf16(bf16_to_f32(o[n]) + acc[n]);
    } else {
        float* o = (float*)out + row * ldo + n0;
        for (int64_t n = 0; n < nb; n++) o[n] = o[n] + acc[n];
    }
}

/* Outputs [n0 + off, n0 + off + 64) of a row of BT into b0 .. b3: float32, 16 each in order; bf16
 * (as the bf16 matmul of gemm/avx2.c reads its panels), 32 weights a load read as 16 pairs, the
 * even outputs (a shift) into b0 and the odd ones (a mask) into b1, the next 32 into b2 and b3:
 * one load and two integer operations for 32 weights. */
#define PS_LORA_EXPAND_LOAD(off)                                                                                  \
    if (wb) {                                                                                                     \
        const ps_lora_u16 u0_ = *(const ps_lora_u16u*)(wh + (off)), u1_ = *(const ps_lora_u16u*)(wh + (off) + 32); \
        b0 = (ps_lora_v16)(u0_ << 16), b1 = (ps_lora_v16)(u0_ & 0xffff0000u);                                     \
        b2 = (ps_lora_v16)(u1_ << 16), b3 = (ps_lora_v16)(u1_ & 0xffff0000u);                                     \
    } else {                                                                                                      \
        b0 = PS_LORA_LD(wf + (off)), b1 = PS_LORA_LD(wf + (off) + 16);                                            \
        b2 = PS_LORA_LD(wf + (off) + 32), b3 = PS_LORA_LD(wf + (off) + 48);                                       \
    }

/* One row's 64 sums over rank column j. */
#define PS_LORA_EXPAND_STEP(c, hj) \
    c##0 = c##0 + b0 * (hj);       \
    c##1 = c##1 + b1 * (hj);       \
    c##2 = c##2 + b2 * (hj);       \
    c##3 = c##3 + b3 * (hj);
/* Its sums added to out: in order, or (bf16 weights) the even and odd outputs put back in place. */
#define PS_LORA_EXPAND_STORE(c, row)                                                                        \
    {                                                                                                       \
        float acc[PS_LORA_NB];                                                                              \
        if (wb) {                                                                                           \
            float eo[PS_LORA_NB];                                                                           \
            PS_LORA_ST(eo, c##0), PS_LORA_ST(eo + 16, c##1), PS_LORA_ST(eo + 32, c##2), PS_LORA_ST(eo + 48, c##3); \
            for (int l = 0; l < 16; l++) {                                                                  \
                acc[2 * l] = eo[l], acc[2 * l + 1] = eo[16 + l];                                            \
                acc[32 + 2 * l] = eo[32 + l], acc[33 + 2 * l] = eo[48 + l];                                 \
            }                                                                                               \
        } else {                                                                                            \
            PS_LORA_ST(acc, c##0), PS_LORA_ST(acc + 16, c##1), PS_LORA_ST(acc + 32, c##2), PS_LORA_ST(acc + 48, c##3); \
        }                                                                                                   \
        ps_lora_store(acc, PS_LORA_NB, out, out_rows[row], ldo, n0, bf16);                                  \
    }

/* out[out_rows[i], n] += sum_j bt[j, n] h[i, j] for n in [n0, n1), j in order from 0 (the first
 * product, then each next one added). A whole block of PS_LORA_NB outputs keeps its sums in
 * registers, PS_LORA_GROUP rows at a time; a narrower block, one row at a time: the same sums. */
PS_LORA_INLINE void ps_lora_expand_body(const void* bt, const int wb, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h,
                                        int64_t ldh, int64_t rows, const int64_t* out_rows, void* out, int64_t ldo, int bf16) {
    const int64_t nb = n1 - n0;
    const float* wf = (const float*)bt + n0;
    const uint16_t* wh = (const uint16_t*)bt + n0;
    const int pf_next = n1 + PS_LORA_NB <= N; /* a whole next block */
    int64_t i = 0;
    if (nb == PS_LORA_NB) {
#if PS_LORA_GROUP == 4
        for (; i + 4 <= rows; i += 4) {
            const float *h0 = h + i * ldh, *h1 = h0 + ldh, *h2 = h1 + ldh, *h3 = h2 + ldh;
            ps_lora_v16 b0, b1, b2, b3;
            PS_LORA_EXPAND_LOAD(0)
            ps_lora_v16 c00 = b0 * h0[0], c01 = b1 * h0[0], c02 = b2 * h0[0], c03 = b3 * h0[0];
            ps_lora_v16 c10 = b0 * h1[0], c11 = b1 * h1[0], c12 = b2 * h1[0], c13 = b3 * h1[0];
            ps_lora_v16 c20 = b0 * h2[0], c21 = b1 * h2[0], c22 = b2 * h2[0], c23 = b3 * h2[0];
            ps_lora_v16 c30 = b0 * h3[0], c31 = b1 * h3[0], c32 = b2 * h3[0], c33 = b3 * h3[0];
            for (int64_t j = 1; j < r; j++) {
                PS_LORA_PREFETCH_EXPAND(j * N)
                ps_lora_v16 b0, b1, b2, b3;
                PS_LORA_EXPAND_LOAD(j * N)
                PS_LORA_EXPAND_STEP(c0, h0[j])
                PS_LORA_EXPAND_STEP(c1, h1[j])
                PS_LORA_EXPAND_STEP(c2, h2[j])
                PS_LORA_EXPAND_STEP(c3, h3[j])
            }
            PS_LORA_EXPAND_STORE(c0, i)
            PS_LORA_EXPAND_STORE(c1, i + 1)
            PS_LORA_EXPAND_STORE(c2, i + 2)
            PS_LORA_EXPAND_STORE(c3, i + 3)
        }
#endif
        for (; i < rows; i++) {
            const float* h0 = h + i * ldh;
            ps_lora_v16 b0, b1, b2, b3;
            PS_LORA_EXPAND_LOAD(0)
            ps_lora_v16 c00 = b0 * h0[0], c01 = b1 * h0[0], c02 = b2 * h0[0], c03 = b3 * h0[0];
            for (int64_t j = 1; j < r; j++) {
                PS_LORA_PREFETCH_EXPAND(j * N)
                ps_lora_v16 b0, b1, b2, b3;
                PS_LORA_EXPAND_LOAD(j * N)
                PS_LORA_EXPAND_STEP(c0, h0[j])
            }
            PS_LORA_EXPAND_STORE(c0, i)
        }
        return;
    }
    for (; i < rows; i++) {
        float acc[PS_LORA_NB];
        const float* hi = h + i * ldh;
        for (int64_t n = 0; n < nb; n++) acc[n] = PS_LORA_W1(n) * hi[0];
        for (int64_t j = 1; j < r; j++) {
            const float hj = hi[j];
            for (int64_t n = 0; n < nb; n++) acc[n] = acc[n] + PS_LORA_W1(j * N + n) * hj;
        }
        ps_lora_store(acc, nb, out, out_rows[i], ldo, n0, bf16);
    }
}

void PS_LORA_FN(ps_lora_expand)(const void* bt, int wbf16, int64_t N, int64_t n0, int64_t n1, int64_t r, const float* h, int64_t ldh,
                                int64_t rows, const int64_t* out_rows, void* out, int64_t ldo, int bf16) {
    if (wbf16)
        ps_lora_expand_body(bt, 1, N, n0, n1, r, h, ldh, rows, out_rows, out, ldo, bf16);
    else
        ps_lora_expand_body(bt, 0, N, n0, n1, r, h, ldh, rows, out_rows, out, ldo, bf16);
}
