/* AVX2 kernels for the x16 layout's K-quants (Q4_K, Q6_K), included by ggml_q.c after its v2_ helpers. AVX2 has 16
 * vector registers and no VNNI, so a 4-input dot costs vpmaddubsw + vpaddw per 16 outputs and a row: what else runs
 * per dot decides the speed once several rows share the weights (verification, prefill). Here
 *   - rows go in tiles of up to 4 that share each weight register (one nibble unpack serves 4 rows);
 *   - a group's 16-bit pair sums are scaled by the group's integer scale with vpmaddwd into 32-bit sums over the
 *     superblock, converted to float once per superblock and row (the shared body converts per group);
 *   - Q6_K always, and Q4_K from X2_UNPACK_ROWS rows on, first unpack the superblock's quants into bytes in L1
 *     (U: group g's lines at U + 64 * lines * g), so the tiles read ready bytes.
 *   - the first tile of a superblock prefetches the weights PREFETCH_AHEAD bytes on, a share in each group
 *     (prefetch_share), except Q4_K at X2_UNPACK_ROWS rows and more (compute-bound: all at the superblock's start).
 * A row's arithmetic is the same for every tile size and either source (integer sums, then the same float steps in
 * the same order), so its result does not depend on how many rows share the call. On AMD Zen 3 (2 threads,
 * python scripts/bench_kernels.py) Q4_K 8960x1536 went from 76.1 to 35.9 ms at 512 rows
 * and from 1.80 to 0.82 ms at 8. Q4_K's group sums stay in range before widening (8 lines x 2 x 15 x 127 < 2^15);
 * Q6_K's take the -32 in 16 bits (x2_group), so they too widen once per group and need no float offsets. */

#define X2_UNPACK_ROWS 16

/* 16 scale bytes at p (unsigned Q4_K, signed Q6_K) -> the 16 outputs' scales as int16 pairs (s, s) per dword: the
 * bytes in both 128-bit lanes, each dword's pair picked by one vpshufb (signed: into the high bytes, then shifted
 * down arithmetically) */
T256 INL v2i x2_scale_pairs(const uint8_t *p, int is_signed) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const char z = (char)0x80;
    if (is_signed) {
        const __m256i l = _mm256_setr_epi8(z, 0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3, z, 4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z, 7);
        const __m256i h = _mm256_add_epi8(l, _mm256_set1_epi16(8 << 8));
        return (v2i){_mm256_srai_epi16(_mm256_shuffle_epi8(b, l), 8), _mm256_srai_epi16(_mm256_shuffle_epi8(b, h), 8)};
    }
    const __m256i l = _mm256_setr_epi8(0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3, z, 4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z, 7, z);
    const __m256i h = _mm256_add_epi8(l, _mm256_set1_epi16(8));
    return (v2i){_mm256_shuffle_epi8(b, l), _mm256_shuffle_epi8(b, h)};
}

/* s[r] += the 16-bit dots of n lines at L (16 outputs x 4 inputs each) with row r's activation dwords a[r][0..n);
 * nib < 0: the lines are bytes as they are; 0 or 4: the nibble at that shift */
T256 INL void x2_lines(const uint8_t *L, int n, int nib, const int8_t *const *a, int R, __m256i *sl, __m256i *sh) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < n; i++) {
        __m256i wl = _mm256_loadu_si256((const __m256i *)(L + 64 * i));
        __m256i wh = _mm256_loadu_si256((const __m256i *)(L + 64 * i + 32));
        if (nib > 0) {
            wl = _mm256_srli_epi16(wl, nib);
            wh = _mm256_srli_epi16(wh, nib);
        }
        if (nib >= 0) {
            wl = _mm256_and_si256(wl, m4);
            wh = _mm256_and_si256(wh, m4);
        }
        for (int r = 0; r < R; r++) {
            const __m256i av = _mm256_set1_epi32((int)rd32((const uint8_t *)a[r] + 4 * i));
            sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(wl, av));
            sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(wh, av));
            __asm__("" : "+x"(sl[r]), "+x"(sh[r])); /* keeps gcc from regrouping the sums (and spilling them) */
        }
    }
}

