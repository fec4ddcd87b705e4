/* The small operations of a decoder layer in one call each (float32, CPU): RMS norm, rotary embedding of q and k in
 * place, SiLU(gate) * up, tanh-GELU(gate) * up (Gemma), gpt-oss's clamped SwiGLU and Qwen3.5's gated delta rule. In
 * torch each is 3 to 8 operator calls, and at one row (decode) their dispatch costs more than their arithmetic.
 *
 * And the best and second-best logit of each row (greedy decoding, verification and the near-tie gaps), one pass
 * where torch's argmax and topk each read the row with far more overhead (a 151936-entry row: 0.4-0.5 ms each); a
 * mixture of experts' router (its logits, softmax and top k: in torch's operators 63 us a layer at one row on
 * gpt-oss-20b's shape, 93 us on Qwen3-30B-A3B's; Zen 5, timed around `MoE.route` in decode forwards, context 200).
 *
 * Each row is computed on its own in a fixed order, so a row's result is the same bits however many rows share the
 * call (decode and verification agree). Single-threaded but for many rows: the work per call is small. Written for
 * specdec.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* Rotary embedding in place on the first rd channels of `heads` heads of each row (rd < hd: partial rotary, the
 * rest passed through): x [rows][stride], the heads at x + r * stride + h * hd; cos, sin [rows][rd]. With
 * half = rd / 2: x'[i] = x[i] cos[i] - x[i + half] sin[i], x'[i + half] = x[i + half] cos[i + half] + x[i]
 * sin[i + half] (the rotate-half form of Llama / Qwen). */
INL int rope(float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd,
             int64_t rd) {
    if (rd < 2 || rd % 2 || rd > hd) return -2;
    const int64_t half = rd / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * rd, *s = sin + r * rd;
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

/* Gemma's GeGLU: out[r][i] = gelu_tanh(gu[r][i]) * gu[r][inter + i], gu and out as silu_mul's. gelu_tanh(g) =
 * g (1 + tanh(u)) / 2 = g sigmoid(2u) with u = sqrt(2 / pi) (g + 0.044715 g^3); sigmoid(a) from e = e^-|a|:
 * 1 / (1 + e) for a >= 0, e / (1 + e) below. */
INL int gelu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
    if (inter % 8) return -2;
    const v8f zero = {0}, one = zero + 1.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const v8f x = *(const v8f *)(const void *)(g + i);
            const v8f a = (x + 0.044715f * (x * x * x)) * 1.59576912160573071f; /* 2 sqrt(2 / pi) */
            const v8i neg = a < zero;
            const v8f e = exp_neg8((v8f)(((v8i)a & neg) | ((v8i)-a & ~neg)));
            const v8f sig = (v8f)(((v8i)e & neg) | ((v8i)one & ~neg)) / (1.0f + e);
            *(v8f *)(void *)(o + i) = x * sig * *(const v8f *)(const void *)(u + i);
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

/* The gated delta rule's inputs for T tokens (Qwen3.5's linear attention), from the conv's outputs before their SiLU
 * x [T][C] (C = 2 Hk dk + Hv dv: q, k, v) and the gate projections a, b [T][Hv]:
 *   q[t][h] = l2norm(silu(q of key head kh)) / sqrt(dk), k[t][h] = l2norm(silu(k of kh)), v[t][h] = silu(v of h)
 *   decay[t][h] = exp(-exp(A_log[h]) * softplus(a + dt_bias[h])), beta[t][h] = sigmoid(b)
 * with kh = h % Hk for value heads tiled over the key heads (llama.cpp's GGUF), else h / (Hv / Hk) (grouped, HF).
 * SiLU eight lanes at a time (C a multiple of 8), squares summed as rmsnorm's (dk a multiple of 8), the rest
 * scalar: every element the same arithmetic at any T. */
INL int gdn_inputs(const float *x, const float *a, const float *b, const float *a_log, const float *dt_bias,
                   int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int32_t tiled, float *q, float *k,
                   float *v, float *decay, float *beta) {
    const int64_t C = 2 * hk * dk + hv * dv;
    if (dk % 8 || dv % 8 || hv % hk) return -2;
    float act[C];
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * C;
        for (int64_t i = 0; i < C; i += 8) {
            const v8f y = *(const v8f *)(const void *)(xt + i), zero = {0};
            const v8i neg = y < zero;
            const v8f e = exp_neg8((v8f)(((v8i)y & neg) | ((v8i)-y & ~neg)));
            *(v8f *)(void *)(act + i) = (v8f)(((v8i)(y * e) & neg) | ((v8i)y & ~neg)) / (1.0f + e);
        }
        for (int64_t part = 0; part < 2; part++) /* l2-normed q (scaled) and k of each key head, in place */
            for (int64_t h = 0; h < hk; h++) {
                float *r = act + part * hk * dk + h * dk, s8[8] = {0};
                for (int64_t i = 0; i < dk; i += 8)
                    for (int l = 0; l < 8; l++) s8[l] += r[i + l] * r[i + l];
                const float tot = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
                const float inv = (1.0f / sqrtf(tot + 1e-6f)) * (part ? 1.0f : 1.0f / sqrtf((float)dk));
                for (int64_t i = 0; i < dk; i++) r[i] *= inv;
            }
        for (int64_t h = 0; h < hv; h++) {
            const int64_t kh = tiled ? h % hk : h / (hv / hk), th = t * hv + h;
            for (int64_t i = 0; i < dk; i++) {
                q[th * dk + i] = act[kh * dk + i];
                k[th * dk + i] = act[hk * dk + kh * dk + i];
            }
            for (int64_t i = 0; i < dv; i++) v[th * dv + i] = act[2 * hk * dk + h * dv + i];
            const float z = a[th] + dt_bias[h];
            const float softplus = z > 20.0f ? z : log1pf(expf(z));
            decay[th] = expf(-expf(a_log[h]) * softplus);
            beta[th] = 1.0f / (1.0f + expf(-b[th]));
        }
    }
    return 0;
}

