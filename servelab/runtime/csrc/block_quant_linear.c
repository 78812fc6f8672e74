/* y = x @ W^T for a weight kept in its GGUF block-quantized form, fp32 activations and sums.
 *
 * Why: a decode step with few rows reads every weight once and does two flops with each, so it
 * is bound by the bytes it streams. SmolLM2's GGUF stores its layers as Q4_1 (5 bits a weight)
 * and its head as Q8_0 (8.5 bits); dequantized to fp32 they are 32 bits, 4-6x the bytes. Two
 * kernels multiply straight from the blocks:
 *   - servelab_block_quant_linear_f32 (up to four rows at a time, 32-weight formats): each
 *     block's quants are widened to fp32 in registers and used for every row (Q4_1_G16, below:
 *     sixteen outputs a vector);
 *   - servelab_block_quant_gemm_f32 (more rows, every format here): 48 outputs' weights are
 *     expanded to fp32 (L2) once and a register-blocked 4-row x 3-output kernel runs over them;
 *   - servelab_block_quant_gemm_kmajor_f32 (AVX-512, many rows, not deterministic mode): the same
 *     48 outputs expanded k-major, one output a lane, in 8-row x 48-output tiles. Q4_1_G16 takes it
 *     through either entry point: its panel fills without a transposition.
 * The weights are the values the loader's dequantization produces (servelab_block_dequant_f32
 * writes them out, and tests check they are bit-identical), so this is the fp32 model with
 * another summation order, not an approximation. block_quant.py picks the kernel per call, and
 * MKL's fp32 GEMM over the dequantized copy for the largest calls.
 *
 * Block formats (ggml); a row of W is its blocks in order:
 *   Q8_0  32 weights: fp16 d, int8 q[32]                 w = d * q
 *   Q4_0  32 weights: fp16 d, uint8 qs[16]               w = d * (nibble - 8)
 *   Q4_1  32 weights: fp16 d, fp16 m, uint8 qs[16]       w = d * nibble + m
 *         (byte j of qs holds element j in its low nibble and element j + 16 in its high one)
 *   Q4_K, Q6_K  256 weights with 6-bit / 8-bit sub-block scales (dequant_k_block)
 *
 * ISA levels: AVX2 (eight lanes) and AVX-512 (sixteen: the in-register and panel kernels, whose
 * sums therefore differ from AVX2's in order, within the same fp32 tolerance); without AVX2, a
 * scalar dequantize-then-dot. At every level the panel kernel and exact_rows sum a row the same way.
 */
#include <stdint.h>
#include <string.h>

#include "fp.h"  /* SL_ROUNDED: Q4_1's and Q4_K's weights round exactly as the loader's */
#include "half.h"
#include "parallel.h"
#include "isa.h"

/* F32: a plain fp32 weight (row_bytes = 4 * in_features), panel kernel only: deterministic mode
 * runs every linear through that kernel, whatever its format (block_quant.py).
 * Q4_1_G16: Q4_1's bytes regrouped by block_quant.py for the AVX-512 levels, one output a lane:
 * sixteen outputs a group (group g where rows 16g..16g+15 were, the same bytes), and per block
 * of 32 inputs 320 bytes: the 16 outputs' fp16 d, their fp16 m, then four 64-byte vectors, dword
 * k of vector c holding output k's quant bytes 4c..4c+3 (byte j: element j's nibble low,
 * element j + 16's high, as in Q4_1). A block's sixteen outputs then need no horizontal sums and
 * each nibble one shift and one vpermps (g16_rows, docs/benchmarks.md "GGUF blocks kept packed"). */
enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, F32 = 5 };
enum { Q4_1_G16 = 6 }; /* a layout of Q4_1, not a ggml type: block_quant.Q4_1_G16 */
#define G16_BLOCK 320 /* bytes of 16 outputs' block */
#define G16_PREFETCH 4096 /* bytes ahead that g16_rows fetches (a hint: past the weight's end is harmless) */


static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return sl_f16_to_f32(h);
}

/* ggml's 6-bit scale and min j of a Q4_K block (get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Bytes of a 32-weight block. */
static inline int64_t block_bytes(int64_t qtype) { return qtype == Q8_0 ? 34 : qtype == Q4_1 || qtype == Q4_1_G16 ? 20 : 18; }

/* Q4_1_G16: output o's weight at input i, rounded as dequant_row rounds Q4_1's (d * q, then + m). */
static float g16_weight(const uint8_t *w, int64_t row_bytes, int64_t o, int64_t i) {
    const uint8_t *blk = w + (o / 16) * 16 * row_bytes + (i / 32) * G16_BLOCK;
    const int64_t k = o % 16, e = i % 32, j = e % 16;
    const uint8_t byte = blk[64 + 64 * (j / 4) + 4 * k + j % 4];
    float v = fp16_to_f32(blk + 2 * k) * (float)(e < 16 ? byte & 0xF : byte >> 4);
    SL_ROUNDED(v);
    return v + fp16_to_f32(blk + 32 + 2 * k);
}

/* One 256-weight K-quant block -> 256 floats, with the loader's (the gguf package's) roundings:
 * Q4_K w = (d * sc) * q - dmin * m; Q6_K w = (d * sc) * q. */
static void dequant_k_block(int64_t qtype, const uint8_t *blk, float *dst) {
    if (qtype == Q4_K) {
        const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
        const uint8_t *scales = blk + 4, *q = blk + 16;
        for (int j = 0; j < 4; j++, q += 32, dst += 64) {
            int sc, m;
            scale_min_k4(2 * j, scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            scale_min_k4(2 * j + 1, scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                float lo = d1 * (float)(q[l] & 0xF), hi = d2 * (float)(q[l] >> 4);
                SL_ROUNDED(lo);
                SL_ROUNDED(hi);
                dst[l] = lo - m1;
                dst[32 + l] = hi - m2;
            }
        }
    } else { /* Q6_K: ql[128], qh[64], int8 scales[16], fp16 d */
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(blk + 208);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, dst += 128)
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                dst[l] = (d * (float)sc[is]) * (float)q1;
                dst[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                dst[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                dst[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
    }
}

#ifdef SL_AVX2
/* A row of 32-weight blocks of one format -> floats, as the loader rounds them, with the format
 * fixed at compile time: this runs over every weight of every panel step, so each block is one
 * fp16 conversion for d (and m), two byte loads widened to dwords, and per eight weights a
 * convert, a multiply (and an add) and a store. */
static inline __attribute__((always_inline)) void dequant_blocks(int64_t qtype, const uint8_t *row, int64_t nblocks,
                                                                 float *dst) {
    const int64_t bb = block_bytes(qtype);
    const __m256i mask = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
    for (int64_t b = 0; b < nblocks; b++, dst += 32) {
        const uint8_t *blk = row + b * bb;
        if (qtype == Q8_0) {
            const __m256 vd = _mm256_set1_ps(fp16_to_f32(blk));
            for (int j = 0; j < 32; j += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + j)));
                _mm256_storeu_ps(dst + j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)));
            }
            continue;
        }
        /* d and (Q4_1) m in one conversion */
        int32_t dm_bits;
        memcpy(&dm_bits, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
        const __m256 vd = _mm256_broadcastss_ps(dm), vm = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        /* bytes 0-7 hold elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15 elements 8-15 and 24-31 */
        const uint8_t *qs = blk + (qtype == Q4_1 ? 4 : 2);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
        const __m256i n[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask), _mm256_srli_epi32(b0, 4),
                              _mm256_srli_epi32(b1, 4)};
        for (int j = 0; j < 4; j++) {
            /* Q4_0: d * (q - 8), the difference exact; Q4_1: d * q, then + m: two roundings */
            __m256 w = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(qtype == Q4_0 ? _mm256_sub_epi32(n[j], eight) : n[j]));
            SL_ROUNDED(w);
            _mm256_storeu_ps(dst + 8 * j, qtype == Q4_1 ? _mm256_add_ps(w, vm) : w);
        }
    }
}
#endif

