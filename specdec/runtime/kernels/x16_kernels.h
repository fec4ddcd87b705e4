/* The kernels for the x16 layout, written once over 16-lane vectors and included by ggml_q.c once per instruction
 * set. The includer defines X16_T (the target attribute), X16_FN(name) (the copy's function names), V(op) (its
 * vector operations), VI / VF / VNEG (its vector types: 16 dwords, 16 floats, Q8_0's signs), X16_DOT (the 4-byte
 * dots, ggml_q.c) and X16_SIGNED_Q8 (1: Q8_0's quants split into |q| and signs; 0: kept unsigned, + 128, as
 * vpdpbusd takes them); X16_KQUANT, optional, names the includer's own kernel for Q4_K and Q6_K (AVX2: x16_avx2.h),
 * else the body below serves them; this file undefines them at its end, so each inclusion states all of them. The
 * AMX kernels (x16_amx.h) unpack and scale with this file's helpers (kq_*, b32_block) and so share its bits.
 *
 * The repacked quants load straight into dword lanes (one 16-lane vector = 4 inputs x 16 outputs, a nibble shift
 * apart from the next 4), so each row needs one 4-byte dot per lane and 4 inputs and nothing is transposed. */

/* Superblock P's scale dv and offset mv per output */
X16_T INL void X16_FN(kq_dm)(int q6, const uint8_t *P, VF *dv, VF *mv) {
    *dv = V(half)(P + (q6 ? X6_D : X4_D));
    *mv = q6 ? V(mul)(*dv, V(setf)(-32.0f)) : V(mul)(V(half)(P + X4_DMIN), V(setf)(-1.0f));
}

/* Step `step` of superblock P: its two groups g and their quants w, unpacked (K = 8 lines for Q4_K, 4 for Q6_K) */
X16_T INL void X16_FN(kq_step)(int q6, const uint8_t *P, int step, int *g, VI (*w)[8]) {
    const VI m4 = V(set8)(0x0F), m3 = V(set8)(0x03);
    const int h = step / 4, j = step % 4, line0 = q6 ? 16 * h + 4 * j : 8 * j, K = q6 ? 4 : 8;
    g[0] = q6 ? 4 * h + j : j;
    g[1] = q6 ? 8 + 4 * h + j : j + 4;
    for (int i = 0; i < K; i++) {
        const VI v = V(load)(P + 64 * (line0 + i));
        w[0][i] = V(and)(v, m4);
        w[1][i] = V(and)(V(srl16)(v, 4), m4);
        if (q6) {
            const VI hb = V(load)(P + X6_HB + 64 * (4 * j + i));
            w[0][i] = V(or)(w[0][i], V(sll16)(V(and)(V(srl16)(hb, 2 * h), m3), 4));
            w[1][i] = V(or)(w[1][i], V(sll16)(V(and)(V(srl16)(hb, 4 + 2 * h), m3), 4));
        }
    }
}

/* Group g's scale s and offset o per output, from the superblock's dv and mv */
X16_T INL void X16_FN(kq_consts)(int q6, const uint8_t *P, int g, VF dv, VF mv, VF *s, VF *o) {
    *s = V(mul)(V(scales)(P + (q6 ? X6_SC : X4_SC) + 16 * g, q6), dv);
    *o = q6 ? V(mul)(*s, V(setf)(-32.0f)) : V(mul)(V(scales)(P + X4_M + 16 * g, 0), mv);
}

/* Q4_K / Q6_K x16 (16 outputs). Each step of a superblock covers two groups: Q4_K j and j + 4 (the low and high
 * nibbles of lines 8j ..), Q6_K 4h + j and 8 + 4h + j; their quants are unpacked into registers once for all rows.
 * Per row and group: the integer dot, then bacc += dot x the group's scale (s) and acc += its offset (o) x the row's
 * activation sum over the group, group by group (both groups' dots first, then their float steps, took Q4_K
 * 1.08-1.24x the time from 4 rows on and Q6_K up to 1.05x: AVX-512 VNNI, Zen 5, python scripts/bench_kernels.py). A
 * row's float steps are the same, in the same order, however many rows share the call, so its result does not depend
 * on how the call was split. */
X16_T static inline __attribute__((always_inline)) void X16_FN(body)(int type, const uint8_t *W, const act_t *A,
                                                                    int64_t r0, int nr, float *y, int64_t ystride,
                                                                    int64_t b0, int64_t b1, int accum) {
    const int q6 = type == GQ_X16 + GQ_Q6_K;
    const int64_t sb = q6 ? X6_BYTES : X4_BYTES, in = A->in, ng = in / A->G, ns = in / A->S;
    const int npb = q6 ? 16 : 8, K = q6 ? 4 : 8, nsteps = q6 ? 8 : 4, bits = q6 ? 6 : 4;
    VF acc[RT], bacc[RT];
    for (int r = 0; r < nr; r++) acc[r] = V(zerof)();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *P = W + b * sb;
        VF dv, mv;
        X16_FN(kq_dm)(q6, P, &dv, &mv);
        for (int r = 0; r < nr; r++) bacc[r] = V(zerof)();
        for (int step = 0; step < nsteps; step++) {
            int g[2];
            VI w[2][8];
            VF s[2], o[2];
            prefetch_share(P, (int)sb, step, nsteps);
            X16_FN(kq_step)(q6, P, step, g, w);
            for (int x = 0; x < 2; x++) X16_FN(kq_consts)(q6, P, g[x], dv, mv, &s[x], &o[x]);
            for (int r = 0; r < nr; r++) {
                const int32_t *a = (const int32_t *)(const void *)(A->q + (r0 + r) * in + b * 256);
                const float *sr = A->s + (r0 + r) * ns + b * npb;
                for (int x = 0; x < 2; x++) {
                    const VI isum = X16_DOT(V(zero)(), w[x], a + K * g[x], K, bits, NULL);
                    bacc[r] = V(fma)(V(cvt)(isum), s[x], bacc[r]);
                    acc[r] = V(fma)(o[x], V(setf)(sr[g[x]]), acc[r]);
                }
            }
        }
        for (int r = 0; r < nr; r++) acc[r] = V(fma)(bacc[r], V(setf)(A->d[(r0 + r) * ng + b]), acc[r]);
    }
    for (int r = 0; r < nr; r++) {
        VF v = acc[r];
        if (accum) v = V(add)(v, V(loadf)(y + r * ystride));
        V(storef)(y + r * ystride, v);
    }
}

