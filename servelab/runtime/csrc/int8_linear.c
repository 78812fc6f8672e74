/* Int8 linears for the opt-in `--quantization int8` (quantization.py quantizes and packs the weights).
 *
 *   y[m, n] = sw[n] * (sum_g sa[m, g] * sum_{k in g} qa[m, k] * qw[n, k]  -  zw[n] * S[m]) + bias[n]
 *
 * Activations: symmetric int8 per group of G = 64 consecutive inputs of a row,
 * qa = round(x * (127 / amax)) in [-127, 127] with sa = amax / 127, amax the group's largest |x|;
 * S[m] = sum_g sa[m, g] * sum_{k in g} qa[m, k] is the row's sum as quantized. Weights: asymmetric
 * 7-bit per output channel, qw in [0, 127] with zero point zw and scale sw, so w ~ sw * (qw - zw).
 *
 * Why groups: a model's activations have outlier channels (SmolLM2's down projection sees rows
 * whose largest value is far above their median one), and one scale per row spends the 8 bits
 * on them (the accuracy of each choice: docs/benchmarks.md). Per group, each tile's int32 sums
 * are scaled into fp32 accumulators every 64 inputs.
 *
 * Why 7-bit weights: AVX2's int8 multiply, vpmaddubsw, multiplies unsigned bytes by signed ones
 * and adds each pair into a saturating int16. Two products of 127 * 127 sum to 32258, which
 * fits; 255 * 127 twice does not, which is why fbgemm drops its activations to 7 bits
 * (`reduce_range`). Here the weights take the unsigned side and the 7 bits, and the activations
 * keep 8 (the other way round measured less accurate).
 * A second multiply, vpmaddwd by ones, widens the pairs to int32.
 *
 * The integer sums are exact and the fp32 steps are the same operations in the same order in
 * the AVX2 and the portable build (no FMA contraction: SL_ROUNDED), so both give the same bits,
 * and a row's result depends on that row alone: batch-invariant, unlike fbgemm's per-tensor
 * activation scale.
 *
 * Packed weights: panels of NP = 16 outputs (out_features padded to a multiple of 16 with zero
 * rows). Panel p is [kp / 4][16][4] bytes, byte (g, o, i) = qw[16 p + o][4 g + i], where kp is
 * in_features rounded up to G (the padding meets zero activations).
 *
 * At AVX2 the kernel holds a 5-row x 16-output tile in ten int32 accumulators. It walks one panel
 * (16 * kp bytes, in L1) over every row tile; panels are split over the threads. At AVX-512 a
 * 64-byte step of a panel is one vector, and a tile is up to 8 rows x 3 panels (tile_wide) from
 * five rows where every thread gets three panels, else one panel. With AVX512-VNNI one vpdpbusd (unsigned x signed bytes, four
 * products summed into each int32 lane) replaces vpmaddubsw + vpmaddwd + vpaddd; both give the
 * same integers, so every ISA level gives the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp.h"
#include "parallel.h"
#include "isa.h"

#define NP 16 /* outputs a panel */
#define MR 5  /* rows a tile */
#define G 64  /* inputs an activation scale covers (kp is a multiple) */

/* One group x [n] (n <= G) -> q [n]; returns its scale (0 for an all-zero group, or one too small
 * for 127 / amax to be finite) and adds its sum of q to *qsum; NaN when it holds inf or NaN. */
static float quantize_group(const float *x, int64_t n, int8_t *q, int32_t *qsum) {
    float amax = 0.f;
    int bad = 0;
    int64_t k = 0;
#ifdef SL_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps(), vbad = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
        vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    bad = _mm256_movemask_ps(vbad) != 0;
#endif
    for (; k < n; k++) {
        const float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
        bad |= x[k] != x[k];
    }
    if (bad || amax > 3.402823466e38f) return NAN; /* NaN, or an infinity */
    if (amax < 1e-30f) {
        memset(q, 0, (size_t)n);
        return 0.f;
    }
    const float inv = 127.f / amax;
    int32_t total = 0;
    k = 0;
#ifdef SL_AVX2
    const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i vsum = _mm256_setzero_si256();
    for (; k + 16 <= n; k += 16) { /* x * inv rounds to nearest even (MXCSR), as nearbyintf */
        const __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv), lo), hi);
        const __m256 b = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv), lo), hi);
        const __m256i ia = _mm256_cvtps_epi32(a), ib = _mm256_cvtps_epi32(b);
        vsum = _mm256_add_epi32(vsum, _mm256_add_epi32(ia, ib));
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ia, ib), 0xD8); /* 16 x int16 in order */
        const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
        _mm_storeu_si128((__m128i *)(q + k), w8);
    }
    int32_t parts[8];
    _mm256_storeu_si256((__m256i *)parts, vsum);
    for (int i = 0; i < 8; i++) total += parts[i];