/* Qwen3.5's gated norm of the delta rule's outputs: out[r] = rmsnorm(o[r]) * w * silu(z[r]) over rows of dv (a
 * multiple of 8), rows = T Hv; squares summed as rmsnorm's, SiLU eight lanes at a time. */
INL int gated_norm(const float *o, const float *z, const float *w, float eps, int64_t rows, int64_t dv, float *out) {
    if (dv % 8) return -2;
    for (int64_t r = 0; r < rows; r++) {
        const float *orow = o + r * dv, *zr = z + r * dv;
        float s8[8] = {0};
        for (int64_t i = 0; i < dv; i += 8)
            for (int l = 0; l < 8; l++) s8[l] += orow[i + l] * orow[i + l];
        const float tot = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
        const float inv = 1.0f / sqrtf(tot / (float)dv + eps);
        for (int64_t i = 0; i < dv; i += 8) {
            const v8f y = *(const v8f *)(const void *)(zr + i), zero = {0};
            const v8i neg = y < zero;
            const v8f e = exp_neg8((v8f)(((v8i)y & neg) | ((v8i)-y & ~neg)));
            const v8f silu = (v8f)(((v8i)(y * e) & neg) | ((v8i)y & ~neg)) / (1.0f + e);
            const v8f x = *(const v8f *)(const void *)(orow + i), wv = *(const v8f *)(const void *)(w + i);
            *(v8f *)(void *)(out + r * dv + i) = wv * (x * inv) * silu;
        }
    }
    return 0;
}

/* The gated delta rule (Qwen3.5's linear attention) over T tokens of one sequence, the state updated in place. Per
 * value head h and token t, with S = ssm[h] [dk][dv], q, k [T][H][dk], v [T][H][dv], decay, beta [T][H]:
 *   S *= decay;  m = S^T k;  S += k (x) ((v - m) * beta);  out = S^T q
 * Heads h0 .. h1 - 1 here (gq_delta_rule splits the heads among threads); each head's state stays in cache over its
 * T tokens, and the sums over dk run in order per output lane, so a token's result does not depend on T or the
 * threads: a forward and a replay of its rows agree. dv a multiple of 8, at most 512; out may be NULL (a replay). */
