/* One decoder layer of a Llama / Qwen2 / Qwen3 / Mistral / Gemma / Phi-3 / Granite / OLMo 2 / SmolLM3 model in one
 * call, for decode and verification steps on the CPU (float32 activations, GGUF weights): RMS norm (OLMo 2: none),
 * q/k/v, q/k norms per head (Qwen3, Gemma 3) or over all heads (OLMo 2) and v norms (Gemma 4), rotary (Phi-4-mini:
 * partial; SmolLM3: none in some layers), K/V written to the cache, attention (Gemma 2: its scale and soft cap),
 * o_proj (Gemma, OLMo 2: normed again) and the residual (Granite: scaled), RMS norm, gate/up, SiLU or tanh-GELU * up,
 * down (normed again as o_proj) and the residual (Gemma 4: times its layer scalar). A mixture of experts (Qwen3-MoE,
 * gpt-oss, Gemma 4): the attention half (gpt-oss: its sinks, its sliding layers' mask), the router (small_ops.c's
 * gq_route), then the experts (gpt-oss: their biases and clamped SwiGLU; Gemma 4: a dense MLP beside them); where
 * the router runs in Python, two calls around it. The same functions in the same order as the layer's Python code
 * (models/transformer.py) runs them one by one, so the two give the same bits; at a few rows the Python between
 * those calls costs more than the arithmetic. Written for specdec.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gq_matmul.h"

int gq_rmsnorm(const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out);
int gq_rope(float *x, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t hd,
            int64_t rd);
int gq_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out);
int gq_gelu_mul(const float *gu, int64_t rows, int64_t inter, float *out);
int gq_swiglu_limit(const float *gu, int64_t rows, int64_t inter, float limit, float alpha, float *out);
int gq_route(const float *x, const float *w, const float *b, const float *in_scale, float eps,
             const float *expert_scale, int64_t rows, int64_t hidden, int64_t n, int64_t k, int32_t kind, int32_t norm,
             int64_t *idx, float *wt);
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

typedef struct { /* the experts' router (gq_route's), or w = NULL: the caller routes between two calls */
    const float *w;            /* [moe.n][hidden] */
    const float *bias;         /* [moe.n] or NULL */
    const float *in_scale;     /* [hidden] or NULL: each row RMS-normed times it first (Gemma 4) */
    const float *expert_scale; /* [moe.n] or NULL: each chosen expert's weight times it (Gemma 4) */
    int64_t k, kind, norm;
} router_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    const float *norm1, *norm2; /* [hidden]: before attention, before the MLP, or NULL (OLMo 2: none before) */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden]: after attention, after the MLP (Gemma, OLMo 2), or NULL */
    /* [head_dim]: each head of q / k normed (Qwen3, Gemma 3); qk_full: [heads * head_dim] / [kv_heads * head_dim],
     * all heads at once (OLMo 2); or NULL */
    const float *q_norm, *k_norm;
    const float *v_norm;          /* [head_dim] of ones: each head of v normed (Gemma 4), or NULL */
    lin_t qkv, o, gate_up, down;
    moe_t moe;
    const float *sinks; /* [heads]: gpt-oss's attention sinks, or NULL */
    int64_t sliding;    /* 1: the step's local_mask and local rotary tables (a sliding-window layer) where it has them */
    float scale, softcap; /* attention scores times scale, then softcap tanh(s / softcap) where softcap > 0 */
    int64_t gelu;         /* 1: tanh-GELU(gate) * up (Gemma), 0: SiLU(gate) * up */
    int64_t kv_parts; /* qkv's outputs beside q: 2 = k, v; 1 = k, the values a copy of it (Gemma 4's full layers); 0 =
                       * none, the layer reads the K/V the step's cache pointers give (another layer's: Gemma 4) */
    const float *out_scale; /* [1]: the layer's output times it (Gemma 4's layer scalar), or NULL */
    /* [hidden]: Gemma 4's experts beside a dense MLP (gate_up, down), each normed before and after, the dense one
     * after, where the layer has them; else NULL */
    const float *expert_in_norm, *expert_out_norm, *dense_out_norm;
    /* Gemma 4's per-layer input: out += pl_norm(pl_proj(gelu(pl_gate(out)) * the step's per_layer row's entry
     * pl_index [pl_dim])) before out_scale, where pl_norm is not NULL */
    lin_t pl_gate, pl_proj;
    const float *pl_norm;
    int64_t pl_index, pl_dim;
    router_t router;
    int64_t rope_dim;     /* channels rotary rotates at the start of each head (< head_dim: partial), 0 = no rotary */
    int64_t qk_full;      /* 1: q_norm / k_norm over all heads at once */
    float residual_scale; /* each block's output times it before the residual add (Granite), 0 = 1 */
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
    const float *cos_local, *sin_local; /* [B * T][their head_dim]: sliding layers' own tables (Gemma 3, 4), or NULL */
    const float *per_layer; /* [B * T][layers][pl_dim]: Gemma 4's per-layer inputs, or NULL */
    int64_t per_layer_stride; /* floats from one row's to the next */
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

