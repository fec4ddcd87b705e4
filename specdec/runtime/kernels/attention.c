/* Attention of a few query rows over a KV cache (float32), for decode and verification steps.
 *
 * Each (sequence, query row, head) is computed on its own, keys in cache order: scores q.k * scale, their
 * maximum, exponentials, sum, and the weighted sum of values (the heads that share a KV head are computed side by
 * side, each key's K and V rows loaded once for them). Nothing in it depends on how many query rows or how many
 * keys beyond its own are computed in the same call, so a token's attention output is the same
 * bits whether it is decoded alone or verified among drafted tokens. (torch's fused attention blocks keys and
 * queries by the call's shape, and with int8-quantized activations downstream those last-bit differences
 * grew to logit differences of 0.2 between plain and speculative decoding.)
 *
 * Arithmetic is on 16-float vectors (GCC vector extensions): dot products keep 16 partial sums over the head
 * dimension (a multiple of 16) and add them in a fixed tree, the exponential is a polynomial (Cephes expf
 * coefficients, relative error ~1e-7). The same C is compiled for AVX-512, AVX2 and plain x86-64 / other CPUs,
 * and gq_best_path picks one per process.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gq_best_path(void); /* ggml_q.c */

#define INL static inline __attribute__((always_inline))
#define MAX_HD 512 /* head dimensions up to this */

typedef struct {
    const float *q;       /* [B][H][T][hd] */
    const float *k, *v;   /* [B] x [kvh] x [S][hd]: element (b, g, s, i) at b * sb + g * sh + s * hd + i */
    int64_t sb, sh;
    const uint8_t *mask;  /* [B][T][S], 1 = attend; NULL = every key */
    int64_t B, H, kvh, T, S, hd;
    float scale;
    float *out;           /* [B][T][H][hd] */
} att_t;

/* 16 floats as one value: GCC lowers its arithmetic to whatever vector width the target has, in the same
 * order, so every path computes the same way; head dims that are a multiple of 16 (64, 128, 256) take it */
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

INL v16f exp_neg16(v16f x) { /* e^x for x <= 0, lane by lane */
    const v16f zero = {0}, lo = zero - 87.0f;
    const v16i below = x < lo; /* all-ones lanes where x < -87 */
    x = (v16f)(((v16i)lo & below) | ((v16i)x & ~below));
    const v16f magic = zero + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to the nearest integer */
    const v16f n = (x * 1.44269504088896341f + magic) - magic;
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    const v16f z = x * x;
    v16f p = zero + 1.9875691500E-4f;
    p = p * x + 1.3981999507E-3f;
    p = p * x + 8.3334519073E-3f;
    p = p * x + 4.1665795894E-2f;
    p = p * x + 1.6666665459E-1f;
    p = p * x + 5.0000001201E-1f;
    p = p * z + x + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16f)bits;
}