/* Q8_0 / Q5_0 / Q4_1 / MXFP4 x16: 16 outputs x 32 inputs per superblock, 8 dwords per row; activation scale per block.
 * Superblock P's quants wz (8 lines; Q8_0's signs in neg where X16_SIGNED_Q8), its scale dv and offset ov. */
X16_T INL void X16_FN(b32_block)(int type, const uint8_t *P, VI *wz, VNEG *neg, VF *dv, VF *ov) {
    const int q8 = type == GQ_X16 + GQ_Q8_0, q41 = type == GQ_X16 + GQ_Q4_1, mx = type == GQ_X16 + GQ_MXFP4;
    const VI m4 = V(set8)(0x0F), b4 = V(set8)(0x10);
    *dv = mx ? V(e8m0)(P + XM_E) : V(half)(P + (q8 ? X8_D : q41 ? X41_D : X5_D));
    *ov = q41 ? V(half)(P + X41_M) : V(mul)(*dv, V(setf)(q8 ? -128.0f * !X16_SIGNED_Q8 : mx ? -12.0f : -16.0f));
    for (int k = 0; k < 8; k++) {
        if (q8) {
            wz[k] = V(load)(P + 64 * k);
            if (X16_SIGNED_Q8) wz[k] = V(q8split)(wz[k], &neg[k]);
        } else {
            const VI v = V(load)(P + 64 * (k % 4));
            const VI nib = V(and)(k < 4 ? v : V(srl16)(v, 4), m4);
            wz[k] = q41 ? nib : mx ? V(lut)(nib) : V(or)(nib, V(bits)(P + X5_HB + 8 * k, b4));
        }
    }
}

X16_T static inline __attribute__((always_inline)) void X16_FN(body32)(int type, const uint8_t *W, const act_t *A,
                                                                      int64_t r0, int nr, float *y, int64_t ystride,
                                                                      int64_t b0, int64_t b1, int accum) {
    const int q8 = type == GQ_X16 + GQ_Q8_0, q41 = type == GQ_X16 + GQ_Q4_1;
    const int64_t sb = x16_bytes(type & ~GQ_X16), in = A->in, ng = in / A->G;
    const VI zero = V(zero)();
    VF acc[RT];
    for (int r = 0; r < nr; r++) acc[r] = V(zerof)();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *P = W + b * sb;
        VI wz[8];
        VNEG neg[8];
        VF dv, ov;
        prefetch_weights(P, (int)sb);
        X16_FN(b32_block)(type, P, wz, neg, &dv, &ov);
        for (int r = 0; r < nr; r++) {
            const int32_t *a = (const int32_t *)(const void *)(A->q + (r0 + r) * in + b * 32);
            const VI isum = X16_DOT(zero, wz, a, 8, q8 ? 8 : q41 ? 4 : 5, q8 && X16_SIGNED_Q8 ? neg : NULL); /* MXFP4: <= 24 */
            const float ad = A->d[(r0 + r) * ng + b], as = A->s[(r0 + r) * ng + b]; /* S = G = 32 */
            acc[r] = V(fma)(V(cvt)(isum), V(mul)(dv, V(setf)(ad)), acc[r]);
            acc[r] = V(fma)(ov, V(setf)(as), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        VF v = acc[r];
        if (accum) v = V(add)(v, V(loadf)(y + r * ystride));
        V(storef)(y + r * ystride, v);
    }
}

X16_T static void X16_FN(matmul)(int type, const uint8_t *W, const act_t *A, int64_t r0, int nr, float *y,
                                 int64_t ystride, int64_t b0, int64_t b1, int accum) {
    switch (type) { /* one row (decode) gets its own copy: the row loop unrolled away */
#define KX16_CASE(T, BODY)                                                                                   \
    case T:                                                                                                  \
        if (nr == 1) BODY(T, W, A, r0, 1, y, ystride, b0, b1, accum);                                        \
        else BODY(T, W, A, r0, nr, y, ystride, b0, b1, accum);                                               \
        break;
#ifndef X16_KQUANT
#define X16_KQUANT X16_FN(body)
#endif
    KX16_CASE(GQ_X16 + GQ_Q4_K, X16_KQUANT)
    KX16_CASE(GQ_X16 + GQ_Q6_K, X16_KQUANT)
    KX16_CASE(GQ_X16 + GQ_Q8_0, X16_FN(body32))
    KX16_CASE(GQ_X16 + GQ_Q5_0, X16_FN(body32))
    KX16_CASE(GQ_X16 + GQ_Q4_1, X16_FN(body32))
    KX16_CASE(GQ_X16 + GQ_MXFP4, X16_FN(body32))
#undef KX16_CASE
    }
}

#undef X16_T
#undef X16_FN
#undef V
#undef VI
#undef VF
#undef VNEG
#undef X16_DOT
#undef X16_SIGNED_Q8
#undef X16_KQUANT
