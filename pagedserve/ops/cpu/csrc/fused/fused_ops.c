/*
 * Fused element-wise ops of a Llama decoder layer for the CPU: each replaces 5-10 small PyTorch
 * ops (and their per-op dispatch cost, which dominates a decode step's non-matmul time) with
 * one pass over the rows. They reproduce HF transformers' rounding order exactly:
 *
 *   add_rms_norm   residual = x + residual (rounded to the storage type), then
 *                  out = weight * to_dtype(residual_f32 * rsqrt(mean(residual_f32^2) + eps))
 *                  (LlamaRMSNorm: fp32 statistics, rounded to the storage type before the
 *                  weight product, which is rounded again).
 *   silu_mul       out = to_dtype(silu(gate)) * up, silu in fp32.
 *   rope_write_kv  q, k = q*cos + rotate_half(q)*sin with cos/sin rounded to the storage type
 *                  and every product and the sum rounded (HF's apply_rotary_pos_emb in bf16);
 *                  q goes to a contiguous output, k and v straight to their cache slots.
 *
 * Compiled with -ffp-contract=off: a fused multiply-add would round once where PyTorch rounds
 * twice, and float32 outputs are compared with HF's.
 *
 * Storage types: float32 (is_bf16 = 0) or bfloat16 (raw uint16). Rows are contiguous unless a
 * row stride (elements) is given. bf16 rows run the AVX512-BF16 rows (avx512bf16.c) where the
 * CPU has them, else the AVX2 rows (avx2.c: the scalar loop's bits), else the scalar loop below;
 * the CPU is asked once per call (cpu.h). The greedy argmax is in argmax.c.
 *
 * Portable: built without ISA flags; the vector rows are their ISA's units.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../common/cpu.h"
#include "../common/kv_int8.h"
#include "fused.h"

/* x, residual, out: [rows, dim]; weight: [dim]. residual may be NULL (first layer: the
 * residual is x itself and is written to residual_out if that is not NULL). */
PS_EXPORT void add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t dim,
                            float eps, int is_bf16) {
    const int isa = ps_cpu_isa();
    (void)isa; /* no ISA units off x86-64 */
#pragma omp parallel for schedule(static) if (rows * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        float rr[MAX_DIM]; /* callers guarantee dim <= MAX_DIM */
        const int64_t base = t * dim;
        int64_t i = 0;
        float sumsq = 0.f;
#ifdef PS_X86
        if (is_bf16 && dim % 16 == 0 && isa >= PS_ISA_AVX2) {
            const uint16_t* x16 = (const uint16_t*)x + base;
            uint16_t* r16 = residual ? (uint16_t*)residual + base : NULL;
            if (isa >= PS_ISA_AVX512BF16)
                fo_add_rms_norm_row_avx512bf16(x16, r16, (const uint16_t*)weight, (uint16_t*)out + base, dim, eps, rr);
            else
                fo_add_rms_norm_row_avx2(x16, r16, (const uint16_t*)weight, (uint16_t*)out + base, dim, eps, rr);
            continue;
        }
#endif
        for (i = 0; i < dim; i++) {
            float v = load(x, base + i, is_bf16);
            if (residual) {
                v = rnd(v + load(residual, base + i, is_bf16), is_bf16);
                store(residual, base + i, v, is_bf16);
            }
            rr[i] = v;
        }
        /* Sum of squares in 16 lanes (the vectorised order), then across lanes. */
        float lanes[16] = {0};
        i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += rr[i + l] * rr[i + l];
        for (int l = 0; l < 16; l++) sumsq += lanes[l];
        for (; i < dim; i++) sumsq += rr[i] * rr[i];
        const float inv = 1.f / sqrtf(sumsq / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) {
            const float h = rnd(rr[j] * inv, is_bf16);
            store(out, base + j, load(weight, j, is_bf16) * h, is_bf16);
        }
    }
}

/* gate_up: [rows, 2 * inter] (gate then up); out: [rows, inter]. */
PS_EXPORT void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int is_bf16) {
    const int isa = ps_cpu_isa();
    (void)isa; /* no ISA units off x86-64 */
#pragma omp parallel for schedule(static) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t gb = t * 2 * inter, ob = t * inter;
        int64_t i = 0;
#ifdef PS_X86
        if (is_bf16 && isa >= PS_ISA_AVX2) {
            const uint16_t* g16 = (const uint16_t*)gate_up + gb;
            if (isa >= PS_ISA_AVX512BF16)
                i = fo_silu_mul_row_avx512bf16(g16, g16 + inter, (uint16_t*)out + ob, inter);
            else
                i = fo_silu_mul_row_avx2(g16, g16 + inter, (uint16_t*)out + ob, inter);
        }
#endif
        for (; i < inter; i++) {
            const float g = load(gate_up, gb + i, is_bf16);
            const float s = rnd(g / (1.f + expf(-g)), is_bf16);
            store(out, ob + i, s * load(gate_up, gb + inter + i, is_bf16), is_bf16);
        }
    }
}

/* qk: [rows, num_heads + num_kv_heads, head_dim] with row stride qk_stride (elements);
 * v: [rows, num_kv_heads, head_dim] with row stride v_stride; positions, slots: [rows] int64;
 * cos, sin: float32 [max_positions, head_dim]; q_out: [rows, num_heads, head_dim] contiguous;
 * k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]. */
