/* The attention's loops, written once over AW-float vectors (GCC vector extensions) and included by attention.c once
 * per instruction set. The includer defines AW (8 or 16: the floats per vector), ATT_T (the target attribute) and
 * ATT_FN(name) (the copy's names); this file undefines them at its end.
 *
 * The arithmetic is stated over 16 lanes, and a 16-lane value is held in 16 / AW vectors: every lane sees the same
 * operations in the same order at either width, so the AVX2 copy (AW 8: 16 ymm registers hold a block's sums) and
 * the AVX-512 copy (AW 16) compute the same values. (A 16-float vector type on AVX2 made GCC spill the block's
 * accumulators to the stack, which was slower than torch's attention.) */

#define NV (16 / AW)
typedef float ATT_FN(vf) __attribute__((vector_size(AW * 4), aligned(4)));
typedef int32_t ATT_FN(vi) __attribute__((vector_size(AW * 4), aligned(4)));
#define VF ATT_FN(vf)
#define VI ATT_FN(vi)

ATT_T INL VF ATT_FN(ld)(const float *p) { return *(const VF *)(const void *)p; } /* VF is 4-byte aligned */

VEC_EXP_NEG(ATT_FN(exp_neg), VF, VI, ATT_T) /* vec_exp.h */

/* The sum of a 16-lane value x[0..NV) in a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1 */
ATT_T INL float ATT_FN(hsum)(const VF *x) {
#if AW == 16
    VF v = x[0];
    v += __builtin_shuffle(v, (VI){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (VI){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (VI){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (VI){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else /* lanes l and l + 8 are x[0][l] and x[1][l]; then the same steps on lanes 0..7 */
    VF v = x[0] + x[1];
    v += __builtin_shuffle(v, (VI){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (VI){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (VI){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* Heads h0..h0+NB-1 (NB a constant: their accumulators stay in registers) of one (b, t) over the visible keys
 * idx[0..n): each key's K row is loaded once for the NB heads. Per head the arithmetic is fixed: the dot product's
 * 16 lanes each a chain over the head dimension in order, added in hsum's tree; softmax over the keys in order; the
 * weighted sum of values in two partial sums (key j into sum j % 2) added at the end. sc: NB x sp floats. */
ATT_T INL void ATT_FN(block)(const att_t *a, int64_t b, int64_t t, int64_t h0, const int NB, const float *K,
                             const float *V, const int32_t *idx, int32_t n, float *sc, int64_t sp) {
    const int64_t hd = a->hd, nc = hd / 16;
    const float *q[4];
    float *o[4];
    UNROLL for (int h = 0; h < NB; h++) {
        q[h] = a->q + b * a->qsb + (h0 + h) * a->qsh + t * a->qst;
        o[h] = a->out + ((b * a->T + t) * a->H + h0 + h) * hd;
    }
    for (int32_t j = 0; j < n; j++) {
        const float *kr = K + (int64_t)idx[j] * hd;
        VF acc[4][NV];
        UNROLL for (int u = 0; u < NV; u++) {
            const VF k0 = ATT_FN(ld)(kr + AW * u);
            UNROLL for (int h = 0; h < NB; h++) acc[h][u] = ATT_FN(ld)(q[h] + AW * u) * k0;
        }
        for (int64_t c = 1; c < nc; c++)
            UNROLL for (int u = 0; u < NV; u++) {
                const VF kc = ATT_FN(ld)(kr + 16 * c + AW * u);
                UNROLL for (int h = 0; h < NB; h++) acc[h][u] += ATT_FN(ld)(q[h] + 16 * c + AW * u) * kc;
            }
        UNROLL for (int h = 0; h < NB; h++) sc[h * sp + j] = ATT_FN(hsum)(acc[h]) * a->scale;
    }
    if (a->softcap > 0)
        for (int h = 0; h < NB; h++)
            for (int32_t j = 0; j < n; j++) sc[h * sp + j] = tanhf(sc[h * sp + j] / a->softcap) * a->softcap;
    const VF zero = {0};
    float inv[4];
    UNROLL for (int h = 0; h < NB; h++) {
        float *s = sc + h * sp, mx = a->sinks ? a->sinks[h0 + h] : -INFINITY;
        for (int32_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        for (int32_t j = n; j < (n + 15) / 16 * 16; j++) s[j] = -INFINITY; /* padding: e^-inf ~ 0 below */
        VF tot[NV];
        UNROLL for (int u = 0; u < NV; u++) tot[u] = zero;
        for (int32_t j = 0; j < n; j += 16)
            UNROLL for (int u = 0; u < NV; u++) {
                const VF e = ATT_FN(exp_neg)(ATT_FN(ld)(s + j + AW * u) - mx);
                *(VF *)(void *)(s + j + AW * u) = e;
                tot[u] += e;
            }
        float sum = ATT_FN(hsum)(tot);
        if (a->sinks) /* the sink's exponential, through the same polynomial, added last */
            sum += ATT_FN(exp_neg)(zero + (a->sinks[h0 + h] - mx))[0];
        inv[h] = 1.0f / sum;
    }
    /* 16 output dims (a key's cache line) at a time, PB heads at a time: PB x 2 x NV sums in registers */
    const int PB = AW == 16 || NB < 2 ? NB : 2;
    for (int64_t c = 0; c < nc; c++) {
        const float *vc = V + 16 * c;
        for (int g = 0; g < NB; g += PB) {
            VF p[4][2][NV];
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++) p[h][0][u] = p[h][1][u] = zero;
            const float *w = sc + g * sp;
            int32_t j = 0;
            for (; j + 2 <= n; j += 2)
                UNROLL for (int r = 0; r < 2; r++) UNROLL for (int u = 0; u < NV; u++) {
                    const VF v = ATT_FN(ld)(vc + (int64_t)idx[j + r] * hd + AW * u);
                    UNROLL for (int h = 0; h < PB; h++) p[h][r][u] += w[h * sp + j + r] * v;
                }
            if (j < n)
                UNROLL for (int u = 0; u < NV; u++) {
                    const VF v = ATT_FN(ld)(vc + (int64_t)idx[j] * hd + AW * u);
                    UNROLL for (int h = 0; h < PB; h++) p[h][0][u] += w[h * sp + j] * v;
                }
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++)
                *(VF *)(void *)(o[g + h] + 16 * c + AW * u) = (p[h][0][u] + p[h][1][u]) * inv[g + h];
        }
    }
}

/* the query heads of kv head g for one (b, t); sc: scratch of 4 x sp floats, idx: of S ints */
ATT_T INL void ATT_FN(group)(const att_t *a, int64_t b, int64_t t, int64_t g, float *sc, int32_t *idx) {
    const int64_t G = a->H / a->kvh, sp = (a->S + 15) / 16 * 16;
    const int64_t at = (a->slots ? a->slots[b] : b) * a->sb + g * a->sh;
    const float *K = a->k + at, *V = a->v + at;
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
    for (; h + 4 <= (g + 1) * G; h += 4) ATT_FN(block)(a, b, t, h, 4, K, V, idx, n, sc, sp);
    if (h + 2 <= (g + 1) * G) {
        ATT_FN(block)(a, b, t, h, 2, K, V, idx, n, sc, sp);
        h += 2;
    }
    if (h < (g + 1) * G) ATT_FN(block)(a, b, t, h, 1, K, V, idx, n, sc, sp);
}

/* tasks t0..t1, task = (b * T + t) * kvh + g */
ATT_T static void ATT_FN(range)(const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) {
    for (int64_t task = t0; task < t1; task++) {
        const int64_t g = task % a->kvh, bt = task / a->kvh;
        ATT_FN(group)(a, bt / a->T, bt % a->T, g, sc, idx);
    }
}

#undef VF
#undef VI
#undef NV
#undef AW
#undef ATT_T
#undef ATT_FN