INL float hsum16(v16f v) { /* a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1 */
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

INL v16f ld16(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

/* Heads h0..h0+NB-1 (NB a constant: their accumulators stay in registers) of one (b, t) over the visible keys
 * idx[0..n): each key's K and V rows are loaded once for the NB heads. Per head the arithmetic is fixed: the dot
 * product's chain over the head dimension in order, softmax over the keys in order, the weighted sum of values in
 * four partial sums (key j into sum j % 4) added as (0 + 1) + (2 + 3). sc: NB x sp floats. */
INL void att_block(const att_t *a, int64_t b, int64_t t, int64_t h0, const int NB, const float *K, const float *V,
                   const int32_t *idx, int32_t n, float *sc, int64_t sp) {
    const int64_t hd = a->hd, nv = hd / 16;
    const float *q[4];
    float *o[4];
    for (int h = 0; h < NB; h++) {
        q[h] = a->q + ((b * a->H + h0 + h) * a->T + t) * hd;
        o[h] = a->out + ((b * a->T + t) * a->H + h0 + h) * hd;
    }
    for (int32_t j = 0; j < n; j++) {
        const float *kr = K + (int64_t)idx[j] * hd;
        v16f acc[4];
        const v16f k0 = ld16(kr);
        for (int h = 0; h < NB; h++) acc[h] = ld16(q[h]) * k0;
        for (int64_t c = 1; c < nv; c++) {
            const v16f kc = ld16(kr + 16 * c);
            for (int h = 0; h < NB; h++) acc[h] += ld16(q[h] + 16 * c) * kc;
        }
        for (int h = 0; h < NB; h++) sc[h * sp + j] = hsum16(acc[h]) * a->scale;
    }
    const v16f zero = {0};
    float inv[4];
    for (int h = 0; h < NB; h++) {
        float *s = sc + h * sp, mx = -INFINITY;
        for (int32_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        for (int32_t j = n; j < (n + 15) / 16 * 16; j++) s[j] = -INFINITY; /* padding: e^-inf = 0 below */
        v16f tot = zero;
        for (int32_t j = 0; j < n; j += 16) {
            const v16f e = exp_neg16(ld16(s + j) - mx);
            memcpy(s + j, &e, 64);
            tot += e;
        }
        inv[h] = 1.0f / hsum16(tot);
    }
    for (int64_t c = 0; c < nv; c++) { /* 16 output dims at a time */
        const float *vc = V + 16 * c;
        v16f p[4][4];
        for (int h = 0; h < NB; h++) p[h][0] = p[h][1] = p[h][2] = p[h][3] = zero;
        int32_t j = 0;
        for (; j + 4 <= n; j += 4)
            for (int r = 0; r < 4; r++) {
                const v16f v = ld16(vc + (int64_t)idx[j + r] * hd);
                for (int h = 0; h < NB; h++) p[h][r] += sc[h * sp + j + r] * v;
            }
        for (; j < n; j++) {
            const v16f v = ld16(vc + (int64_t)idx[j] * hd);
            for (int h = 0; h < NB; h++) p[h][0] += sc[h * sp + j] * v;
        }
        for (int h = 0; h < NB; h++) {
            const v16f r = ((p[h][0] + p[h][1]) + (p[h][2] + p[h][3])) * inv[h];
            memcpy(o[h] + 16 * c, &r, 64);
        }
    }
}

/* the query heads of kv head g for one (b, t); sc: scratch of 4 x sp floats, idx: of S ints */
INL void att_group(const att_t *a, int64_t b, int64_t t, int64_t g, float *sc, int32_t *idx) {
    const int64_t G = a->H / a->kvh, sp = (a->S + 15) / 16 * 16;
    const float *K = a->k + b * a->sb + g * a->sh, *V = a->v + b * a->sb + g * a->sh;
    const uint8_t *m = a->mask ? a->mask + (b * a->T + t) * a->S : NULL;
    int32_t n = 0;
    for (int64_t s = 0; s < a->S; s++)
        if (!m || m[s]) idx[n++] = (int32_t)s;
    if (n == 0) {
        for (int64_t h = g * G; h < (g + 1) * G; h++)
            memset(a->out + ((b * a->T + t) * a->H + h) * a->hd, 0, sizeof(float) * (size_t)a->hd);
        return;
    }
    int64_t h = g * G;
    for (; h + 4 <= (g + 1) * G; h += 4) att_block(a, b, t, h, 4, K, V, idx, n, sc, sp);
    if (h + 2 <= (g + 1) * G) {
        att_block(a, b, t, h, 2, K, V, idx, n, sc, sp);
        h += 2;
    }
    if (h < (g + 1) * G) att_block(a, b, t, h, 1, K, V, idx, n, sc, sp);
}

INL void att_range(const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) {
    for (int64_t task = t0; task < t1; task++) { /* task = (b * T + t) * kvh + g */
        const int64_t g = task % a->kvh, bt = task / a->kvh;
        att_group(a, bt / a->T, bt % a->T, g, sc, idx);
    }
}

static void att_any(const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) { att_range(a, t0, t1, sc, idx); }
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) static void att_256(const att_t *a, int64_t t0, int64_t t1, float *sc,
                                                         int32_t *idx) {
    att_range(a, t0, t1, sc, idx);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) static void att_512(
    const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) {
    att_range(a, t0, t1, sc, idx);
}
#endif

/* out[B][T][H][hd] = softmax(q k^T * scale, masked) v. q [B][H][T][hd]; k, v as in att_t (the last two dims
 * [S][hd] contiguous); mask [B][T][S] bytes or NULL. path as gq_matmul_parts (0 auto). Returns 0, or negative. */
int gq_attention(const float *q, const float *k, const float *v, int64_t sb, int64_t sh, const uint8_t *mask,
                 int64_t B, int64_t H, int64_t kvh, int64_t T, int64_t S, int64_t hd, float scale, float *out,
                 int nthreads, int path) {
    if (B < 1 || T < 1 || S < 1 || hd < 16 || hd % 16 || hd > MAX_HD || kvh < 1 || H % kvh != 0) return -2;
    const int best = gq_best_path();
    if (path == 0 || path > best) path = best;
    if (nthreads < 1) nthreads = 1;
    const att_t a = {q, k, v, sb, sh, mask, B, H, kvh, T, S, hd, scale, out};
    const int64_t tasks = B * T * kvh;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(4 * (S + 16)));
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)S);
        if (!sc || !idx) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !idx) continue;
#if defined(__x86_64__) || defined(__i386__)
            if (path >= 3) { att_512(&a, task, task + 1, sc, idx); continue; }
            if (path == 2) { att_256(&a, task, task + 1, sc, idx); continue; }
#endif
            att_any(&a, task, task + 1, sc, idx);
        }
        free(sc);
        free(idx);
    }
    return err ? -3 : 0;
}
