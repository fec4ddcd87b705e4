/* One decoder layer of a Llama / Qwen2 / Qwen3 / Mistral model in one call, for decode and verification steps on the
 * CPU (float32 activations, GGUF weights): RMS norm, q/k/v, per-head q/k norms (Qwen3), rotary, K/V written to the
 * cache, attention, o_proj and the residual, RMS norm, gate/up, SiLU * up, down and the residual. A mixture of experts
 * (Qwen3-MoE, gpt-oss) in two calls around its router: the attention half (gpt-oss: its sinks, its sliding layers'
 * mask), then the experts (gpt-oss: their biases and clamped SwiGLU). The same functions
 * in the same order as the layer's Python code (models/transformer.py) runs them one by one, so the two give the
 * same bits; at a few rows the Python between those calls costs more than the arithmetic. Written for specdec.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gq_matmul_parts(int nparts, const int *types, const uint8_t *const *Ws, const int64_t *outs, int64_t in,
                    const float *x, int64_t rows, float *y, int nthreads, int path);
int gq_rmsnorm(const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out);
int gq_rope(float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd);
int gq_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out);
int gq_swiglu_limit(const float *gu, int64_t rows, int64_t inter, float limit, float alpha, float *out);
int gq_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qst, const float *k, const float *v,
                 const int64_t *slots, int64_t sb, int64_t sh, const uint8_t *mask, int64_t B, int64_t H, int64_t kvh,
                 int64_t T, int64_t S, int64_t hd, float scale, float softcap, const float *sinks, float *out,
                 int nthreads, int path);

typedef struct { /* a linear layer: GGUF matrices side by side (as gq_matmul_parts takes them), bias or NULL */
    int n;
    const int *types;
    const uint8_t *const *w;
    const int64_t *outs;
    const float *bias;
} lin_t;

typedef struct { /* a mixture-of-experts MLP's experts (Qwen3-MoE, gpt-oss); n = 0 for a dense MLP */
    int64_t n, inter;                /* experts, each one's width */
    const int *gate_up_types;        /* [2n]: expert e's gate at 2e, its up at 2e + 1 */
    const uint8_t *const *gate_up_w; /* [2n] */
    const int *down_types;           /* [n] */
    const uint8_t *const *down_w;    /* [n] */
    const float *gate_up_bias;       /* [n][2 inter] or NULL (gpt-oss) */
    const float *down_bias;          /* [n][hidden] or NULL */
    float limit, alpha;              /* limit > 0: gpt-oss's clamped SwiGLU, else SiLU(gate) * up */
} moe_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    const float *norm1, *norm2; /* [hidden]: before attention, before the MLP */
    const float *q_norm, *k_norm; /* [head_dim]: each head of q / k normed (Qwen3), or NULL */
    lin_t qkv, o, gate_up, down;
    moe_t moe;
    const float *sinks; /* [heads]: gpt-oss's attention sinks, or NULL */
    int64_t sliding;    /* 1: the step's local_mask (a sliding-window layer) where it has one */
} layer_t;

typedef struct {
    int64_t B, T, S;        /* sequences, rows per sequence, keys each sequence reads */
    const float *cos, *sin; /* [B * T][head_dim] */
    float *kc, *vc;         /* this layer's cache: element (slot, g, position, i) at slot * sb + g * sh + position * hd + i */
    int64_t sb, sh;
    const int64_t *slots;   /* [B] */
    const int64_t *index;   /* [B * T]: the cache position each row's K/V is written to */
    const uint8_t *mask;    /* [B][T][S], 1 = attend; NULL = every key */
    const uint8_t *local_mask; /* the same for sliding-window layers, or NULL: `mask` serves them */
} step_t;

static int linear(const lin_t *l, const float *x, int64_t rows, int64_t in, float *y, int nthreads, int path) {
    const int rc = gq_matmul_parts(l->n, l->types, l->w, l->outs, in, x, rows, y, nthreads, path);
    if (rc < 0 || !l->bias) return rc;
    int64_t out = 0;
    for (int i = 0; i < l->n; i++) out += l->outs[i];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < out; i++) y[r * out + i] = y[r * out + i] + l->bias[i];
    return rc;
}

/* The attention half of a layer: out [B * T][hidden] = x + attention(norm1(x)), its K/V written to the cache, and
 * h = norm2(out), the MLP's input. Returns as gq_decoder_layer. */
