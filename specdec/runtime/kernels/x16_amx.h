/* The x16 kernels with AMX (Intel AMX-INT8 tile instructions) for the integer dots, included by ggml_q.c after
 * the AVX-512 VNNI copy. A tile dot product (tdpbsud: signed activations x unsigned quants, 4 bytes per dword, no
 * saturation) gives the same int32 sums as vpdpbusd, and the float steps after them are x16_kernels.h's, in the
 * same order: every row gets the bits of the VNNI kernel, at any row count, so which of the two serves a call does
 * not change a result (tests/test_gguf_kernels.py). What changes is speed at many rows: one tile instruction does
 * 16 rows x 16 outputs x 32 inputs: the kernels' time below; an 800-token prefill of the 1.5B target's Q4_K_M file,
 * both paths alternated in one process (5 pairs), took avx512/amx 1.02x by medians, 1.17x pairwise.
 *
 * Tiles (amx_config): sums, activations and a group's quants (8 lines of 16 outputs x 4 inputs: the x16 layout's
 * lines as they are), for 16 rows of a call and its last rows. Linux asks each process to request the tile state
 * (arch_prctl), and some VMs list AMX yet kill its instructions (SIGILL), so amx_usable tries them once in a child
 * process before the kernels use them. Written for specdec. */
#include <cpuid.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define T512A __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))
/* Calls of fewer rows, and Q6_K (16-input groups: as many float steps per group as Q4_K's 32-input ones, and half
 * the dot), keep the VNNI kernel, with the same bits. Time with AMX over VNNI (python scripts/bench_kernels.py
 * --paths amx,avx512, 1536x8960 and 8960x1536, 2 threads, Intel Xeon with AMX): Q6_K 1.1-1.5x; Q4_K 1.04-1.12x at 16
 * rows; with the activations in tiles (act_t.t), Q4_K 0.81-0.89x at 64 rows, 0.76-0.86x at 128 and 512, Q8_0 and
 * Q5_0 0.67-0.77x at 128, 0.52-0.71x at 512. The tile sequence is most of it (scripts/ab_kernels.py with the tile
 * dots or the float steps left out: 2/3 and 2/5 of the time), the tile stores a quarter. */
#define AMX_ROWS 32

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* The tiles for groups of 32 inputs and calls of nr rows: sums, activations and quants in 0-2 and 5-7, the last
 * nr % 16 rows' sums and activations in 3 and 4. */
T512A static void amx_config(int nr) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int tail = nr % 16;
    c.rows[0] = 16, c.colsb[0] = 64;
    c.rows[1] = 16, c.colsb[1] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    c.rows[5] = 16, c.colsb[5] = 64;
    c.rows[6] = 16, c.colsb[6] = 32;
    c.rows[7] = 8, c.colsb[7] = 64;
    if (tail) {
        c.rows[3] = (uint8_t)tail, c.colsb[3] = 64;
        c.rows[4] = (uint8_t)tail, c.colsb[4] = 32;
    }
    _tile_loadconfig(&c);
}

/* sums in tile C = rows of src (tile T, `stride` bytes apart) . the quants in tile B, stored at dst (tile numbers are
 * constants of the instructions) */
#define AMX_DOT(C, T, B, src, dst)                                                                                     \
    do {                                                                                                               \
        _tile_zero(C);                                                                                                 \
        _tile_loadd(T, src, stride);                                                                                   \
        _tile_dpbsud(C, T, B);                                                                                         \
        _tile_stored(C, dst, 64);                                                                                      \
    } while (0)
/* isum[x][r] (16 outputs) = the integer dots of two groups' quants (lines, group x at lines + 8 x: 8 lines, line i's
 * dword t = inputs 4i .. 4i + 3 of output t) with rows [0, nr) of a[x] (32 bytes each, rows `stride` bytes apart,
 * tiles of 16 rows `in` x 16 bytes apart: amx_rows). The groups take two sets of tiles (0-2, 5-7), so one group's
 * dots overlap the other's loads. */