/* One row of nblocks 32-weight blocks (nblocks / 8 K-quant blocks) -> nblocks * 32 floats. */
static void dequant_row(int64_t qtype, const uint8_t *row, int64_t nblocks, float *dst) {
    if (qtype == F32) {
        memcpy(dst, row, sizeof(float) * (size_t)(nblocks * 32));
        return;
    }
    if (qtype == Q4_K || qtype == Q6_K) {
        const int64_t kb = qtype == Q4_K ? 144 : 210;
        for (int64_t b = 0; b < nblocks / 8; b++) dequant_k_block(qtype, row + b * kb, dst + b * 256);
        return;
    }
#ifdef SL_AVX2
    switch (qtype) {
    case Q8_0: dequant_blocks(Q8_0, row, nblocks, dst); return;
    case Q4_0: dequant_blocks(Q4_0, row, nblocks, dst); return;
    default: dequant_blocks(Q4_1, row, nblocks, dst); return;
    }
#else
    for (int64_t b = 0; b < nblocks; b++, dst += 32) {
        if (qtype == Q8_0) {
            const uint8_t *blk = row + b * 34;
            const float d = fp16_to_f32(blk);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) dst[j] = d * (float)q[j];
        } else {
            const int has_min = qtype == Q4_1;
            const uint8_t *blk = row + b * block_bytes(qtype);
            const float d = fp16_to_f32(blk);
            const float m = has_min ? fp16_to_f32(blk + 2) : 0.0f;
            const uint8_t *qs = blk + (has_min ? 4 : 2);
            const float off = has_min ? 0.0f : 8.0f;
            for (int j = 0; j < 16; j++) {
                float w_lo = d * ((float)(qs[j] & 0x0f) - off), w_hi = d * ((float)(qs[j] >> 4) - off);
                SL_ROUNDED(w_lo);
                SL_ROUNDED(w_hi);
                dst[j] = has_min ? w_lo + m : w_lo;
                dst[j + 16] = has_min ? w_hi + m : w_hi;
            }
        }
    }
#endif
}

/* Per block, sum_i w_i x_i = d * sum_i q_i x_i + m * sum_i x_i with q the raw quant (int8, or a
 * nibble 0..15) and m the block's offset (Q4_1: m; Q4_0: -8 d; Q8_0: 0). So the weights need no
 * multiply or add of their own, only a conversion to float: that halves the work a block costs
 * (the kernel is bound by those instructions, not by memory, on two AVX2 cores). The result is
 * the fp32 dot product with the dequantized weights up to rounding order, like any other GEMM. */
static inline float block_offset(int64_t qtype, const uint8_t *blk, float d) {
    return qtype == Q4_1 ? fp16_to_f32(blk + 2) : qtype == Q4_0 ? -8.0f * d : 0.0f;
}

#ifdef SL_AVX2
/* The 32 raw quants of a block as four vectors of eight floats. */
static inline void block_quants(int64_t qtype, const uint8_t *blk, __m256 q[4]) {
    if (qtype == Q8_0) {
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * j))));
        return;
    }
    /* Each half of the 16 quant bytes zero-extended straight from memory to eight dwords; the
     * low nibbles are elements 0-7 / 8-15, the high nibbles 16-23 / 24-31: fewer shuffles than
     * splitting a 16-byte load, and shuffles bound this loop. */
    const uint8_t *qs = blk + (qtype == Q4_1 ? 4 : 2);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

static inline float hsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#if defined(SL_AVX512)
/* The 32 raw quants of a block as two vectors of sixteen floats (elements 0-15, 16-31). */
static inline void block_quants16(int64_t qtype, const uint8_t *blk, __m512 q[2]) {
    if (qtype == Q8_0) {
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        return;
    }
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2))));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

static inline float hsum512(__m512 s) { return hsum(_mm256_add_ps(sl_lo256(s), sl_hi256(s))); }

/* fused_rows at 512 bits: a block is two vectors of quants, one chain of two products per row. */
static inline void fused_rows(int64_t qtype, int NR, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                              int64_t o_begin, int64_t o_end, const float *x, const float *xsum,
                              const float *bias, float *y, int64_t y_stride) {
    const int64_t nblocks = in_features / 32, bb = block_bytes(qtype);
    const int64_t s1 = in_features, s2 = 2 * in_features, s3 = 3 * in_features;
    for (int64_t o = o_begin; o < o_end; o++) {
        const uint8_t *row = w + o * row_bytes;
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        float m0 = 0.0f, m1 = 0.0f, m2 = 0.0f, m3 = 0.0f;
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * bb;
            __m512 q[2];
            block_quants16(qtype, blk, q);
            int32_t dm_bits;
            memcpy(&dm_bits, blk, 4);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
            const float d = _mm_cvtss_f32(dm);
            const __m512 vd = _mm512_set1_ps(d);
            const float *xb = x + b * 32;
#define SL_ROW(T, M, OFF, R)                                                                       \
            {                                                                                      \
                __m512 e = _mm512_mul_ps(q[0], _mm512_loadu_ps(xb + (OFF)));                       \
                e = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xb + (OFF) + 16), e);                    \
                T = _mm512_fmadd_ps(vd, e, T);                                                     \
                if (qtype != Q8_0) M += mo * xsum[(R) * nblocks + b];                              \
            }
            const float mo = qtype == Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : qtype == Q4_0 ? -8.0f * d : 0.0f;
            SL_ROW(t0, m0, 0, 0)
            if (NR > 1) SL_ROW(t1, m1, s1, 1)
            if (NR > 2) SL_ROW(t2, m2, s2, 2)
            if (NR > 3) SL_ROW(t3, m3, s3, 3)
#undef SL_ROW
        }
        const float bo = bias ? bias[o] : 0.0f;
        y[o] = hsum512(t0) + m0 + bo;
        if (NR > 1) y[y_stride + o] = hsum512(t1) + m1 + bo;
        if (NR > 2) y[2 * y_stride + o] = hsum512(t2) + m2 + bo;
        if (NR > 3) y[3 * y_stride + o] = hsum512(t3) + m3 + bo;
    }
}