/* qkv [rows][W]: each row's q and k, given side by side [rows][made] at its start, and v = k after them (made < W:
 * a projection that gives k alone) */
static void widen(float *qkv, int64_t rows, int64_t made, int64_t W, int64_t q, int64_t kv) {
    for (int64_t r = rows - 1; r >= 0 && made < W; r--) { /* from the last row: a row never moves down */
        float *row = qkv + r * W;
        memmove(row, qkv + r * made, sizeof(float) * (size_t)made);
        if (made > q) memcpy(row + q + kv, row + q, sizeof(float) * (size_t)kv);
    }
}

/* Each row of qkv [rows][W]: its heads of q and k normed by q_norm / k_norm (each head, or all at once), of v by
 * v_norm, where the layer has them, in place */
static int head_norms(const layer_t *L, float *qkv, int64_t rows, int64_t W) {
    const int64_t hd = L->head_dim, q = L->heads * hd, kv = L->kv_heads * hd, nd = L->qk_full ? q : hd;
    const int64_t qn = L->qk_full ? 1 : L->heads, kn = L->qk_full ? 1 : L->kv_heads, kd = L->qk_full ? kv : hd;
    int rc = 0;
    for (int64_t r = 0; rc >= 0 && r < rows && (L->q_norm || L->v_norm); r++) {
        float *row = qkv + r * W;
        if (L->q_norm) rc = gq_rmsnorm(row, L->q_norm, L->eps, qn, nd, row);
        if (L->q_norm && L->kv_parts && rc >= 0) rc = gq_rmsnorm(row + q, L->k_norm, L->eps, kn, kd, row + q);
        if (L->v_norm && L->kv_parts && rc >= 0)
            rc = gq_rmsnorm(row + q + kv, L->v_norm, L->eps, L->kv_heads, hd, row + q + kv);
    }
    return rc;
}

/* out[i] = x[i] + y[i], y times the layer's residual scale first where it has one (Granite; in place on y: the
 * product stored before the sum, as the Python path's `h * scale` then `x + h`) */
static void residual(const layer_t *L, const float *x, float *y, float *out, int64_t n) {
    const float scale = L->residual_scale;
    if (scale != 0 && scale != 1)
        for (int64_t i = 0; i < n; i++) y[i] = y[i] * scale;
    for (int64_t i = 0; i < n; i++) out[i] = x[i] + y[i];
}

/* The attention half of a layer: out [B * T][hidden] = x + attention(norm1(x)) (normed by attn_out_norm where the
 * layer has it), its K/V written to the cache, and h = norm2(out), the MLP's input (without norms: x and out
 * themselves). Returns as gq_decoder_layer. */