INL int delta_heads(float *ssm, const float *q, const float *k, const float *v, const float *decay, const float *beta,
                    int64_t T, int64_t H, int64_t dk, int64_t dv, int64_t h0, int64_t h1, float *out) {
    const int64_t lanes = dv / 8;
    for (int64_t h = h0; h < h1; h++) {
        float *S = ssm + h * dk * dv;
        v8f m[64], d[64], o[64];
        for (int64_t t = 0; t < T; t++) {
            const int64_t th = t * H + h;
            const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv;
            const float g = decay[th], b = beta[th];
            for (int64_t j = 0; j < lanes; j++) m[j] = (v8f){0};
            for (int64_t i = 0; i < dk; i++) {
                v8f *row = (v8f *)(void *)(S + i * dv);
                for (int64_t j = 0; j < lanes; j++) {
                    const v8f s = row[j] * g;
                    row[j] = s;
                    m[j] += s * kt[i];
                }
            }
            for (int64_t j = 0; j < lanes; j++) d[j] = (*(const v8f *)(const void *)(vt + 8 * j) - m[j]) * b, o[j] = (v8f){0};
            for (int64_t i = 0; i < dk; i++) {
                v8f *row = (v8f *)(void *)(S + i * dv);
                for (int64_t j = 0; j < lanes; j++) {
                    const v8f s = row[j] + d[j] * kt[i];
                    row[j] = s;
                    o[j] += s * qt[i];
                }
            }
            if (out)
                for (int64_t j = 0; j < lanes; j++) *(v8f *)(void *)(out + th * dv + 8 * j) = o[j];
        }
    }
    return 0;
}

/* The dot products of x [hidden] with router rows w[e0 + j] [hidden], j < 4 (rows past n - 1 repeat the last one):
 * each in 8 partial sums (element i into sum i % 8) added as rmsnorm's, so a logit is the same bits in any block. */
