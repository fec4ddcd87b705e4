/* Low-bit CPU matmul on GGUF blocks: y[rows, out] = x[rows, in] @ W^T.
 *
 * W is `out` rows of `in / block` blocks, each exactly the GGUF bytes of one block:
 *   Q8_0 (34 B / 32):  f16 d, int8 q[32]                              w = d * q
 *   Q5_0 (22 B / 32):  f16 d, u32 qh, u8 qs[16]                         w = d * (q - 16), q 5-bit
 *   Q4_1 (20 B / 32):  f16 d, f16 m, u8 qs[16]                          w = d * q + m, q 4-bit
 *   Q4_K (144 B / 256): f16 d, f16 dmin, 12 B of 6-bit scales/mins, 128 B of nibbles
 *                       w = d * sc[s] * q - dmin * m[s], 8 sub-blocks of 32
 *   Q6_K (210 B / 256): ql[128], qh[64], int8 sc[16], f16 d           w = d * sc[g] * (q - 32), 16 groups of 16
 *   MXFP4 (17 B / 32): e8m0 e, u8 qs[16] (e2m1 nibbles, as Q4_1's)    w = 2^(e - 128) * kv[q], kv: twice e2m1's values
 *
 * Activations are quantized per call to int8 (one scale per 256 inputs for the K-quants, per 32 for
 * Q8_0/Q5_0/Q4_1), so the inner products are integer (AVX-512 VNNI vpdpbusd, or AVX-512BW / AVX2 vpmaddubsw +
 * vpmaddwd). Weight offsets (Q5_0's -16, Q6_K's -32, Q4_K's and Q4_1's mins, Q8_0's +128 bias in the VNNI path,
 * MXFP4's -12: its nibbles go through a 16-byte table (vpshufb) to kv + 12, unsigned as vpdpbusd takes them)
 * are applied as float products of per-group weight constants with per-group activation sums.
 *
 * Kernels: on the file's layout each output's blocks are walked, each block unpacked once into registers and
 * applied to every row (tile1_avx512 / row_avx2 / row_scalar), the same arithmetic per row at any row count. The
 * inputs are walked in chunks of 2048 (activations stay in L2).
 * On AVX2 and AVX-512 the loader repacks the blocks once (gq_repack, "x16": 16 outputs interleaved per block, the
 * same values) and the x16 kernel (x16_kernels.h; AVX2's Q4_K/Q6_K: x16_avx2.h) serves every row count: a row's
 * result is then the same bits however many rows share the call. Several matrices with the same input (fused q/k/v,
 * gate/up) go in one call (gq_matmul_parts), and so do matrices with inputs of their own (a layer's experts, each over
 * the rows that chose it: gq_matmul_jobs).
 * Threads (OpenMP, count passed in) split the outputs in tasks of 32, each thread one contiguous range.
 *
 * One build runs on any x86-64: the AVX2 and AVX-512 paths carry function-level target attributes
 * and are only called when __builtin_cpu_supports says the CPU (and OS) has them; otherwise the
 * portable scalar path runs. Written for specdec; layouts follow the GGUF format definitions.
 */
#include <math.h>
#include "gq_matmul.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#define GQ_X86 1
#include <immintrin.h>
#endif

enum { GQ_Q4_1 = 3, GQ_Q5_0 = 6, GQ_Q8_0 = 8, GQ_Q4_K = 12, GQ_Q6_K = 14, GQ_MXFP4 = 39 };
/* GQ_X16 + Q4_K / Q6_K: the same blocks repacked 16 outputs at a time (gq_repack, layouts below), for the
 * AVX-512 kernel. Addressed like the file's layout with 256 inputs and X16_BYTES / 16 bytes per output and
 * block, so output o's data starts at W + o * rowbytes when o is a multiple of 16. */
enum { GQ_X16 = 256 };
/* Q4_K x16, per 16 outputs x 256 inputs (2368 bytes): [0, 2048) quants, 32 lines of 64 bytes: line L, dword t
 * (output t), byte j: low nibble = input 4L + j, high nibble = input 128 + 4L + j; [2048, 2080) d of the 16
 * outputs (fp16); [2080, 2112) dmin (fp16); [2112, 2240) scales, sc[g][t] (6-bit, uint8); [2240, 2368) mins. */
enum { X4_D = 2048, X4_DMIN = 2080, X4_SC = 2112, X4_M = 2240, X4_BYTES = 2368 };
/* Q6_K x16 (3360 bytes): [0, 2048) low 4 bits as Q4_K x16's quants; [2048, 3072) high 2 bits, 16 lines of 64
 * bytes: line h, dword t, byte j, bits 2c, 2c + 1 = bits 4-5 of input 4(h + 16c) + j; [3072, 3328) scales
 * sc[g][t] (int8, 16 groups of 16); [3328, 3360) d (fp16). */
enum { X6_HB = 2048, X6_SC = 3072, X6_D = 3328, X6_BYTES = 3360 };
/* Q8_0 x16, per 16 outputs x 32 inputs (544 bytes): [0, 512) quants + 128 (unsigned), 8 lines of 64 bytes: line k,
 * dword t, byte j = input 4k + j; [512, 544) d (fp16). Q5_0 x16 (352 bytes): [0, 256) low 4 bits of the unsigned
 * quants (q + 16), 4 lines: line L, dword t, byte j: low nibble = input 4L + j, high nibble = input 16 + 4L + j;
 * [256, 320) bit 4, as 8 64-bit masks: mask k, bit 4t + j = input 4k + j of output t; [320, 352) d (fp16). */
enum { X8_D = 512, X8_BYTES = 544, X5_HB = 256, X5_D = 320, X5_BYTES = 352 };
/* Q4_1 x16 (320 bytes): [0, 256) the quants' nibbles as Q5_0 x16's; [256, 288) d, [288, 320) m (fp16). */
enum { X41_D = 256, X41_M = 288, X41_BYTES = 320 };
/* MXFP4 x16 (272 bytes): [0, 256) the e2m1 nibbles as Q4_1 x16's; [256, 272) e of the 16 outputs (e8m0). */
enum { XM_E = 256, XM_BYTES = 272 };
/* kvalues_mxfp4 (ggml-common.h, twice each e2m1 value) and the same + 12, unsigned for the integer dots */
static const int8_t MX_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t MX_LUT[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
/* PATH_AVX512BW: AVX-512 F/BW/VL/DQ without VNNI (the x16 kernels with vpmaddubsw + vpmaddwd; the file's layout on the
 * AVX2 row kernels); PATH_AVX512: with VNNI; PATH_AMX: with VNNI and AMX-INT8 (x16 calls of many rows: x16_amx.h) */
enum { PATH_AUTO = 0, PATH_SCALAR = 1, PATH_AVX2 = 2, PATH_AVX512BW = 3, PATH_AVX512 = 4, PATH_AMX = 5 };
#define RT 64 /* rows per tile: accumulators of one output for RT rows stay in L1 */

static int block_elems(int type) { return (type & ~GQ_X16) == GQ_Q4_K || (type & ~GQ_X16) == GQ_Q6_K ? 256 : 32; }
static int block_bytes(int type) {
    switch (type) {
    case GQ_Q8_0: return 34;
    case GQ_Q5_0: return 22;
    case GQ_Q4_1: return 20;
    case GQ_Q4_K: return 144;
    case GQ_Q6_K: return 210;
    case GQ_MXFP4: return 17;
    case GQ_X16 + GQ_Q4_K: return X4_BYTES / 16;
    case GQ_X16 + GQ_Q6_K: return X6_BYTES / 16;
    case GQ_X16 + GQ_Q8_0: return X8_BYTES / 16;
    case GQ_X16 + GQ_Q5_0: return X5_BYTES / 16;
    case GQ_X16 + GQ_Q4_1: return X41_BYTES / 16;
    case GQ_X16 + GQ_MXFP4: return XM_BYTES / 16;
    default: return 0;
    }
}
/* activation-sum group: the size of a weight group with its own offset constant */
static int sum_group(int type) { return (type & ~GQ_X16) == GQ_Q6_K ? 16 : 32; }

static float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* zero or subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float rdh(const uint8_t *p) { return fp16_to_f32(rd16(p)); }
/* an MXFP4 block's scale: 2^(e - 128), as ggml's e8m0_to_fp32_half (e < 2: subnormal) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define INL static inline __attribute__((always_inline))
/* 6-bit scales and mins of the 8 sub-blocks, from the 12 packed bytes: bytes 0-3 hold sc[0..3] (low 6 bits)
 * and the top 2 bits of sc[4..7]; bytes 4-7 likewise m[0..3] and m[4..7]'s top bits; bytes 8-11 the low
 * nibbles of sc[4..7] and (high nibbles) m[4..7]. Computed four bytes at a time. */
INL void q4k_scales(const uint8_t *s, uint8_t *sc, uint8_t *m) {
    uint32_t w0 = rd32(s), w1 = rd32(s + 4), w2 = rd32(s + 8), t;
    t = w0 & 0x3F3F3F3Fu; memcpy(sc, &t, 4);
    t = w1 & 0x3F3F3F3Fu; memcpy(m, &t, 4);
    t = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4); memcpy(sc + 4, &t, 4);
    t = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4); memcpy(m + 4, &t, 4);
}