#endif
    for (; k < n; k++) {
        float v = x[k] * inv;
        v = v < -127.f ? -127.f : v > 127.f ? 127.f : v;
        q[k] = (int8_t)nearbyintf(v);
        total += q[k];
    }
    *qsum = total;
    return amax / 127.f;
}

/* A row x [in] -> q [kp] (zero padded), its group scales [kp / G] and its quantized sum S. A row
 * holding inf or NaN gets every scale NaN (its outputs are NaN, which the sampler reports). */
static void quantize_row(const float *x, int64_t in, int64_t kp, int8_t *q, float *scales, float *row_sum) {
    memset(q, 0, (size_t)kp);
    float sum = 0.f;
    int bad = 0;
    for (int64_t g = 0; g < kp / G; g++) {
        const int64_t k0 = g * G, n = in - k0 < G ? (in - k0 > 0 ? in - k0 : 0) : G;
        int32_t qsum = 0;
        scales[g] = quantize_group(x + k0, n, q + k0, &qsum);
        bad |= scales[g] != scales[g];
        float t = scales[g] * (float)qsum;
        SL_ROUNDED(t);
        sum += t;
    }
    if (bad) {
        memset(q, 0, (size_t)kp);
        for (int64_t g = 0; g < kp / G; g++) scales[g] = NAN;
        sum = NAN;
    }
    *row_sum = sum;
}

#if !defined(SL_AVX512) /* the AVX2 and portable tile (AVX-512's is tile_wide below) */
#ifdef SL_AVX2
/* acc + the sums of four products of w's unsigned and b's signed bytes, per int32 lane. In one asm
 * statement so that its int16 temporary lives only here: written as intrinsics, gcc issued all
 * ten of a tile's vpmaddubsw first and spilled six accumulators to the stack every iteration. */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i b, __m256i ones) {
#if defined(__GNUC__)
    __m256i t;
    __asm__("vpmaddubsw %2, %3, %0\n\tvpmaddwd %4, %0, %0\n\tvpaddd %0, %1, %1"
            : "=&x"(t), "+x"(acc)
            : "x"(b), "x"(w), "x"(ones));
    return acc;
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, b), ones));
#endif
}

/* acc[0 .. 16) += scale * (float)sums of one group (outputs 0-7 in s0, 8-15 in s1), each product
 * rounded before the add, like the scalar code. */
static inline void scale_add(float acc[NP], float scale, __m256i s0, __m256i s1) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 t0 = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(s0)), t1 = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(s1));
    SL_ROUNDED(t0);
    SL_ROUNDED(t1);
    _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), t0));
    _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_loadu_ps(acc + 8), t1));
}
#endif

/* acc[r][o] = sum_g scales[r][g] * sum_{k in g} qa[r][k] * qw[o][k] over one panel, for the first
 * `mr` rows (a constant once inlined into tile_dispatch: each row count gets its own unrolled
 * loop). Rows are kp apart in qa, their scales `groups` apart. */
static inline __attribute__((always_inline)) void tile(const int mr, const int8_t *qa, const float *scales,
                                                       int64_t kp, const uint8_t *panel, float acc[MR][NP]) {
    const int64_t groups = kp / G;
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < NP; o++) acc[r][o] = 0.f;
#if defined(SL_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        __m256i a0[MR], a1[MR];
        for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        const uint8_t *w = panel + g * G * NP;
        for (int64_t k4 = 0; k4 < G / 4; k4++, w += 4 * NP) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, qa + r * kp + g * G + 4 * k4, 4);
                const __m256i b = _mm256_set1_epi32(four);
                a0[r] = dot4(a0[r], w0, b, ones);
                a1[r] = dot4(a1[r], w1, b, ones);
            }
        }
        for (int r = 0; r < mr; r++) scale_add(acc[r], scales[r * groups + g], a0[r], a1[r]);
    }