int gq_attention_half(const layer_t *L, const step_t *s, const float *x, float *out, float *h, int nthreads,
                      int path) {
    const int64_t rows = s->B * s->T, H = L->hidden, hd = L->head_dim, q = L->heads * hd, kv = L->kv_heads * hd;
    const int64_t W = q + 2 * kv;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (W + q)));
    if (!buf) return -3;
    float *qkv = buf, *att = qkv + rows * W;
    const int local = L->sliding && s->cos_local;
    int rc = L->norm1 ? gq_rmsnorm(x, L->norm1, L->eps, rows, H, h) : 0;
    if (rc >= 0) rc = linear(&L->qkv, L->norm1 ? h : x, rows, H, qkv, nthreads, path);
    if (rc >= 0) widen(qkv, rows, q + L->kv_parts * kv, W, q, kv);
    if (rc >= 0) rc = head_norms(L, qkv, rows, W);
    if (rc >= 0 && L->rope_dim)
        rc = gq_rope(qkv, W, local ? s->cos_local : s->cos, local ? s->sin_local : s->sin, rows,
                     L->heads + (L->kv_parts ? L->kv_heads : 0), hd, L->rope_dim);
    if (rc >= 0) {
        for (int64_t b = 0; b < s->B && L->kv_parts; b++)
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
                          L->kv_heads, s->T, s->S, hd, L->scale, L->softcap, L->sinks, att, nthreads, path);
    }
    int used = 0;
    if (rc >= 0) rc = used = linear(&L->o, att, rows, q, out, nthreads, path);
    if (rc >= 0 && L->attn_out_norm) rc = gq_rmsnorm(out, L->attn_out_norm, L->eps, rows, H, out);
    if (rc >= 0) {
        residual(L, x, out, out, rows * H);
        if (L->norm2) rc = gq_rmsnorm(out, L->norm2, L->eps, rows, H, h);
        else memcpy(h, out, sizeof(float) * (size_t)(rows * H));
    }
    free(buf);
    return rc < 0 ? rc : used;
}

/* y[r][i] = y[r][i] + b[i] (a bias) */
static void add_bias(float *y, const float *b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] = y[r * n + i] + b[i];
}

/* Expert e's activation of its gate/up outputs gu [m][2 inter] (its bias added first, in place) -> act [m][inter]:
 * gpt-oss's clamped SwiGLU, or the layer's own (SiLU or tanh-GELU of gate, times up) */
static int activate(const layer_t *L, int64_t e, float *gu, int64_t m, float *act) {
    const moe_t *M = &L->moe;
    if (M->gate_up_bias) add_bias(gu, M->gate_up_bias + e * 2 * M->inter, m, 2 * M->inter);
    if (M->limit > 0) return gq_swiglu_limit(gu, m, M->inter, M->limit, M->alpha, act);
    return L->gelu ? gq_gelu_mul(gu, m, M->inter, act) : gq_silu_mul(gu, m, M->inter, act);
}

/* acc[r] += y[j] * w, the product stored before the sum (no fused multiply-add: the bits of the Python path's
 * `y * w` then `index_add_`); tmp [hidden] scratch. */
static void add_scaled(float *acc, const float *y, float w, float *tmp, int64_t H) {
    for (int64_t i = 0; i < H; i++) tmp[i] = y[i] * w;
    for (int64_t i = 0; i < H; i++) acc[i] = acc[i] + tmp[i];
}

/* sel [rows k]: the (row, slot) pairs r k + j ordered by their expert idx[r k + j], rows ascending within one (a
 * counting sort); count [n experts] scratch. Returns 0, or -2 for an expert out of range. */
static int by_expert(const int64_t *idx, int64_t pairs, int64_t n, int64_t *count, int64_t *sel) {
    memset(count, 0, sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < pairs; i++) {
        if (idx[i] < 0 || idx[i] >= n) return -2;
        count[idx[i]]++;
    }
    for (int64_t e = 0, at = 0; e < n; e++) {
        const int64_t c = count[e];
        count[e] = at;
        at += c;
    }
    for (int64_t i = 0; i < pairs; i++) sel[count[idx[i]]++] = i;
    return 0;
}

/* The experts' matmuls in two grouped calls: gate/up of every chosen expert over its rows xs[g] (gu [pairs][2 inter],
 * the expert's rows from start[g]), their activations, then every down (y [pairs][hidden]) and its bias. */