/* One block -> signed integer values q (w = gs[g] * q + gm[g] for group g); returns the group size. */
INL int unpack_block(int type, const uint8_t *b, int8_t *q, float *gs, float *gm) {
    switch (type) {
    case GQ_Q8_0:
        gs[0] = rdh(b);
        gm[0] = 0;
        for (int i = 0; i < 32; i++) q[i] = (int8_t)b[2 + i];
        return 32;
    case GQ_Q5_0: {
        const uint32_t qh = rd32(b + 2);
        const uint8_t *qs = b + 6;
        uint8_t hb[32];
        gs[0] = rdh(b);
        gm[0] = 0;
        for (int j = 0; j < 32; j++) hb[j] = (uint8_t)(((qh >> j) & 1u) << 4);
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((uint8_t)((qs[j] & 0xF) | hb[j]) - 16);
            q[j + 16] = (int8_t)((uint8_t)((qs[j] >> 4) | hb[j + 16]) - 16);
        }
        return 32;
    }
    case GQ_Q4_1:
        gs[0] = rdh(b);
        gm[0] = rdh(b + 2);
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(b[4 + j] & 0xF);
            q[j + 16] = (int8_t)(b[4 + j] >> 4);
        }
        return 32;
    case GQ_MXFP4:
        gs[0] = e8m0_half(b[0]);
        gm[0] = 0;
        for (int j = 0; j < 16; j++) {
            q[j] = MX_KV[b[1 + j] & 0xF];
            q[j + 16] = MX_KV[b[1 + j] >> 4];
        }
        return 32;
    case GQ_Q4_K: {
        float d = rdh(b), dmin = rdh(b + 2);
        uint8_t sc[8], m[8];
        const uint8_t *qs = b + 16;
        q4k_scales(b + 4, sc, m);
        for (int s = 0; s < 8; s++) {
            gs[s] = d * sc[s];
            gm[s] = -dmin * m[s];
        }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                q[64 * j + l] = (int8_t)(qs[32 * j + l] & 0xF);
                q[64 * j + 32 + l] = (int8_t)(qs[32 * j + l] >> 4);
            }
        return 32;
    }
    case GQ_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = rdh(b + 208);
        for (int g = 0; g < 16; g++) {
            gs[g] = d * sc[g];
            gm[g] = 0;
        }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                q[128 * h + l] = (int8_t)(((a & 0xF) | ((hb & 3) << 4)) - 32);
                q[128 * h + 32 + l] = (int8_t)(((c & 0xF) | (((hb >> 2) & 3) << 4)) - 32);
                q[128 * h + 64 + l] = (int8_t)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                q[128 * h + 96 + l] = (int8_t)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        return 16;
    }
    }
    return 0;
}

/* Output t (0-15) of an x16 superblock P -> signed values q and group scales, as unpack_block gives them. */
INL int unpack_x16(int type, const uint8_t *P, int t, int8_t *q, float *gs, float *gm) {
    if (type == GQ_X16 + GQ_Q4_1 || type == GQ_X16 + GQ_MXFP4) {
        const int mx = type == GQ_X16 + GQ_MXFP4;
        for (int i = 0; i < 32; i++) {
            const int nib = (P[64 * ((i % 16) / 4) + 4 * t + i % 4] >> (i >= 16 ? 4 : 0)) & 0xF;
            q[i] = (int8_t)(mx ? MX_KV[nib] : nib);
        }
        gs[0] = mx ? e8m0_half(P[XM_E + t]) : rdh(P + X41_D + 2 * t);
        gm[0] = mx ? 0.0f : rdh(P + X41_M + 2 * t);
        return 32;
    }
    if (type == GQ_X16 + GQ_Q8_0 || type == GQ_X16 + GQ_Q5_0) {
        const int q8 = type == GQ_X16 + GQ_Q8_0;
        for (int i = 0; i < 32; i++) {
            const int at = 4 * t + i % 4;
            if (q8) q[i] = (int8_t)(P[64 * (i / 4) + at] - 128);
            else q[i] = (int8_t)((((P[64 * ((i % 16) / 4) + at] >> (i >= 16 ? 4 : 0)) & 0xF) |
                                  (((P[X5_HB + 8 * (i / 4) + at / 8] >> (at % 8)) & 1) << 4)) - 16);
        }
        gs[0] = rdh(P + (q8 ? X8_D : X5_D) + 2 * t);
        gm[0] = 0;
        return 32;
    }
    for (int i = 0; i < 256; i++) {
        const int k = i / 4, at = 4 * t + i % 4;
        int v = (P[64 * (k % 32) + at] >> (k >= 32 ? 4 : 0)) & 0xF;
        if (type == GQ_X16 + GQ_Q6_K) v = (v | (((P[X6_HB + 64 * (k % 16) + at] >> (2 * (k / 16))) & 3) << 4)) - 32;
        q[i] = (int8_t)v;
    }
    if (type == GQ_X16 + GQ_Q4_K) {
        const float d = rdh(P + X4_D + 2 * t), dmin = rdh(P + X4_DMIN + 2 * t);
        for (int g = 0; g < 8; g++) {
            gs[g] = d * P[X4_SC + 16 * g + t];
            gm[g] = -dmin * P[X4_M + 16 * g + t];
        }
        return 32;
    }
    const float d = rdh(P + X6_D + 2 * t);
    for (int g = 0; g < 16; g++) {
        gs[g] = d * (int8_t)P[X6_SC + 16 * g + t];
        gm[g] = 0;
    }
    return 16;
}

static int x16_bytes(int type) { return 16 * block_bytes(GQ_X16 + type); }

/* Output t's values q of one K-quant block into x16 superblock P: value i = 4k + r (k 0-63) is the nibble of
 * byte 64 (k % 32) + 4t + r, low for k < 32, high above; Q6_K's top two bits are bits 2 (k / 16) of byte
 * X6_HB + 64 (k % 16) + 4t + r. Written byte by byte, not value by value: repacking the Qwen3-30B-A3B shape's
 * Q4_K_M file (9.5 GB) value by value took 14.5 s of its 19 s load (`python -m cProfile`, `specdec.LLM(path)`);
 * this way the load takes 9.5 s (median of 3, Zen 5). */
static void repack_kquant(int type, const int8_t *q, uint8_t *P, int t) {
    uint8_t u[256];
    const int off = type == GQ_Q6_K ? 32 : 0;
    for (int i = 0; i < 256; i++) u[i] = (uint8_t)(q[i] + off);
    for (int m = 0; m < 32; m++)
        for (int r = 0; r < 4; r++)
            P[64 * m + 4 * t + r] = (uint8_t)((u[4 * m + r] & 0xF) | ((u[128 + 4 * m + r] & 0xF) << 4));
    if (type != GQ_Q6_K) return;
    for (int n = 0; n < 16; n++)
        for (int r = 0; r < 4; r++) {
            uint8_t h = 0;
            for (int s = 0; s < 4; s++) h |= (uint8_t)((u[4 * (n + 16 * s) + r] >> 4) << (2 * s));
            P[X6_HB + 64 * n + 4 * t + r] = h;
        }
}

/* Output t's Q8_0 quants qs into P: value i = 4k + r is byte 64k + 4t + r, offset to unsigned (+128: the top
 * bit flipped). */
static void repack_q8_0(const uint8_t *qs, uint8_t *P, int t) {
    for (int k = 0; k < 8; k++) {
        const uint32_t w = rd32(qs + 4 * k) ^ 0x80808080u;
        memcpy(P + 64 * k + 4 * t, &w, 4);
    }
}

/* Output t's Q4_1 / MXFP4 block: value j < 16 is the low nibble of byte 64 (j / 4) + 4t + j % 4, value j + 16 its
 * high nibble, so each of the 16 stored bytes (quants or e2m1 codes) moves whole. */
static void repack_nibbles(const uint8_t *qs, uint8_t *P, int t) {
    for (int k = 0; k < 4; k++) memcpy(P + 64 * k + 4 * t, qs + 4 * k, 4);
}

/* A block's integer values alone (unpack_block without its scales). */
static void block_values(int type, const uint8_t *blk, int8_t *q) {
    float gs[16], gm[16];
    unpack_block(type, blk, q, gs, gm);
}

/* Output t's Q5_0 values q into P: low nibbles as Q4_1's, the fifth bits one per bit at X5_HB. */
static void repack_q5_0(const int8_t *q, uint8_t *P, int t) {
    for (int i = 0; i < 32; i++) {
        const int k = i / 4, at = 4 * t + i % 4;
        P[64 * ((i % 16) / 4) + at] |= (uint8_t)(((q[i] + 16) & 0xF) << (i >= 16 ? 4 : 0));
        P[X5_HB + 8 * k + at / 8] |= (uint8_t)((((q[i] + 16) >> 4) & 1) << (at % 8));
    }
}

/* Blocks of one 16-output group (16 rows of the file's layout, rowbytes apart) -> x16 superblocks at dst. */
static void repack_group(int type, const uint8_t *W, int64_t rowbytes, int64_t nbk, uint8_t *dst) {
    const int bb = block_bytes(type), sb = x16_bytes(type);
    for (int64_t b = 0; b < nbk; b++) {
        uint8_t *P = dst + b * sb;
        memset(P, 0, (size_t)sb); /* Q5_0's bytes are or-ed together */
        for (int t = 0; t < 16; t++) {
            const uint8_t *blk = W + t * rowbytes + b * bb;
            int8_t q[256];
            switch (type) {
            case GQ_Q8_0:
                repack_q8_0(blk + 2, P, t);
                memcpy(P + X8_D + 2 * t, blk, 2);
                break;
            case GQ_Q5_0:
                block_values(type, blk, q);
                repack_q5_0(q, P, t);
                memcpy(P + X5_D + 2 * t, blk, 2);
                break;
            case GQ_Q4_1:
                repack_nibbles(blk + 4, P, t);
                memcpy(P + X41_D + 2 * t, blk, 2);
                memcpy(P + X41_M + 2 * t, blk + 2, 2);
                break;
            case GQ_MXFP4:
                repack_nibbles(blk + 1, P, t);
                P[XM_E + t] = blk[0];
                break;
            case GQ_Q4_K: {
                uint8_t sc[8], m[8];
                block_values(type, blk, q);
                repack_kquant(type, q, P, t);
                q4k_scales(blk + 4, sc, m);
                memcpy(P + X4_D + 2 * t, blk, 2);
                memcpy(P + X4_DMIN + 2 * t, blk + 2, 2);
                for (int g = 0; g < 8; g++) {
                    P[X4_SC + 16 * g + t] = sc[g];
                    P[X4_M + 16 * g + t] = m[g];
                }
                break;
            }
            default: /* Q6_K */
                block_values(type, blk, q);
                repack_kquant(type, q, P, t);
                for (int g = 0; g < 16; g++) P[X6_SC + 16 * g + t] = blk[192 + g];
                memcpy(P + X6_D + 2 * t, blk + 208, 2);
            }
        }
    }
}

