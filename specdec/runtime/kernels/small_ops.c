/* The small operations of a decoder layer in one call each (float32, CPU): RMS norm, rotary embedding of q and k in
 * place, and SiLU(gate) * up. In torch each is 3 to 8 operator calls, and at one row (decode) their dispatch costs
 * more than their arithmetic.
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
