/* Attention of query rows over a KV cache (float32): decode and verification steps, and prefill chunks.
 *
 * Each (sequence, query row, head) is computed on its own, keys in cache order: scores q.k * scale, their
 * maximum, exponentials, sum, and the weighted sum of values. For speed, the heads that share a KV head, of up to
 * TILE consecutive query rows, are computed side by side, each key's K and V rows loaded once for them (the rows of
 * a causal chunk, with or without a sliding window, see overlapping runs of the keys: each row's keys before the
 * ones all of a block's rows see, those, then its keys after, each row's sums in its own keys' order).
 * Nothing in a row's arithmetic depends on how many query rows or how many keys beyond its own are computed in the
 * same call, so a token's attention output is the same bits whether it is decoded alone, verified among drafted
 * tokens or prefilled in a chunk of any size. (torch's fused attention blocks keys and queries by the call's shape,
 * and with int8-quantized activations downstream those last-bit differences grew to logit differences of 0.2
 * between plain and speculative decoding.) Tiles of rows: a causal 512-row chunk at Qwen3-0.6B's heads (16 over 8
 * KV heads, head_dim 128) took 6.6 ms at 2 threads, 16.6 ms before (one row at a time, each thread a contiguous
 * half of the rows, whose later half sees 3/4 of the keys), 12.6 ms in torch's SDPA (Zen 5).
 *
 * Arithmetic is stated over 16 lanes (attention_body.h): dot products keep 16 partial sums over the head
 * dimension (a multiple of 16) and add them in a fixed tree, the exponential is a polynomial (Cephes expf
 * coefficients, relative error ~1e-7). Gemma 2's soft cap (softcap * tanh(s / softcap), libm's tanhf) and gpt-oss's
 * sinks (a logit per head that joins the softmax's maximum and sum and attends to nothing) are optional. The same
 * loops are compiled for AVX-512, AVX2 and plain x86-64 / other CPUs, and gq_best_path picks one per process.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_exp.h"

int gq_best_path(void); /* ggml_q.c */

#define INL static inline __attribute__((always_inline))
#define MAX_HD 512 /* head dimensions up to this */
#define UNROLL _Pragma("GCC unroll 16") /* loops over a block's heads and lanes: their sums stay in registers */

typedef struct {
    const float *q;       /* element (b, h, t, i) at b * qsb + h * qsh + t * qst + i */
    int64_t qsb, qsh, qst;
    const float *k, *v;   /* element (b, g, s, i) at slot(b) * sb + g * sh + s * hd + i */
    const int64_t *slots; /* slot(b) = slots[b]; NULL: b */
    int64_t sb, sh;
    const uint8_t *mask;  /* [B][T][S], 1 = attend; NULL = every key */
    int64_t B, H, kvh, T, S, hd;
    float scale, softcap; /* softcap 0: none */
    const float *sinks;   /* [H] or NULL */
    float *out;           /* [B][T][H][hd] */
    int64_t rows;         /* query rows of one sequence in a tile (up to TILE) */
} att_t;

typedef struct { /* one query row's head: its query and output (hd floats each), its keys (a run of the tile's:
                  * from lo, n of them), the head's index */
    const float *q;
    float *o;
    int32_t lo, n, head;
} pair_t;

#define TILE 8 /* query rows of one sequence whose heads share each key's loads, at most */

/* The loops (attention_body.h), once per instruction set: 16-float vectors for AVX-512 and for any other CPU (GCC
 * lowers them to what it has), 8-float vectors for AVX2 */
#define AW 16
#define ATT_T
#define ATT_FN(name) att_any_##name
#include "attention_body.h"
#if defined(__x86_64__) || defined(__i386__)
#define AW 8
#define ATT_T __attribute__((target("avx2,fma")))
#define ATT_FN(name) att_256_##name
#include "attention_body.h"
#define AW 16
#define ATT_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define ATT_FN(name) att_512_##name
#include "attention_body.h"
#endif

/* out[B][T][H][hd] = softmax(q k^T * scale, masked) v. q, k, v as in att_t (a head's hd floats and the keys' [S][hd]
 * contiguous); mask [B][T][S] bytes or NULL; softcap (0: none) and sinks ([H] or NULL) as att_t. path as
 * gq_matmul_parts (0 auto). Returns 0, or negative. */
int gq_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qst, const float *k, const float *v,
                 const int64_t *slots, int64_t sb, int64_t sh, const uint8_t *mask, int64_t B, int64_t H, int64_t kvh,
                 int64_t T, int64_t S, int64_t hd, float scale, float softcap, const float *sinks, float *out,
                 int nthreads, int path) {
    if (B < 1 || T < 1 || S < 1 || hd < 16 || hd % 16 || hd > MAX_HD || kvh < 1 || H % kvh != 0) return -2;
    const int best = gq_best_path();
    if (path == 0 || path > best) path = best;
    if (nthreads < 1) nthreads = 1;
    int64_t rows = TILE; /* fewer where the tiles would leave threads idle (a few rows: verification) */
    while (rows > 1 && B * ((T + rows - 1) / rows) * kvh < 2 * nthreads) rows /= 2;
    const att_t a = {q, qsb, qsh, qst, k, v, slots, sb, sh, mask, B, H, kvh, T, S, hd, scale, softcap, sinks, out, rows};
    const int64_t tasks = B * ((T + rows - 1) / rows) * kvh;
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(8 * (S + 16)));
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)S);
        if (!sc || !idx) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static, 1) /* interleaved: a causal chunk's later rows see more keys */
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !idx) continue;
#if defined(__x86_64__) || defined(__i386__)
            if (path >= 3) { att_512_range(&a, task, task + 1, sc, idx); continue; }
            if (path == 2) { att_256_range(&a, task, task + 1, sc, idx); continue; }
#endif
            att_any_range(&a, task, task + 1, sc, idx);
        }
        free(sc);
        free(idx);
    }
    return err ? -3 : 0;
}