INL void dot4(const float *x, const float *w, int64_t hidden, int64_t e0, int64_t n, float *dots) {
    const float *wr[4];
    for (int j = 0; j < 4; j++) wr[j] = w + (e0 + j < n ? e0 + j : n - 1) * hidden;
    v8f acc[4] = {{0}, {0}, {0}, {0}};
    for (int64_t i = 0; i < hidden; i += 8) {
        const v8f xv = *(const v8f *)(const void *)(x + i);
        for (int j = 0; j < 4; j++) acc[j] += xv * *(const v8f *)(const void *)(wr[j] + i);
    }
    for (int j = 0; j < 4 && e0 + j < n; j++) {
        const v8f a = acc[j];
        dots[e0 + j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

/* top [k]: the indices of v's k largest of n, largest first (equal values: the lower index first) */
INL void largest(const float *v, int64_t n, int64_t k, int64_t *top) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= top[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        top[j] = best;
    }
}

#define ROUTER_MAX 1024 /* experts a router may score (Qwen3-Next: 512) */

/* A mixture of experts' router: each row's k of n experts from x [rows][hidden] and the router w [n][hidden] (+ b [n]
 * or NULL). Where in_scale is not NULL (Gemma 4) the router reads each row RMS-normed (eps) times in_scale [hidden].
 * Logit e: that row . w[e] (dot4) + b[e]. kind 0 (Qwen3-MoE, Gemma 4): the softmax of all n logits (e^(l - max) /
 * their sum in index order), its k largest, divided by their sum (largest first) where norm; kind 1 (gpt-oss): the k
 * largest logits, softmaxed. Then times expert_scale [n] of each chosen expert where it is not NULL (Gemma 4).
 * idx [rows][k] and wt [rows][k], largest first; xs [hidden] scratch. gq_route checks the sizes. */
INL int route_rows(const float *x, const float *w, const float *b, const float *in_scale, float eps,
                   const float *expert_scale, int64_t rows, int64_t hidden, int64_t n, int64_t k, int32_t kind,
                   int32_t norm, int64_t *idx, float *wt, float *xs) {
    float lg[ROUTER_MAX];
    for (int64_t r = 0; r < rows; r++) {
        int64_t *top = idx + r * k;
        float *out = wt + r * k;
        const float *xr = x + r * hidden;
        if (in_scale) xr = (rmsnorm(xr, in_scale, eps, 1, hidden, xs), xs);
        for (int64_t e = 0; e < n; e += 4) dot4(xr, w, hidden, e, n, lg);
        for (int64_t e = 0; b && e < n; e++) lg[e] = lg[e] + b[e];
        if (kind == 0) {
            float m = lg[0], sum = 0.0f;
            for (int64_t e = 1; e < n; e++) m = lg[e] > m ? lg[e] : m;
            for (int64_t e = 0; e < n; e++) sum += lg[e] = expf(lg[e] - m);
            for (int64_t e = 0; e < n; e++) lg[e] = lg[e] / sum;
        }
        largest(lg, n, k, top);
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += out[j] = kind == 0 ? lg[top[j]] : expf(lg[top[j]] - lg[top[0]]);
        for (int64_t j = 0; j < k && (kind == 1 || norm); j++) out[j] = out[j] / sum;
        for (int64_t j = 0; j < k && expert_scale; j++) out[j] = out[j] * expert_scale[top[j]];
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
DISPATCH(rope,
         (float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd,
          int64_t rd),
         (x, stride, cos, sin, rows, heads, hd, rd))
DISPATCH(silu_mul, (const float *gu, int64_t rows, int64_t inter, float *out), (gu, rows, inter, out))
DISPATCH(gelu_mul, (const float *gu, int64_t rows, int64_t inter, float *out), (gu, rows, inter, out))
DISPATCH(swiglu_limit, (const float *gu, int64_t rows, int64_t inter, float limit, float alpha, float *out),
         (gu, rows, inter, limit, alpha, out))
DISPATCH(route_rows,
         (const float *x, const float *w, const float *b, const float *in_scale, float eps, const float *expert_scale,
          int64_t rows, int64_t hidden, int64_t n, int64_t k, int32_t kind, int32_t norm, int64_t *idx, float *wt,
          float *xs),
         (x, w, b, in_scale, eps, expert_scale, rows, hidden, n, k, kind, norm, idx, wt, xs))

/* route_rows over rows split among threads where there are many (as gq_delta_rule's split). A row's result does not
 * depend on the rows beside it. hidden a multiple of 8, n <= ROUTER_MAX, 0 < k <= n. */
int gq_route(const float *x, const float *w, const float *b, const float *in_scale, float eps,
             const float *expert_scale, int64_t rows, int64_t hidden, int64_t n, int64_t k, int32_t kind, int32_t norm,
             int64_t *idx, float *wt) {
    if (hidden % 8 || n < 1 || n > ROUTER_MAX || k < 1 || k > n || kind < 0 || kind > 1) return -2;
    const int64_t chunk = 8;
    int rc = 0;
#pragma omp parallel for schedule(static) if (rows * n * hidden >= (1 << 22))
    for (int64_t r = 0; r < rows; r += chunk) {
        float *xs = in_scale ? (float *)malloc(sizeof(float) * (size_t)hidden) : NULL;
        if (in_scale && !xs) {
            rc = -3;
            continue;
        }
        gq_route_rows(x + r * hidden, w, b, in_scale, eps, expert_scale, rows - r < chunk ? rows - r : chunk, hidden,
                      n, k, kind, norm, idx + r * k, wt + r * k, xs);
        free(xs);
    }
    return rc;
}
DISPATCH(top2, (const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *best, float *gap),
         (x, rows, cols, stride, best, gap))
DISPATCH(gdn_inputs,
         (const float *x, const float *a, const float *b, const float *a_log, const float *dt_bias, int64_t T,
          int64_t hk, int64_t hv, int64_t dk, int64_t dv, int32_t tiled, float *q, float *k, float *v, float *decay,
          float *beta),
         (x, a, b, a_log, dt_bias, T, hk, hv, dk, dv, tiled, q, k, v, decay, beta))
DISPATCH(gated_norm, (const float *o, const float *z, const float *w, float eps, int64_t rows, int64_t dv, float *out),
         (o, z, w, eps, rows, dv, out))
DISPATCH(delta_heads,
         (float *ssm, const float *q, const float *k, const float *v, const float *decay, const float *beta, int64_t T,
          int64_t H, int64_t dk, int64_t dv, int64_t h0, int64_t h1, float *out),
         (ssm, q, k, v, decay, beta, T, H, dk, dv, h0, h1, out))

/* The gated delta rule (delta_heads) with the heads split among threads where the work is large. The OpenMP regions
 * here and in gq_route sit outside the dispatched code: a region inside it is outlined for the baseline CPU. */
int gq_delta_rule(float *ssm, const float *q, const float *k, const float *v, const float *decay, const float *beta,
                  int64_t T, int64_t H, int64_t dk, int64_t dv, float *out) {
    if (dv % 8 || dv > 512) return -2;
#pragma omp parallel for schedule(static) if (T * H * dk * dv >= (1 << 18))
    for (int64_t h = 0; h < H; h++) gq_delta_heads(ssm, q, k, v, decay, beta, T, H, dk, dv, h, h + 1, out);
    return 0;
}
