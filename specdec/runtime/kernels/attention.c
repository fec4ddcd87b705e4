/* Attention of a few query rows over a KV cache (float32), for decode and verification steps.
 *
 * Each (sequence, query row, head) is computed on its own, keys in cache order: scores q.k * scale, their
 * maximum, exponentials, sum, and the weighted sum of values. Nothing in it depends on how many query rows
 * or how many keys beyond its own are computed in the same call, so a token's attention output is the same
 * bits whether it is decoded alone or verified among drafted tokens. (torch's fused attention blocks keys and
 * queries by the call's shape, and with int8-quantized activations downstream those last-bit differences
 * grew to logit differences of 0.2 between plain and speculative decoding.)
 *
 * Dot products keep 16 partial sums over the head dimension and add them in a fixed tree; the exponential is
 * a polynomial (Cephes expf coefficients, relative error ~1e-7) so that loops over keys vectorize. The same
 * C is compiled for AVX-512, AVX2 and plain x86-64 / other CPUs, and gq_best_path picks one per process.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gq_best_path(void); /* ggml_q.c */

#define INL static inline __attribute__((always_inline))

typedef struct {
    const float *q;       /* [B][H][T][hd] */
    const float *k, *v;   /* [B] x [kvh] x [S][hd]: element (b, g, s, i) at b * sb + g * sh + s * hd + i */
    int64_t sb, sh;
    const uint8_t *mask;  /* [B][T][S], 1 = attend; NULL = every key */
    int64_t B, H, kvh, T, S, hd;
    float scale;
    float *out;           /* [B][T][H][hd] */
} att_t;

INL float exp_neg(float x) { /* e^x for x <= 0 */
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    const float z = x * x;
    float p = 1.9875691500E-4f;
    p = p * x + 1.3981999507E-3f;
    p = p * x + 8.3334519073E-3f;
    p = p * x + 4.1665795894E-2f;
    p = p * x + 1.6666665459E-1f;
    p = p * x + 5.0000001201E-1f;
    p = p * z + x + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

INL float dot16(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) acc[i % 16] += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* one (b, t, h); sc: scratch of S floats, idx: of S ints */
INL void att_one(const att_t *a, int64_t b, int64_t t, int64_t h, float *sc, int32_t *idx) {
    const int64_t hd = a->hd, g = h / (a->H / a->kvh);
    const float *q = a->q + ((b * a->H + h) * a->T + t) * hd;
    const float *K = a->k + b * a->sb + g * a->sh, *V = a->v + b * a->sb + g * a->sh;
    const uint8_t *m = a->mask ? a->mask + (b * a->T + t) * a->S : NULL;
    float *o = a->out + ((b * a->T + t) * a->H + h) * hd;
    int32_t n = 0;
    for (int64_t s = 0; s < a->S; s++)
        if (!m || m[s]) idx[n++] = (int32_t)s;
    for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
    if (n == 0) return;
    float mx = -INFINITY;
    for (int32_t j = 0; j < n; j++) {
        sc[j] = dot16(q, K + (int64_t)idx[j] * hd, hd) * a->scale;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    for (int32_t j = 0; j < n; j++) sc[j] = exp_neg(sc[j] - mx);
    float part[16] = {0};
    for (int32_t j = 0; j < n; j++) part[j % 16] += sc[j];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    for (int32_t j = 0; j < n; j++) {
        const float p = sc[j], *vr = V + (int64_t)idx[j] * hd;
        for (int64_t i = 0; i < hd; i++) o[i] += p * vr[i];
    }
    const float inv = 1.0f / part[0];
    for (int64_t i = 0; i < hd; i++) o[i] *= inv;
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
    if (B < 1 || T < 1 || S < 1 || hd < 1 || kvh < 1 || H % kvh != 0) return -2;
    const int best = gq_best_path();
    if (path == 0 || path > best) path = best;
    if (nthreads < 1) nthreads = 1;
    const att_t a = {q, k, v, sb, sh, mask, B, H, kvh, T, S, hd, scale, out};
    const int64_t tasks = B * T * H;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)S);
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
