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

/* The scores of pairs h < NB (their queries q[h]) for the keys idx[j], j0 <= j < j1, at sc[h * sp + j - lo[h]]: each
 * key's K row loaded once for the NB pairs. Per (pair, key) the arithmetic is fixed: the dot product's 16 lanes each a
 * chain over the head dimension in order, added in hsum's tree, times the scale. */
ATT_T INL void ATT_FN(scores)(const att_t *a, const int NB, const float *const *q, const int32_t *lo, const float *K,
                              const int32_t *idx, int32_t j0, int32_t j1, float *sc, int64_t sp) {
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
        UNROLL for (int h = 0; h < NB; h++) sc[h * sp + j - lo[h]] = ATT_FN(hsum)(acc[h]) * a->scale;
    }
}

/* The (query row, head) pairs pr[0..NB) (NB a constant: their accumulators stay in registers) of one sequence and
 * KV head: pair h sees the run of keys idx[lo, hi) (lo = pr[h].lo, hi = lo + pr[h].n; the rows of a causal chunk,
 * with or without a sliding window, see overlapping runs), and the keys all pairs see, [L, H), are loaded once for
 * every pair. Per pair the arithmetic is fixed, whichever pairs share the block: its scores (scores() above), stored
 * from its own first key; softmax over its keys in order; the weighted sum of values in two partial sums, keys in
 * order, alternate keys into each (a key at an even place in idx into the first), added at the end (which sum holds
 * a pair's first key does not matter: the two are added in either order to the same bits). sc: NB x sp floats. */
ATT_T INL void ATT_FN(block)(const att_t *a, const pair_t *pr, const int NB, const float *K, const float *V,
                             const int32_t *idx, float *sc, int64_t sp) {
    const int64_t hd = a->hd, nc = hd / 16;
    const float *q[NBMAX];
    int32_t lo[NBMAX], L = pr[0].lo, H = pr[0].lo + pr[0].n;
    UNROLL for (int h = 0; h < NB; h++) {
        q[h] = pr[h].q;
        lo[h] = pr[h].lo;
        L = lo[h] > L ? lo[h] : L;
        H = lo[h] + pr[h].n < H ? lo[h] + pr[h].n : H;
    }
    H = H > L ? H : L;                                          /* [L, H): the keys every pair sees, maybe none */
    ATT_FN(scores)(a, NB, q, lo, K, idx, L, H, sc, sp);
    for (int h = 0; h < NB; h++) { /* each pair's keys before and after the shared ones */
        const int32_t hi = lo[h] + pr[h].n, before = L < hi ? L : hi;
        ATT_FN(scores)(a, 1, q + h, lo + h, K, idx, lo[h], before, sc + h * sp, sp);
        ATT_FN(scores)(a, 1, q + h, lo + h, K, idx, H > before ? H : before, hi, sc + h * sp, sp);
    }
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
    /* 16 output dims (a key's cache line) at a time, PB pairs at a time: PB x 2 x NV sums in registers; each pair's
     * keys before the shared ones, the shared ones for all (two at a time from an even place), then its keys after */
    const int PB = AW == 16 || NB < 2 ? NB : 2;
#define ATT_KEY(h, r, j) /* key j into pair h's sum r (j's parity) */                                               \
    do {                                                                                                           \
        UNROLL for (int u = 0; u < NV; u++) p[h][r][u] +=                                                          \
            sc[(g + h) * sp + (j) - lo[g + h]] * ATT_FN(ld)(vc + (int64_t)idx[j] * hd + AW * u);                   \
    } while (0)
#define ATT_RUN(h, j0, j1) /* keys [j0, j1) into pair h's sums, two at a time from an even place (no branch on a */ \
    do {                   /* key's parity: GCC would hoist the product out of both arms and not fuse it) */       \
        int32_t j_ = (j0);                                                                                         \
        if (j_ < (j1) && j_ & 1) {                                                                                 \
            ATT_KEY(h, 1, j_);                                                                                     \
            j_++;                                                                                                  \
        }                                                                                                          \
        for (; j_ + 2 <= (j1); j_ += 2) {                                                                          \
            ATT_KEY(h, 0, j_);                                                                                     \
            ATT_KEY(h, 1, j_ + 1);                                                                                 \
        }                                                                                                          \
        if (j_ < (j1)) ATT_KEY(h, 0, j_);                                                                          \
    } while (0)
    for (int64_t c = 0; c < nc; c++) {
        const float *vc = V + 16 * c;
        for (int g = 0; g < NB; g += PB) {
            VF p[NBMAX][2][NV];
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++) p[h][0][u] = p[h][1][u] = zero;
            UNROLL for (int h = 0; h < PB; h++) {
                const int32_t hi = lo[g + h] + pr[g + h].n, before = L < hi ? L : hi;
                ATT_RUN(h, lo[g + h], before);
            }
            int32_t j = L;
            if (j < H && j & 1) {
                UNROLL for (int h = 0; h < PB; h++) ATT_KEY(h, 1, j);
                j++;
            }
            for (; j + 2 <= H; j += 2)
                UNROLL for (int r = 0; r < 2; r++) UNROLL for (int u = 0; u < NV; u++) {
                    const VF v = ATT_FN(ld)(vc + (int64_t)idx[j + r] * hd + AW * u);
                    UNROLL for (int h = 0; h < PB; h++) p[h][r][u] += sc[(g + h) * sp + j + r - lo[g + h]] * v;
                }
            if (j < H) UNROLL for (int h = 0; h < PB; h++) ATT_KEY(h, 0, j);
            UNROLL for (int h = 0; h < PB; h++) {
                const int32_t hi = lo[g + h] + pr[g + h].n, before = L < hi ? L : hi;
                ATT_RUN(h, H > before ? H : before, hi);
            }
            UNROLL for (int h = 0; h < PB; h++) UNROLL for (int u = 0; u < NV; u++)
                *(VF *)(void *)(pr[g + h].o + 16 * c + AW * u) = (p[h][0][u] + p[h][1][u]) * inv[g + h];
        }
    }