/* Q4_1_G16's nibble at `shift` of each dword of v as a float, 0..15: vpermps reads only the low
 * four bits of each index, so one shift and one permute (no mask, no conversion). */
static inline __m512 g16_quant(__m512i v, int shift) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(v, shift) : v, values);
}

/* NR (1..4) rows against Q4_1_G16 groups [g_begin, g_end): sixteen outputs a vector. Per block
 * and row, four FMA chains over the quants (element j of the block in chain (j & 1) * 2, element
 * j + 16 in the next), then T += d * (sum of the chains) and M += m * sum(x over the block), as
 * fused_rows factors a block; y = T + M (+ bias). */
static inline __attribute__((always_inline)) void g16_rows(int NR, const uint8_t *w, int64_t row_bytes, int64_t in,
                                                           int64_t g_begin, int64_t g_end, const float *x,
                                                           const float *xsum, const float *bias, float *y,
                                                           int64_t y_stride) {
    const int64_t nblocks = in / 32;
    const uint8_t *stop = w + g_end * 16 * row_bytes - 64;
    for (int64_t g = g_begin; g < g_end; g++) {
        const uint8_t *grp = w + g * 16 * row_bytes;
        __m512 t[4], mo[4];
        for (int r = 0; r < NR; r++) t[r] = mo[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = grp + b * G16_BLOCK;
            /* the stream's next lines ahead of the hardware prefetcher, which starts afresh at
             * each call's few hundred KB: 1.15-1.2x at batch 1 (docs/benchmarks.md) */
            for (int l = 0; l < G16_BLOCK; l += 64) {
                const uint8_t *ahead = blk + G16_PREFETCH + l;  /* not into another thread's range */
                _mm_prefetch((const char *)(ahead < stop ? ahead : stop), _MM_HINT_T0);
            }
            __m512 a[4][4];
            for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 + 64 * c));
                for (int jj = 0; jj < 4; jj++) {
                    const int j = 4 * c + jj, chain = (jj & 1) * 2;
                    const __m512 lo = g16_quant(v, 8 * jj), hi = g16_quant(v, 8 * jj + 4);
                    for (int r = 0; r < NR; r++) {
                        const float *xb = x + r * in + b * 32;
                        a[r][chain] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[j]), a[r][chain]);
                        a[r][chain + 1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[j + 16]), a[r][chain + 1]);
                    }
                }
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            for (int r = 0; r < NR; r++) {
                const __m512 q = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][2]), _mm512_add_ps(a[r][1], a[r][3]));
                t[r] = _mm512_fmadd_ps(d, q, t[r]);
                mo[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * nblocks + b]), mo[r]);
            }
        }
        for (int r = 0; r < NR; r++) {
            __m512 s = _mm512_add_ps(t[r], mo[r]);
            if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + 16 * g));
            _mm512_storeu_ps(y + r * y_stride + 16 * g, s);
        }
    }
}

/* Blocks [b0, b0 + nblocks) of a Q4_1_G16 group's sixteen outputs, as dequant_row rounds Q4_1's
 * weights, k-major: dst[k * stride + lane] for input 32 * b0 + k and output lane. */
static void g16_dequant_kmajor(const uint8_t *grp, int64_t b0, int64_t nblocks, float *dst, int64_t stride) {
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = grp + (b0 + b) * G16_BLOCK;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        float *db = dst + 32 * b * stride;
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 + 64 * c));
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * c + jj;
                __m512 lo = _mm512_mul_ps(d, g16_quant(v, 8 * jj)), hi = _mm512_mul_ps(d, g16_quant(v, 8 * jj + 4));
                SL_ROUNDED512(lo);
                SL_ROUNDED512(hi);
                _mm512_storeu_ps(db + j * stride, _mm512_add_ps(lo, m));
                _mm512_storeu_ps(db + (j + 16) * stride, _mm512_add_ps(hi, m));
            }
        }
    }
}
#else
/* NR (1..4) rows x against output rows [o_begin, o_end); xsum [NR, nblocks] holds each row's
 * per-block sums. Named accumulators, not arrays, so that they stay in registers. */
static inline void fused_rows(int64_t qtype, int NR, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                              int64_t o_begin, int64_t o_end, const float *x, const float *xsum,
                              const float *bias, float *y, int64_t y_stride) {
    const int64_t nblocks = in_features / 32, bb = block_bytes(qtype);
    const int64_t s1 = in_features, s2 = 2 * in_features, s3 = 3 * in_features;
    for (int64_t o = o_begin; o < o_end; o++) {
        const uint8_t *row = w + o * row_bytes;
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        float m0 = 0.0f, m1 = 0.0f, m2 = 0.0f, m3 = 0.0f;
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * bb;
            __m256 q[4];
            block_quants(qtype, blk, q);
            /* d and (Q4_1) m in one conversion: the scalar fp16 loads cost a tenth of a block */
            int32_t dm_bits;
            memcpy(&dm_bits, blk, 4);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
            const __m256 vd = _mm256_broadcastss_ps(dm);
            const float d = _mm_cvtss_f32(dm);
            const float *xb = x + b * 32;
            /* two chains per row inside a block, then one FMA into the row's total */
#define SL_ROW(T, M, OFF, R)                                                                       \
            {                                                                                      \
                __m256 e = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb + (OFF)));                       \
                __m256 f = _mm256_mul_ps(q[1], _mm256_loadu_ps(xb + (OFF) + 8));                   \
                e = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + (OFF) + 16), e);                    \
                f = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + (OFF) + 24), f);                    \
                T = _mm256_fmadd_ps(vd, _mm256_add_ps(e, f), T);                                   \
                if (qtype != Q8_0) M += mo * xsum[(R) * nblocks + b];                              \
            }
            const float mo = qtype == Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : qtype == Q4_0 ? -8.0f * d : 0.0f;
            SL_ROW(t0, m0, 0, 0)
            if (NR > 1) SL_ROW(t1, m1, s1, 1)
            if (NR > 2) SL_ROW(t2, m2, s2, 2)
            if (NR > 3) SL_ROW(t3, m3, s3, 3)
#undef SL_ROW
        }
        const float bo = bias ? bias[o] : 0.0f;
        y[o] = hsum(t0) + m0 + bo;
        if (NR > 1) y[y_stride + o] = hsum(t1) + m1 + bo;
        if (NR > 2) y[2 * y_stride + o] = hsum(t2) + m2 + bo;
        if (NR > 3) y[3 * y_stride + o] = hsum(t3) + m3 + bo;
    }
}

#endif