static int expert_calls(const layer_t *L, int64_t groups, const int64_t *ge, const int64_t *start,
                        const float *const *xs, float *gu, float *act, float *y, gq_job_t *jobs, int nthreads,
                        int path) {
    const moe_t *M = &L->moe;
    const int64_t H = L->hidden, I = M->inter;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t e = ge[g], s = start[g], m = start[g + 1] - s;
        for (int h = 0; h < 2; h++)
            jobs[2 * g + h] = (gq_job_t){M->gate_up_types[2 * e + h], M->gate_up_w[2 * e + h], I, xs[g], m,
                                         gu + s * 2 * I + h * I, 2 * I};
    }
    int rc = gq_matmul_jobs((int)(2 * groups), jobs, H, nthreads, path);
    for (int64_t g = 0; g < groups && rc >= 0; g++) {
        const int64_t e = ge[g], s = start[g], m = start[g + 1] - s;
        rc = activate(L, e, gu + s * 2 * I, m, act + s * I);
        jobs[g] = (gq_job_t){M->down_types[e], M->down_w[e], H, act + s * I, m, y + s * H, H};
    }
    const int used = rc >= 0 ? (rc = gq_matmul_jobs((int)groups, jobs, I, nthreads, path)) : rc;
    for (int64_t g = 0; g < groups && rc >= 0 && M->down_bias; g++)
        add_bias(y + start[g] * H, M->down_bias + ge[g] * H, start[g + 1] - start[g], H);
    return rc < 0 ? rc : used;
}

/* acc [rows][hidden] (zeros) += the experts' output for h [rows][hidden]: row r's k experts idx[r k + j] weighted
 * w[r k + j], summed in ascending expert order, as `transformer.MoE` does: each chosen expert once over the rows that
 * chose it (a row alone where one did: read in place), all experts' gate/up in one call and all downs in another.
 * Returns the kernels' path or a negative error. */
static int experts(const layer_t *L, const float *h, int64_t rows, int64_t k, const int64_t *idx, const float *w,
                   float *acc, int nthreads, int path) {
    const moe_t *M = &L->moe;
    const int64_t H = L->hidden, I = M->inter, P = rows * k;
    if (M->n <= 0 || k <= 0 || k > 32) return -2;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(P * (2 * H + 3 * I) + H));
    int64_t *ints = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M->n + 3 * P + 1));
    gq_job_t *jobs = (gq_job_t *)malloc((sizeof(gq_job_t) * 2 + sizeof(float *)) * (size_t)P);
    if (!buf || !ints || !jobs) {
        free(buf);
        free(ints);
        free(jobs);
        return -3;
    }
    float *xg = buf, *gu = xg + P * H, *act = gu + P * 2 * I, *y = act + P * I, *tmp = y + P * H;
    int64_t *count = ints, *sel = count + M->n, *ge = sel + P, *start = ge + P; /* start [groups + 1] */
    const float **xs = (const float **)(void *)(jobs + 2 * P);
    int rc = by_expert(idx, P, M->n, count, sel);
    int64_t groups = 0;
    for (int64_t i = 0; i < P && rc >= 0; i++) { /* groups: runs of one expert in sel; xg: their rows, gathered */
        if (i == 0 || idx[sel[i]] != idx[sel[i - 1]]) {
            ge[groups] = idx[sel[i]];
            start[groups++] = i;
        }
        memcpy(xg + i * H, h + sel[i] / k * H, sizeof(float) * (size_t)H);
    }
    start[groups] = P;
    for (int64_t g = 0; g < groups; g++) /* one row: its own place in h, so the rows many experts share quantize once */
        xs[g] = start[g + 1] - start[g] == 1 ? h + sel[start[g]] / k * H : xg + start[g] * H;
    if (rc >= 0) rc = expert_calls(L, groups, ge, start, xs, gu, act, y, jobs, nthreads, path);
    for (int64_t i = 0; i < P && rc >= 0; i++) add_scaled(acc + sel[i] / k * H, y + i * H, w[sel[i]], tmp, H);
    free(buf);
    free(ints);
    free(jobs);
    return rc;
}

