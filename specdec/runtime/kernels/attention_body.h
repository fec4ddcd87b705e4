/* The attention's loops, written once over AW-float vectors (GCC vector extensions) and included by attention.c once
 * per instruction set. The includer defines AW (8 or 16: the floats per vector), ATT_T (the target attribute) and
 * ATT_FN(name) (the copy's names); this file undefines them at its end.
 *
 * The arithmetic is stated over 16 lanes, and a 16-lane value is held in 16 / AW vectors: every lane sees the same
 * operations in the same order at either width, so the AVX2 copy (AW 8: 16 ymm registers hold a block's sums) and
 * the AVX-512 copy (AW 16) compute the same values. (A 16-float vector type on AVX2 made GCC spill the block's
 * accumulators to the stack, which was slower than torch's attention.) */

#define NV (16 / AW)
#define NBMAX (AW == 16 ? 8 : 4) /* pairs a block holds in registers */
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

/* The scores sc[h * sp + j] of pairs h < NB (their queries q[h]) for the keys idx[j], j0 <= j < j1: each key's K row
 * loaded once for the NB pairs. Per (pair, key) the arithmetic is fixed: the dot product's 16 lanes each a chain
 * over the head dimension in order, added in hsum's tree, times the scale. */
ATT_T INL void ATT_FN(scores)(const att_t *a, const int NB, const float *const *q, const float *K, const int32_t *idx,
                              int32_t j0, int32_t j1, float *sc, int64_t sp) {
    const int64_t hd = a->hd, nc = hd / 16;
    for (int32_t j = j0; j < j1; j++) {
        const float *kr = K + (int64_t)idx[j] * hd;
        VF acc[NBMAX][NV];
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
}

/* The (query row, head) pairs pr[0..NB) (NB a constant: their accumulators stay in registers) of one sequence and
 * KV head over the keys idx[0..pr[h].n): pair h sees the first pr[h].n of them (rows of a causal chunk see nested
 * prefixes), the keys all see loaded once for every pair. Per pair the arithmetic is fixed, whichever pairs share
 * the block: its scores (scores() above); softmax over its keys in order; the weighted sum of values in two partial
 * sums (key j into sum j % 2) added at the end. sc: NB x sp floats. */
ATT_T INL void ATT_FN(block)(const att_t *a, const pair_t *pr, const int NB, const float *K, const float *V,
                             const int32_t *idx, float *sc, int64_t sp) {
    const int64_t hd = a->hd, nc = hd / 16;
    const float *q[NBMAX];
    int32_t nmin = pr[0].n;
    UNROLL for (int h = 0; h < NB; h++) {
        q[h] = pr[h].q;
        nmin = pr[h].n < nmin ? pr[h].n : nmin;
    }
    ATT_FN(scores)(a, NB, q, K, idx, 0, nmin, sc, sp);
    for (int h = 0; h < NB; h++) /* each pair's keys beyond the shared ones */
        ATT_FN(scores)(a, 1, q + h, K, idx, nmin, pr[h].n, sc + h * sp, sp);
    if (a->softcap > 0)
        for (int h = 0; h < NB; h++)
            for (int32_t j = 0; j < pr[h].n; j++) sc[h * sp + j] = tanhf(sc[h * sp + j] / a->softcap) * a->softcap;
    const VF zero = {0};
    float inv[NBMAX];
    UNROLL for (int h = 0; h < NB; h++) {
        const int32_t n = pr[h].n;
        float *s = sc + h * sp, mx = a->sinks ? a->sinks[pr[h].head] : -INFINITY;
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
            sum += ATT_FN(exp_neg)(zero + (a->sinks[pr[h].head] - mx))[0];
        inv[h] = 1.0f / sum;
    }
    /* 16 output dims (a key's cache line) at a time, PB pairs at a time: PB x 2 x NV sums in registers; the keys all
     * pairs see first, then each pair's own, in the same two sums */
    const int PB = AW == 16 || NB < 2 ? NB : 2;
    for (int64_t c = 0; c < nc; c++) {
        const float *vc = V + 16 * c;
        for (int g = 0; g < NB; g += PB) {
            VF p[NBMAX][2][NV];
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++) p[h][0][u] = p[h][1][u] = zero;
            const float *w = sc + g * sp;
            int32_t j = 0;
            for (; j + 2 <= nmin; j += 2)
                UNROLL for (int r = 0; r < 2; r++) UNROLL for (int u = 0; u < NV; u++) {
                    const VF v = ATT_FN(ld)(vc + (int64_t)idx[j + r] * hd + AW * u);
                    UNROLL for (int h = 0; h < PB; h++) p[h][r][u] += w[h * sp + j + r] * v;
                }
            UNROLL for (int h = 0; h < PB; h++) {
                const int32_t n = pr[g + h].n;
                int32_t i = j;
                for (; i + 2 <= n; i += 2)
                    UNROLL for (int r = 0; r < 2; r++) UNROLL for (int u = 0; u < NV; u++)
                        p[h][r][u] += w[h * sp + i + r] * ATT_FN(ld)(vc + (int64_t)idx[i + r] * hd + AW * u);
                if (i < n)
                    UNROLL for (int u = 0; u < NV; u++)
                        p[h][0][u] += w[h * sp + i] * ATT_FN(ld)(vc + (int64_t)idx[i] * hd + AW * u);
            }
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++)
                *(VF *)(void *)(pr[g + h].o + 16 * c + AW * u) = (p[h][0][u] + p[h][1][u]) * inv[g + h];
        }
    }
}

