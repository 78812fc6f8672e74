/* y = x @ W^T with int8 dot products straight over GGUF blocks: llama.cpp's Q4_1 x Q8_1 and
 * Q8_0 x Q8_0 method, for steps with many rows (prefill, batched decode), where the exact fp32
 * kernels (block_quant_linear.c) are bound by their multiply-adds, not by the weights' bytes.
 *
 * Activations: each row's 32-input blocks quantized to int8 with round-to-nearest-even,
 *   d_a = amax / 127, q_a = round(x * (127 / amax)), s_a = d_a * sum(q_a)   (per row and block),
 * once a call (servelab_q8_quantize_f32), shared by every segment of a fused linear.
 * Per output o, row r and block b, with the weights' own quants q_w and fp16 scales:
 *   Q4_1  d_w * d_a * sum(q_w q_a) + m_w * s_a          (w = d_w q_w + m_w, q_w a nibble)
 *   Q4_0  d_w * d_a * (sum(q_w q_a) - 8 sum(q_a))       (w = d_w (q_w - 8): the -8 in integers)
 *   Q8_0  d_w * d_a * sum(q_w q_a)
 * summed over blocks in order in fp32. The integer sums are exact; the error against the fp32
 * model is the activations' rounding (docs/accuracy.md gives its KL). A row's result depends on
 * that row alone: its quantization, its sums and their order are the same at any row count.
 *
 * Weights: groups of 16 outputs, one output a vector lane (block_quant.py's Q4_1_G16, whose bytes
 * the exact kernels read too, or a copy block_quant.q8_segments makes for Q4_0 and Q8_0). Per
 * group and block: the 16 outputs' fp16 d, their fp16 m (zero but for Q4_1), then the quants,
 * dword k of each 64-byte vector holding four of output k's:
 *   nibbles (Q4_1_G16, Q4_0_G16): four vectors, vector c byte j of lane k = quant byte 4c + j of
 *     the GGUF block (element 4c + j low, element 16 + 4c + j high): 320 bytes;
 *   bytes (Q8_0_G16): eight vectors, vector c lane k = int8 quants 4c .. 4c + 3: 576 bytes.
 * So one broadcast of four activation bytes meets sixteen outputs in one vpdpbusd (unsigned
 * weight bytes x signed activation bytes, four products summed into each int32 lane). Q8_0's
 * signed weights go in as q + 128 (an xor), the 128 sum(q_a) taken off in integers; without VNNI
 * vpmaddubsw + vpmaddwd do the same products, Q8_0 through |q_w| x sign(q_a, q_w) (128 x 127 x 2
 * fits its int16 pairs; 255 x 127 x 2 does not).
 *
 * Tiles: up to 8 rows (AVX-512) or 4 (AVX2) x one group, its int32 and fp32 sums in registers;
 * a thread takes groups in turn and runs every row tile over a group, whose blocks stay in L1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "parallel.h"
#include "isa.h"

enum { Q4_1_G16 = 6, Q8_0_G16 = 7, Q4_0_G16 = 8 }; /* block_quant.py's codes for these layouts */
#define GROUP 16
#define NIB_BLOCK 320
#define BYTE_BLOCK 576

static inline int64_t group_block_bytes(int64_t fmt) { return fmt == Q8_0_G16 ? BYTE_BLOCK : NIB_BLOCK; }

/* ------------------------------------------------------------------ activations */

/* Where servelab_q8_quantize_f32 puts a step's quantized activations in one buffer of
 * servelab_q8_act_bytes(rows, in) bytes: q_a [rows, in] int8, then per row and block d_a and s_a
 * (fp32) and sum(q_a) (int32). */
struct q8_act {
    const int8_t *q, *q2;
    const float *d, *s;
    const int32_t *qsum;
    int64_t in, nb;
};

static struct q8_act act_view(const uint8_t *buf, int64_t rows, int64_t in) {
    const int64_t nb = in / 32;
    const float *d = (const float *)(buf + 2 * rows * in);
    return (struct q8_act){(const int8_t *)buf, (const int8_t *)buf + rows * in, d, d + rows * nb,
                           (const int32_t *)(d + 2 * rows * nb), in, nb};
}

int64_t servelab_q8_act_bytes(int64_t rows, int64_t in) { return 2 * rows * in + 12 * rows * (in / 32); }

