/* The AVX2 x16 kernel's inner loop with nothing else: how fast this CPU runs its instruction mix.
 *
 * The many-row path of kernels/x16_avx2.h spends its time in one pattern per "line-row" (16 outputs x 4 inputs of
 * one activation row, 64 multiply-adds): broadcast the row's 4 activation bytes, two vpmaddubsw against the line's
 * two weight registers, two vpaddw into 16-bit sums; 4 rows share each weight register. This program runs that
 * pattern on data in L1 (no memory traffic, no unpacking, no widening) and prints nanoseconds per line-row: what this
 * mix costs on this CPU. Compare it with a kernel timing (python scripts/bench_kernels.py) divided by its line-rows
 * per thread, out/16 x in/4 x rows / threads; the kernel, which interleaves more independent work, has measured a
 * little faster (docs/benchmarks.md section 27), so read it as the mix's speed, not a strict floor.
 *
 *     gcc -O2 -o /tmp/avx2_dot_ceiling scripts/avx2_dot_ceiling.c && /tmp/avx2_dot_ceiling
 *     (/tmp/avx2_dot_ceiling & /tmp/avx2_dot_ceiling & wait)   # both cores at once
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LINES 64
#define ROWS 4

__attribute__((target("avx2"), noinline)) static void run(const int8_t *act, const uint8_t *w, long reps, __m256i *out) {
    __m256i s[2 * ROWS];
    for (int i = 0; i < 2 * ROWS; i++) s[i] = _mm256_setzero_si256();
    for (long it = 0; it < reps; it++)
        for (int l = 0; l < LINES; l++) {
            const __m256i wl = _mm256_load_si256((const __m256i *)(w + 64 * l));
            const __m256i wh = _mm256_load_si256((const __m256i *)(w + 64 * l + 32));
            for (int r = 0; r < ROWS; r++) {
                const __m256i a = _mm256_set1_epi32(*(const int32_t *)(act + 1024 * r + 4 * l));
                s[2 * r] = _mm256_add_epi16(s[2 * r], _mm256_maddubs_epi16(wl, a));
                s[2 * r + 1] = _mm256_add_epi16(s[2 * r + 1], _mm256_maddubs_epi16(wh, a));
            }
        }
    for (int i = 0; i < 2 * ROWS; i++) out[i] = s[i];
}

int main(void) {
    int8_t *act = aligned_alloc(64, 1024 * ROWS);
    uint8_t *w = aligned_alloc(64, 64 * LINES);
    for (int i = 0; i < 1024 * ROWS; i++) act[i] = (int8_t)(i % 7);
    for (int i = 0; i < 64 * LINES; i++) w[i] = (uint8_t)(i % 13);
    const long reps = 2000000;
    __m256i out[2 * ROWS];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run(act, w, reps, out);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    int16_t first[16];
    memcpy(first, &out[0], sizeof first);
    printf("%.3f ns per line-row (checksum %d)\n", s / ((double)reps * LINES * ROWS) * 1e9, first[0]);
    return 0;
}
