/*
 * Greedy sampling in C: the index of the largest value of each bf16 row of the logits, as
 * torch.max(dim) (the first maximum on ties, the first NaN in a row that has one). Included by
 * fused_ops.c, whose AVX-512 helpers (ld16) and PAR_MIN_ELEMS it uses.
 */

#if defined(HAVE_AVX2_ROWS)
/* Scans columns [0, c) of a bf16 row, c the largest multiple of 16 <= cols (cols >= 32), in two
 * sets of 8 lanes; each lane keeps its first maximum. Returns 1 when a NaN was seen (the caller
 * then finds the first NaN), else 0 with *best_i the first column holding the maximum of [0, c)
 * (the smallest index among the lanes that hold it) and *c_end = c. */
static inline int argmax_head_avx2(const uint16_t* p, int64_t cols, int64_t* best_i, int64_t* c_end) {
    __m256 b0 = bf16x8_load(p), b1 = bf16x8_load(p + 8);
    __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
    __m256i bi0 = i0, bi1 = i1;
    const __m256i step = _mm256_set1_epi32(16);
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(b0, b0, _CMP_UNORD_Q), _mm256_cmp_ps(b1, b1, _CMP_UNORD_Q));
    int64_t c = 16;
    for (; c + 16 <= cols; c += 16) {
        i0 = _mm256_add_epi32(i0, step);
        i1 = _mm256_add_epi32(i1, step);
        const __m256 v0 = bf16x8_load(p + c), v1 = bf16x8_load(p + c + 8);
        const __m256 g0 = _mm256_cmp_ps(v0, b0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, b1, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
        b0 = _mm256_blendv_ps(b0, v0, g0);
        b1 = _mm256_blendv_ps(b1, v1, g1);
        bi0 = _mm256_blendv_epi8(bi0, i0, _mm256_castps_si256(g0));
        bi1 = _mm256_blendv_epi8(bi1, i1, _mm256_castps_si256(g1));
    }
    if (_mm256_movemask_ps(nan)) return 1;
    float v[16];
    int32_t idx[16];
    _mm256_storeu_ps(v, b0);
    _mm256_storeu_ps(v + 8, b1);
    _mm256_storeu_si256((__m256i*)idx, bi0);
    _mm256_storeu_si256((__m256i*)(idx + 8), bi1);
    float m = v[0];
    for (int l = 1; l < 16; l++) m = v[l] > m ? v[l] : m;
    int64_t first = cols;
    for (int l = 0; l < 16; l++)
        if (v[l] == m && idx[l] < first) first = idx[l];
    *best_i = first;
    *c_end = c;
    return 0;
}
#endif

/* Index of the largest value of each bf16 row (the first one on ties, as torch.max(dim) and
 * argmax; the first NaN when a row has one, as torch). x: [rows, cols] with a row stride
 * (elements); out: [rows] int64. Greedy sampling of a [64, 49152] batch: one 6 MB read. */
/* Continues a scan from column start (no NaN before it): the first NaN wins. */
static int64_t argmax_row_scalar(const uint16_t* p, int64_t cols, int64_t start, int64_t best_i) {
    float best = bf16_to_f32(p[best_i]);
    for (int64_t c = start; c < cols; c++) {
        const float v = bf16_to_f32(p[c]);
        if (isnan(v)) return c;
        if (v > best) {
            best = v;
            best_i = c;
        }
    }
    return best_i;
}

static int64_t argmax_row_first_nan(const uint16_t* p, int64_t cols) {
    for (int64_t c = 0; c < cols; c++)
        if (isnan(bf16_to_f32(p[c]))) return c;
    return -1;
}

void argmax_bf16_rows(const uint16_t* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows * cols >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* p = x + r * row_stride;
        int64_t best_i = 0, c = 1;
#ifdef HAVE_BF16_VEC
        if (cols >= 32) {
            __m512 best = ld16(p);
            __m512i best_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512i idx = best_idx;
            const __m512i step = _mm512_set1_epi32(16);
            __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
            for (c = 16; c + 16 <= cols; c += 16) {
                idx = _mm512_add_epi32(idx, step);
                const __m512 v = ld16(p + c);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                best = _mm512_mask_mov_ps(best, gt, v);
                best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
            }
            if (nan) {
                out[r] = argmax_row_first_nan(p, cols);
                continue;
            }
            /* Each lane holds its first maximum; the earliest lane index among the lanes that
             * hold the row maximum is the row's first maximum. */
            const float m = _mm512_reduce_max_ps(best);
            const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
            best_i = _mm512_mask_reduce_min_epi32(at_max, best_idx);
        }
#elif defined(HAVE_AVX2_ROWS)
        if (cols >= 32 && argmax_head_avx2(p, cols, &best_i, &c)) {
            out[r] = argmax_row_first_nan(p, cols);
            continue;
        }
#endif
        const int64_t nan_i = c == 1 ? argmax_row_first_nan(p, cols) : -1;
        out[r] = nan_i >= 0 ? nan_i : argmax_row_scalar(p, cols, c, best_i);
    }
}