#else
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < mr; r++)
            for (int o = 0; o < NP; o++) {
                int32_t s = 0;
                for (int64_t k = g * G; k < (g + 1) * G; k++)
                    s += (int32_t)panel[(k / 4) * 4 * NP + 4 * o + k % 4] * qa[r * kp + k];
                float t = scales[r * groups + g] * (float)s;
                SL_ROUNDED(t);
                acc[r][o] += t;
            }
#endif
}

static void tile_dispatch(int64_t mr, const int8_t *qa, const float *scales, int64_t kp, const uint8_t *panel,
                          float acc[MR][NP]) {
    switch (mr) {
    case 1: tile(1, qa, scales, kp, panel, acc); break;
    case 2: tile(2, qa, scales, kp, panel, acc); break;
    case 3: tile(3, qa, scales, kp, panel, acc); break;
    case 4: tile(4, qa, scales, kp, panel, acc); break;
    default: tile(5, qa, scales, kp, panel, acc); break;
    }
}
#else
/* AVX-512 has 32 vector registers: a wide tile of up to MRW rows x PW panels (48 outputs) keeps 24
 * int32 accumulators, so each 64-byte weight load serves 8 rows and each broadcast of 4 activation
 * bytes 3 panels (against 5 and 1 in `tile`). The integers, and each output's fp32 steps, are the
 * same as tile's, so the bits are too. Panels p .. p + pw - 1 are consecutive, 16 * kp bytes apart. */
#ifndef MRW /* MRW, PW and WIDE_ROWS may be set with -D (benchmarks/build_ab.py) */
#define MRW 8
#endif
#ifndef PW
#define PW 3
#endif
#if PW < 1 || PW > 4 || MRW < 1 || MRW > 12
#error "the wide tile's dispatch covers 1 <= PW <= 4 and 1 <= MRW <= 12"
#endif

/* acc + the sums of four products of w's unsigned and b's signed bytes, per int32 lane (`ones`:
 * 16-bit ones, unused with VNNI). In asm where GCC allows: for the intrinsic, it moved every
 * accumulator through one register and back around each vpdpbusd (three instructions, not one). */
static inline __attribute__((always_inline)) __m512i dot4_512(__m512i acc, __m512i w, __m512i b, __m512i ones) {
#if defined(__GNUC__) && !defined(SL_SIMDE_LEVEL) && defined(SL_AVX512_VNNI)
    (void)ones;
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b));
    return acc;
#elif defined(__GNUC__) && !defined(SL_SIMDE_LEVEL)
    __m512i t;
    __asm__("vpmaddubsw %2, %3, %0\n\tvpmaddwd %4, %0, %0\n\tvpaddd %0, %1, %1"
            : "=&v"(t), "+v"(acc)
            : "v"(b), "v"(w), "v"(ones));
    return acc;
#elif defined(SL_AVX512_VNNI)
    (void)ones;
    return _mm512_dpbusd_epi32(acc, w, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, b), ones));
#endif
}
static inline __attribute__((always_inline)) void tile_wide(const int mr, const int pw, const int8_t *qa,
                                                            const float *scales, int64_t kp, const uint8_t *panel,
                                                            float acc[MRW][PW * NP]) {
    const int64_t groups = kp / G;
    const __m512 zero = _mm512_setzero_ps();
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < pw; c++) _mm512_storeu_ps(acc[r] + c * NP, zero);
    const __m512i ones = _mm512_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        __m512i a[MRW][PW];
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < pw; c++) a[r][c] = _mm512_setzero_si512();
        const uint8_t *w = panel + g * G * NP;
        const int8_t *x = qa + g * G;
        for (int64_t k4 = 0; k4 < G / 4; k4++, w += 4 * NP, x += 4) {
            __m512i wv[PW];
            for (int c = 0; c < pw; c++) wv[c] = _mm512_loadu_si512((const void *)(w + c * NP * kp));
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, x + r * kp, 4);
                const __m512i b = _mm512_set1_epi32(four);
                for (int c = 0; c < pw; c++)