int gq_attention_half(const layer_t *L, const step_t *s, const float *x, float *out, float *h, int nthreads,
                      int path) {
    const int64_t rows = s->B * s->T, H = L->hidden, hd = L->head_dim, q = L->heads * hd, kv = L->kv_heads * hd;
    const int64_t W = q + 2 * kv;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (W + q)));
    if (!buf) return -3;
    float *qkv = buf, *att = qkv + rows * W;
    int rc = gq_rmsnorm(x, L->norm1, L->eps, rows, H, h);
    if (rc >= 0) rc = linear(&L->qkv, h, rows, H, qkv, nthreads, path);
    for (int64_t r = 0; L->q_norm && rc >= 0 && r < rows; r++) { /* in place: q's heads, then k's */
        float *row = qkv + r * W;
        rc = gq_rmsnorm(row, L->q_norm, L->eps, L->heads, hd, row);
        if (rc >= 0) rc = gq_rmsnorm(row + q, L->k_norm, L->eps, L->kv_heads, hd, row + q);
    }
    if (rc >= 0 && (rc = gq_rope(qkv, W, s->cos, s->sin, rows, L->heads + L->kv_heads, hd)) >= 0) {
        for (int64_t b = 0; b < s->B; b++)
            for (int64_t t = 0; t < s->T; t++) {
                const float *row = qkv + (b * s->T + t) * W;
                const int64_t at = s->slots[b] * s->sb + s->index[b * s->T + t] * hd;
                for (int64_t g = 0; g < L->kv_heads; g++) {
                    memcpy(s->kc + at + g * s->sh, row + q + g * hd, sizeof(float) * (size_t)hd);
                    memcpy(s->vc + at + g * s->sh, row + q + kv + g * hd, sizeof(float) * (size_t)hd);
                }
            }
        const uint8_t *mask = L->sliding && s->local_mask ? s->local_mask : s->mask;
        rc = gq_attention(qkv, s->T * W, hd, W, s->kc, s->vc, s->slots, s->sb, s->sh, mask, s->B, L->heads,
                          L->kv_heads, s->T, s->S, hd, (float)(1.0 / sqrt((double)hd)), 0.0f, L->sinks, att, nthreads,
                          path);
    }
    int used = 0;
    if (rc >= 0) rc = used = linear(&L->o, att, rows, q, out, nthreads, path);
    if (rc >= 0) {
        for (int64_t i = 0; i < rows * H; i++) out[i] = x[i] + out[i];
        rc = gq_rmsnorm(out, L->norm2, L->eps, rows, H, h);
    }
    free(buf);
    return rc < 0 ? rc : used;
}

/* y[r][i] = y[r][i] + b[i] (a bias) */
static void add_bias(float *y, const float *b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] = y[r * n + i] + b[i];
}

/* Expert e's activation of its gate/up outputs gu [m][2 inter] (its bias added first, in place) -> act [m][inter] */
static int activate(const moe_t *M, int64_t e, float *gu, int64_t m, float *act) {
    if (M->gate_up_bias) add_bias(gu, M->gate_up_bias + e * 2 * M->inter, m, 2 * M->inter);
    return M->limit > 0 ? gq_swiglu_limit(gu, m, M->inter, M->limit, M->alpha, act) : gq_silu_mul(gu, m, M->inter, act);
}

/* Expert e's down projection: y [m][hidden] = down(act [m][inter]) + its bias */
static int down(const layer_t *L, int64_t e, const float *act, int64_t m, float *y, int nthreads, int path) {
    const moe_t *M = &L->moe;
    const int64_t outs[1] = {L->hidden};
    const int rc = gq_matmul_parts(1, M->down_types + e, M->down_w + e, outs, M->inter, act, m, y, nthreads, path);
    if (rc >= 0 && M->down_bias) add_bias(y, M->down_bias + e * L->hidden, m, L->hidden);
    return rc;
}

/* One expert over m rows: y [m][hidden] = down(act(gate, up))(x [m][hidden]); gu [m][2 inter], act [m][inter]. */
static int expert(const layer_t *L, int64_t e, const float *x, int64_t m, float *gu, float *act, float *y,
                  int nthreads, int path) {
    const moe_t *M = &L->moe;
    const int64_t gu_outs[2] = {M->inter, M->inter};
    int rc = gq_matmul_parts(2, M->gate_up_types + 2 * e, M->gate_up_w + 2 * e, gu_outs, L->hidden, x, m, gu,
                             nthreads, path);
    if (rc >= 0) rc = activate(M, e, gu, m, act);
    if (rc >= 0) rc = down(L, e, act, m, y, nthreads, path);
    return rc;
}

/* acc[r] += y[j] * w, the product stored before the sum (no fused multiply-add: the bits of the Python path's
 * `y * w` then `index_add_`); tmp [hidden] scratch. */
static void add_scaled(float *acc, const float *y, float w, float *tmp, int64_t H) {
    for (int64_t i = 0; i < H; i++) tmp[i] = y[i] * w;
    for (int64_t i = 0; i < H; i++) acc[i] = acc[i] + tmp[i];
}

/* out [rows][hidden] += the experts' output for h [rows][hidden]: row r's k experts idx[r k + j] weighted w[r k + j],
 * summed into zeros in ascending expert order, as `transformer.MoE` does (one row: every chosen expert's gate/up in
 * one call; more: each expert once over the rows that chose it). Returns the kernels' path or a negative error. */