void fo_rope_write_kv(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                      const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache, void* v_cache,
                      int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int is_bf16,
                      int kv_int8) {
    const int isa = ps_cpu_isa();
    /* the vector rows (AVX2 and AVX512-BF16 are alternatives, as their rounding of cos / sin) */
    const int bf16_rows = is_bf16 && isa >= PS_ISA_AVX512BF16, avx2_rows = is_bf16 && isa >= PS_ISA_AVX2 && !bf16_rows;
    void (*quantize)(const float*, int64_t, int8_t*, float*) = quantize_row_q8;
#ifdef PS_X86
    if (isa >= PS_ISA_AVX512) quantize = fo_quantize_row_q8_avx512;
#endif
    const int64_t half = head_dim / 2;
    const int64_t esize = is_bf16 ? 2 : 4;
    const int64_t q8_bytes = Q8_BYTES(block_size, head_dim);
#pragma omp parallel for schedule(static) if (rows * (num_heads + 2 * num_kv_heads) * head_dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float* c = cos + positions[t] * head_dim;
        const float* s = sin + positions[t] * head_dim;
        float cr[1024], sr[1024];
        uint16_t krow[1024]; /* int8 cache: one K row in the storage type before quantization */
        int64_t i0 = 0;
#ifdef PS_X86
        if (avx2_rows) {
            i0 = head_dim - head_dim % 8;
            fo_round_rows_avx2(c, cr, i0);
            fo_round_rows_avx2(s, sr, i0);
        }
#endif
        for (int64_t i = i0; i < head_dim; i++) {
            cr[i] = rnd(c[i], is_bf16);
            sr[i] = rnd(s[i], is_bf16);
        }
        const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            const int64_t src = t * qk_stride + h * head_dim;
            char* dst_base;
            int64_t dst;
            int vec_done = 0;
            if (h < num_heads) {
                dst_base = (char*)q_out;
                dst = (t * num_heads + h) * head_dim;
            } else if (kv_int8) {
                dst_base = (char*)krow; /* float32 rows need 4 bytes a value: krow holds 2048 bytes */
                dst = 0;
            } else {
                dst_base = (char*)k_cache;
                dst = ((blk * num_kv_heads + (h - num_heads)) * block_size + off) * head_dim;
            }
#ifdef PS_X86
            if (bf16_rows && half > 0 && head_dim == 2 * half && half % 16 == 0) {
                fo_rope_head_avx512bf16((const uint16_t*)qk + src, (uint16_t*)dst_base + dst, cr, sr, half);
                vec_done = 1;
            } else if (avx2_rows && half > 0 && head_dim == 2 * half && half % 8 == 0) {
                fo_rope_head_avx2((const uint16_t*)qk + src, (uint16_t*)dst_base + dst, cr, sr, half);
                vec_done = 1;
            }
#endif
            for (int64_t i = 0; i < head_dim && !vec_done; i++) {
                const float x = load(qk, src + i, is_bf16);
                const float rot = i < half ? -load(qk, src + i + half, is_bf16) : load(qk, src + i - half, is_bf16);
                const float a = rnd(x * cr[i], is_bf16);
                const float b = rnd(rot * sr[i], is_bf16);
                store(dst_base, dst + i, a + b, is_bf16);
            }
            if (kv_int8 && h >= num_heads) {
                float kf[512];
                char* cell = (char*)k_cache + (blk * num_kv_heads + (h - num_heads)) * q8_bytes;
                for (int64_t i = 0; i < head_dim; i++) kf[i] = load(krow, i, is_bf16);
                quantize(kf, head_dim, (int8_t*)cell + off * head_dim, (float*)(cell + block_size * head_dim) + off);
            }
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            if (kv_int8) {
                float vf[512];
                char* cell = (char*)v_cache + (blk * num_kv_heads + h) * q8_bytes;
                for (int64_t i = 0; i < head_dim; i++) vf[i] = load(v, t * v_stride + h * head_dim + i, is_bf16);
                quantize(vf, head_dim, (int8_t*)cell + off * head_dim, (float*)(cell + block_size * head_dim) + off);
                continue;
            }
            const int64_t dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim;
            memcpy((char*)v_cache + dst * esize, (const char*)v + (t * v_stride + h * head_dim) * esize, head_dim * esize);
        }
    }
}

/* qk, v, positions, slots, cos, sin, q_out as fo_rope_write_kv; k_cache, v_cache: [num_blocks,
 * num_kv_heads, block_size, head_dim] in the storage type. */
PS_EXPORT void rope_write_kv(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                   const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache,
                   void* v_cache, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int is_bf16) {
    fo_rope_write_kv(qk, qk_stride, v, v_stride, positions, slots, cos, sin, q_out, k_cache, v_cache, rows,
                       num_heads, num_kv_heads, head_dim, block_size, is_bf16, 0);
}

/* The same with an int8 cache (kv_int8.h): k_cache, v_cache [num_blocks, num_kv_heads,
 * Q8_BYTES(block_size, head_dim)] bytes; head_dim <= 512. */
PS_EXPORT void rope_write_kv_q8(const void* qk, int64_t qk_stride, const void* v, int64_t v_stride, const int64_t* positions,
                      const int64_t* slots, const float* cos, const float* sin, void* q_out, void* k_cache,
                      void* v_cache, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int is_bf16) {
    fo_rope_write_kv(qk, qk_stride, v, v_stride, positions, slots, cos, sin, q_out, k_cache, v_cache, rows,
                       num_heads, num_kv_heads, head_dim, block_size, is_bf16, 1);
}