/* The switches give the compiler one specialised loop per (format, row count). */
static void fused(int64_t qtype, int64_t nr, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                  int64_t o_begin, int64_t o_end, const float *x, const float *xsum, const float *bias, float *y,
                  int64_t y_stride) {
#define SL_ROWS(QT)                                                                                         \
    switch (nr) {                                                                                           \
    case 1: fused_rows(QT, 1, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break; \
    case 2: fused_rows(QT, 2, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break; \
    case 3: fused_rows(QT, 3, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break; \
    default: fused_rows(QT, 4, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break; \
    }
#if defined(SL_AVX512)
    if (qtype == Q4_1_G16) { /* o_begin and o_end count groups of sixteen outputs here */
        switch (nr) {
        case 1: g16_rows(1, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break;
        case 2: g16_rows(2, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break;
        case 3: g16_rows(3, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break;
        default: g16_rows(4, w, row_bytes, in_features, o_begin, o_end, x, xsum, bias, y, y_stride); break;
        }
        return;
    }
#endif
    switch (qtype) {
    case Q8_0: SL_ROWS(Q8_0) break;
    case Q4_0: SL_ROWS(Q4_0) break;
    default: SL_ROWS(Q4_1) break;
    }
#undef SL_ROWS
}
#endif

#ifndef SL_AVX2
/* Without AVX2: y[r, o0 + o] = dequantized rows w[o] . x[r] (+ bias), eight partial sums so the
 * compiler can vectorize without reassociating. */
static void scalar_rows(const float *w, int64_t no, int64_t in, const float *x, int64_t rows, const float *bias,
                        int64_t o0, float *y, int64_t y_stride) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < no; o++) {
            const float *xr = x + r * in, *wo = w + o * in;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t i = 0; i < in; i += 8)
                for (int k = 0; k < 8; k++) acc[k] += wo[i + k] * xr[i + k];
            y[r * y_stride + o0 + o] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
                                       + (bias ? bias[o0 + o] : 0.0f);
        }
}
#endif

struct linear_job {
    int64_t qtype, row_bytes, in_features, rows, y_stride;
    const uint8_t *w;
    const float *x, *bias, *xsum;
    float *y, *scratch;
};

/* Output rows [begin, end) for every activation row (Q4_1_G16: groups of sixteen). */
static void linear_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    const struct linear_job *j = ctx;
#ifdef SL_AVX2
    (void)part;
    const int64_t nblocks = j->in_features / 32;
    for (int64_t r0 = 0; r0 < j->rows; r0 += 4) {
        const int64_t nr = j->rows - r0 < 4 ? j->rows - r0 : 4;
        fused(j->qtype, nr, j->w, j->row_bytes, j->in_features, begin, end, j->x + r0 * j->in_features,
              j->xsum + r0 * nblocks, j->bias, j->y + r0 * j->y_stride, j->y_stride);
    }
#else
    float *row = j->scratch + part * j->in_features;
    for (int64_t o = begin; o < end; o++) {
        dequant_row(j->qtype, j->w + o * j->row_bytes, j->in_features / 32, row);
        scalar_rows(row, 1, j->in_features, j->x, j->rows, j->bias, o, j->y, j->y_stride);
    }
#endif
}

/* y[r, o] = sum_i W[o, i] * x[r, i] (+ bias[o]) for all out_features outputs and all rows, the
 * outputs split over up to `threads` threads (parallel.c).
 *   w        the packed weight, out_features rows of row_bytes bytes (in_features / 32 blocks)
 *   x        [rows, in_features] contiguous; y [rows, y_stride] (columns 0..out_features written)
 *   bias     NULL or [out_features]
 *   scratch  rows * in_features / 32 floats, plus threads * in_features floats without AVX2
 */
void servelab_block_quant_linear_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                     int64_t out_features, const float *x, int64_t rows, const float *bias,
                                     float *y, int64_t y_stride, float *scratch, int64_t threads)
{
    struct linear_job job = {qtype, row_bytes, in_features, rows, y_stride, w, x, bias, scratch, y, scratch};
#ifdef SL_AVX2
    const int64_t nblocks = in_features / 32;
    for (int64_t r = 0; r < rows; r++)  /* each row's per-block sums, for the offset term */
        for (int64_t b = 0; b < nblocks; b++) {
            const float *xb = x + r * in_features + b * 32;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            scratch[r * nblocks + b] = hsum(s);
        }
#endif
    /* a part of at least ~32k weights (~10 us), so that waking a worker pays; Q4_1_G16's parts
     * are groups of sixteen outputs */
    const int64_t max_parts = out_features * in_features / 32768;
    sl_parallel_for(linear_part, &job, qtype == Q4_1_G16 ? out_features / 16 : out_features,
                    threads < max_parts ? threads : max_parts);
}

/* More rows: the weights of PANEL outputs at a time are expanded to fp32 once (into L2), then a
 * register-blocked 4-row x 3-output kernel runs over them (12 accumulators, every weight and
 * activation load feeding three or four FMAs). Ahead of MKL's fp32 GEMM up to ~256 rows
 * (docs/benchmarks.md, "GGUF blocks kept packed"). */
#define PANEL 48

#ifdef SL_AVX2
#if defined(SL_AVX512)
/* panel_row and panel_rows at 512 bits: the same kernels with sixteen lanes per accumulator (k in
 * steps of 16; in_features is a multiple of 32), hsum512 at the end. Within a level, a row's sums
 * are still one FMA chain in one order, whichever of the three kernels (these, exact_rows) runs. */
static void panel_row(const float *panel, int64_t no, int64_t in, const float *x, const float *bias, int64_t o0,
                      float *y) {
    for (int64_t j = 0; j < no; j += 6) {
        const int64_t nj = no - j < 6 ? no - j : 6;
        const float *w[6];
        for (int b = 0; b < 6; b++) w[b] = panel + (j + (b < nj ? b : 0)) * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int64_t k = 0; k < in; k += 16) {
            const __m512 xx = _mm512_loadu_ps(x + k);
            a0 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[0] + k), a0);
            a1 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[1] + k), a1);
            a2 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[2] + k), a2);
            a3 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[3] + k), a3);
            a4 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[4] + k), a4);
            a5 = _mm512_fmadd_ps(xx, _mm512_loadu_ps(w[5] + k), a5);
        }
        const float sums[6] = {hsum512(a0), hsum512(a1), hsum512(a2), hsum512(a3), hsum512(a4), hsum512(a5)};
        for (int64_t b = 0; b < nj; b++) {
            const int64_t o = o0 + j + b;
            y[o] = sums[b] + (bias ? bias[o] : 0.0f);
        }
    }
}

/* Keeps a loaded vector in a register: left alone, gcc folds the row's load into each of its
 * three FMAs (27 loads an iteration of the 8-row tile instead of 11). Not on SIMDe's types. */
#if defined(SL_SIMDE_LEVEL)
#define SL_IN_REGISTER(v) ((void)0)
#else
#define SL_IN_REGISTER(v) __asm__("" : "+v"(v))
#endif

/* One row's three FMAs against the weight vectors v0-v2 at k. */
#define SL_ROW3(a0, a1, a2, xp)                                                                   \
    do {                                                                                          \
        __m512 xx_ = _mm512_loadu_ps((xp) + k);                                                   \
        SL_IN_REGISTER(xx_);                                                                      \
        a0 = _mm512_fmadd_ps(xx_, v0, a0); a1 = _mm512_fmadd_ps(xx_, v1, a1); a2 = _mm512_fmadd_ps(xx_, v2, a2); \
    } while (0)