/* The layer's output out [n] times its out_scale (Gemma 4's layer scalar), where it has one */
static void scale_out(const layer_t *L, float *out, int64_t n) {
    for (int64_t i = 0; L->out_scale && i < n; i++) out[i] = out[i] * L->out_scale[0];
}

/* The dense MLP of h [rows][hidden]: y [rows][hidden] = down(act(gate_up(h))); gu [rows][2 inter], act [rows][inter]
 * scratch. Returns the kernels' path or a negative error. */
static int dense_mlp(const layer_t *L, const float *h, int64_t rows, float *gu, float *act, float *y, int nthreads,
                     int path) {
    const int64_t H = L->hidden, I = L->inter;
    int rc = linear(&L->gate_up, h, rows, H, gu, nthreads, path), used = 0;
    if (rc >= 0) rc = L->gelu ? gq_gelu_mul(gu, rows, I, act) : gq_silu_mul(gu, rows, I, act);
    if (rc >= 0) rc = used = linear(&L->down, act, rows, I, y, nthreads, path);
    const float *after = L->expert_in_norm ? L->dense_out_norm : L->mlp_out_norm; /* beside experts: its own */
    if (rc >= 0 && after) rc = gq_rmsnorm(y, after, L->eps, rows, H, y);
    return rc < 0 ? rc : used;
}

/* The MLP half of a layer with experts, after gq_attention_half (out: its output, h: norm2 of it) and the router
 * (row r's experts idx[r k + j] weighted w[r k + j]): out += the experts' output for h. Gemma 4 (experts beside a
 * dense MLP): out += mlp_out_norm(dense_out_norm(MLP(h)) + expert_out_norm(experts(expert_in_norm(out)))), then
 * out times out_scale. Returns the kernels' path or a negative error. */
int gq_moe_experts(const layer_t *L, const float *h, int64_t rows, int64_t k, const int64_t *idx, const float *w,
                   float *out, int nthreads, int path) {
    const int64_t H = L->hidden, I = L->inter, beside = L->expert_in_norm != NULL;
    float *buf = (float *)calloc((size_t)(rows * (3 * H + 3 * I)), sizeof(float));
    if (!buf) return -3;
    float *acc = buf, *xe = acc + rows * H, *y = xe + rows * H, *gu = y + rows * H, *act = gu + rows * 2 * I;
    int rc = beside ? gq_rmsnorm(out, L->expert_in_norm, L->eps, rows, H, xe) : 0;
    if (rc >= 0) rc = experts(L, beside ? xe : h, rows, k, idx, w, acc, nthreads, path);
    int used = rc;
    if (rc >= 0 && beside && (rc = gq_rmsnorm(acc, L->expert_out_norm, L->eps, rows, H, acc)) >= 0)
        rc = dense_mlp(L, h, rows, gu, act, y, nthreads, path);
    if (rc >= 0 && beside) {
        for (int64_t i = 0; i < rows * H; i++) acc[i] = y[i] + acc[i];
        rc = gq_rmsnorm(acc, L->mlp_out_norm, L->eps, rows, H, acc);
    }
    if (rc >= 0) {
        residual(L, out, acc, out, rows * H);
        scale_out(L, out, rows * H);
    }
    free(buf);
    return rc < 0 ? rc : used;
}

/* Gemma 4's per-layer input, in place on out [rows][hidden]: out += pl_norm(pl_proj(gelu(pl_gate(out)) * this layer's
 * per-layer input)). Returns the kernels' path or a negative error. */
static int per_layer_input(const layer_t *L, const step_t *s, float *out, int64_t rows, int nthreads, int path) {
    const int64_t H = L->hidden, P = L->pl_dim;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (4 * P + H)));
    if (!buf) return -3;
    float *g = buf, *gp = g + rows * P, *act = gp + rows * 2 * P, *y = act + rows * P; /* gp: gate, then the input */
    int rc = linear(&L->pl_gate, out, rows, H, g, nthreads, path), used = rc;
    for (int64_t r = 0; rc >= 0 && r < rows; r++) {
        memcpy(gp + r * 2 * P, g + r * P, sizeof(float) * (size_t)P);
        memcpy(gp + r * 2 * P + P, s->per_layer + r * s->per_layer_stride + L->pl_index * P, sizeof(float) * (size_t)P);
    }
    if (rc >= 0) rc = gq_gelu_mul(gp, rows, P, act);
    if (rc >= 0) rc = linear(&L->pl_proj, act, rows, P, y, nthreads, path);
    if (rc >= 0) rc = gq_rmsnorm(y, L->pl_norm, L->eps, rows, H, y);
    for (int64_t i = 0; rc >= 0 && i < rows * H; i++) out[i] = out[i] + y[i];
    free(buf);
    return rc < 0 ? rc : used;
}