T512A INL void amx_dots(const __m512i *lines, const int8_t *const *a, int64_t in, int64_t stride, int nr,
                        int32_t (*isum)[RT][16]) {
    _tile_loadd(2, lines, 64);
    _tile_loadd(7, lines + 8, 64);
    int r = 0;
    for (; r + 16 <= nr; r += 16) {
        AMX_DOT(0, 1, 2, a[0] + r * in, isum[0][r]);
        AMX_DOT(5, 6, 7, a[1] + r * in, isum[1][r]);
    }
    if (r < nr) { /* the last rows: tiles 3 and 4 */
        AMX_DOT(3, 4, 2, a[0] + r * in, isum[0][r]);
        AMX_DOT(3, 4, 7, a[1] + r * in, isum[1][r]);
    }
}
#undef AMX_DOT

/* Where amx_dots finds input group g (32 inputs) of row r0 (a multiple of 16): in A's tiles, else in its rows */
T512A INL const int8_t *amx_rows(const act_t *A, int64_t r0, int64_t g) {
    return A->t ? A->t + r0 * A->in + 512 * g : A->q + r0 * A->in + 32 * g;
}

/* y[r] (16 outputs, rows ystride apart) = acc[r], or += where accum */
T512A INL void amx_store(const __m512 *acc, int nr, float *y, int64_t ystride, int accum) {
    for (int r = 0; r < nr; r++)
        _mm512_storeu_ps(y + r * ystride, accum ? _mm512_add_ps(acc[r], _mm512_loadu_ps(y + r * ystride)) : acc[r]);
}

/* Q4_K x16 as kx16_vnni_body, the same steps and bits, the dots on tiles a step ahead: step k + 1's tile dots are
 * issued before step k's float steps, which then run beside them */
T512A static void kx16_amx_kquant(int type, const uint8_t *W, const act_t *A, int64_t r0, int nr, float *y,
                                  int64_t ystride, int64_t b0, int64_t b1, int accum) {
    const int64_t in = A->in, ng = in / A->G, ns = in / A->S;
    (void)type; /* kx16_amx_b32's signature */
    int32_t isum[2][2][RT][16] __attribute__((aligned(64))); /* [step parity][group of the step][row][output] */
    __m512 acc[RT], bacc[RT];
    int g[2][2];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *P = W + b * X4_BYTES;
        __m512 dv, mv;
        kx16_vnni_kq_dm(0, P, &dv, &mv);
        for (int r = 0; r < nr; r++) bacc[r] = _mm512_setzero_ps();
        for (int step = -1; step < 4; step++) {
            if (step + 1 < 4) { /* the next step's dots */
                const int n = (step + 1) & 1;
                __m512i w[2][8], lines[16];
                kx16_vnni_kq_step(0, P, step + 1, g[n], w);
                for (int i = 0; i < 8; i++) lines[i] = w[0][i], lines[8 + i] = w[1][i];
                const int8_t *a[2] = {amx_rows(A, r0, 8 * b + g[n][0]), amx_rows(A, r0, 8 * b + g[n][1])};
                amx_dots(lines, a, in, A->t ? 32 : in, nr, isum[n]);
            }
            if (step < 0) continue;
            const int c = step & 1;
            __m512 s[2], o[2];
            for (int x = 0; x < 2; x++) kx16_vnni_kq_consts(0, P, g[c][x], dv, mv, &s[x], &o[x]);
            for (int r = 0; r < nr; r++) {
                const float *sr = A->s + (r0 + r) * ns + b * 8;
                for (int x = 0; x < 2; x++) {
                    bacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[c][x][r])), s[x], bacc[r]);
                    acc[r] = _mm512_fmadd_ps(o[x], _mm512_set1_ps(sr[g[c][x]]), acc[r]);
                }
            }
        }
        for (int r = 0; r < nr; r++) acc[r] = _mm512_fmadd_ps(bacc[r], _mm512_set1_ps(A->d[(r0 + r) * ng + b]), acc[r]);
    }
    amx_store(acc, nr, y, ystride, accum);
}

/* Q8_0 / Q5_0 / Q4_1 / MXFP4 x16 as kx16_vnni_body32, the same bits, two superblocks (2 x 32 inputs) a step, the
 * dots on tiles a step ahead as in kx16_amx_kquant */
