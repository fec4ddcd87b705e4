/* A streaming read's bandwidth: the ceiling for one-row decoding, which reads every weight once. THREADS threads
 * sum 256 MB of bytes (4 x 32-byte loads per 128 bytes, `omp for` static: one contiguous stretch each), 6 times;
 * with PREFETCH > 0 each line is also prefetched (prefetcht0) that many bytes ahead, as the kernels do.
 *
 *   gcc -O2 -mavx2 -fopenmp -o /tmp/stream_read scripts/stream_read.c && /tmp/stream_read 2 0 && /tmp/stream_read 2 4096
 *
 * Prints GB/s per pass: the ceiling a one-row (decode) kernel's GB/s is compared with. */
#define _POSIX_C_SOURCE 199309L
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const size_t n = (size_t)256 << 20;
    const int threads = argc > 1 ? atoi(argv[1]) : 2, ahead = argc > 2 ? atoi(argv[2]) : 0;
    uint8_t *b = aligned_alloc(64, n + 65536);
    memset(b, 1, n + 65536);
    for (int pass = 0; pass < 6; pass++) {
        const double t0 = now();
        __m256i total = _mm256_setzero_si256();
#pragma omp parallel num_threads(threads)
        {
            __m256i a = _mm256_setzero_si256(), c = a;
#pragma omp for schedule(static)
            for (size_t i = 0; i < n; i += 128) {
                if (ahead) {
                    _mm_prefetch((const char *)b + i + ahead, _MM_HINT_T0);
                    _mm_prefetch((const char *)b + i + ahead + 64, _MM_HINT_T0);
                }
                a = _mm256_add_epi8(a, _mm256_load_si256((const __m256i *)(b + i)));
                c = _mm256_add_epi8(c, _mm256_load_si256((const __m256i *)(b + i + 32)));
                a = _mm256_add_epi8(a, _mm256_load_si256((const __m256i *)(b + i + 64)));
                c = _mm256_add_epi8(c, _mm256_load_si256((const __m256i *)(b + i + 96)));
            }
#pragma omp critical
            total = _mm256_add_epi8(total, _mm256_add_epi8(a, c));
        }
        printf("%.1f GB/s (check %d)\n", n / (now() - t0) / 1e9, _mm256_extract_epi8(total, 0));
    }
    free(b);
    return 0;
}