/* The 8-row tile's eight activation rows stay in L1 up to 32 KB of them; past that (SmolLM2's
 * down projection, 1,536 inputs: 48 KB) the 4-row tiles run 1.15-1.2x faster (docs/benchmarks.md,
 * "Panel kernel: decode steps of 4-128 rows"). Either way a row's sums are the same chains: the same bits. */
#define TILE8_MAX_IN 1024

/* Eight rows x three outputs (24 accumulators of the 32 registers): each weight vector loaded
 * from the panel (L2) feeds eight FMAs, not four, so the panel is streamed once per eight rows.
 * Every accumulator is the same chain as in the 4-row tile and panel_row: the same bits. */
static int64_t panel_rows8(const float *panel, int64_t no, int64_t in, const float *x, int64_t rows, const float *bias,
                           int64_t o0, float *y, int64_t out) {
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8) {
        const float *x0 = x + r0 * in;
        for (int64_t j = 0; j < no; j += 3) {
            const int64_t nj = no - j < 3 ? no - j : 3;
            const float *w0 = panel + j * in, *w1 = w0 + (nj > 1) * in, *w2 = w0 + (nj > 2) * 2 * in;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
            __m512 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
            __m512 a40 = a00, a41 = a00, a42 = a00, a50 = a00, a51 = a00, a52 = a00;
            __m512 a60 = a00, a61 = a00, a62 = a00, a70 = a00, a71 = a00, a72 = a00;
            for (int64_t k = 0; k < in; k += 16) {
                const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k), v2 = _mm512_loadu_ps(w2 + k);
                SL_ROW3(a00, a01, a02, x0);
                SL_ROW3(a10, a11, a12, x0 + in);
                SL_ROW3(a20, a21, a22, x0 + 2 * in);
                SL_ROW3(a30, a31, a32, x0 + 3 * in);
                SL_ROW3(a40, a41, a42, x0 + 4 * in);
                SL_ROW3(a50, a51, a52, x0 + 5 * in);
                SL_ROW3(a60, a61, a62, x0 + 6 * in);
                SL_ROW3(a70, a71, a72, x0 + 7 * in);
            }
            const __m512 acc[8][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32},
                                      {a40, a41, a42}, {a50, a51, a52}, {a60, a61, a62}, {a70, a71, a72}};
            for (int64_t r = 0; r < 8; r++)
                for (int64_t b = 0; b < nj; b++) {
                    const int64_t o = o0 + j + b;
                    y[(r0 + r) * out + o] = hsum512(acc[r][b]) + (bias ? bias[o] : 0.0f);
                }
        }
    }
    return r0;
}
#undef SL_ROW3

static void panel_rows(const float *panel, int64_t no, int64_t in, const float *x, int64_t rows, const float *bias,
                       int64_t o0, float *y, int64_t out) {
    const int64_t done = in <= TILE8_MAX_IN ? panel_rows8(panel, no, in, x, rows, bias, o0, y, out) : 0;
    for (int64_t r0 = done; r0 + 4 <= rows; r0 += 4) {
        const float *x0 = x + r0 * in, *x1 = x0 + in, *x2 = x0 + 2 * in, *x3 = x0 + 3 * in;
        for (int64_t j = 0; j < no; j += 3) {
            const int64_t nj = no - j < 3 ? no - j : 3;
            const float *w0 = panel + j * in, *w1 = w0 + (nj > 1) * in, *w2 = w0 + (nj > 2) * 2 * in;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
            __m512 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
            for (int64_t k = 0; k < in; k += 16) {
                const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k), v2 = _mm512_loadu_ps(w2 + k);
                __m512 xx = _mm512_loadu_ps(x0 + k);
                SL_IN_REGISTER(xx);
                a00 = _mm512_fmadd_ps(xx, v0, a00); a01 = _mm512_fmadd_ps(xx, v1, a01); a02 = _mm512_fmadd_ps(xx, v2, a02);
                xx = _mm512_loadu_ps(x1 + k);
                SL_IN_REGISTER(xx);
                a10 = _mm512_fmadd_ps(xx, v0, a10); a11 = _mm512_fmadd_ps(xx, v1, a11); a12 = _mm512_fmadd_ps(xx, v2, a12);
                xx = _mm512_loadu_ps(x2 + k);
                SL_IN_REGISTER(xx);
                a20 = _mm512_fmadd_ps(xx, v0, a20); a21 = _mm512_fmadd_ps(xx, v1, a21); a22 = _mm512_fmadd_ps(xx, v2, a22);
                xx = _mm512_loadu_ps(x3 + k);
                SL_IN_REGISTER(xx);
                a30 = _mm512_fmadd_ps(xx, v0, a30); a31 = _mm512_fmadd_ps(xx, v1, a31); a32 = _mm512_fmadd_ps(xx, v2, a32);
            }
            const float sums[4][3] = {{hsum512(a00), hsum512(a01), hsum512(a02)}, {hsum512(a10), hsum512(a11), hsum512(a12)},
                                      {hsum512(a20), hsum512(a21), hsum512(a22)}, {hsum512(a30), hsum512(a31), hsum512(a32)}};
            for (int64_t r = 0; r < 4; r++)
                for (int64_t b = 0; b < nj; b++) {
                    const int64_t o = o0 + j + b;
                    y[(r0 + r) * out + o] = sums[r][b] + (bias ? bias[o] : 0.0f);
                }
        }
    }
    for (int64_t r = rows / 4 * 4; r < rows; r++) panel_row(panel, no, in, x + r * in, bias, o0, y + r * out);
}
/* The k-major panel (servelab_block_quant_gemm_kmajor_f32, for many rows outside deterministic
 * mode): [in][PANEL], one output a lane (fill_panel), and a tile of TM rows x 48 outputs loads
 * three weight vectors an input and broadcasts each row's input, as BLIS-style GEMMs do. Each
 * output's sum is one FMA chain over k ascending, then + bias, so no lanes are summed at the end,
 * where the dot-product tiles above spend about a third of their time at 576 inputs. Filling it
 * costs a transposition, which pays from ~48 rows (docs/benchmarks.md, "GGUF blocks kept packed"). */
#define TM 8 /* rows a tile: 24 accumulators + 3 weight vectors + 1 broadcast */

/* dst[k][0..16) = src[0..16)[k] for k < 16: sixteen rows of 16 floats (src_stride apart)
 * transposed into sixteen rows dst_stride apart. */
static inline void transpose16(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i++) { /* pairs of rows interleaved */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* then fours: r[4g + j] holds rows 4g..4g+3 of columns j, j+4, j+8, j+12 */
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
        r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) { /* then the four groups' 128-bit lanes gathered per column */
        const __m512 v0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        const __m512 w0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), w1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        _mm512_storeu_ps(dst + j * dst_stride, _mm512_shuffle_f32x4(v0, w0, 0x88));
        _mm512_storeu_ps(dst + (j + 4) * dst_stride, _mm512_shuffle_f32x4(v1, w1, 0x88));
        _mm512_storeu_ps(dst + (j + 8) * dst_stride, _mm512_shuffle_f32x4(v0, w0, 0xdd));
        _mm512_storeu_ps(dst + (j + 12) * dst_stride, _mm512_shuffle_f32x4(v1, w1, 0xdd));
    }
}