/* group g of rows r0 .. r0 + R: il/ih += its integer sums times the group's scale. Q4_K: its 8 lines' 16-bit sums
 * (in range, see above) widened at once; acc += the group's offsets (oc) times the row's activation sum. Q6_K: its 4
 * lines' 16-bit sums less the row's A->p (32 x the activations of the same lanes) are its sums of (q - 32) * a,
 * within +-8 x 32 x 127 < 2^15, so exact although the partial sums may wrap (vpaddw and vpsubw are modular and no
 * vpmaddubsw pair saturates: 2 x 63 x 127), then widened: no float offsets */
T256 INL void x2_group(int q6, const uint8_t *P, const uint8_t *U, const act_t *A, int64_t r0, int R, int64_t b, int g,
                       int nib, const int8_t *const *a, __m256i *il, __m256i *ih, const v2f *oc, v2f *acc, int pf) {
    const int nl = q6 ? 4 : 8;
    if (pf) prefetch_share(P, q6 ? X6_BYTES : X4_BYTES, g, q6 ? 16 : 8);
    const uint8_t *L = U ? U + 64 * nl * g : P + 512 * (g % 4);
    const v2i sc = x2_scale_pairs(P + (q6 ? X6_SC : X4_SC) + 16 * g, q6);
    const int8_t *ai[4];
    __m256i sl[4], sh[4];
    for (int r = 0; r < R; r++) {
        ai[r] = a[r] + 4 * nl * g;
        sl[r] = sh[r] = _mm256_setzero_si256();
    }
    x2_lines(L, nl, nib, ai, R, sl, sh);
    for (int r = 0; r < R; r++) {
        if (q6) {
            const __m256i off = _mm256_set1_epi32(A->p[(r0 + r) * (A->in / 16) + b * 16 + g]);
            sl[r] = _mm256_sub_epi16(sl[r], off);
            sh[r] = _mm256_sub_epi16(sh[r], off);
        }
        il[r] = _mm256_add_epi32(il[r], _mm256_madd_epi16(sl[r], sc.l));
        ih[r] = _mm256_add_epi32(ih[r], _mm256_madd_epi16(sh[r], sc.h));
    }
    if (q6) return;
    const int64_t ns = A->in / A->S;
    for (int r = 0; r < R; r++) acc[r] = v2_fma(oc[g], v2_setf(A->s[(r0 + r) * ns + b * 8 + g]), acc[r]);
}

/* Rows r0 .. r0 + R of superblock b (at P; its quants unpacked at U, or U == NULL: Q4_K's nibbles read at P) into
 * acc[0..R): groups of 32 (Q4_K) or 16 (Q6_K) inputs; oc[g] (Q4_K): the group's offsets per output, -dmin * m */
T256 INL void x2_tile(int q6, const uint8_t *P, const uint8_t *U, const act_t *A, int64_t r0, int R, int64_t b,
                      v2f dv, const v2f *oc, v2f *acc, int pf) {
    const int ngr = q6 ? 16 : 8;
    const int64_t in = A->in, ng = in / A->G;
    const int8_t *a[4];
    __m256i il[4], ih[4];
    for (int r = 0; r < R; r++) {
        a[r] = A->q + (r0 + r) * in + b * 256;
        il[r] = ih[r] = _mm256_setzero_si256();
    }
    for (int g = 0; g < ngr / 2; g++) x2_group(q6, P, U, A, r0, R, b, g, U ? -1 : 0, a, il, ih, oc, acc, pf);
    for (int g = ngr / 2; g < ngr; g++) x2_group(q6, P, U, A, r0, R, b, g, U ? -1 : 4, a, il, ih, oc, acc, pf);
    for (int r = 0; r < R; r++)
        acc[r] = v2_fma(v2_cvt((v2i){il[r], ih[r]}), v2_mul(dv, v2_setf(A->d[(r0 + r) * ng + b])), acc[r]);
}