/* ---- activations: int8 per group of G inputs, scale d; S-group sums pre-multiplied by d ---- */
typedef struct {
    int8_t *q;  /* [rows][in] */
    float *d;   /* [rows][in / G] */
    float *s;   /* [rows][in / S]: d * sum(q) over each S-group */
    int32_t *p; /* [rows][in / 16] on the AVX2 path where S == 16 (Q6_K), else NULL: per 16-group, 32 x the sums of q
                 * over inputs 4k, 4k + 1 and over 4k + 2, 4k + 3 (k < 4) as the low and high int16 (x16_avx2.h's -32) */
    int8_t *t;  /* [rows / 16, rounded up][in / 32][16][32] for AMX tiles (x16_amx.h), else NULL: q, 16 rows x 32
                 * inputs contiguous, so that a tile of them loads 8 cache lines instead of 16 */
    int64_t in;
    int G, S;
    const float *x; /* [rows][in]: what was quantized */
    int64_t rows;
} act_t;

INL void quantize_rows(const float *x, int64_t r0, int64_t r1, act_t *A) {
    const int64_t in = A->in, ng = in / A->G, ns = in / A->S;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * in;
        int8_t *q = A->q + r * in;
        for (int64_t g = 0; g < ng; g++) {
            const float *xg = xr + g * A->G;
            float amax = 0;
            for (int i = 0; i < A->G; i++) {
                float v = fabsf(xg[i]);
                amax = v > amax ? v : amax;
            }
            const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
            A->d[r * ng + g] = d;
            for (int i = 0; i < A->G; i++) q[g * A->G + i] = (int8_t)lrintf(xg[i] * id);
        }
        for (int64_t s = 0; s < ns; s++) {
            int sum = 0;
            for (int i = 0; i < A->S; i++) sum += q[s * A->S + i];
            A->s[r * ns + s] = A->d[r * ng + (s * A->S) / A->G] * (float)sum;
        }
        if (A->p)
            for (int64_t s = 0; s < in / 16; s++) {
                int lo = 0, hi = 0; /* within +-32 x 8 x 127 < 2^15 */
                for (int i = 0; i < 16; i++) *(i % 4 < 2 ? &lo : &hi) += 32 * q[16 * s + i];
                A->p[r * (in / 16) + s] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
            }
    }
}

/* ---- scalar path: any CPU ---- */
static void row_scalar(int type, const uint8_t *w, const act_t *A, int64_t r0, int nr, float *y, int64_t ystride,
                       int64_t b0, int64_t b1, int accum) {
    const int be = block_elems(type), bb = block_bytes(type);
    const int64_t in = A->in, ng = in / A->G;
    int8_t q[256];
    float gs[16], gm[16], acc[RT];
    for (int r = 0; r < nr; r++) acc[r] = 0;
    for (int64_t b = b0; b < b1; b++) {
        const int gsz = unpack_block(type, w + b * bb, q, gs, gm);
        for (int r = 0; r < nr; r++) {
            const int8_t *a = A->q + (r0 + r) * in + b * be;
            const float *ad = A->d + (r0 + r) * ng;
            float part = 0;
            for (int g = 0; g < be / gsz; g++) {
                int isum = 0, asum = 0;
                for (int i = g * gsz; i < (g + 1) * gsz; i++) {
                    isum += q[i] * a[i];
                    asum += a[i];
                }
                part += ad[(b * be + g * gsz) / A->G] * (gs[g] * (float)isum + gm[g] * (float)asum);
            }
            acc[r] += part;
        }
    }
    for (int r = 0; r < nr; r++) y[r * ystride] = (accum ? y[r * ystride] : 0.0f) + acc[r];
}

#ifdef GQ_X86
/* ======================================= AVX2 + FMA ======================================= */
#define T256 __attribute__((target("avx2,fma,f16c")))

/* The 1-2 row kernels read each weight row once and do little work per byte, so they wait on memory unless
 * the next bytes are already on their way: prefetch PREFETCH_AHEAD bytes ahead of the block being read
 * (measured on Zen 5, 2 threads, 1 row: Q6_K 1536x8960 0.214 -> 0.195 ms; 4 KB beat 1 and 2 KB). */
#define PREFETCH_AHEAD 4096
INL void prefetch_weights(const uint8_t *p, int n) {
    for (int i = 0; i < n; i += 64) _mm_prefetch((const char *)p + PREFETCH_AHEAD + i, _MM_HINT_T0);
}

/* share g (of ngr) of the cache lines PREFETCH_AHEAD bytes past the superblock at P (n bytes): spread over the
 * superblock's groups, the prefetches leave the loads room, where all at its start they stalled them (Zen 3, AVX2, one
 * row, Q4_K 17920x1536: 17.9 -> 19.6 GB/s, Q6_K 1536x8960: 15.6 -> 19.0; python scripts/bench_kernels.py) */
INL void prefetch_share(const uint8_t *P, int n, int g, int ngr) {
    const int lines = (n + 63) / 64;
    for (int k = g * lines / ngr; k < (g + 1) * lines / ngr; k++) _mm_prefetch((const char *)P + PREFETCH_AHEAD + 64 * k, _MM_HINT_T0);
}

/* acc + scale * sum over 8 groups of 32: (unsigned weights wv . int8 activations a) x 16-bit group scales sv */
T256 static inline __attribute__((always_inline)) __m256 kdot256(const __m256i wv[8], const __m256i sv[8],
                                                                 const int8_t *a, float scale, __m256 acc) {
    __m256i is = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i p = _mm256_maddubs_epi16(wv[j], _mm256_loadu_si256((const __m256i *)(a + 32 * j)));
        is = _mm256_add_epi32(is, _mm256_madd_epi16(p, sv[j]));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(scale), acc);
}

T256 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
T256 static float dot256(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
T256 static inline float h2f_256(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* returns whether `off` holds offsets to add (dot with the activation S-sums) */
T256 static int row_avx2(int type, const uint8_t *w, const act_t *A, int64_t r0, int nr, float *y, int64_t ystride,
                         float *off, int64_t b0, int64_t b1, int accum) {
    const int64_t in = A->in, ng = in / A->G;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
    __m256 acc[RT];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    int use_off = 1;
    if (type == GQ_Q4_K) {
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = w + b * 144;
            prefetch_weights(blk, 144);
            const float d = h2f_256(blk), dmin = h2f_256(blk + 2);
            uint8_t sc[8], m[8];
            q4k_scales(blk + 4, sc, m);
            __m256i wv[8], sv[8];
            for (int s = 0; s < 8; s++) {
                off[b * 8 + s] = -dmin * m[s];
                sv[s] = _mm256_set1_epi16(sc[s]);
            }
            for (int j = 0; j < 4; j++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
                wv[2 * j] = _mm256_and_si256(x, m4);
                wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            }
            for (int r = 0; r < nr; r++)
                acc[r] = kdot256(wv, sv, A->q + (r0 + r) * in + b * 256, d * A->d[(r0 + r) * ng + b], acc[r]);
        }
    } else if (type == GQ_Q6_K) {
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = w + b * 210, *ql = blk, *qh = blk + 128;
            prefetch_weights(blk, 210);
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = h2f_256(blk + 208);
            __m256i wv[8], sv[8];
            for (int g = 0; g < 16; g++) off[b * 16 + g] = -32.0f * d * sc[g];
            for (int j = 0; j < 8; j++)
                sv[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
            for (int h = 0; h < 2; h++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
                const __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                wv[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
                wv[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
                wv[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
                wv[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
            }
            for (int r = 0; r < nr; r++)
                acc[r] = kdot256(wv, sv, A->q + (r0 + r) * in + b * 256, d * A->d[(r0 + r) * ng + b], acc[r]);
        }
    } else if (type == GQ_Q8_0) {
        use_off = 0; /* signed weights: vpsignb trick, no offset */
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = w + b * 34;
            prefetch_weights(blk, 34);
            const float d = h2f_256(blk);
            const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2)), aw = _mm256_sign_epi8(wq, wq);
            for (int r = 0; r < nr; r++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(A->q + (r0 + r) * in + b * 32));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, wq)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * A->d[(r0 + r) * ng + b]), acc[r]);
            }
        }
    } else { /* Q5_0 / Q4_1: unsigned quants (Q5_0: with its fifth bit), offset -16 d / m */
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
        const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL), b5 = _mm256_set1_epi8(0x10);
        const int q41 = type == GQ_Q4_1, bb = q41 ? 20 : 22;
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = w + b * bb;
            prefetch_weights(blk, bb);
            const float d = h2f_256(blk);
            const __m128i x = _mm_loadu_si128((const __m128i *)(blk + (q41 ? 4 : 6))), m4x = _mm_set1_epi8(0x0F);
            __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m4x), _mm_and_si128(x, m4x));
            if (!q41) {
                const __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(blk + 2)), shuf);
                wq = _mm256_or_si256(wq, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bits), bits), b5));
            }
            off[b] = q41 ? h2f_256(blk + 2) : -16.0f * d;
            for (int r = 0; r < nr; r++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(A->q + (r0 + r) * in + b * 32));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, a), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * A->d[(r0 + r) * ng + b]), acc[r]);
            }
        }
    }
    const int64_t ns = in / A->S, sg = block_elems(type) / A->S; /* S-groups per block */
    for (int r = 0; r < nr; r++)
        y[r * ystride] = (accum ? y[r * ystride] : 0.0f) + hsum256(acc[r]) +
                         (use_off ? dot256(off + b0 * sg, A->s + (r0 + r) * ns + b0 * sg, (b1 - b0) * sg) : 0.0f);
    return use_off;
}