/* Rows t0..t0+rt-1 of sequence b, the query heads of KV head g: their (row, head) pairs in blocks of 4 (then 2, 1),
 * over the last row's visible keys (idx), each row over the prefix of them it sees. Where a row sees no key, or keys
 * other than such a prefix (a tree's branches), each row is a tile of its own. sc: scratch of 4 x sp floats, idx: of
 * S ints. */
ATT_T static void ATT_FN(tile)(const att_t *a, int64_t b, int64_t t0, int64_t rt, int64_t g, float *sc, int32_t *idx) {
    const int64_t G = a->H / a->kvh, sp = (a->S + 15) / 16 * 16;
    const int64_t at = (a->slots ? a->slots[b] : b) * a->sb + g * a->sh;
    const float *K = a->k + at, *V = a->v + at;
    const uint8_t *m = a->mask ? a->mask + (b * a->T + t0 + rt - 1) * a->S : NULL;
    int32_t n = 0, seen[TILE]; /* rt <= TILE */
    for (int64_t s = 0; s < a->S; s++)
        if (!m || m[s]) idx[n++] = (int32_t)s;
    for (int64_t r = 0; r < rt; r++) { /* seen[r]: how many of idx row t0 + r sees, -1: none, or not a prefix */
        const uint8_t *mr = a->mask ? a->mask + (b * a->T + t0 + r) * a->S : NULL;
        int32_t k = 0;
        for (int64_t s = 0; s < a->S && k >= 0; s++)
            if (!mr || mr[s]) k = k < n && idx[k] == s ? k + 1 : -1;
        seen[r] = k > 0 ? k : -1;
        if (seen[r] < 0 && rt > 1) {
            for (int64_t t = t0; t < t0 + rt; t++) ATT_FN(tile)(a, b, t, 1, g, sc, idx);
            return;
        }
    }
    if (seen[0] < 0) { /* one row that sees no key (a padded row) */
        for (int64_t h = g * G; h < (g + 1) * G; h++)
            memset(a->out + ((b * a->T + t0) * a->H + h) * a->hd, 0, sizeof(float) * (size_t)a->hd);
        return;
    }
    pair_t pr[NBMAX];
    for (int64_t i = 0, P = rt * G; i < P;) {
        const int NB = P - i >= NBMAX ? NBMAX : P - i >= 4 ? 4 : P - i >= 2 ? 2 : 1;
        for (int k = 0; k < NB; k++, i++) {
            const int64_t r = i / G, h = g * G + i % G, row = b * a->T + t0 + r;
            pr[k] = (pair_t){a->q + b * a->qsb + h * a->qsh + (t0 + r) * a->qst, a->out + (row * a->H + h) * a->hd,
                             seen[r], (int32_t)h};
        }
        if (NB == 8) ATT_FN(block)(a, pr, NBMAX, K, V, idx, sc, sp);
        else if (NB == 4) ATT_FN(block)(a, pr, 4, K, V, idx, sc, sp);
        else if (NB == 2) ATT_FN(block)(a, pr, 2, K, V, idx, sc, sp);
        else ATT_FN(block)(a, pr, 1, K, V, idx, sc, sp);
    }
}

/* tasks t0..t1, task = ((b * tiles + tile) * kvh + g), a tile a->rows rows of one sequence (fewer at its end) */
ATT_T static void ATT_FN(range)(const att_t *a, int64_t t0, int64_t t1, float *sc, int32_t *idx) {
    const int64_t R = a->rows, tiles = (a->T + R - 1) / R;
    for (int64_t task = t0; task < t1; task++) {
        const int64_t g = task % a->kvh, bt = task / a->kvh, b = bt / tiles, t = bt % tiles * R;
        ATT_FN(tile)(a, b, t, a->T - t < R ? a->T - t : R, g, sc, idx);
    }
}

#undef VF
#undef VI
#undef NV
#undef NBMAX
#undef AW
#undef ATT_T
#undef ATT_FN
