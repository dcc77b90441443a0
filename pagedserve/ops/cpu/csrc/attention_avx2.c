/*
 * The attention task for CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, Intel client
 * cores), included by paged_attention.c, for float32 and bf16 caches (bf16 keys and values are
 * widened to float32 as they are loaded, exactly): scores of 8 keys per pass with one
 * transposing reduction, softmax in fp32, P.V in fp32. Each row is computed the same way
 * whatever else is in the call, like every other path of the kernel.
 */
#ifdef HAVE_AVX2
/* Eight vectors -> one: lane r = sum of the lanes of a[r] (7 shuffles/adds for 8 reductions). */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* Blocks of a sequence are scattered over the pool, which stops the hardware prefetcher at
 * every block boundary: ask for the next one while this one is used. */
static inline void prefetch_bytes(const void* p, int64_t nbytes) {
    for (int64_t i = 0; i < nbytes; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T0);
}

/* Eight values at element i of a float32 (bf = 0) or bf16 (bf = 1) array, as float32. */
static inline __attribute__((always_inline)) __m256 load8(const void* base, int64_t i, const int bf) {
    if (bf)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i))), 16));
    return _mm256_loadu_ps((const float*)base + i);
}

/* One (query token, KV head) task, head_dim % 8 == 0. q: the group's query rows [group,
 * head_dim]; kc/vc blocks found through table at block_stride elements, the head at head_off;
 * q, caches and out all float32 (bf = 0) or all bf16 (bf = 1). Scores of 8 keys per pass, each
 * in one running FMA sum per key, reduced together; softmax in fp32; P.V accumulated in fp32,
 * rounded once into out. */
static inline __attribute__((always_inline)) void task_avx2(const void* q, const void* kc, const void* vc, const int64_t* table,
                                                             int64_t n, int64_t block_size, int64_t block_stride, int64_t head_off,
                                                             int64_t group, int64_t head_dim, float scale, void* out,
                                                             float* scores, const int bf) {
    float qf[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float row[MAX_HEAD_DIM];
    const int64_t nc = head_dim / 8, esize = bf ? 2 : 4, block_bytes = block_size * head_dim * esize;
    for (int64_t g = 0; g < group; g++) {
        load_row((const char*)q + g * head_dim * esize, bf, head_dim, qf[g]);
        for (int64_t d = 0; d < head_dim; d++) qf[g][d] *= scale;
    }
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const char* kb = (const char*)kc + (table[t0 / block_size] * block_stride + head_off) * esize;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + block_size < n) prefetch_bytes((const char*)kc + (table[t0 / block_size + 1] * block_stride + head_off) * esize, block_bytes);
        else prefetch_bytes((const char*)vc + (table[0] * block_stride + head_off) * esize, block_bytes);
        int64_t o = 0;
        for (; o + 8 <= len; o += 8) {
            const char* k8 = kb + o * head_dim * esize;
            for (int64_t g = 0; g < group; g++) {
                __m256 a[8];
                for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                for (int64_t c = 0; c < nc; c++) {
                    const __m256 qv = _mm256_load_ps(qf[g] + 8 * c);
                    for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(load8(k8, r * head_dim + 8 * c, bf), qv, a[r]);
                }
                _mm256_storeu_ps(scores + g * n + t0 + o, hsum8x8(a));
            }
        }
        for (; o < len; o++) {
            load_row(kb + o * head_dim * esize, bf, head_dim, row);
            for (int64_t g = 0; g < group; g++) scores[g * n + t0 + o] = dot(qf[g], row, head_dim);
        }
    }
    softmax_rows(scores, group, n);
    for (int64_t g = 0; g < group; g++) memset(acc[g], 0, sizeof(float) * head_dim);
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const char* vb = (const char*)vc + (table[t0 / block_size] * block_stride + head_off) * esize;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + block_size < n) prefetch_bytes((const char*)vc + (table[t0 / block_size + 1] * block_stride + head_off) * esize, block_bytes);
        for (int64_t g = 0; g < group; g++) {
            const float* p = scores + g * n + t0;
            for (int64_t c = 0; c < nc; c++) {
                __m256 s0 = _mm256_load_ps(acc[g] + 8 * c), s1 = _mm256_setzero_ps();
                int64_t o = 0;
                for (; o + 2 <= len; o += 2) {  /* two chains: FMA latency, not throughput, bounds one */
                    s0 = _mm256_fmadd_ps(_mm256_set1_ps(p[o]), load8(vb, o * head_dim + 8 * c, bf), s0);
                    s1 = _mm256_fmadd_ps(_mm256_set1_ps(p[o + 1]), load8(vb, (o + 1) * head_dim + 8 * c, bf), s1);
                }
                if (o < len) s0 = _mm256_fmadd_ps(_mm256_set1_ps(p[o]), load8(vb, o * head_dim + 8 * c, bf), s0);
                _mm256_store_ps(acc[g] + 8 * c, _mm256_add_ps(s0, s1));
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        if (bf) {
            uint16_t* op = (uint16_t*)out + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) op[d] = f32_to_bf16(acc[g][d]);
        } else {
            memcpy((float*)out + g * head_dim, acc[g], sizeof(float) * head_dim);
        }
    }
}

static void task_f32_avx2(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t n,
                          int64_t block_size, int64_t block_stride, int64_t head_off, int64_t group, int64_t head_dim,
                          float scale, float* out, float* scores) {
    task_avx2(q, kc, vc, table, n, block_size, block_stride, head_off, group, head_dim, scale, out, scores, 0);
}

static void task_bf16_avx2(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t n,
                           int64_t block_size, int64_t block_stride, int64_t head_off, int64_t group, int64_t head_dim,
                           float scale, uint16_t* out, float* scores) {
    task_avx2(q, kc, vc, table, n, block_size, block_stride, head_off, group, head_dim, scale, out, scores, 1);
}
#endif