/* ============================ AVX-512 F/BW/VL/DQ (T512), + VNNI (T512V) ============================ */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define T512V __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

T512 static float dot512(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
T512 static inline float h2f_512(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* Unpack one K-quant block: wv = 4 zmm of unsigned weights in input order (64 inputs each), sc = their
 * integer scales as int16 pairs (lane i of zmm j: the scale of inputs 64j + 2i, 64j + 2i + 1), *d the block
 * scale, off_b the per-group offsets (Q4_K: -dmin * m per 32 inputs; Q6_K: -32 * d * sc per 16).
 * (Tried and dropped: a 4x4 dword transpose of the block, and the activations stored to match, so that
 * vpdpbusd lanes each see one group and the scales apply as floats once per row: 7 instead of 11 vector
 * ops per row and block, but measured no faster at 16-64 rows and 15-40% slower at one row on Zen 5.) */

/* A Q6_K block's 256 6-bit quants (0..63, unsigned) as 4 x 64 bytes: low nibbles from ql, 2 high bits from qh */
T512 static inline __attribute__((always_inline)) void q6k_quants_512(const uint8_t *blk, __m512i wv[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; h++) {
        const __m512i L = _mm512_loadu_si512(ql + 64 * h);
        const __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        const __m512i Hz = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
        wv[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(Hz, m3), 4));
        wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Hz, 4), m3), 4));
    }
}

T512 static inline __attribute__((always_inline)) void kblock_512(int type, const uint8_t *blk, __m512i wv[4],
                                                                  __m512i sc[4], float *d, float *off_b) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == GQ_Q4_K) {
        uint8_t sm[16]; /* sc[8], m[8] */
        *d = _cvtsh_ss(rd16(blk));
        const float dmin = _cvtsh_ss(rd16(blk + 2));
        q4k_scales(blk + 4, sm, sm + 8);
        const __m128i smv = _mm_loadu_si128((const __m128i *)sm);
        _mm256_storeu_ps(off_b, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))),
                                              _mm256_set1_ps(-dmin)));
        const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(smv));
        /* int16 lane i of zmm j -> sub-block 2j + i / 16 */
        __m512i idx = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                       0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int j = 0; j < 4; j++, idx = _mm512_add_epi16(idx, _mm512_set1_epi16(2)))
            sc[j] = _mm512_permutexvar_epi16(idx, s16);
        const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
        const __m512i lo0 = _mm512_and_si512(q0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
        const __m512i lo1 = _mm512_and_si512(q1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
        wv[0] = _mm512_shuffle_i64x2(lo0, hi0, 0x44); /* sub-blocks 0 | 1 */
        wv[1] = _mm512_shuffle_i64x2(lo0, hi0, 0xEE); /* 2 | 3 */
        wv[2] = _mm512_shuffle_i64x2(lo1, hi1, 0x44);
        wv[3] = _mm512_shuffle_i64x2(lo1, hi1, 0xEE);
    } else { /* Q6_K */
        *d = _cvtsh_ss(rd16(blk + 208));
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        _mm512_storeu_ps(off_b, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)), _mm512_set1_ps(-32.0f * *d)));
        const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8));
        /* int16 lane i of zmm j -> group 4j + i / 8 */
        __m512i idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                       1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int j = 0; j < 4; j++, idx = _mm512_add_epi16(idx, _mm512_set1_epi16(4)))
            sc[j] = _mm512_permutexvar_epi16(idx, s16);
        q6k_quants_512(blk, wv);
    }
}

/* NO consecutive outputs (weight rows w, w + rowbytes, ...) for rows r0..r0+nr; each activation vector is
 * loaded once for all NO outputs. (Measured on Zen 5: NO = 2 was slower than NO = 1 at every row count
 * from 1 to 64, so only NO = 1 is instantiated.) */
T512V static inline __attribute__((always_inline)) void tile_avx512(int type, const int NO, const uint8_t *w,
                                                                   int64_t rowbytes, const act_t *A, int64_t r0,
                                                                   int nr, float *y, int64_t ystride, float *off,
                                                                   int64_t b0, int64_t b1, int accum) {
    const int64_t in = A->in, ng = in / A->G, offn = in / 16;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[2][RT];
    for (int k = 0; k < NO; k++)
        for (int r = 0; r < nr; r++) acc[k][r] = _mm512_setzero_ps();
    if (type == GQ_Q4_K || type == GQ_Q6_K) {
        const int64_t bb = type == GQ_Q4_K ? 144 : 210, ob = type == GQ_Q4_K ? 8 : 16;
        for (int64_t b = b0; b < b1; b++) {
            __m512i wv[2][4], sc[2][4];
            float d[2];
            prefetch_weights(w + b * bb, (int)bb);
            for (int k = 0; k < NO; k++) kblock_512(type, w + k * rowbytes + b * bb, wv[k], sc[k], &d[k], off + k * offn + b * ob);
            const int8_t *a = A->q + r0 * in + b * 256;
            const float *ad = A->d + r0 * ng + b;
            for (int r = 0; r < nr; r++, a += in, ad += ng) {
                const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 64);
                const __m512i a2 = _mm512_loadu_si512(a + 128), a3 = _mm512_loadu_si512(a + 192);
                for (int k = 0; k < NO; k++) {
                    __m512i s = _mm512_dpwssd_epi32(zero, _mm512_maddubs_epi16(wv[k][0], a0), sc[k][0]);
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k][1], a1), sc[k][1]);
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k][2], a2), sc[k][2]);
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k][3], a3), sc[k][3]);
                    acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d[k] * *ad), acc[k][r]);
                }
            }
        }
    } else { /* Q8_0 / Q5_0: two 32-input blocks per zmm (tried: eight blocks per 256-input step: 15-50% slower at
              * 1-2 rows) */
        const int bb = type == GQ_Q8_0 ? 34 : 22;
        const float bias = type == GQ_Q8_0 ? -128.0f : -16.0f;
        const __m256i x80 = _mm256_set1_epi8((char)0x80), m4y = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
        const __m512i pair0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int64_t b = b0; b < b1; b += 2) {
            const int two_blocks = b + 1 < b1;
            prefetch_weights(w + b * bb, 2 * bb);
            __m512i wz[2];
            __m512 dw[2];
            for (int k = 0; k < NO; k++) {
                __m256i wy[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                float dd[2] = {0, 0};
                for (int h = 0; h < 1 + two_blocks; h++) {
                    const uint8_t *blk = w + k * rowbytes + (b + h) * bb;
                    dd[h] = _cvtsh_ss(rd16(blk));
                    off[k * offn + b + h] = bias * dd[h];
                    if (type == GQ_Q8_0) {
                        wy[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), x80); /* q + 128 */
                    } else {
                        const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 6));
                        const __m256i x2 = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
                        wy[h] = _mm256_or_si256(_mm256_and_si256(x2, m4y), _mm256_maskz_mov_epi8(rd32(blk + 2), b5));
                    }
                }
                wz[k] = _mm512_inserti64x4(_mm512_castsi256_si512(wy[0]), wy[1], 1);
                dw[k] = _mm512_permutexvar_ps(pair0, _mm512_castps128_ps512(_mm_setr_ps(dd[0], dd[1], 0, 0)));
            }
            const __mmask64 km = two_blocks ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
            const int8_t *a = A->q + r0 * in + b * 32;
            const float *ad = A->d + r0 * ng + b;
            for (int r = 0; r < nr; r++, a += in, ad += ng) {
                const __m512i av = _mm512_maskz_loadu_epi8(km, a);
                const __m128 adv = two_blocks ? _mm_castpd_ps(_mm_load_sd((const double *)ad)) : _mm_load_ss(ad);
                const __m512 da = _mm512_permutexvar_ps(pair0, _mm512_castps128_ps512(adv));
                for (int k = 0; k < NO; k++) {
                    const __m512i p = _mm512_dpbusd_epi32(zero, wz[k], av);
                    acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[k], da), acc[k][r]);
                }
            }
        }
    }
    const int64_t ns = in / A->S, sg = block_elems(type) / A->S; /* S-groups per block */
    for (int k = 0; k < NO; k++)
        for (int r = 0; r < nr; r++)
            y[r * ystride + k] = (accum ? y[r * ystride + k] : 0.0f) + _mm512_reduce_add_ps(acc[k][r]) +
                                 dot512(off + k * offn + b0 * sg, A->s + (r0 + r) * ns + b0 * sg, (b1 - b0) * sg);
}

T512V static void tile1_avx512(int type, const uint8_t *w, int64_t rowbytes, const act_t *A, int64_t r0, int nr,
                              float *y, int64_t ystride, float *off, int64_t b0, int64_t b1, int accum) {
    switch (type) {
    case GQ_Q4_K: tile_avx512(GQ_Q4_K, 1, w, rowbytes, A, r0, nr, y, ystride, off, b0, b1, accum); break;
    case GQ_Q6_K: tile_avx512(GQ_Q6_K, 1, w, rowbytes, A, r0, nr, y, ystride, off, b0, b1, accum); break;
    case GQ_Q8_0: tile_avx512(GQ_Q8_0, 1, w, rowbytes, A, r0, nr, y, ystride, off, b0, b1, accum); break;
    case GQ_Q5_0: tile_avx512(GQ_Q5_0, 1, w, rowbytes, A, r0, nr, y, ystride, off, b0, b1, accum); break;
    }
}
/* ---- the x16 layout's kernels (x16_kernels.h), written once over 16-lane vectors: VI (16 dwords), VF (16 floats)
 * and VNEG (Q8_0's signs), with the operations V(op). AVX-512 holds the 16 outputs in one register (v5_), AVX2 in
 * two (v2_, low 8 outputs and high 8); the 4-byte dots are X16_DOT: vpdpbusd (VNNI) or vpmaddubsw + vpmaddwd, whose
 * 16-bit pair sums are added for as many terms as cannot saturate (2 * 127 * (2^bits - 1) each: 8 terms at
 * 4 bits, 4 at 5, 2 at 6) before they are widened. Without VNNI, Q8_0's quants (stored + 128) are split into |q|
 * (at most 128: one term) and their signs, which go onto the activations. ---- */
