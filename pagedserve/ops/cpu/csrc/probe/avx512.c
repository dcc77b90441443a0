/* stream_read's loop on 512-bit loads (stream_read.c). An AVX-512 unit (build.py's flags). */
#if !defined(__AVX512F__)
#error "an AVX-512 unit: build it with the AVX-512 flags (build.py)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

float ps_stream_read_avx512(const void* buf, int64_t nbytes) {
    float total = 0.f;
#pragma omp parallel reduction(+ : total)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunks = nbytes / 256, c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        const char* p = (const char*)buf;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = c0; c < c1; c++) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + 256 * c));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + 256 * c + 64));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + 256 * c + 128));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + 256 * c + 192));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    return total;
}