#undef ATT_KEY
#undef ATT_RUN
}

/* Rows t0..t0+rt-1 of sequence b, the query heads of KV head g: their (row, head) pairs in blocks of up to NBMAX,
 * over the keys any of the rows sees (idx), each row over the run of them it sees. Where a row sees no key, or keys
 * that are not one run of those (a tree's branches), each row is a tile of its own. sc: scratch of NBMAX x sp
 * floats, idx: of S ints. */
ATT_T static void ATT_FN(tile)(const att_t *a, int64_t b, int64_t t0, int64_t rt, int64_t g, float *sc, int32_t *idx) {
    const int64_t G = a->H / a->kvh, sp = (a->S + 15) / 16 * 16;
    const int64_t at = (a->slots ? a->slots[b] : b) * a->sb + g * a->sh;
    const float *K = a->k + at, *V = a->v + at;
    const uint8_t *m = a->mask ? a->mask + (b * a->T + t0) * a->S : NULL; /* the tile's rows [rt][S] */
    int32_t n = 0, first[TILE], count[TILE];
    for (int64_t s = 0; s < a->S; s++) {
        int seen = !m;
        for (int64_t r = 0; r < rt && !seen; r++) seen = m[r * a->S + s];
        if (seen) idx[n++] = (int32_t)s;
    }
    for (int64_t r = 0; r < rt; r++) { /* row t0 + r sees idx[first, first + count), or count < 0 */
        first[r] = count[r] = 0;
        for (int32_t j = 0; j < n && count[r] >= 0; j++)
            if (!m || m[r * a->S + idx[j]]) {
                if (count[r] == 0) first[r] = j;
                count[r] = first[r] + count[r] == j ? count[r] + 1 : -1;
            }
        if (count[r] <= 0 && rt > 1) {
            for (int64_t t = t0; t < t0 + rt; t++) ATT_FN(tile)(a, b, t, 1, g, sc, idx);
            return;
        }
    }
    if (count[0] <= 0) { /* one row that sees no key (a padded row) */
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
                             first[r], count[r], (int32_t)h};
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