INL int x16_terms(int bits) { return bits >= 8 ? 1 : 32767 / (254 * ((1 << bits) - 1)); }

/* AVX2: 16 lanes as two registers */
typedef struct { __m256i l, h; } v2i;
typedef struct { __m256 l, h; } v2f;
#define V2_I2(name, op) T256 INL v2i v2_##name(v2i a, v2i b) { return (v2i){op(a.l, b.l), op(a.h, b.h)}; }
#define V2_F2(name, op) T256 INL v2f v2_##name(v2f a, v2f b) { return (v2f){op(a.l, b.l), op(a.h, b.h)}; }
V2_I2(and, _mm256_and_si256)
V2_I2(or, _mm256_or_si256)
V2_F2(mul, _mm256_mul_ps)
V2_F2(add, _mm256_add_ps)
#undef V2_I2
#undef V2_F2
T256 INL v2i v2_load(const uint8_t *p) { return (v2i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))}; }
T256 INL v2i v2_srl16(v2i a, int n) { return (v2i){_mm256_srli_epi16(a.l, n), _mm256_srli_epi16(a.h, n)}; }
T256 INL v2i v2_sll16(v2i a, int n) { return (v2i){_mm256_slli_epi16(a.l, n), _mm256_slli_epi16(a.h, n)}; }
T256 INL v2i v2_set8(int c) { return (v2i){_mm256_set1_epi8((char)c), _mm256_set1_epi8((char)c)}; }
T256 INL v2i v2_zero(void) { return (v2i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
T256 INL v2f v2_setf(float x) { return (v2f){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
T256 INL v2f v2_zerof(void) { return v2_setf(0.0f); }
T256 INL v2f v2_fma(v2f a, v2f b, v2f c) { return (v2f){_mm256_fmadd_ps(a.l, b.l, c.l), _mm256_fmadd_ps(a.h, b.h, c.h)}; }
T256 INL v2f v2_cvt(v2i a) { return (v2f){_mm256_cvtepi32_ps(a.l), _mm256_cvtepi32_ps(a.h)}; }
T256 INL v2f v2_loadf(const float *p) { return (v2f){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
T256 INL void v2_storef(float *p, v2f v) { _mm256_storeu_ps(p, v.l); _mm256_storeu_ps(p + 8, v.h); }
T256 INL v2f v2_half(const uint8_t *p) { /* 16 fp16 -> floats */
    return (v2f){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
T256 INL v2f v2_scales(const uint8_t *p, int is_signed) { /* 16 scale bytes -> floats */
    const __m128i a = _mm_loadl_epi64((const __m128i *)p), b = _mm_loadl_epi64((const __m128i *)(p + 8));
    return is_signed ? (v2f){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))}
                     : (v2f){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))};
}
T256 INL v2i v2_bits(const uint8_t *p, v2i v) { /* v where bit b of the 64-bit mask at p is set (byte b), else 0 */
    long long m;
    memcpy(&m, p, 8);
    const __m256i all = _mm256_set1_epi64x(m); /* the mask in every qword; each byte picks its mask byte, then its bit */
    const __m256i pl = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i ph = _mm256_add_epi8(pl, _mm256_set1_epi8(4));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i l = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(all, pl), bit), bit);
    const __m256i h = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(all, ph), bit), bit);
    return (v2i){_mm256_and_si256(l, v.l), _mm256_and_si256(h, v.h)};
}
T256 INL v2f v2_e8m0(const uint8_t *p) { /* 16 MXFP4 scales -> 2^(e - 128), as e8m0_half */
    v2f r;
    for (int h = 0; h < 2; h++) {
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256 f = _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        if (h) r.h = f;
        else r.l = f;
    }
    return r;
}
T256 INL v2i v2_lut(v2i nib) { /* MXFP4 nibbles -> kv + 12 */
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_LUT));
    return (v2i){_mm256_shuffle_epi8(t, nib.l), _mm256_shuffle_epi8(t, nib.h)};
}
T256 INL v2i v2_q8split(v2i w, v2i *neg) { /* Q8_0 quants + 128 -> |q|; *neg: q (its signs) */
    const __m256i f = _mm256_set1_epi8((char)0x80);
    *neg = (v2i){_mm256_xor_si256(w.l, f), _mm256_xor_si256(w.h, f)};
    return (v2i){_mm256_abs_epi8(neg->l), _mm256_abs_epi8(neg->h)};
}
T256 INL v2i v2_dot(v2i acc, const v2i *w, const int32_t *a, int K, int bits, const v2i *neg) {
    const int terms = x16_terms(bits);
    const __m256i one = _mm256_set1_epi16(1);
    for (int i = 0; i < K; i += terms) {
        __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();
        for (int j = i; j < i + terms && j < K; j++) {
            const __m256i av = _mm256_set1_epi32(a[j]);
            sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(w[j].l, neg ? _mm256_sign_epi8(av, neg[j].l) : av));
            sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(w[j].h, neg ? _mm256_sign_epi8(av, neg[j].h) : av));
        }
        acc.l = _mm256_add_epi32(acc.l, _mm256_madd_epi16(sl, one));
        acc.h = _mm256_add_epi32(acc.h, _mm256_madd_epi16(sh, one));
    }
    return acc;
}

/* AVX-512: 16 lanes in one register (x16_kernels.h; the AVX2 counterparts are the v2_ functions) */
T512 INL __m512i v5_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
T512 INL __m512i v5_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
T512 INL __m512 v5_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
T512 INL __m512 v5_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
T512 INL __m512i v5_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
T512 INL __m512i v5_srl16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
T512 INL __m512i v5_sll16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
T512 INL __m512i v5_set8(int c) { return _mm512_set1_epi8((char)c); }
T512 INL __m512i v5_zero(void) { return _mm512_setzero_si512(); }
T512 INL __m512 v5_setf(float x) { return _mm512_set1_ps(x); }
T512 INL __m512 v5_zerof(void) { return _mm512_setzero_ps(); }
T512 INL __m512 v5_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
T512 INL __m512 v5_cvt(__m512i a) { return _mm512_cvtepi32_ps(a); }
T512 INL __m512 v5_loadf(const float *p) { return _mm512_loadu_ps(p); }
T512 INL void v5_storef(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
T512 INL __m512 v5_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
T512 INL __m512 v5_scales(const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}
T512 INL __m512i v5_bits(const uint8_t *p, __m512i v) {
    __mmask64 m;
    memcpy(&m, p, 8);
    return _mm512_maskz_mov_epi8(m, v);
}
T512 INL __m512 v5_e8m0(const uint8_t *p) { /* 16 MXFP4 scales -> 2^(e - 128), as e8m0_half */
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), big, small));
}
T512 INL __m512i v5_lut(__m512i nib) { /* MXFP4 nibbles -> kv + 12 */
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_LUT)), nib);
}
T512 INL __m512i v5_q8split(__m512i w, __mmask64 *neg) {
    const __m512i q = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    *neg = _mm512_movepi8_mask(q);
    return _mm512_abs_epi8(q);
}
T512V INL __m512i v5_dot_vnni(__m512i acc, const __m512i *w, const int32_t *a, int K, int bits, const __mmask64 *neg) {
    (void)bits;
    (void)neg; /* the quants stay unsigned (Q8_0's + 128 is an offset) */
    for (int i = 0; i < K; i++) acc = _mm512_dpbusd_epi32(acc, w[i], _mm512_set1_epi32(a[i]));
    return acc;
}
T512 INL __m512i v5_dot(__m512i acc, const __m512i *w, const int32_t *a, int K, int bits, const __mmask64 *neg) {
    const int terms = x16_terms(bits);
    for (int i = 0; i < K; i += terms) {
        __m512i s16 = _mm512_setzero_si512();
        for (int j = i; j < i + terms && j < K; j++) {
            __m512i av = _mm512_set1_epi32(a[j]);
            if (neg) av = _mm512_mask_sub_epi8(av, neg[j], _mm512_setzero_si512(), av);
            s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(w[j], av));
        }
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(s16, _mm512_set1_epi16(1)));
    }
    return acc;
}

#define X16_T T512V /* AVX-512 with VNNI */
#define X16_FN(name) kx16_vnni_##name
#define V(op) v5_##op
#define VI __m512i
#define VF __m512
#define VNEG __mmask64
#define X16_DOT v5_dot_vnni
#define X16_SIGNED_Q8 0
#include "x16_kernels.h"
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define GQ_AMX 1
#include "x16_amx.h"
#endif
#define X16_T T512 /* AVX-512 without VNNI */
#define X16_FN(name) kx16_bw_##name
#define V(op) v5_##op
#define VI __m512i
#define VF __m512
#define VNEG __mmask64
#define X16_DOT v5_dot
#define X16_SIGNED_Q8 1
#include "x16_kernels.h"
#include "x16_avx2.h"
#define X16_T T256 /* AVX2 */
#define X16_FN(name) kx16_avx2_##name
#define X16_KQUANT kx16_avx2_kquant
#define V(op) v2_##op
#define VI v2i
#define VF v2f
#define VNEG v2i
#define X16_DOT v2_dot
#define X16_SIGNED_Q8 1
#include "x16_kernels.h"
#endif /* GQ_X86 */