/* One block of 32 inputs -> q [32] (and with two passes the residual q2 [32]); returns the
 * activations' scale and sets *qsum to the sum of their integers; NaN where it holds inf or NaN.
 * Two passes: the integers are 256 q + q2 (16 bits), their scale d_a / 256, with
 * q2 = round(256 (x / d_a - q)) kept in [-127, 127] (so -q2 is an int8 too). */
static float quantize_block(const float *x, int passes, int8_t *q, int8_t *q2, int32_t *qsum) {
    float amax = 0.f;
    int bad = 0;
    for (int k = 0; k < 32; k++) {
        const float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
        bad |= !(a <= 3.402823466e38f); /* NaN or an infinity */
    }
    if (bad) return NAN;
    if (amax < 1e-30f) { /* all zero, or too small for 127 / amax to be finite */
        memset(q, 0, 32);
        if (passes == 2) memset(q2, 0, 32);
        *qsum = 0;
        return 0.f;
    }
    const float inv = 127.f / amax;
    int32_t total = 0, total2 = 0;
#if defined(SL_AVX512)
    const __m512 vinv = _mm512_set1_ps(inv), v256 = _mm512_set1_ps(256.f), lim = _mm512_set1_ps(127.f);
    for (int k = 0; k < 32; k += 16) { /* rounds to nearest even (MXCSR), as nearbyintf below */
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + k), vinv);
        const __m512i v = _mm512_cvtps_epi32(t);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtsepi32_epi8(v));
        total += _mm512_reduce_add_epi32(v);
        if (passes == 2) { /* t - v is exact: v is an integer within 0.5 of t */
            __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(v)), v256);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
            const __m512i v2 = _mm512_cvtps_epi32(r);
            _mm_storeu_si128((__m128i *)(q2 + k), _mm512_cvtsepi32_epi8(v2));
            total2 += _mm512_reduce_add_epi32(v2);
        }
    }
#else
    for (int k = 0; k < 32; k++) {
        const float t = x[k] * inv;
        const int32_t v = (int32_t)nearbyintf(t); /* |v| <= 127: t <= 127 + an ulp */
        q[k] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        total += q[k];
        if (passes == 2) {
            float r = (t - (float)v) * 256.f;
            r = r < -127.f ? -127.f : r > 127.f ? 127.f : r;
            q2[k] = (int8_t)nearbyintf(r);
            total2 += q2[k];
        }
    }
#endif
    if (passes == 2) {
        *qsum = 256 * total + total2;
        return amax / 127.f / 256.f;
    }
    *qsum = total;
    return amax / 127.f;
}

struct quantize_job {
    const float *x;
    int64_t in, rows, passes;
    uint8_t *buf;
};

static void quantize_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct quantize_job *j = ctx;
    const struct q8_act a = act_view(j->buf, j->rows, j->in);
    for (int64_t r = begin; r < end; r++) {
        int8_t *q = (int8_t *)a.q + r * j->in, *q2 = (int8_t *)a.q2 + r * j->in;
        float *d = (float *)a.d + r * a.nb, *s = (float *)a.s + r * a.nb;
        int32_t *qsum = (int32_t *)a.qsum + r * a.nb;
        int bad = 0;
        for (int64_t b = 0; b < a.nb; b++) {
            d[b] = quantize_block(j->x + r * j->in + 32 * b, (int)j->passes, q + 32 * b, q2 + 32 * b, qsum + b);
            bad |= d[b] != d[b];
            s[b] = d[b] * (float)qsum[b];
        }
        if (bad) /* a row holding inf or NaN: every output NaN, which the sampler reports */
            for (int64_t b = 0; b < a.nb; b++) {
                memset(q + 32 * b, 0, 32);
                memset(q2 + 32 * b, 0, 32);
                d[b] = s[b] = NAN;
                qsum[b] = 0;
            }
    }
}

/* Rows below this are quantized on the calling thread: a handful take less than waking a worker. */
#define QUANTIZE_PARALLEL_ROWS 16

/* x [rows, in] fp32 contiguous (in a multiple of 32) -> buf (servelab_q8_act_bytes), in one or
 * two int8 passes. */
void servelab_q8_quantize_f32(const float *x, int64_t rows, int64_t in, int64_t passes, uint8_t *buf,
                              int64_t threads) {
    const struct quantize_job job = {x, in, rows, passes, buf};
    if (rows >= QUANTIZE_PARALLEL_ROWS)
        sl_parallel_for(quantize_part, &job, rows, threads);
    else
        quantize_part(&job, 0, 0, rows);
}

