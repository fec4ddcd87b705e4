/* Attention of a few query rows over a KV cache (float32), for decode and verification steps.
 *
 * Each (sequence, query row, head) is computed on its own, keys in cache order: scores q.k * scale, their
 * maximum, exponentials, sum, and the weighted sum of values. Nothing in it depends on how many query rows
 * or how many keys beyond its own are computed in the same call, so a token's attention output is the same
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

/* one (b, t, h); sc: scratch of S + 16 floats, idx: of S ints */
INL void att_one(const att_t *a, int64_t b, int64_t t, int64_t h, float *sc, int32_t *idx) {
    const int64_t hd = a->hd, nv = hd / 16, g = h / (a->H / a->kvh);
    const float *q = a->q + ((b * a->H + h) * a->T + t) * hd;
    const float *K = a->k + b * a->sb + g * a->sh, *V = a->v + b * a->sb + g * a->sh;
    const uint8_t *m = a->mask ? a->mask + (b * a->T + t) * a->S : NULL;
    float *o = a->out + ((b * a->T + t) * a->H + h) * hd;
    int32_t n = 0;
    for (int64_t s = 0; s < a->S; s++)
        if (!m || m[s]) idx[n++] = (int32_t)s;
    if (n == 0) {
        memset(o, 0, sizeof(float) * (size_t)hd);
        return;
    }
    v16f qv[MAX_HD / 16];
    for (int64_t c = 0; c < nv; c++) qv[c] = ld16(q + 16 * c);
    int32_t j = 0;
    for (; j + 4 <= n; j += 4) { /* four keys at a time: four independent chains, each key computed as alone */
        const float *k0 = K + (int64_t)idx[j] * hd, *k1 = K + (int64_t)idx[j + 1] * hd;
        const float *k2 = K + (int64_t)idx[j + 2] * hd, *k3 = K + (int64_t)idx[j + 3] * hd;
        v16f a0 = qv[0] * ld16(k0), a1 = qv[0] * ld16(k1), a2 = qv[0] * ld16(k2), a3 = qv[0] * ld16(k3);
        for (int64_t c = 1; c < nv; c++) {
            a0 += qv[c] * ld16(k0 + 16 * c);
            a1 += qv[c] * ld16(k1 + 16 * c);
            a2 += qv[c] * ld16(k2 + 16 * c);
            a3 += qv[c] * ld16(k3 + 16 * c);
        }
        sc[j] = hsum16(a0) * a->scale;
        sc[j + 1] = hsum16(a1) * a->scale;
        sc[j + 2] = hsum16(a2) * a->scale;
        sc[j + 3] = hsum16(a3) * a->scale;
    }
    for (; j < n; j++) {
        const float *kr = K + (int64_t)idx[j] * hd;
        v16f acc = qv[0] * ld16(kr);
        for (int64_t c = 1; c < nv; c++) acc += qv[c] * ld16(kr + 16 * c);
        sc[j] = hsum16(acc) * a->scale;
    }
    float mx = -INFINITY;
    for (j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
    for (j = n; j < (n + 15) / 16 * 16; j++) sc[j] = -INFINITY; /* padding: e^-inf = 0 below */
    const v16f zero = {0};
    v16f tot = zero;
    for (j = 0; j < n; j += 16) {
        const v16f e = exp_neg16(ld16(sc + j) - mx);
        memcpy(sc + j, &e, 64);
        tot += e;
    }
    const float inv = 1.0f / hsum16(tot);
    for (int64_t c = 0; c < nv; c++) { /* 16 output dims at a time; keys j = 4i + r go to partial sum r */
        const float *vc = V + 16 * c;
        v16f p0 = zero, p1 = zero, p2 = zero, p3 = zero;
        for (j = 0; j + 4 <= n; j += 4) {
            p0 += sc[j] * ld16(vc + (int64_t)idx[j] * hd);
            p1 += sc[j + 1] * ld16(vc + (int64_t)idx[j + 1] * hd);
            p2 += sc[j + 2] * ld16(vc + (int64_t)idx[j + 2] * hd);
            p3 += sc[j + 3] * ld16(vc + (int64_t)idx[j + 3] * hd);
        }
        for (; j < n; j++) p0 += sc[j] * ld16(vc + (int64_t)idx[j] * hd);
        const v16f r = ((p0 + p1) + (p2 + p3)) * inv;
        memcpy(o + 16 * c, &r, 64);
    }
}

INL void att_range(const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) {
    for (int64_t task = t0; task < t1; task++) { /* task = (b * T + t) * H + h */
        const int64_t h = task % a->H, bt = task / a->H;
        att_one(a, bt / a->T, bt % a->T, h, sc, idx);
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
    const int64_t tasks = B * T * H;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(S + 16));
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)S);
        if (!sc || !idx) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !idx) continue;
#if defined(__x86_64__) || defined(__i386__)
            if (path == 3) { att_512(&a, task, task + 1, sc, idx); continue; }
            if (path == 2) { att_256(&a, task, task + 1, sc, idx); continue; }
#endif
            att_any(&a, task, task + 1, sc, idx);
        }
        free(sc);
        free(idx);
    }
    return err ? -3 : 0;
}
