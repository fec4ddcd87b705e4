/* The small operations of a decoder layer in one call each (float32, CPU): RMS norm, rotary embedding of q and k in
 * place, SiLU(gate) * up and gpt-oss's clamped SwiGLU. In torch each is 3 to 8 operator calls, and at one row (decode) their dispatch costs
 * more than their arithmetic.
 *
 * And the best and second-best logit of each row (greedy decoding, verification and the near-tie gaps), one pass
 * where torch's argmax and topk each read the row with far more overhead (a 151936-entry row: 0.4-0.5 ms each).
 *
 * Each row is computed on its own in a fixed order, so a row's result is the same bits however many rows share the
 * call (decode and verification agree). Single-threaded: the work per call is small. Written for specdec.
 */
#include <math.h>
#include <stdint.h>

#include "vec_exp.h"

#define INL static inline __attribute__((always_inline))

int gq_best_path(void); /* ggml_q.c: 2 and up = AVX2 + FMA */
#pragma GCC diagnostic ignored "-Wpsabi" /* v8f returned by always-inline functions only */

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)): the squares summed in 8 partial sums (element i into sum i % 8),
 * added as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); dim a multiple of 8. x and out may be the same. */
INL int rmsnorm(const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out) {
    if (dim < 8 || dim % 8) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float s[8] = {0};
        for (int64_t i = 0; i < dim; i += 8)
            for (int l = 0; l < 8; l++) s[l] += xr[i + l] * xr[i + l];
        const float tot = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
        const float inv = 1.0f / sqrtf(tot / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
    return 0;
}

/* Rotary embedding in place on `heads` heads of each row: x [rows][stride], the heads at x + r * stride + h * hd;
 * cos, sin [rows][hd]. With half = hd / 2: x'[i] = x[i] cos[i] - x[i + half] sin[i],
 * x'[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half] (the rotate-half form of Llama / Qwen). */
INL int rope(float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd) {
    if (hd < 2 || hd % 2) return -2;
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * hd, *s = sin + r * hd;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * stride + h * hd, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = a[i], x1 = b[i];
                a[i] = x0 * c[i] - x1 * s[i];
                b[i] = x1 * c[i + half] + x0 * s[i + half];
            }
        }
    }
    return 0;
}

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

VEC_EXP_NEG(exp_neg8, v8f, v8i, ) /* vec_exp.h */

/* out[r][i] = silu(gu[r][i]) * gu[r][inter + i]: gu [rows][2 * inter] (gate, then up), out [rows][inter], inter a
 * multiple of 8. silu(g) = g / (1 + e^-g), computed from e = e^-|g| as g / (1 + e) for g >= 0 and g e / (1 + e)
 * below. */
INL int silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
    if (inter % 8) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const v8f x = *(const v8f *)(const void *)(g + i), zero = {0};
            const v8i neg = x < zero;
            const v8f e = exp_neg8((v8f)(((v8i)x & neg) | ((v8i)-x & ~neg)));
            const v8f num = (v8f)(((v8i)(x * e) & neg) | ((v8i)x & ~neg));
            *(v8f *)(void *)(o + i) = num / (1.0f + e) * *(const v8f *)(const void *)(u + i);
        }
    }
    return 0;
}

/* gpt-oss's clamped SwiGLU: out[r][i] = (clamp(u, -limit, limit) + 1) * (g * sigmoid(alpha g)), g = min(gate, limit),
 * gu and out as silu_mul's; sigmoid(a) from e = e^-|a|: 1 / (1 + e) for a >= 0, e / (1 + e) below. */
