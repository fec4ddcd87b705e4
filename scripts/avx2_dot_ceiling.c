/* The AVX2 x16 kernel's inner loop with nothing else: how fast this CPU runs its instruction mix.
 *
 * The many-row path of kernels/x16_avx2.h spends most of its time in one pattern per "line-row" (16 outputs x 4
 * inputs of one activation row, 64 multiply-adds): broadcast the row's 4 activation bytes, two vpmaddubsw against
 * the line's two weight registers, two vpaddw into 16-bit sums; 4 rows share each weight register. This program runs
 * that pattern on data in L1 with the 8 sums in registers (no memory traffic, no unpacking, no widening, no offsets)
 * and prints nanoseconds per line-row. Compare it with a kernel timing (python scripts/bench_kernels.py) divided by
 * the kernel's line-rows per thread, out/16 x in/4 x rows / threads: the difference is what the kernel spends
 * around this loop.
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

/* one line of 4 rows: s0..s7 (named, so that they stay in registers) += the line's dots */
#define ROW(r, lo, hi)                                                                                       \
    do {                                                                                                     \
        const __m256i a = _mm256_set1_epi32(*(const int32_t *)(act + 1024 * (r) + 4 * l));                   \
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(wl, a));                                              \
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(wh, a));                                              \
    } while (0)

__attribute__((target("avx2"), noinline)) static void run(const int8_t *act, const uint8_t *w, long reps, __m256i *out) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (long it = 0; it < reps; it++) {
        for (int l = 0; l < LINES; l++) {
            const __m256i wl = _mm256_load_si256((const __m256i *)(w + 64 * l));
            const __m256i wh = _mm256_load_si256((const __m256i *)(w + 64 * l + 32));
            ROW(0, s0, s1);
            ROW(1, s2, s3);
            ROW(2, s4, s5);
            ROW(3, s6, s7);
        }
        __asm__ volatile("" : : "r"(w) : "memory"); /* one pass per rep: the compiler may not fold the reps */
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3, out[4] = s4, out[5] = s5, out[6] = s6, out[7] = s7;
}

int main(void) {
    int8_t *act = aligned_alloc(64, 4096);
    uint8_t *w = aligned_alloc(64, 64 * LINES);
    for (int i = 0; i < 4096; i++) act[i] = (int8_t)(i % 7);
    for (int i = 0; i < 64 * LINES; i++) w[i] = (uint8_t)(i % 13);
    const long reps = 4000000;
    __m256i out[8];
    run(act, w, 1000, out);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run(act, w, reps, out);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    int16_t first[16];
    memcpy(first, &out[0], sizeof first);
    printf("%.3f ns per line-row (checksum %d)\n", s / ((double)reps * LINES * 4) * 1e9, first[0]);
    return 0;
}