/* ------------------------------------------ API ------------------------------------------ */
static void quant_path(int path, const float *x, int64_t r0, int64_t r1, act_t *A);


int gq_best_path(void) {
#ifdef GQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        if (!__builtin_cpu_supports("avx512vnni")) return PATH_AVX512BW;
#ifdef GQ_AMX
        if (amx_usable()) return PATH_AMX;
#endif
        return PATH_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return PATH_AVX2;
#endif
    return PATH_SCALAR;
}


#ifdef GQ_X86
typedef void (*x16_kernel_t)(int, const uint8_t *, const act_t *, int64_t, int, float *, int64_t, int64_t, int64_t, int);
/* The x16 kernel of `path` for a call of nr rows of `type`: on the AMX path, AMX where it pays (x16_amx.h: not Q6_K,
 * from AMX_ROWS rows), else VNNI, with the same bits */
static x16_kernel_t x16_kernel(int path, int type, int nr) {
#ifdef GQ_AMX
    if (path == PATH_AMX && nr >= AMX_ROWS && type != GQ_X16 + GQ_Q6_K) return kx16_amx_run;
#endif
    (void)type, (void)nr;
    return path >= PATH_AVX512 ? kx16_vnni_matmul : path == PATH_AVX512BW ? kx16_bw_matmul : kx16_avx2_matmul;
}
#endif

#define MAXPARTS 64
#define ROW_GROUP 128 /* rows through every task at a time: a group's activations (x 2048 bytes) stay in L2 */

static void act_free(act_t *A) { free(A->q); free(A->d); free(A->s); free(A->p); free(A->t); }

/* One task of gq_matmul_parts: outputs [oa, oe) of one matrix (W, `rb` bytes per output; results at yp, rows
 * ystride apart) for rows [g0, g1) of the call's `rows`, the inputs in chunks of 2048 (see there). */
static void gq_task(int type, const uint8_t *W, int64_t rb, const act_t *A, int64_t in, int64_t oa, int64_t oe,
                    int64_t g0, int64_t g1, float *yp, int64_t ystride, float *off, int path) {
    const int64_t nbk = in / block_elems(type);
    const int64_t kc = 2048 / block_elems(type); /* the same for every row count (see gq_matmul_parts) */
    /* the file's layout has AVX-512 kernels with VNNI only, and none for Q4_1: the AVX2 row kernel serves the rest;
     * MXFP4 has the scalar kernel there (its outputs a multiple of 16, the loader repacks it to x16) */
    if (type == GQ_MXFP4) path = PATH_SCALAR;
    const int p512 = path >= PATH_AVX512 && (type & ~GQ_X16) != GQ_Q4_1;
#ifdef GQ_X86
    if (type & GQ_X16) {
        /* Few rows: each group of 16 outputs from its first chunk to its last, so a thread reads its stretch of the
         * weights front to back; more: chunk by chunk over the groups, so a chunk's activations stay in L2. Either
         * way an output's chunks are added in the same order. */
        const int64_t ng = (oe - oa + 15) / 16, nc = (nbk + kc - 1) / kc, by_group = (g1 - g0) * in <= (1 << 16);
        for (int64_t i = 0; i < ng * nc; i++) {
            const int64_t o = oa + 16 * (by_group ? i / nc : i % ng), b0 = kc * (by_group ? i % nc : i / ng);
            const int64_t b1 = b0 + kc < nbk ? b0 + kc : nbk;
            for (int64_t r0 = g0; r0 < g1; r0 += RT) {
                const int nr = (int)(g1 - r0 < RT ? g1 - r0 : RT);
                x16_kernel(path, type, nr)(type, W + o * rb, A, r0, nr, yp + r0 * ystride + o, ystride, b0, b1, b0 > 0);
            }
        }
        return;
    }
#endif
    for (int64_t b0 = 0; b0 < nbk; b0 += kc) {
        const int64_t b1 = b0 + kc < nbk ? b0 + kc : nbk;
        for (int64_t o = oa; o < oe; o++) {
            const uint8_t *wr = W + o * rb;
            for (int64_t r0 = g0; r0 < g1; r0 += RT) {
                const int nr = (int)(g1 - r0 < RT ? g1 - r0 : RT);
                float *yo = yp + r0 * ystride + o;
#ifdef GQ_X86
                if (p512) {
                    tile1_avx512(type, wr, rb, A, r0, nr, yo, ystride, off, b0, b1, b0 > 0);
                    continue;
                }
                if (path >= PATH_AVX2) {
                    row_avx2(type, wr, A, r0, nr, yo, ystride, off, b0, b1, b0 > 0);
                    continue;
                }
#endif
                row_scalar(type, wr, A, r0, nr, yo, ystride, b0, b1, b0 > 0);
            }
        }
    }
}

/* y[rows][sum outs] (float32) = x[rows][in] (float32) @ [W_0; W_1; ...]^T: weight matrices that share the input (a
 * fused q/k/v or gate/up), their outputs side by side, in one call (gq_matmul_jobs). path: 0 auto, 1 scalar, 2 avx2,
 * 3 avx512 (a path the CPU lacks is lowered to the best it has). Returns the path used, or a negative error. */
int gq_matmul_parts(int nparts, const int *types, const uint8_t *const *Ws, const int64_t *outs, int64_t in,
                    const float *x, int64_t rows, float *y, int nthreads, int path) {
    if (nparts < 1 || nparts > MAXPARTS) return -2;
    gq_job_t jobs[MAXPARTS];
    int64_t col = 0, ystride = 0;
    for (int p = 0; p < nparts; p++) ystride += outs[p];
    for (int p = 0; p < nparts; p++) {
        jobs[p] = (gq_job_t){types[p], Ws[p], outs[p], x, rows, y + col, ystride};
        col += outs[p];
    }
    return gq_matmul_jobs(nparts, jobs, in, nthreads, path);
}

/* Activations for jobs[j]: one per (input, rows, block size, sum group), so jobs of the same kind on the same input
 * share them; acts[] and act_of[] filled, their count returned, or -3 (out of memory: what was allocated freed) */
static int job_acts(int n, const gq_job_t *J, int64_t in, int path, act_t *acts, int *act_of) {
    int nacts = 0, err = 0;
    for (int j = 0; j < n; j++) {
        const int G = block_elems(J[j].type), S = sum_group(J[j].type);
        act_of[j] = -1;
        for (int a = 0; a < nacts; a++)
            if (acts[a].G == G && acts[a].S == S && acts[a].x == J[j].x && acts[a].rows == J[j].rows) act_of[j] = a;
        if (act_of[j] >= 0) continue;
        act_t *A = &acts[nacts];
        const int64_t rows = J[j].rows;
        *A = (act_t){.in = in, .G = G, .S = S, .x = J[j].x, .rows = rows};
        A->q = (int8_t *)malloc((size_t)(rows * in) + 64);
        A->d = (float *)malloc(sizeof(float) * (size_t)(rows * (in / G)) + 64);
        A->s = (float *)malloc(sizeof(float) * (size_t)(rows * (in / S)) + 64);
        const int with_p = S == 16 && path == PATH_AVX2; /* only the AVX2 x16 kernel reads it */
        A->p = with_p ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(rows * (in / 16)) + 64) : NULL;
#ifdef GQ_AMX
        const int with_t = path == PATH_AMX && rows >= AMX_ROWS && S == 32; /* S 16: Q6_K, which AMX does not take */
#else
        const int with_t = 0;
#endif
        A->t = with_t ? (int8_t *)malloc((size_t)((rows + 15) / 16 * 16 * in) + 64) : NULL;
        act_of[j] = nacts++;
        if (!A->q || !A->d || !A->s || (with_p && !A->p) || (with_t && !A->t)) err = 1;
    }
    if (!err) return nacts;
    for (int a = 0; a < nacts; a++) act_free(&acts[a]);
    return -3;
}

/* Each job's y = its x @ its W^T, all in one parallel region (the experts of a layer: each over the rows that chose
 * it): the threads split all jobs' outputs between them. A row's result is the same bits as in a call of its own.
 * path as gq_matmul_parts. Returns the path used, or a negative error. */