INL int swiglu_limit(const float *gu, int64_t rows, int64_t inter, float limit, float alpha, float *out) {
    if (inter % 8) return -2;
    const v8f hi = {limit, limit, limit, limit, limit, limit, limit, limit}, lo = -hi, zero = {0}, one = zero + 1.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = gu + r * 2 * inter, *ur = gr + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const v8f x = *(const v8f *)(const void *)(gr + i), y = *(const v8f *)(const void *)(ur + i);
            const v8i over = x > hi, above = y > hi, below = y < lo;
            const v8f g = (v8f)(((v8i)hi & over) | ((v8i)x & ~over));
            const v8f u = (v8f)(((v8i)hi & above) | ((v8i)lo & below) | ((v8i)y & ~(above | below)));
            const v8f a = g * alpha;
            const v8i neg = a < zero;
            const v8f e = exp_neg8((v8f)(((v8i)a & neg) | ((v8i)-a & ~neg)));
            const v8f sig = (v8f)(((v8i)e & neg) | ((v8i)one & ~neg)) / (1.0f + e);
            *(v8f *)(void *)(o + i) = (u + 1.0f) * (g * sig);
        }
    }
    return 0;
}

/* Per row of x [rows][stride] (cols used): best[r] = the index of the largest value (the first if several), gap[r] =
 * that value minus the largest of the others (0 where the best value occurs twice), as torch's argmax and topk(2).
 * Eight lanes each keep their best, its index and their second; the lanes are merged at the end. NaN is never
 * chosen. */
INL int top2(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *best, float *gap) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        v8f m1, m2;
        v8i i1;
        for (int l = 0; l < 8; l++) m1[l] = m2[l] = -INFINITY, i1[l] = l;
        const int64_t body = cols - cols % 8;
        for (int64_t i = 0; i < body; i += 8) {
            const v8f v = *(const v8f *)(const void *)(xr + i);
            const v8i gt = v > m1, gt2 = v > m2;
            const int32_t j = (int32_t)i;
            const v8i idx = {j, j + 1, j + 2, j + 3, j + 4, j + 5, j + 6, j + 7};
            m2 = (v8f)(((v8i)m1 & gt) | (((v8i)v & gt2 & ~gt) | ((v8i)m2 & ~gt2 & ~gt)));
            i1 = (idx & gt) | (i1 & ~gt);
            m1 = (v8f)(((v8i)v & gt) | ((v8i)m1 & ~gt));
        }
        float b = -INFINITY, s = -INFINITY;
        int64_t bi = -1;
        for (int l = 0; l < 8; l++) { /* the lanes' bests in index order, then the tail */
            if (i1[l] >= cols) continue;
            const float v = m1[l];
            if (v > b || (v == b && i1[l] < bi)) s = b > s ? b : s, b = v, bi = i1[l];
            else if (v > s) s = v;
            if (m2[l] > s) s = m2[l];
        }
        for (int64_t i = body; i < cols; i++) {
            const float v = xr[i];
            if (v > b) s = b > s ? b : s, b = v, bi = i;
            else if (v > s) s = v;
        }
        best[r] = bi < 0 ? 0 : bi;
        gap[r] = b - s;
    }
    return 0;
}

/* Each operation twice: for CPUs with AVX2 + FMA and for any other; the exported gq_NAME picks one */
#if defined(__x86_64__) || defined(__i386__)
#define T256 __attribute__((target("avx2,fma")))
#define FAST (gq_best_path() >= 2)
#else
#define T256
#define FAST 0
#endif
#define DISPATCH(name, params, args)                                                                              \
    static int name##_any params { return name args; }                                                           \
    T256 static int name##_256 params { return name args; }                                                      \
    int gq_##name params { return FAST ? name##_256 args : name##_any args; }

DISPATCH(rmsnorm, (const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out),
         (x, w, eps, rows, dim, out))
DISPATCH(rope, (float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd),
         (x, stride, cos, sin, rows, heads, hd))
DISPATCH(silu_mul, (const float *gu, int64_t rows, int64_t inter, float *out), (gu, rows, inter, out))
DISPATCH(swiglu_limit, (const float *gu, int64_t rows, int64_t inter, float limit, float alpha, float *out),
         (gu, rows, inter, limit, alpha, out))
DISPATCH(top2, (const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *best, float *gap),
         (x, rows, cols, stride, best, gap))