#define FILL_CHUNK 1024 /* inputs of 16 rows dequantized at a time (64 KB of stack; a K-quant's 256 divide it) */

/* Outputs [o0, o0 + no) of the weight, dequantized as dequant_row rounds them, into panel
 * [in][PANEL] (outputs past no: zeros): 16 rows x up to FILL_CHUNK inputs at a time into a
 * buffer, then transposed 16 x 16 at a time. */
static void fill_panel(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in, int64_t o0, int64_t no,
                       float *panel) {
    if (qtype == Q4_1_G16) { /* already one output a lane: no transposition (no is a multiple of 16) */
        for (int64_t g = 0; g < PANEL; g += 16) {
            if (g < no) {
                g16_dequant_kmajor(w + (o0 + g) * row_bytes, 0, in / 32, panel + g, PANEL);
                continue;
            }
            for (int64_t k = 0; k < in; k++) _mm512_storeu_ps(panel + k * PANEL + g, _mm512_setzero_ps());
        }
        return;
    }
    float tmp[16 * FILL_CHUNK] __attribute__((aligned(64)));
    /* bytes of FILL_CHUNK inputs of a row: 32 per block, 256 per K-quant block, 4 each for F32 */
    const int64_t chunk_bytes = qtype == F32 ? 4 * FILL_CHUNK
                                : qtype == Q4_K ? 144 * (FILL_CHUNK / 256)
                                : qtype == Q6_K ? 210 * (FILL_CHUNK / 256)
                                : block_bytes(qtype) * (FILL_CHUNK / 32);
    for (int64_t g = 0; g < PANEL; g += 16)
        for (int64_t k0 = 0, c = 0; k0 < in; k0 += FILL_CHUNK, c++) {
            const int64_t n = in - k0 < FILL_CHUNK ? in - k0 : FILL_CHUNK;
            for (int64_t o = 0; o < 16; o++) {
                if (g + o < no)
                    dequant_row(qtype, w + (o0 + g + o) * row_bytes + c * chunk_bytes, n / 32, tmp + o * n);
                else
                    memset(tmp + o * n, 0, sizeof(float) * (size_t)n);
            }
            for (int64_t k = 0; k < n; k += 16) transpose16(tmp + k, n, panel + (k0 + k) * PANEL + g, PANEL);
        }
}

/* Outputs [o0, o0 + no) of a Q4_1_G16 weight as dequant_row writes rows, [no][in] (for
 * servelab_block_dequant_f32): FILL_CHUNK inputs of a group k-major into a buffer, then
 * transposed 16 x 16 into the rows. */
static void fill_rows_g16(const uint8_t *w, int64_t row_bytes, int64_t in, int64_t o0, int64_t no, float *rows) {
    float tmp[FILL_CHUNK * 16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < no; g += 16)
        for (int64_t k0 = 0; k0 < in; k0 += FILL_CHUNK) {
            const int64_t n = in - k0 < FILL_CHUNK ? in - k0 : FILL_CHUNK;
            g16_dequant_kmajor(w + (o0 + g) * row_bytes, k0 / 32, n / 32, tmp, 16);
            for (int64_t k = 0; k < n; k += 16) transpose16(tmp + k * 16, 16, rows + g * in + k0 + k, in);
        }
}

/* mr rows of x against the panel's no outputs (a constant mr once inlined); y and bias start at
 * the panel's first output. */
static inline __attribute__((always_inline)) void tile48(const int mr, const float *panel, int64_t in, const float *x,
                                                         const float *bias, int64_t no, float *y, int64_t y_stride) {
    __m512 acc[TM][3];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        const float *wk = panel + k * PANEL;
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
        for (int r = 0; r < mr; r++) {
            const __m512 xx = _mm512_set1_ps(x[r * in + k]);
            acc[r][0] = _mm512_fmadd_ps(xx, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xx, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xx, w2, acc[r][2]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 3 && 16 * v < no; v++) {
            float *yv = y + r * y_stride + 16 * v;
            const __m512 s = bias && 16 * v + 16 <= no ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + 16 * v)) : acc[r][v];
            if (16 * v + 16 <= no) {
                _mm512_storeu_ps(yv, s);
                continue;
            }
            float sums[16];
            _mm512_storeu_ps(sums, s);
            for (int64_t i = 0; i < no - 16 * v; i++) yv[i] = bias ? sums[i] + bias[16 * v + i] : sums[i];
        }
}

/* Every row against a filled k-major panel: TM rows at a time, then the rest. */
static void kmajor_rows(const float *panel, int64_t no, int64_t in, const float *x, int64_t rows, const float *bias,
                       int64_t o0, float *y, int64_t out) {
    const float *b = bias ? bias + o0 : NULL;
    for (int64_t r0 = 0; r0 < rows; r0 += TM) {
        const float *xr = x + r0 * in;
        float *yr = y + r0 * out + o0;
        switch (rows - r0 < TM ? rows - r0 : TM) { /* constants, so every tile is unrolled */
        case 8: tile48(8, panel, in, xr, b, no, yr, out); break;
        case 7: tile48(7, panel, in, xr, b, no, yr, out); break;
        case 6: tile48(6, panel, in, xr, b, no, yr, out); break;
        case 5: tile48(5, panel, in, xr, b, no, yr, out); break;
        case 4: tile48(4, panel, in, xr, b, no, yr, out); break;
        case 3: tile48(3, panel, in, xr, b, no, yr, out); break;
        case 2: tile48(2, panel, in, xr, b, no, yr, out); break;
        default: tile48(1, panel, in, xr, b, no, yr, out); break;
        }
    }
}
#else
/* One row against the panel, six outputs at a time: for the rows past a multiple of four (all of
 * them in a step of 1-3 rows), which panel_rows' 4-row tiles would compute four times over. Each
 * output's sum is the same chain of FMAs in the same order as in panel_rows, so a row's result
 * does not depend on how many rows the call has. */
static void panel_row(const float *panel, int64_t no, int64_t in, const float *x, const float *bias, int64_t o0,
                      float *y) {
    for (int64_t j = 0; j < no; j += 6) {
        const int64_t nj = no - j < 6 ? no - j : 6;
        const float *w[6];
        for (int b = 0; b < 6; b++) w[b] = panel + (j + (b < nj ? b : 0)) * in; /* absent outputs alias the first */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int64_t k = 0; k < in; k += 8) {
            const __m256 xx = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[0] + k), a0);
            a1 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[1] + k), a1);
            a2 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[2] + k), a2);
            a3 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[3] + k), a3);
            a4 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[4] + k), a4);
            a5 = _mm256_fmadd_ps(xx, _mm256_loadu_ps(w[5] + k), a5);
        }
        const float sums[6] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5)};
        for (int64_t b = 0; b < nj; b++) {
            const int64_t o = o0 + j + b;
            y[o] = sums[b] + (bias ? bias[o] : 0.0f);
        }
    }
}