int gq_matmul_jobs(int n, const gq_job_t *J, int64_t in, int nthreads, int path) {
    if (n < 1 || in <= 0) return -2;
    const int64_t OC = 32;
    int64_t maxrows = 0, quantized = 0;
    for (int j = 0; j < n; j++) {
        const int be = block_elems(J[j].type);
        if (block_bytes(J[j].type) == 0) return -1;
        if (in % be != 0 || J[j].out <= 0 || J[j].rows < 0) return -2;
        if (J[j].type & GQ_X16 && J[j].out % 16 != 0) return -2;
        maxrows = J[j].rows > maxrows ? J[j].rows : maxrows;
    }
    const int best = gq_best_path();
    if (path == PATH_AUTO || path > best) path = best;
    for (int j = 0; j < n; j++)
        if (J[j].type & GQ_X16 && path < PATH_AVX2) return -4; /* the x16 layout has AVX2 and AVX-512 kernels */
    if (nthreads < 1) nthreads = 1;
    if (maxrows == 0) return path;
    void *mem = malloc((sizeof(act_t) + sizeof(int) + sizeof(int64_t)) * (size_t)n + sizeof(int64_t));
    if (!mem) return -3;
    act_t *acts = (act_t *)mem;
    int64_t *task0 = (int64_t *)(acts + n); /* [n + 1]: job j's tasks are [task0[j], task0[j + 1]) */
    int *act_of = (int *)(task0 + n + 1);
    const int nacts = job_acts(n, J, in, path, acts, act_of);
    if (nacts < 0) {
        free(mem);
        return nacts;
    }
    task0[0] = 0;
    for (int j = 0; j < n; j++) task0[j + 1] = task0[j] + (J[j].out + OC - 1) / OC;
    for (int a = 0; a < nacts; a++) quantized += acts[a].rows * in;
    /* few rows: quantize here, so the parallel region has one barrier (its end) instead of two, which
     * matters when the machine is oversubscribed and every barrier may wait for a descheduled thread */
    const int quant_serial = quantized <= (1 << 16);
    if (quant_serial)
        for (int a = 0; a < nacts; a++) quant_path(path, acts[a].x, 0, acts[a].rows, &acts[a]);
    int err = 0;
#pragma omp parallel num_threads(nthreads)
    {
        if (!quant_serial) {
            for (int a = 0; a < nacts; a++) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < acts[a].rows; r++) quant_path(path, acts[a].x, r, r + 1, &acts[a]);
            }
        }
        float *off = (float *)malloc(sizeof(float) * (size_t)(2 * (in / 16) + 32));
        if (!off) {
#pragma omp atomic write
            err = 1;
        }
        /* Tasks of OC outputs of one job, split statically: each thread reads one contiguous stretch of the
         * weights. (A dynamic schedule, tasks handed out in turn, interleaved the threads' reads and halved the
         * memory throughput at one row: Q4_K 8960x1536 from DRAM, 2 threads, 0.41 vs 0.22 ms.) The inputs are
         * walked in chunks of 2048 so that the activations of one chunk (rows x 2048 bytes) stay in L2 while
         * every output of the task uses them (without this the cost per row grew past ~16 rows); at every row
         * count, so that a row's sums are added in the same order however many rows share the call. Many rows
         * (a prefill chunk) go through every task a group of ROW_GROUP at a time, so a chunk's activations stay in
         * L2 (512 rows x 2048 bytes filled it: Q4_K 17920x1536 x16 on Zen 5 took 2.7x the time of 256 rows); a
         * row's arithmetic is the same in any group. */
        for (int64_t g0 = 0; g0 < maxrows; g0 += ROW_GROUP) {
            int j = 0; /* the job of this thread's task: its tasks come in ascending order */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < task0[n]; task++) {
                while (task >= task0[j + 1]) j++;
                if (!off || g0 >= J[j].rows) continue;
                const int64_t g1 = g0 + ROW_GROUP < J[j].rows ? g0 + ROW_GROUP : J[j].rows;
                const int64_t oa = (task - task0[j]) * OC, oe = oa + OC < J[j].out ? oa + OC : J[j].out;
                const int64_t rb = in / block_elems(J[j].type) * block_bytes(J[j].type);
                gq_task(J[j].type, J[j].W, rb, &acts[act_of[j]], in, oa, oe, g0, g1, J[j].y, J[j].ystride, off, path);
            }
        }
        free(off);
    }
    for (int a = 0; a < nacts; a++) act_free(&acts[a]);
    free(mem);
    return err ? -3 : path;
}

INL uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = nan ? ((u >> 16) | 0x40u) : ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* nearest even */
    return (uint16_t)r;
}

/* rows [o0, o1) of W (absolute) -> dst rows o - obase */
INL void dequant_rows(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, int64_t obase, void *dst,
                      int bf16) {
    const int be = block_elems(type), bb = block_bytes(type), per = 256 / be; /* blocks per 256 inputs */
    const int64_t nb = in / be, rowbytes = nb * bb;
    for (int64_t o = o0; o < o1; o++) {
        for (int64_t b0 = 0; b0 < nb; b0 += per) {
            int8_t q[256];
            float gs[16], gm[16], v[256];
            const int nblk = (int)(nb - b0 < per ? nb - b0 : per), n = nblk * be;
            for (int k = 0; k < nblk; k++) {
                const int gsz = type & GQ_X16 ? unpack_x16(type, W + (o / 16 * 16) * rowbytes + (b0 + k) * 16 * bb, (int)(o % 16),
                                                           q, gs, gm)
                                              : unpack_block(type, W + o * rowbytes + (b0 + k) * bb, q, gs, gm);
                for (int g = 0; g < be / gsz; g++)
                    for (int i = 0; i < gsz; i++) v[k * be + g * gsz + i] = gs[g] * (float)q[g * gsz + i] + gm[g];
            }
            const int64_t at = (o - obase) * in + b0 * be;
            if (bf16) {
                uint16_t *d16 = (uint16_t *)dst + at;
                for (int i = 0; i < n; i++) d16[i] = f32_to_bf16(v[i]);
            } else {
                memcpy((float *)dst + at, v, sizeof(float) * (size_t)n);
            }
        }
    }
}

/* The same generic C compiled for each instruction set (gcc vectorizes the loops per target), with the
 * type a constant in each copy. */
#define TYPE_SWITCH(CALL)                                                                                  \
    switch (type) {                                                                                          \
    case GQ_Q4_K: { const int type_ = GQ_Q4_K; CALL; } break;                                                \
    case GQ_Q6_K: { const int type_ = GQ_Q6_K; CALL; } break;                                                \
    case GQ_Q5_0: { const int type_ = GQ_Q5_0; CALL; } break;                                                \
    case GQ_Q4_1: { const int type_ = GQ_Q4_1; CALL; } break;                                                \
    case GQ_Q8_0: { const int type_ = GQ_Q8_0; CALL; } break;                                                \
    case GQ_MXFP4: { const int type_ = GQ_MXFP4; CALL; } break;                                              \
    case GQ_X16 + GQ_Q4_K: { const int type_ = GQ_X16 + GQ_Q4_K; CALL; } break;                              \
    case GQ_X16 + GQ_Q6_K: { const int type_ = GQ_X16 + GQ_Q6_K; CALL; } break;                              \
    case GQ_X16 + GQ_Q8_0: { const int type_ = GQ_X16 + GQ_Q8_0; CALL; } break;                              \
    case GQ_X16 + GQ_Q5_0: { const int type_ = GQ_X16 + GQ_Q5_0; CALL; } break;                              \
    case GQ_X16 + GQ_Q4_1: { const int type_ = GQ_X16 + GQ_Q4_1; CALL; } break;                              \
    case GQ_X16 + GQ_MXFP4: { const int type_ = GQ_X16 + GQ_MXFP4; CALL; } break;                            \
    }
static void dequant_any(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, int64_t obase, void *dst,
                            int bf16) {
    TYPE_SWITCH(dequant_rows(type_, W, in, o0, o1, obase, dst, bf16))
}
static void quant_any(const float *x, int64_t r0, int64_t r1, act_t *A) { quantize_rows(x, r0, r1, A); }
#ifdef GQ_X86
T256 static void dequant_256(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, int64_t obase, void *dst,
                            int bf16) {
    TYPE_SWITCH(dequant_rows(type_, W, in, o0, o1, obase, dst, bf16))
}
T512 static void dequant_512(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, int64_t obase, void *dst,
                            int bf16) {
    TYPE_SWITCH(dequant_rows(type_, W, in, o0, o1, obase, dst, bf16))
}
T256 static void quant_256(const float *x, int64_t r0, int64_t r1, act_t *A) { quantize_rows(x, r0, r1, A); }
T512 static void quant_512(const float *x, int64_t r0, int64_t r1, act_t *A) { quantize_rows(x, r0, r1, A); }
/* x16 blocks -> bfloat16, transposed (dst[i * ld + t]: input i, output t of the group), for the prefill's
 * dequantize + bf16 matmul on CPUs with AVX512-BF16 (and VBMI): a line of the layout (4 inputs x 16 outputs, output-
 * major) regrouped by one byte permute into 4 x 16 bytes, one input's 16 outputs each; a value is gs * q + gm
 * (mul, then add), as dequant_rows gives it, rounded to nearest even. */
#define T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,avx2,fma,f16c")))
T512BF static inline __attribute__((always_inline)) __m256i x16_bf16(__m512i q32, __m512 gs, __m512 gm) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(gs, _mm512_cvtepi32_ps(q32)), gm));
}
/* The quants of inputs 4k..4k+3 of one group's superblock P as 4 x 16 bytes (lane j: input 4k + j, byte t: output t) */
T512BF static inline __attribute__((always_inline)) __m512i x16_quads(int q6, const uint8_t *P, int k, __m512i idx) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(P + 64 * (k % 32)));
    __m512i q = _mm512_and_si512(k < 32 ? v : _mm512_srli_epi16(v, 4), m4);
    if (q6) {
        const __m512i h = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(P + X6_HB + 64 * (k % 16)));
        q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * (k / 16)), m3), 4));
    }
    return q;
}
T512BF static inline __attribute__((always_inline)) void x16_group_scales(int q6, const uint8_t *P, __m512 *gs,
                                                                         __m512 *gm) {
    const __m512 dv = v5_half(P + (q6 ? X6_D : X4_D)), zero = _mm512_setzero_ps();
    for (int g = 0; g < (q6 ? 16 : 8); g++) {
        gs[g] = _mm512_mul_ps(v5_scales(P + (q6 ? X6_SC : X4_SC) + 16 * g, q6), dv);
        gm[g] = q6 ? zero : _mm512_mul_ps(_mm512_sub_ps(zero, v5_half(P + X4_DMIN)), v5_scales(P + X4_M + 16 * g, 0));
    }
}
/* Lane j of 4 x 16 quants as 16 signed values (less the layout's offset `off`) */
#define X16_LANE(q, j) _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, j)), off)
/* Two neighbouring groups (32 outputs: Wg and Wg + 16 rows), so that each input's 32 outputs fill a 64-byte line. */
T512BF static void x16_dequant_t_pair(int type, const uint8_t *Wg, int64_t gbytes, int64_t nbk, uint16_t *dst,
                                      int64_t ld) {
    const int q6 = type == GQ_X16 + GQ_Q6_K;
    const int64_t sb = q6 ? X6_BYTES : X4_BYTES;
    uint8_t ix[64];
    for (int k = 0; k < 64; k++) ix[k] = (uint8_t)(4 * (k % 16) + k / 16); /* lane j, byte t <- byte 4t + j */
    const __m512i idx = _mm512_loadu_si512(ix), off = _mm512_set1_epi32(q6 ? 32 : 0);
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *P[2] = {Wg + b * sb, Wg + gbytes + b * sb};
        uint16_t *D = dst + b * 256 * ld;
        __m512 gs[2][16], gm[2][16];
        for (int h = 0; h < 2; h++) x16_group_scales(q6, P[h], gs[h], gm[h]);
        for (int k = 0; k < 64; k++) { /* inputs 4k .. 4k + 3 */
            const int g = q6 ? k / 4 : k / 8;
            const __m512i qa = x16_quads(q6, P[0], k, idx), qb = x16_quads(q6, P[1], k, idx);
#define X16_ROW(j)                                                                                              \
    _mm512_storeu_si512(D + (4 * k + j) * ld,                                                                   \
                        _mm512_inserti64x4(_mm512_castsi256_si512(x16_bf16(X16_LANE(qa, j), gs[0][g], gm[0][g])), \
                                           x16_bf16(X16_LANE(qb, j), gs[1][g], gm[1][g]), 1))
            X16_ROW(0);
            X16_ROW(1);
            X16_ROW(2);
            X16_ROW(3);
#undef X16_ROW
        }
    }
}
/* The same for the 32-input types (Q8_0, Q5_0, Q4_1, MXFP4): a block of one group is 32 inputs, its quants unsigned
 * (q + off; MXFP4's through its table). */