int gq_moe_experts(const layer_t *L, const float *h, int64_t rows, int64_t k, const int64_t *idx, const float *w,
                   float *out, int nthreads, int path) {
    const moe_t *M = &L->moe;
    const int64_t H = L->hidden, I = M->inter;
    if (M->n <= 0 || k <= 0 || k > 32) return -2;
    float *buf = (float *)calloc((size_t)(rows * (3 * H + 3 * I) + 2 * k * I + H), sizeof(float));
    int64_t *sel = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows > k ? rows : k));
    if (!buf || !sel) {
        free(buf);
        free(sel);
        return -3;
    }
    float *acc = buf, *xg = acc + rows * H, *gu = xg + rows * H, *act = gu + rows * 2 * I + 2 * k * I;
    float *y = act + rows * I, *tmp = y + rows * H;
    int rc = 0;
    if (rows == 1) { /* sel: the k slots in ascending expert order */
        for (int64_t j = 0; j < k; j++) sel[j] = j;
        for (int64_t a = 1; a < k; a++)
            for (int64_t b = a; b > 0 && idx[sel[b]] < idx[sel[b - 1]]; b--) {
                const int64_t t = sel[b];
                sel[b] = sel[b - 1];
                sel[b - 1] = t;
            }
        int types[64];
        const uint8_t *ws[64];
        int64_t outs[64];
        for (int64_t j = 0; j < 2 * k; j++) {
            const int64_t e = idx[sel[j / 2]];
            types[j] = M->gate_up_types[2 * e + j % 2];
            ws[j] = M->gate_up_w[2 * e + j % 2];
            outs[j] = I;
        }
        rc = gq_matmul_parts((int)(2 * k), types, ws, outs, H, h, 1, gu, nthreads, path);
        for (int64_t j = 0; j < k && rc >= 0; j++) {
            const int64_t e = idx[sel[j]];
            rc = activate(M, e, gu + j * 2 * I, 1, act);
            if (rc >= 0) rc = down(L, e, act, 1, y, nthreads, path);
            if (rc >= 0) add_scaled(acc, y, w[sel[j]], tmp, H);
        }
    }
    for (int64_t e = 0; rows > 1 && e < M->n && rc >= 0; e++) {
        int64_t m = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < k; j++)
                if (idx[r * k + j] == e) {
                    sel[m] = r * k + j;
                    memcpy(xg + m * H, h + r * H, sizeof(float) * (size_t)H);
                    m++;
                }
        if (m == 0) continue;
        rc = expert(L, e, xg, m, gu, act, y, nthreads, path);
        for (int64_t j = 0; j < m && rc >= 0; j++) add_scaled(acc + sel[j] / k * H, y + j * H, w[sel[j]], tmp, H);
    }
    if (rc >= 0)
        for (int64_t i = 0; i < rows * H; i++) out[i] = out[i] + acc[i];
    free(buf);
    free(sel);
    return rc;
}

/* out [B * T][hidden] = the layer applied to x [B * T][hidden]. path as gq_matmul_parts (0 auto). Returns the
 * kernels' path, or a negative error (then nothing but the cache rows of this step may have been written). */
int gq_decoder_layer(const layer_t *L, const step_t *s, const float *x, float *out, int nthreads, int path) {
    const int64_t rows = s->B * s->T, H = L->hidden, I = L->inter;
    if (L->moe.n > 0) return -2; /* experts: gq_attention_half, the router, then gq_moe_experts */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (H + 3 * I)));
    if (!buf) return -3;
    float *h = buf, *gu = h + rows * H, *act = gu + rows * 2 * I;
    int rc = gq_attention_half(L, s, x, out, h, nthreads, path);
    if (rc >= 0) rc = linear(&L->gate_up, h, rows, H, gu, nthreads, path);
    if (rc >= 0) rc = gq_silu_mul(gu, rows, I, act);
    int used = 0;
    if (rc >= 0) rc = used = linear(&L->down, act, rows, I, h, nthreads, path);
    if (rc >= 0)
        for (int64_t i = 0; i < rows * H; i++) out[i] = out[i] + h[i];
    free(buf);
    return rc < 0 ? rc : used;
}

/* The decoder stack in one call: layers L[0..n) in a row, layer l's cache at kc[l] / vc[l] (s's strides), x -> out
 * [B * T][hidden], tmp a second buffer of that size (a layer's output may not overwrite its input). Returns as
 * gq_decoder_layer; on an error the layers after it have not run. */
int gq_decoder_stack(const layer_t *const *L, int n, step_t *s, float *const *kc, float *const *vc, const float *x,
                     float *out, float *tmp, int nthreads, int path) {
    int rc = 0;
    const float *in = x;
    for (int l = 0; l < n && rc >= 0; l++) {
        float *dst = (n - 1 - l) % 2 ? tmp : out; /* the last layer writes out */
        s->kc = kc[l];
        s->vc = vc[l];
        rc = gq_decoder_layer(L[l], s, in, dst, nthreads, path);
        in = dst;
    }
    return rc;
}