/* A layer with experts routed here: gq_attention_half, the router on its MLP input, then gq_moe_experts. Returns as
 * gq_decoder_layer. */
static int routed_layer(const layer_t *L, const step_t *s, const float *x, float *out, int nthreads, int path) {
    const int64_t rows = s->B * s->T, H = L->hidden, k = L->router.k;
    float *h = (float *)malloc(sizeof(float) * (size_t)(rows * (H + k)));
    int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows * k));
    int rc = h && idx ? gq_attention_half(L, s, x, out, h, nthreads, path) : -3;
    const router_t *R = &L->router;
    if (rc >= 0) /* the MLP's input; beside a dense MLP (Gemma 4) the attention half's output */
        rc = gq_route(L->expert_in_norm ? out : h, R->w, R->bias, R->in_scale, L->eps, R->expert_scale, rows, H,
                      L->moe.n, k, (int32_t)R->kind, (int32_t)R->norm, idx, h + rows * H);
    if (rc >= 0) rc = gq_moe_experts(L, h, rows, k, idx, h + rows * H, out, nthreads, path);
    free(h);
    free(idx);
    return rc;
}

/* out [B * T][hidden] = the layer applied to x [B * T][hidden]. path as gq_matmul_parts (0 auto). Returns the
 * kernels' path, or a negative error (then nothing but the cache rows of this step may have been written). */
int gq_decoder_layer(const layer_t *L, const step_t *s, const float *x, float *out, int nthreads, int path) {
    const int64_t rows = s->B * s->T, H = L->hidden, I = L->inter;
    if (L->moe.n > 0) /* experts not routed here: gq_attention_half, the caller's router, then gq_moe_experts */
        return L->router.w ? routed_layer(L, s, x, out, nthreads, path) : -2;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (2 * H + 3 * I)));
    if (!buf) return -3;
    float *h = buf, *y = h + rows * H, *gu = y + rows * H, *act = gu + rows * 2 * I;
    int rc = gq_attention_half(L, s, x, out, h, nthreads, path);
    int used = 0;
    if (rc >= 0) rc = used = dense_mlp(L, h, rows, gu, act, y, nthreads, path);
    if (rc >= 0) residual(L, out, y, out, rows * H);
    if (rc >= 0 && L->pl_norm) rc = s->per_layer ? per_layer_input(L, s, out, rows, nthreads, path) : -2;
    if (rc >= 0) scale_out(L, out, rows * H);
    free(buf);
    return rc < 0 ? rc : used;
}

/* The decoder stack in one call: layers L[0..n) in a row, layer l's cache at kc[l] / vc[l] with strides sb[l], sh[l]
 * (as step_t's), x -> out [B * T][hidden], tmp a second buffer of that size (a layer's output may not overwrite its
 * input). Returns as gq_decoder_layer; on an error the layers after it have not run. */
int gq_decoder_stack(const layer_t *const *L, int n, step_t *s, float *const *kc, float *const *vc, const int64_t *sb,
                     const int64_t *sh, const float *x, float *out, float *tmp, int nthreads, int path) {
    int rc = 0;
    const float *in = x;
    for (int l = 0; l < n && rc >= 0; l++) {
        float *dst = (n - 1 - l) % 2 ? tmp : out; /* the last layer writes out */
        s->kc = kc[l];
        s->vc = vc[l];
        s->sb = sb[l];
        s->sh = sh[l];
        rc = gq_decoder_layer(L[l], s, in, dst, nthreads, path);
        in = dst;
    }
    return rc;
}
