/*
 * The float32 attention task for CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, Intel
 * client cores), included by paged_attention.c: scores of 8 keys per pass with one
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
static inline void prefetch_f32(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm_prefetch((const char*)(p + i), _MM_HINT_T0);
}

/* float32 cache, head_dim % 8 == 0, AVX2: one (query token, KV head) task. q: the group's
 * query rows [group, head_dim]; kb/vb blocks found through table at block_stride elements, the
 * head at head_off. Scores of 8 keys per pass, each in one running FMA sum per key, reduced
 * together; softmax in fp32; P.V accumulated in fp32 in out. */
static void task_f32_avx2(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t n,
                          int64_t block_size, int64_t block_stride, int64_t head_off, int64_t group, int64_t head_dim,
                          float scale, float* out, float* scores) {
    float qf[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32)));
    const int64_t nc = head_dim / 8;
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qf[g][d] = q[g * head_dim + d] * scale;
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* kb = kc + table[t0 / block_size] * block_stride + head_off;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + block_size < n) prefetch_f32(kc + table[t0 / block_size + 1] * block_stride + head_off, block_size * head_dim);
        else prefetch_f32(vc + table[0] * block_stride + head_off, block_size * head_dim);
        int64_t o = 0;
        for (; o + 8 <= len; o += 8) {
            const float* k8 = kb + o * head_dim;
            for (int64_t g = 0; g < group; g++) {
                __m256 a[8];
                for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                for (int64_t c = 0; c < nc; c++) {
                    const __m256 qv = _mm256_load_ps(qf[g] + 8 * c);
                    for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(k8 + r * head_dim + 8 * c), qv, a[r]);
                }
                _mm256_storeu_ps(scores + g * n + t0 + o, hsum8x8(a));
            }
        }
        for (; o < len; o++)
            for (int64_t g = 0; g < group; g++) scores[g * n + t0 + o] = dot(qf[g], kb + o * head_dim, head_dim);
    }
    softmax_rows(scores, group, n);
    for (int64_t g = 0; g < group; g++) memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* vb = vc + table[t0 / block_size] * block_stride + head_off;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        if (t0 + block_size < n) prefetch_f32(vc + table[t0 / block_size + 1] * block_stride + head_off, block_size * head_dim);
        for (int64_t g = 0; g < group; g++) {
            const float* p = scores + g * n + t0;
            float* acc = out + g * head_dim;
            for (int64_t c = 0; c < nc; c++) {
                __m256 s0 = _mm256_loadu_ps(acc + 8 * c), s1 = _mm256_setzero_ps();
                int64_t o = 0;
                for (; o + 2 <= len; o += 2) {  /* two chains: FMA latency, not throughput, bounds one */
                    s0 = _mm256_fmadd_ps(_mm256_set1_ps(p[o]), _mm256_loadu_ps(vb + o * head_dim + 8 * c), s0);
                    s1 = _mm256_fmadd_ps(_mm256_set1_ps(p[o + 1]), _mm256_loadu_ps(vb + (o + 1) * head_dim + 8 * c), s1);
                }
                if (o < len) s0 = _mm256_fmadd_ps(_mm256_set1_ps(p[o]), _mm256_loadu_ps(vb + o * head_dim + 8 * c), s0);
                _mm256_storeu_ps(acc + 8 * c, _mm256_add_ps(s0, s1));
            }
        }
    }
}
#endif