#if defined(SL_AVX512_VNNI)
                    /* one panel (the narrow steps): the intrinsic, which GCC folds the broadcast into */
                    a[r][c] = pw == 1 ? _mm512_dpbusd_epi32(a[r][c], wv[c], b) : dot4_512(a[r][c], wv[c], b, ones);
#else
                    a[r][c] = dot4_512(a[r][c], wv[c], b, ones);
#endif
            }
        }
        for (int r = 0; r < mr; r++) {
            const __m512 sc = _mm512_set1_ps(scales[r * groups + g]);
            for (int c = 0; c < pw; c++) {
                __m512 t = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(a[r][c]));
                SL_ROUNDED512(t);
                _mm512_storeu_ps(acc[r] + c * NP, _mm512_add_ps(_mm512_loadu_ps(acc[r] + c * NP), t));
            }
        }
    }
}

/* One unrolled loop per (rows, panels) a tile can have. */
#define SL_PW1(mr) case 1: tile_wide(mr, 1, qa, scales, kp, panel, acc); break;
#if PW >= 2
#define SL_PW2(mr) case 2: tile_wide(mr, 2, qa, scales, kp, panel, acc); break;
#else
#define SL_PW2(mr)
#endif
#if PW >= 3
#define SL_PW3(mr) case 3: tile_wide(mr, 3, qa, scales, kp, panel, acc); break;
#else
#define SL_PW3(mr)
#endif
#if PW >= 4
#define SL_PW4(mr) case 4: tile_wide(mr, 4, qa, scales, kp, panel, acc); break;
#else
#define SL_PW4(mr)
#endif
#define SL_MR(mr) case mr: switch (pw) { SL_PW1(mr) SL_PW2(mr) SL_PW3(mr) SL_PW4(mr) } break;

static void tile_wide_dispatch(int64_t mr, int64_t pw, const int8_t *qa, const float *scales, int64_t kp,
                               const uint8_t *panel, float acc[MRW][PW * NP]) {
    switch (mr) {
        SL_MR(1)
#if MRW >= 2
        SL_MR(2)
#endif
#if MRW >= 3
        SL_MR(3)
#endif
#if MRW >= 4
        SL_MR(4)
#endif
#if MRW >= 5
        SL_MR(5)
#endif
#if MRW >= 6
        SL_MR(6)
#endif
#if MRW >= 7
        SL_MR(7)
#endif
#if MRW >= 8
        SL_MR(8)
#endif
#if MRW >= 9
        SL_MR(9)
#endif
#if MRW >= 10
        SL_MR(10)
#endif
#if MRW >= 11
        SL_MR(11)
#endif
#if MRW >= 12
        SL_MR(12)
#endif
    }
}
#endif

struct int8_job {
    const uint8_t *w;
    const float *w_scale, *bias;
    const int32_t *w_zero;
    int64_t kp, out, rows, unit;
    const int8_t *qa;
    const float *a_scale, *a_sum;
    float *y;
};

/* y = sw * (acc - zw * S) + bias for one row's `width` outputs from n0: t = zw * S, d = acc - t,
 * y = sw * d (+ bias), each rounded on its own. */
static void finish_row(const struct int8_job *j, int64_t row, int64_t n0, int64_t width, const float *acc) {
    float *y = j->y + row * j->out + n0;
    const float rs = j->a_sum[row];
    int64_t o = 0;
#ifdef SL_AVX2
    if (width == NP) /* the same operations as the scalar loop, eight outputs at a time */
        for (; o < NP; o += 8) {
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(j->w_zero + n0 + o))),
                                     _mm256_set1_ps(rs));
            SL_ROUNDED(t);
            __m256 d = _mm256_mul_ps(_mm256_loadu_ps(j->w_scale + n0 + o), _mm256_sub_ps(_mm256_loadu_ps(acc + o), t));
            SL_ROUNDED(d);
            _mm256_storeu_ps(y + o, j->bias ? _mm256_add_ps(d, _mm256_loadu_ps(j->bias + n0 + o)) : d);
        }
#endif
    for (; o < width; o++) {
        float t = (float)j->w_zero[n0 + o] * rs;
        SL_ROUNDED(t);
        float d = j->w_scale[n0 + o] * (acc[o] - t);
        SL_ROUNDED(d);
        y[o] = j->bias ? d + j->bias[n0 + o] : d;
    }
}

