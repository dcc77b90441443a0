/* stream_read's loop on 256-bit loads (stream_read.c). An AVX2 unit (build.py's flags). */
#if !defined(__AVX2__)
#error "an AVX2 unit: build it with -mavx2 -mfma (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

float ps_stream_read_avx2(const void* buf, int64_t nbytes) {
    float total = 0.f;
#pragma omp parallel reduction(+ : total)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunks = nbytes / 256, c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        const char* p = (const char*)buf;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c1; c++)
            for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_loadu_ps((const float*)(p + 256 * c + 32 * i)));
        for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
        float lanes[8];
        _mm256_storeu_ps(lanes, a[0]);
        for (int i = 0; i < 8; i++) total += lanes[i];
    }
    return total;
}