T512A static void kx16_amx_b32(int type, const uint8_t *W, const act_t *A, int64_t r0, int nr, float *y,
                               int64_t ystride, int64_t b0, int64_t b1, int accum) {
    const int64_t sb = x16_bytes(type & ~GQ_X16), in = A->in, ng = in / A->G;
    int32_t isum[2][2][RT][16] __attribute__((aligned(64))); /* [step parity][block of the step][row][output] */
    __m512 acc[RT], dv[2][2], ov[2][2];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = b0 - 2; b < b1; b += 2) { /* step: blocks b, b + 1 (the dots of b + 2, b + 3 first) */
        if (b + 2 < b1) {
            const int n = ((b + 2 - b0) / 2) & 1;
            __m512i lines[16];
            __mmask64 neg[8];
            const int64_t b2 = b + 3 < b1 ? b + 3 : b + 2; /* an odd count: the last block twice, its copy unused */
            kx16_vnni_b32_block(type, W + (b + 2) * sb, lines, neg, &dv[n][0], &ov[n][0]);
            kx16_vnni_b32_block(type, W + b2 * sb, lines + 8, neg, &dv[n][1], &ov[n][1]);
            const int8_t *a[2] = {amx_rows(A, r0, b + 2), amx_rows(A, r0, b2)};
            amx_dots(lines, a, in, A->t ? 32 : in, nr, isum[n]);
        }
        if (b < b0) continue;
        const int c = ((b - b0) / 2) & 1, nb = b + 1 < b1 ? 2 : 1;
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < nb; x++) {
                const float ad = A->d[(r0 + r) * ng + b + x], as = A->s[(r0 + r) * ng + b + x]; /* S = G = 32 */
                const __m512 isf = _mm512_cvtepi32_ps(_mm512_load_si512(isum[c][x][r]));
                acc[r] = _mm512_fmadd_ps(isf, _mm512_mul_ps(dv[c][x], _mm512_set1_ps(ad)), acc[r]);
                acc[r] = _mm512_fmadd_ps(ov[c][x], _mm512_set1_ps(as), acc[r]);
            }
    }
    amx_store(acc, nr, y, ystride, accum);
}

/* kx16_vnni_matmul's arguments and bits, the dots on tiles (Q4_K, Q8_0, Q5_0, Q4_1, MXFP4) */
T512A static void kx16_amx_run(int type, const uint8_t *W, const act_t *A, int64_t r0, int nr, float *y,
                               int64_t ystride, int64_t b0, int64_t b1, int accum) {
    amx_config(nr);
    (type == GQ_X16 + GQ_Q4_K ? kx16_amx_kquant : kx16_amx_b32)(type, W, A, r0, nr, y, ystride, b0, b1, accum);
    _tile_release();
}

/* One tile dot on known bytes: 1 where it gives the right sums. */
T512A static int amx_selftest(void) {
    int8_t a[16][32];
    uint8_t w[8][64];
    int32_t c[16][16];
    for (int i = 0; i < 16 * 32; i++) a[i / 32][i % 32] = (int8_t)(i % 13 - 6);
    for (int i = 0; i < 8 * 64; i++) w[i / 64][i % 64] = (uint8_t)(i * 7 % 251);
    amx_config(16);
    _tile_zero(0);
    _tile_loadd(1, a, 32);
    _tile_loadd(2, w, 64);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int r = 0; r < 16; r++)
        for (int t = 0; t < 16; t++) {
            int32_t s = 0;
            for (int k = 0; k < 32; k++) s += a[r][k] * w[k / 4][4 * t + k % 4];
            if (s != c[r][t]) return 0;
        }
    return 1;
}

/* Whether this process may run the tile instructions: the CPU has AMX-TILE and AMX-INT8 (CPUID 7: EDX bits 24, 25),
 * the OS saves their state (XCR0 bits 17, 18) and grants it to this process (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, 18), and a child process ran one tile dot right. Asked once per process. */
static int amx_probe(void) {
    unsigned a, b, c, d, lo, hi;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 0; /* OSXSAVE: xgetbv may run */
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo >> 17 & 3) != 3) return 0;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
    const pid_t pid = fork();
    if (pid == 0) _exit(amx_selftest() ? 0 : 1);
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) usable = amx_probe();
    return usable;
}