/* ------------------------------------------------------------------ tiles */

struct q8_job {
    int64_t fmt, passes, out, rows, y_stride;
    const uint8_t *w;
    struct q8_act a;
    const float *bias;
    float *y;
};

/* out[r][0 .. 16) for rows r0 .. r0 + nr - 1 of one group: y of its outputs (bias added). */
static void store_group(const struct q8_job *j, int64_t g, int64_t r, const float *sums) {
    const int64_t o0 = g * GROUP, n = j->out - o0 < GROUP ? j->out - o0 : GROUP;
    float *y = j->y + r * j->y_stride + o0;
    for (int64_t k = 0; k < n; k++) y[k] = sums[k] + (j->bias ? j->bias[o0 + k] : 0.0f);
}

#if defined(SL_AVX2)
#if defined(SL_AVX512)
#define LANES 16
#define ROWS 8
#ifndef ROWS2
#define ROWS2 8
#endif
typedef __m512i vi;
typedef __m512 vf;
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_set1(v) _mm512_set1_epi32(v)
#define vi_zero() _mm512_setzero_si512()
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_xor(a, b) _mm512_xor_si512(a, b)
#define vi_srli16(a, n) _mm512_srli_epi16(a, n)
#define vi_sub32(a, b) _mm512_sub_epi32(a, b)
#define vi_slli32(a, n) _mm512_slli_epi32(a, n)
#define vi_set1_8(v) _mm512_set1_epi8(v)
#define vf_set1(v) _mm512_set1_ps(v)
#define vf_zero() _mm512_setzero_ps()
#define vf_cvt(a) _mm512_cvtepi32_ps(a)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_store(p, a) _mm512_storeu_ps(p, a)
#define vf_ph(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vi_abs8(a) _mm512_abs_epi8(a)
#define vi_sign8(a, w) _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a)
#define vi_maddubs(u, s) _mm512_maddubs_epi16(u, s)
#define vi_madd16(a, b) _mm512_madd_epi16(a, b)
#define vi_add32(a, b) _mm512_add_epi32(a, b)
#define vi_set1_16(v) _mm512_set1_epi16(v)
#else
#define LANES 8
#define ROWS 4
#define ROWS2 4
typedef __m256i vi;
typedef __m256 vf;
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1(v) _mm256_set1_epi32(v)
#define vi_zero() _mm256_setzero_si256()
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_xor(a, b) _mm256_xor_si256(a, b)
#define vi_srli16(a, n) _mm256_srli_epi16(a, n)
#define vi_sub32(a, b) _mm256_sub_epi32(a, b)
#define vi_slli32(a, n) _mm256_slli_epi32(a, n)
#define vi_set1_8(v) _mm256_set1_epi8(v)
#define vf_set1(v) _mm256_set1_ps(v)
#define vf_zero() _mm256_setzero_ps()
#define vf_cvt(a) _mm256_cvtepi32_ps(a)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_store(p, a) _mm256_storeu_ps(p, a)
#define vf_ph(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vi_abs8(a) _mm256_abs_epi8(a)
#define vi_sign8(a, w) _mm256_sign_epi8(a, w)
#define vi_maddubs(u, s) _mm256_maddubs_epi16(u, s)
#define vi_madd16(a, b) _mm256_madd_epi16(a, b)
#define vi_add32(a, b) _mm256_add_epi32(a, b)
#define vi_set1_16(v) _mm256_set1_epi16(v)
#endif

static inline vi bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vi_set1(v);
}

/* acc + per int32 lane the four products of u's unsigned and s's signed bytes. */
static inline __attribute__((always_inline)) vi dot4(vi acc, vi u, vi s) {
#if defined(SL_AVX512_VNNI)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return vi_add32(acc, vi_madd16(vi_maddubs(u, s), vi_set1_16(1)));
#endif
}

/* Q8_0 without VNNI takes |q_w| x sign(q_a, q_w); with it, q_w + 128 and the 128 sum(q_a) off. */
#if defined(SL_AVX512_VNNI)
#define BYTE_OFFSET 128
#else
#define BYTE_OFFSET 0
#endif

/* Rows [r0, r0 + NR) against half `h` of group `g` (LANES outputs: h is 0 at AVX-512, 0 or 1 at
 * AVX2), every block, into sums[r][h * LANES ..). FMT constant once inlined. */