T512BF static inline __attribute__((always_inline)) __m512i x16_quads32(int type, const uint8_t *P, int k, __m512i idx) {
    if (type == GQ_X16 + GQ_Q8_0) return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(P + 64 * k));
    const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(P + 64 * (k % 4)));
    __m512i q = _mm512_and_si512(k < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    if (type == GQ_X16 + GQ_Q5_0) { /* bit 4t + j of mask k -> byte 4t + j -> lane j, byte t */
        uint64_t m;
        memcpy(&m, P + X5_HB + 8 * k, 8);
        q = _mm512_or_si512(q, _mm512_and_si512(_mm512_permutexvar_epi8(idx, _mm512_movm_epi8(m)), _mm512_set1_epi8(0x10)));
    }
    if (type == GQ_X16 + GQ_MXFP4) q = v5_lut(q);
    return q;
}
static int x16_body32(int type) {
    return type == GQ_X16 + GQ_Q8_0 || type == GQ_X16 + GQ_Q5_0 || type == GQ_X16 + GQ_Q4_1 || type == GQ_X16 + GQ_MXFP4;
}
T512BF static void x16_dequant_t_pair32(int type, const uint8_t *Wg, int64_t gbytes, int64_t nbk, uint16_t *dst,
                                        int64_t ld) {
    const int q8 = type == GQ_X16 + GQ_Q8_0, q41 = type == GQ_X16 + GQ_Q4_1, mx = type == GQ_X16 + GQ_MXFP4;
    const int64_t sb = q8 ? X8_BYTES : q41 ? X41_BYTES : mx ? XM_BYTES : X5_BYTES, d_at = q8 ? X8_D : q41 ? X41_D : X5_D;
    uint8_t ix[64];
    for (int k = 0; k < 64; k++) ix[k] = (uint8_t)(4 * (k % 16) + k / 16); /* lane j, byte t <- byte 4t + j */
    const __m512i idx = _mm512_loadu_si512(ix), off = _mm512_set1_epi32(q8 ? 128 : q41 ? 0 : mx ? 12 : 16);
    for (int64_t b = 0; b < nbk; b++) {
        const uint8_t *P[2] = {Wg + b * sb, Wg + gbytes + b * sb};
        uint16_t *D = dst + b * 32 * ld;
        __m512 gs[2], gm[2];
        for (int h = 0; h < 2; h++) {
            gs[h] = mx ? v5_e8m0(P[h] + XM_E) : v5_half(P[h] + d_at);
            gm[h] = q41 ? v5_half(P[h] + X41_M) : _mm512_setzero_ps();
        }
        for (int k = 0; k < 8; k++) { /* inputs 4k .. 4k + 3 */
            const __m512i qa = x16_quads32(type, P[0], k, idx), qb = x16_quads32(type, P[1], k, idx);
            for (int j = 0; j < 4; j++)
                _mm512_storeu_si512(D + (4 * k + j) * ld,
                                    _mm512_inserti64x4(_mm512_castsi256_si512(x16_bf16(X16_LANE(qa, j), gs[0], gm[0])),
                                                       x16_bf16(X16_LANE(qb, j), gs[1], gm[1]), 1));
        }
    }
}
static int has_bf16_dequant(void) {
    return gq_best_path() >= PATH_AVX512BW && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
}
#endif

/* Rows [r0, r1) of A->q into A->t's tiles */
static void act_tiles(int64_t r0, int64_t r1, act_t *A) {
    const int64_t ng = A->in / 32;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < ng; g++) memcpy(A->t + ((r / 16 * ng + g) * 16 + r % 16) * 32, A->q + r * A->in + 32 * g, 32);
}

static void quant_rows_path(int path, const float *x, int64_t r0, int64_t r1, act_t *A) {
#ifdef GQ_X86
    if (path >= PATH_AVX512BW) { quant_512(x, r0, r1, A); return; }
    if (path == PATH_AVX2) { quant_256(x, r0, r1, A); return; }
#endif
    (void)path;
    quant_any(x, r0, r1, A);
}

static void quant_path(int path, const float *x, int64_t r0, int64_t r1, act_t *A) {
    quant_rows_path(path, x, r0, r1, A);
    if (A->t) act_tiles(r0, r1, A);
}

/* Dequantize weight rows [o0, o1) into dst: float32 (bf16 = 0) or bfloat16 (bf16 = 1), row-major [o1 - o0][in]. */
int gq_dequantize(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, void *dst, int bf16, int nthreads) {
    const int be = block_elems(type), bb = block_bytes(type);
    if (bb == 0) return -1;
    if (in % be != 0 || o1 < o0) return -2;
    if (nthreads < 1) nthreads = 1;
    const int path = gq_best_path();
    const int64_t chunk = 16;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = o0; c < o1; c += chunk) {
        const int64_t e = c + chunk < o1 ? c + chunk : o1;
#ifdef GQ_X86
        if (path >= PATH_AVX512BW) { dequant_512(type, W, in, c, e, o0, dst, bf16); continue; }
        if (path == PATH_AVX2) { dequant_256(type, W, in, c, e, o0, dst, bf16); continue; }
#endif
        dequant_any(type, W, in, c, e, o0, dst, bf16);
    }
    return 0;
}

/* x16 Q4_K / Q6_K / Q8_0 / Q5_0 / Q4_1 / MXFP4 weight rows [o0, o1) (o0 a multiple of 16, o1 - o0 of 32) -> bfloat16,
 * transposed: dst[i * ld + (o - o0)] for input i (x16_dequant_t_pair, x16_dequant_t_pair32; subnormal weights, only MXFP4's
 * e < 2 makes them, become 0 as vcvtneps2bf16 gives them). Returns 0, -1 where the type or this CPU (AVX512-BF16
 * and VBMI) has no such path, -2 on bad shapes. */
int gq_dequantize_t(int type, const uint8_t *W, int64_t in, int64_t o0, int64_t o1, uint16_t *dst, int64_t ld,
                    int nthreads) {
#ifdef GQ_X86
    const int b32 = x16_body32(type);
    if ((type != GQ_X16 + GQ_Q4_K && type != GQ_X16 + GQ_Q6_K && !b32) || !has_bf16_dequant()) return -1;
    const int be = block_elems(type);
    if (in % be || o0 % 16 || (o1 - o0) % 32 || o1 < o0 || ld < o1 - o0) return -2;
    if (nthreads < 1) nthreads = 1;
    const int64_t nbk = in / be, rowbytes = nbk * block_bytes(type);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = o0; o < o1; o += 32)
        (b32 ? x16_dequant_t_pair32 : x16_dequant_t_pair)(type, W + o * rowbytes, 16 * rowbytes, nbk, dst + (o - o0), ld);
    return 0;
#else
    (void)type, (void)W, (void)in, (void)o0, (void)o1, (void)dst, (void)ld, (void)nthreads;
    return -1;
#endif
}

/* Q4_K / Q6_K / Q8_0 / Q5_0 / Q4_1 / MXFP4 blocks [out][in] in the file's layout -> the x16 layout (GQ_X16 + type) at dst
 * (out / 16 groups of in / block_elems superblocks: out * in / block_elems * block_bytes(GQ_X16 + type) bytes). out
 * must be a multiple of 16. Returns 0 or a negative error. */
int gq_repack(int type, const uint8_t *W, int64_t out, int64_t in, uint8_t *dst, int nthreads) {
    if (type != GQ_Q4_K && type != GQ_Q6_K && type != GQ_Q8_0 && type != GQ_Q5_0 && type != GQ_Q4_1 && type != GQ_MXFP4)
        return -1;
    if (in % block_elems(type) != 0 || out % 16 != 0 || in <= 0) return -2;
    if (nthreads < 1) nthreads = 1;
    const int64_t nbk = in / block_elems(type), rowbytes = nbk * block_bytes(type), sb = x16_bytes(type);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < out / 16; g++) repack_group(type, W + g * 16 * rowbytes, rowbytes, nbk, dst + g * nbk * sb);
    return 0;
}