/* Panels a part's unit of work: at AVX-512, PW from WIDE_ROWS rows, where there are enough
 * panels for every thread to get a unit; below, a step streams its weights, and one panel at a
 * time streams them faster than three side by side. */
#if defined(SL_AVX512)
#ifndef WIDE_ROWS
#define WIDE_ROWS 5
#endif
#define UNIT(rows, panels, threads) ((rows) >= WIDE_ROWS && (panels) >= PW * (threads) ? PW : 1)
#else
#define UNIT(rows, panels, threads) 1
#endif

/* Units [begin, end) of j->unit panels each, over every row. */
static void int8_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct int8_job *j = ctx;
    const int64_t groups = j->kp / G, panels = (j->out + NP - 1) / NP;
    for (int64_t u = begin; u < end; u++) {
        const int64_t unit = j->unit, p = u * unit, pw = panels - p < unit ? panels - p : unit;
        const uint8_t *panel = j->w + p * NP * j->kp;
#if defined(SL_AVX512)
        float acc[MRW][PW * NP];
        for (int64_t m = 0; m < j->rows; m += MRW) {
            const int64_t mr = j->rows - m < MRW ? j->rows - m : MRW;
            tile_wide_dispatch(mr, pw, j->qa + m * j->kp, j->a_scale + m * groups, j->kp, panel, acc);
#else
        float acc[MR][NP];
        for (int64_t m = 0; m < j->rows; m += MR) {
            const int64_t mr = j->rows - m < MR ? j->rows - m : MR;
            tile_dispatch(mr, j->qa + m * j->kp, j->a_scale + m * groups, j->kp, panel, acc);
#endif
            for (int64_t r = 0; r < mr; r++)
                for (int64_t c = 0; c < pw; c++) {
                    const int64_t n0 = (p + c) * NP, width = j->out - n0 < NP ? j->out - n0 : NP;
                    finish_row(j, m + r, n0, width, acc[r] + c * NP);
                }
        }
    }
}

struct quantize_job {
    const float *x;
    int64_t in, kp;
    int8_t *qa;
    float *a_scale, *a_sum;
};

/* Rows below this are quantized on the calling thread: a handful take less than waking a worker. */
#define QUANTIZE_PARALLEL_ROWS 16

static void quantize_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct quantize_job *q = ctx;
    const int64_t groups = q->kp / G;
    for (int64_t m = begin; m < end; m++)
        quantize_row(q->x + m * q->in, q->in, q->kp, q->qa + m * q->kp, q->a_scale + m * groups, q->a_sum + m);
}

/* The calling thread's buffer for the quantized activations (grown, never shrunk): a decode step
 * makes ~120 of these calls, and malloc of a few hundred KB would be an mmap + page faults each. */
static __thread void *scratch;
static __thread size_t scratch_bytes;

/* y [rows, out] (contiguous) = x [rows, in] (contiguous) times the packed weights; bias may be
 * NULL. Returns 0, or -1 when the scratch buffer cannot be allocated (y is then untouched). */
int servelab_int8_linear_f32(const uint8_t *w, const float *w_scale, const int32_t *w_zero, const float *bias,
                             int64_t in, int64_t kp, int64_t out, const float *x, int64_t rows, float *y,
                             int64_t threads)
{
    const int64_t groups = kp / G;
    const size_t need = (size_t)rows * ((size_t)kp + sizeof(float) * (size_t)(groups + 1));
    if (need > scratch_bytes) {
        void *grown = realloc(scratch, need);
        if (grown == NULL) return -1;
        scratch = grown;
        scratch_bytes = need;
    }
    float *a_scale = scratch, *a_sum = a_scale + rows * groups;
    int8_t *qa = (int8_t *)(a_sum + rows);
    const struct quantize_job quant = {x, in, kp, qa, a_scale, a_sum};
    if (rows >= QUANTIZE_PARALLEL_ROWS)
        sl_parallel_for(quantize_part, &quant, rows, threads);
    else
        quantize_part(&quant, 0, 0, rows);
    const int64_t panels = (out + NP - 1) / NP, unit = UNIT(rows, panels, threads);
    struct int8_job job = {w, w_scale, bias, w_zero, kp, out, rows, unit, qa, a_scale, a_sum, y};
    sl_parallel_for(int8_part, &job, (panels + unit - 1) / unit, threads);
    return 0;
}