static inline __attribute__((always_inline)) void tile(const int64_t FMT, const int P, const int NR,
                                                        const struct q8_job *j, const uint8_t *grp, int64_t r0,
                                                        int h, float sums[ROWS][GROUP]) {
    const struct q8_act *a = &j->a;
    const int64_t bb = group_block_bytes(FMT);
    const int off = FMT == Q4_0_G16 ? 8 : FMT == Q8_0_G16 ? BYTE_OFFSET : 0;
    const vi low4 = vi_set1_8(0x0F), flip = vi_set1_8((char)0x80);
    vf acc[ROWS];
    for (int r = 0; r < NR; r++) acc[r] = vf_zero();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = grp + b * bb;
        vi s[ROWS], s2[ROWS];
        for (int r = 0; r < NR; r++) s[r] = s2[r] = vi_zero();
        const int8_t *qa = a->q + r0 * a->in + 32 * b, *qa2 = a->q2 + r0 * a->in + 32 * b;
        if (FMT == Q8_0_G16)
            for (int c = 0; c < 8; c++) {
                const vi w = vi_load(blk + 64 + 64 * c + 4 * LANES * h);
#if defined(SL_AVX512_VNNI)
                const vi u = vi_xor(w, flip);
                for (int r = 0; r < NR; r++) {
                    s[r] = dot4(s[r], u, bcast4(qa + r * a->in + 4 * c));
                    if (P == 2) s2[r] = dot4(s2[r], u, bcast4(qa2 + r * a->in + 4 * c));
                }
#else
                (void)flip;
                const vi u = vi_abs8(w);
                for (int r = 0; r < NR; r++) {
                    s[r] = dot4(s[r], u, vi_sign8(bcast4(qa + r * a->in + 4 * c), w));
                    if (P == 2) s2[r] = dot4(s2[r], u, vi_sign8(bcast4(qa2 + r * a->in + 4 * c), w));
                }
#endif
            }
        else
            for (int c = 0; c < 4; c++) {
                const vi w = vi_load(blk + 64 + 64 * c + 4 * LANES * h);
                const vi lo = vi_and(w, low4), hi = vi_and(vi_srli16(w, 4), low4);
                for (int r = 0; r < NR; r++) {
                    s[r] = dot4(s[r], lo, bcast4(qa + r * a->in + 4 * c));
                    s[r] = dot4(s[r], hi, bcast4(qa + r * a->in + 16 + 4 * c));
                    if (P == 2) {
                        s2[r] = dot4(s2[r], lo, bcast4(qa2 + r * a->in + 4 * c));
                        s2[r] = dot4(s2[r], hi, bcast4(qa2 + r * a->in + 16 + 4 * c));
                    }
                }
            }
        const vf dw = vf_ph(blk + 2 * LANES * h);
        const int64_t at = r0 * a->nb + b;
        for (int r = 0; r < NR; r++) {
            vi t = P == 2 ? vi_add32(vi_slli32(s[r], 8), s2[r]) : s[r]; /* 256 q + q2's sums, exact */
            if (off) t = vi_sub32(t, vi_set1(off * a->qsum[at + r * a->nb]));
            acc[r] = vf_fma(vf_cvt(t), vf_mul(dw, vf_set1(a->d[at + r * a->nb])), acc[r]);
        }
        if (FMT == Q4_1_G16) {
            const vf mw = vf_ph(blk + 32 + 2 * LANES * h);
            for (int r = 0; r < NR; r++) acc[r] = vf_fma(mw, vf_set1(a->s[at + r * a->nb]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) vf_store(sums[r] + LANES * h, acc[r]);
}

#define SL_TILE(FMT, P, NR) tile(FMT, P, NR, j, grp, r0, h, sums)
#define SL_TILES(FMT, P)                                                                           \
    switch (nr) {                                                                                  \
    case 1: SL_TILE(FMT, P, 1); break;                                                             \
    case 2: SL_TILE(FMT, P, 2); break;                                                             \
    case 3: SL_TILE(FMT, P, 3); break;                                                             \
    case 4: SL_TILE(FMT, P, 4); break;                                                             \
    SL_TILES_WIDE(FMT, P)                                                                          \
    }
#if ROWS == 8
#define SL_TILES_WIDE(FMT, P)                                                                      \
    case 5: SL_TILE(FMT, P, 5); break;                                                             \
    case 6: SL_TILE(FMT, P, 6); break;                                                             \
    case 7: SL_TILE(FMT, P, 7); break;                                                             \
    case 8: SL_TILE(FMT, P, 8); break;
#else
#define SL_TILES_WIDE(FMT, P)
#endif

static void tile_dispatch(const struct q8_job *j, const uint8_t *grp, int64_t r0, int64_t nr, int h,
                          float sums[ROWS][GROUP]) {
    if (j->passes == 2)
        switch (j->fmt) {
        case Q8_0_G16: SL_TILES(Q8_0_G16, 2) break;
        case Q4_0_G16: SL_TILES(Q4_0_G16, 2) break;
        default: SL_TILES(Q4_1_G16, 2) break;
        }
    else
        switch (j->fmt) {
        case Q8_0_G16: SL_TILES(Q8_0_G16, 1) break;
        case Q4_0_G16: SL_TILES(Q4_0_G16, 1) break;
        default: SL_TILES(Q4_1_G16, 1) break;
        }
}
#else
#define ROWS 1
#define ROWS2 1
/* The same integers and the same products, one row and one output at a time. */
static void tile_dispatch(const struct q8_job *j, const uint8_t *grp, int64_t r0, int64_t nr, int h,
                          float sums[ROWS][GROUP]) {
    (void)nr;
    (void)h;
    const struct q8_act *a = &j->a;
    const int64_t bb = group_block_bytes(j->fmt);
    for (int k = 0; k < GROUP; k++) {
        float acc = 0.f;
        for (int64_t b = 0; b < a->nb; b++) {
            const uint8_t *blk = grp + b * bb;
            const int8_t *qa = a->q + r0 * a->in + 32 * b;
            const int8_t *qa2 = a->q2 + r0 * a->in + 32 * b;
            int32_t s = 0;
            for (int e = 0; e < 32; e++) { /* q_a as 256 q + q2 with two passes */
                const int32_t v = j->passes == 2 ? 256 * qa[e] + qa2[e] : qa[e];
                if (j->fmt == Q8_0_G16)
                    s += (int8_t)blk[64 + 64 * (e / 4) + 4 * k + e % 4] * v;
                else {
                    const uint8_t byte = blk[64 + 64 * (e % 16 / 4) + 4 * k + e % 4];
                    s += (e < 16 ? byte & 0x0F : byte >> 4) * v;
                }
            }
            const int64_t at = r0 * a->nb + b;
            if (j->fmt == Q4_0_G16) s -= 8 * a->qsum[at];
            uint16_t dh;
            memcpy(&dh, blk + 2 * k, 2);
            acc += (float)s * (sl_f16_to_f32(dh) * a->d[at]);
            if (j->fmt == Q4_1_G16) {
                uint16_t mh;
                memcpy(&mh, blk + 32 + 2 * k, 2);
                acc += sl_f16_to_f32(mh) * a->s[at];
            }
        }
        sums[0][k] = acc;
    }
}
#endif

/* Groups [begin, end): every row tile over each. */
static void q8_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct q8_job *j = ctx;
    const int64_t group_bytes = j->a.nb * group_block_bytes(j->fmt);
    float sums[ROWS][GROUP];
    const int64_t tile_rows = j->passes == 2 ? ROWS2 : ROWS;
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *grp = j->w + g * group_bytes;
        for (int64_t r0 = 0; r0 < j->rows; r0 += tile_rows) {
            const int64_t nr = j->rows - r0 < tile_rows ? j->rows - r0 : tile_rows;
#if defined(SL_AVX2)
            for (int h = 0; h < GROUP / LANES; h++) tile_dispatch(j, grp, r0, nr, h, sums);
#else
            tile_dispatch(j, grp, r0, nr, 0, sums);
#endif
            for (int64_t r = 0; r < nr; r++) store_group(j, g, r0 + r, sums[r]);
        }
    }
}

/* y [rows, out] (row stride y_stride) = the quantized activations `act` (servelab_q8_quantize_f32
 * of x [rows, in]) times a weight in one of the group layouts above, out outputs (its groups
 * padded to 16 with zero scales), plus bias (or NULL). */
void servelab_q8_block_linear_f32(int64_t fmt, const uint8_t *w, int64_t in, int64_t out, const uint8_t *act,
                                  int64_t passes, int64_t rows, const float *bias, float *y, int64_t y_stride,
                                  int64_t threads) {
    const struct q8_job job = {fmt, passes, out, rows, y_stride, w, act_view(act, rows, in), bias, y};
    sl_parallel_chunks(q8_part, &job, (out + GROUP - 1) / GROUP, 1, threads);
}