static void panel_rows(const float *panel, int64_t no, int64_t in, const float *x, int64_t rows, const float *bias,
                       int64_t o0, float *y, int64_t out) {
    for (int64_t r0 = 0; r0 + 4 <= rows; r0 += 4) { /* tiles of four rows, then panel_row for the rest */
        const int64_t nr = 4;
        const float *x0 = x + r0 * in, *x1 = x0 + in, *x2 = x0 + 2 * in, *x3 = x0 + 3 * in;
        for (int64_t j = 0; j < no; j += 3) {
            const int64_t nj = no - j < 3 ? no - j : 3;
            /* missing outputs alias the first one: computed, never stored */
            const float *w0 = panel + j * in, *w1 = w0 + (nj > 1) * in, *w2 = w0 + (nj > 2) * 2 * in;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
            __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
            for (int64_t k = 0; k < in; k += 8) {
                const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k);
                __m256 xx = _mm256_loadu_ps(x0 + k);
                a00 = _mm256_fmadd_ps(xx, v0, a00); a01 = _mm256_fmadd_ps(xx, v1, a01); a02 = _mm256_fmadd_ps(xx, v2, a02);
                xx = _mm256_loadu_ps(x1 + k);
                a10 = _mm256_fmadd_ps(xx, v0, a10); a11 = _mm256_fmadd_ps(xx, v1, a11); a12 = _mm256_fmadd_ps(xx, v2, a12);
                xx = _mm256_loadu_ps(x2 + k);
                a20 = _mm256_fmadd_ps(xx, v0, a20); a21 = _mm256_fmadd_ps(xx, v1, a21); a22 = _mm256_fmadd_ps(xx, v2, a22);
                xx = _mm256_loadu_ps(x3 + k);
                a30 = _mm256_fmadd_ps(xx, v0, a30); a31 = _mm256_fmadd_ps(xx, v1, a31); a32 = _mm256_fmadd_ps(xx, v2, a32);
            }
            const float sums[4][3] = {{hsum(a00), hsum(a01), hsum(a02)}, {hsum(a10), hsum(a11), hsum(a12)},
                                      {hsum(a20), hsum(a21), hsum(a22)}, {hsum(a30), hsum(a31), hsum(a32)}};
            for (int64_t r = 0; r < nr; r++)
                for (int64_t b = 0; b < nj; b++) {
                    const int64_t o = o0 + j + b;
                    y[(r0 + r) * out + o] = sums[r][b] + (bias ? bias[o] : 0.0f);
                }
        }
    }
    for (int64_t r = rows / 4 * 4; r < rows; r++) panel_row(panel, no, in, x + r * in, bias, o0, y + r * out);
}
#endif

#endif

#ifdef SL_AVX2
#if defined(SL_AVX512)
/* block_weights and exact_rows at 512 bits: two vectors of sixteen weights a block, rounded as
 * dequant_row writes them; the FMA chain of panel_rows' 512-bit kernel over k ascending. */
static inline __attribute__((always_inline)) void block_weights(int64_t qtype, const uint8_t *blk, __m512 w[2]) {
    __m512 q[2];
    block_quants16(qtype, blk, q);
    const __m512 vd = _mm512_set1_ps(fp16_to_f32(blk));
    const __m512 vm = _mm512_set1_ps(qtype == Q4_1 ? fp16_to_f32(blk + 2) : 0.0f);
    for (int j = 0; j < 2; j++) {
        __m512 v = _mm512_mul_ps(vd, qtype == Q4_0 ? _mm512_sub_ps(q[j], _mm512_set1_ps(8.0f)) : q[j]);
        SL_ROUNDED512(v);
        w[j] = qtype == Q4_1 ? _mm512_add_ps(v, vm) : v;
    }
}