/* Q4_K superblock at P -> U: group g (low nibbles of lines 8g.., or high nibbles of lines 8(g - 4)..) at U + 512 g */
T256 INL void x2_unpack_q4(const uint8_t *P, uint8_t *U) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < 64; k++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(P + 32 * k));
        _mm256_storeu_si256((__m256i *)(U + 32 * k), _mm256_and_si256(w, m4));
        _mm256_storeu_si256((__m256i *)(U + 2048 + 32 * k), _mm256_and_si256(_mm256_srli_epi16(w, 4), m4));
    }
}

/* Q6_K superblock at P -> U: group g's 4 lines of 6-bit values at U + 256 g (groups 4h + j: low nibbles of lines
 * 16h + 4j + i; 8 + 4h + j: high nibbles; bits 4-5 from high-bit line 4j + i at bits 2h, resp. 4 + 2h) */
T256 INL void x2_unpack_q6(const uint8_t *P, uint8_t *U) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < 2; k++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(P + 64 * (16 * h + 4 * j + i) + 32 * k));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(P + X6_HB + 64 * (4 * j + i) + 32 * k));
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(w, m4), _mm256_and_si256(_mm256_slli_epi16(hb, h ? 2 : 4), m30));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4),
                                                       _mm256_and_si256(h ? _mm256_srli_epi16(hb, 2) : hb, m30));
                    _mm256_storeu_si256((__m256i *)(U + 256 * (4 * h + j) + 64 * i + 32 * k), lo);
                    _mm256_storeu_si256((__m256i *)(U + 256 * (8 + 4 * h + j) + 64 * i + 32 * k), hi);
                }
}

/* every tile of up to 4 rows, R a constant in each copy; PF: the first tile prefetches (x2_group) */
#define X2_TILE(Q6, SRC, R, PF) x2_tile(Q6, P, SRC, A, r0 + r, R, b, dv, oc, acc + r, PF)
#define X2_TILES(Q6, SRC, PF)                                                                                \
    do {                                                                                                     \
        int r = 0;                                                                                           \
        if (nr >= 4) {                                                                                       \
            X2_TILE(Q6, SRC, 4, PF);                                                                         \
            r = 4;                                                                                           \
        }                                                                                                    \
        for (; r + 4 <= nr; r += 4) X2_TILE(Q6, SRC, 4, 0);                                                  \
        switch (nr - r) {                                                                                    \
        case 3: X2_TILE(Q6, SRC, 3, PF && r == 0); break;                                                    \
        case 2: X2_TILE(Q6, SRC, 2, PF && r == 0); break;                                                    \
        case 1: X2_TILE(Q6, SRC, 1, PF && r == 0); break;                                                    \
        }                                                                                                    \
    } while (0)

/* The x16 kernel's signature (x16_kernels.h) for Q4_K / Q6_K on AVX2. */
T256 static void kx16_avx2_kquant(int type, const uint8_t *W, const act_t *A, int64_t r0, int nr, float *y,
                                  int64_t ystride, int64_t b0, int64_t b1, int accum) {
    const int q6 = type == GQ_X16 + GQ_Q6_K;
    v2f acc[RT];
    uint8_t U[4096] __attribute__((aligned(32)));
    for (int r = 0; r < nr; r++) acc[r] = v2_zerof();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *P = W + b * (q6 ? X6_BYTES : X4_BYTES);
        const v2f dv = v2_half(P + (q6 ? X6_D : X4_D));
        v2f oc[8];
        if (!q6) {
            const v2f mv = v2_mul(v2_half(P + X4_DMIN), v2_setf(-1.0f));
            for (int g = 0; g < 8; g++) oc[g] = v2_mul(v2_scales(P + X4_M + 16 * g, 0), mv);
        }
        if (q6) {
            x2_unpack_q6(P, U);
            X2_TILES(1, U, 1);
        } else if (nr >= X2_UNPACK_ROWS) {
            prefetch_weights(P, X4_BYTES);
            x2_unpack_q4(P, U);
            X2_TILES(0, U, 0);
        } else {
            X2_TILES(0, NULL, 1);
        }
    }
    for (int r = 0; r < nr; r++) {
        v2f v = acc[r];
        if (accum) v = v2_add(v, v2_loadf(y + r * ystride));
        v2_storef(y + r * ystride, v);
    }
}
#undef X2_TILES
#undef X2_TILE