static inline __attribute__((always_inline)) void exact_rows(int64_t qtype, int NR, const uint8_t *w, int64_t row_bytes,
                                                             int64_t in, int64_t o0, int64_t no, const float *x,
                                                             const float *bias, float *y, int64_t y_stride) {
    const int64_t nblocks = in / 32, bb = block_bytes(qtype);
    for (int64_t j = 0; j < no; j += 2) {
        const int two = j + 1 < no;
        const uint8_t *r0 = w + (o0 + j) * row_bytes, *r1 = two ? r0 + row_bytes : r0;
        __m512 a[3][2];
        for (int r = 0; r < 3; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            __m512 w0[2], w1[2];
            block_weights(qtype, r0 + b * bb, w0);
            block_weights(qtype, r1 + b * bb, w1);
            for (int r = 0; r < NR; r++) {
                const float *xb = x + r * in + b * 32;
                for (int i = 0; i < 2; i++) {
                    const __m512 xx = _mm512_loadu_ps(xb + 16 * i);
                    a[r][0] = _mm512_fmadd_ps(xx, w0[i], a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(xx, w1[i], a[r][1]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c <= two; c++) {
                const int64_t o = o0 + j + c;
                y[r * y_stride + o] = hsum512(a[r][c]) + (bias ? bias[o] : 0.0f);
            }
    }
}
#else
/* A 32-weight block's weights as four vectors of eight floats, rounded exactly as dequant_row
 * writes them (d * q; d * (q - 8); d * q, then + m). */
static inline __attribute__((always_inline)) void block_weights(int64_t qtype, const uint8_t *blk, __m256 w[4]) {
    __m256 q[4];
    block_quants(qtype, blk, q);
    const __m256 vd = _mm256_set1_ps(fp16_to_f32(blk));
    const __m256 vm = _mm256_set1_ps(qtype == Q4_1 ? fp16_to_f32(blk + 2) : 0.0f);
    for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_mul_ps(vd, qtype == Q4_0 ? _mm256_sub_ps(q[j], _mm256_set1_ps(8.0f)) : q[j]);
        SL_ROUNDED(v);
        w[j] = qtype == Q4_1 ? _mm256_add_ps(v, vm) : v;
    }
}

/* 1-3 rows against outputs [o0, o0 + no) of a 32-weight format, two outputs at a time: the
 * panel kernel's sums bit for bit (the same weights, the same FMA chain over k ascending, the
 * same horizontal sum), with the weights dequantized in registers instead of expanded into a
 * panel in memory, which at so few rows cost more than the products (deterministic mode's
 * decode). */
static inline __attribute__((always_inline)) void exact_rows(int64_t qtype, int NR, const uint8_t *w, int64_t row_bytes,
                                                             int64_t in, int64_t o0, int64_t no, const float *x,
                                                             const float *bias, float *y, int64_t y_stride) {
    const int64_t nblocks = in / 32, bb = block_bytes(qtype);
    for (int64_t j = 0; j < no; j += 2) {
        const int two = j + 1 < no;
        const uint8_t *r0 = w + (o0 + j) * row_bytes, *r1 = two ? r0 + row_bytes : r0;
        __m256 a[3][2];
        for (int r = 0; r < 3; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            __m256 w0[4], w1[4];
            block_weights(qtype, r0 + b * bb, w0);
            block_weights(qtype, r1 + b * bb, w1);
            for (int r = 0; r < NR; r++) {
                const float *xb = x + r * in + b * 32;
                for (int i = 0; i < 4; i++) {
                    const __m256 xx = _mm256_loadu_ps(xb + 8 * i);
                    a[r][0] = _mm256_fmadd_ps(xx, w0[i], a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(xx, w1[i], a[r][1]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c <= two; c++) {
                const int64_t o = o0 + j + c;
                y[r * y_stride + o] = hsum(a[r][c]) + (bias ? bias[o] : 0.0f);
            }
    }
}

#endif

static void exact(int64_t qtype, int64_t nr, const uint8_t *w, int64_t row_bytes, int64_t in, int64_t o0, int64_t no,
                  const float *x, const float *bias, float *y, int64_t y_stride) {
#define SL_EXACT(QT)                                                                                 \
    switch (nr) {                                                                                    \
    case 1: exact_rows(QT, 1, w, row_bytes, in, o0, no, x, bias, y, y_stride); break;                \
    case 2: exact_rows(QT, 2, w, row_bytes, in, o0, no, x, bias, y, y_stride); break;                \
    default: exact_rows(QT, 3, w, row_bytes, in, o0, no, x, bias, y, y_stride); break;               \
    }
    switch (qtype) {
    case Q8_0: SL_EXACT(Q8_0) break;
    case Q4_0: SL_EXACT(Q4_0) break;
    default: SL_EXACT(Q4_1) break;
    }
#undef SL_EXACT
}
#endif

struct gemm_job {
    int64_t qtype, row_bytes, in_features, out_features, rows, y_stride, kmajor;
    const uint8_t *w;
    const float *x, *bias;
    float *y, *scratch;
};

/* Fetches the lines of y that a panel's rows write ([rows, o0 .. o0 + no)), before the panel is
 * dequantized. Each is written once a call, so it is cold, and the kernels' scattered stores
 * stall on every miss (docs/benchmarks.md, "Panel kernel: decode steps of 4-128 rows"). A hint
 * only: no result changes. */
static inline void prefetch_outputs(const float *y, int64_t y_stride, int64_t rows, int64_t o0, int64_t no) {
    for (int64_t r = 0; r < rows; r++) {
        const uintptr_t first = (uintptr_t)(y + r * y_stride + o0) & ~(uintptr_t)63;
        const uintptr_t last = (uintptr_t)(y + r * y_stride + o0 + no - 1);
        for (uintptr_t line = first; line <= last; line += 64) __builtin_prefetch((const void *)line, 1, 3);
    }
}

/* Panels [begin, end) of PANEL outputs each. The threads take panels in turn (sl_parallel_chunks),
 * not a half each: a panel is ~10 us at 32 rows, and a thread slowed for a while (a shared core)
 * then leaves the other less to wait for (32-row steps 0.82x the time, docs/benchmarks.md). */
static void gemm_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    const struct gemm_job *j = ctx;
    const int64_t in = j->in_features, out = j->out_features;
    float *scratch = j->scratch + part * PANEL * in;
    for (int64_t p = begin; p < end; p++) {
        const int64_t o0 = p * PANEL, no = out - o0 < PANEL ? out - o0 : PANEL;
#if defined(SL_AVX512)
        if (j->kmajor || j->qtype == Q4_1_G16) { /* regrouped Q4_1: its panel fills without transposing */
            prefetch_outputs(j->y, j->y_stride, j->rows, o0, no);
            fill_panel(j->qtype, j->w, j->row_bytes, in, o0, no, scratch);
            kmajor_rows(scratch, no, in, j->x, j->rows, j->bias, o0, j->y, j->y_stride);
            continue;
        }
#endif
#ifdef SL_AVX2
        if (j->rows < 4 && j->qtype <= Q4_1) { /* few rows: the same sums without the panel */
            exact(j->qtype, j->rows, j->w, j->row_bytes, in, o0, no, j->x, j->bias, j->y, j->y_stride);
            continue;
        }
#endif
        prefetch_outputs(j->y, j->y_stride, j->rows, o0, no);
        const float *panel = scratch;
        if (j->qtype == F32) /* already fp32: the panel is the weight's own rows */
            panel = (const float *)(j->w + o0 * j->row_bytes);
        else
            for (int64_t o = 0; o < no; o++) dequant_row(j->qtype, j->w + (o0 + o) * j->row_bytes, in / 32, scratch + o * in);
#ifdef SL_AVX2
        panel_rows(panel, no, in, j->x, j->rows, j->bias, o0, j->y, j->y_stride);
#else
        scalar_rows(panel, no, in, j->x, j->rows, j->bias, o0, j->y, j->y_stride);
#endif
    }
}

/* y = x @ W^T (+ bias) through fp32 panels: the same contract as servelab_block_quant_linear_f32,
 * for more rows; scratch holds threads * 48 * in_features floats. */
void servelab_block_quant_gemm_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                   int64_t out_features, const float *x, int64_t rows, const float *bias, float *y,
                                   int64_t y_stride, float *scratch, int64_t threads)
{
    struct gemm_job job = {qtype, row_bytes, in_features, out_features, rows, y_stride, 0, w, x, bias, y, scratch};
    sl_parallel_chunks(gemm_part, &job, (out_features + PANEL - 1) / PANEL, 1, threads);
}

/* The same contract and scratch, through the k-major panel at the AVX-512 levels (elsewhere the
 * panel above): sums in another order than servelab_block_quant_gemm_f32's, so deterministic mode
 * never takes it. For many rows (block_quant.KMAJOR_MIN_ROWS). */
void servelab_block_quant_gemm_kmajor_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                          int64_t out_features, const float *x, int64_t rows, const float *bias,
                                          float *y, int64_t y_stride, float *scratch, int64_t threads)
{
    struct gemm_job job = {qtype, row_bytes, in_features, out_features, rows, y_stride, 1, w, x, bias, y, scratch};
    sl_parallel_chunks(gemm_part, &job, (out_features + PANEL - 1) / PANEL, 1, threads);
}

/* The rows of a packed weight dequantized into out [o_end - o_begin, in_features] (for tests). */
void servelab_block_dequant_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                int64_t o_begin, int64_t o_end, float *out)
{
#if defined(SL_AVX512)
    if (qtype == Q4_1_G16 && o_begin % 16 == 0 && (o_end - o_begin) % 16 == 0) { /* whole groups: vectorized */
        fill_rows_g16(w, row_bytes, in_features, o_begin, o_end - o_begin, out);
        return;
    }
#endif
    for (int64_t o = o_begin; o < o_end; o++) {
        float *dst = out + (o - o_begin) * in_features;
        if (qtype == Q4_1_G16) /* any level: block_quant.py regroups only for AVX-512's, but reads back anywhere */
            for (int64_t i = 0; i < in_features; i++) dst[i] = g16_weight(w, row_bytes, o, i);
        else
            dequant_row(qtype, w + o * row_bytes, in_features / 32, dst);
    }
}
