/* Linears in bf16 (opt-in, `--quantization bf16`): y [rows, out] = x [rows, in] @ W [out, in]^T
 * + bias with W stored as bf16, each activation rounded to bf16 (to nearest even; a value under
 * bf16's smallest normal becomes a signed zero), every product exact in fp32 and the sums in fp32.
 *
 * Why: AVX512-BF16's vdpbf16ps does 32 multiply-adds an instruction where an fp32 FMA does 16,
 * so the GEMMs of prefill and batched decode run up to twice as fast, and the weight is half the
 * bytes of fp32 at batch 1. It costs the activations' rounding (8 bits of mantissa), so it is
 * never a default (docs/benchmarks.md, "bf16 compute").
 *
 * The arithmetic is vdpbf16ps's, and the same at every ISA level: y[r][o] is one fp32 chain over
 * the input pairs in order, pair p adding x[2p+1] w[2p+1], then x[2p] w[2p], each as one fused
 * multiply-add (vdpbf16ps's order on AMD's Zen 5 and in Intel's definition), an odd last input
 * paired with a zero; then + bias. A vector lane is an output, so no lanes are summed at the end
 * and the vector width does not change the bits. Where the CPU lacks the instruction (and on
 * SIMDe, whose version adds the even product first) each pair is split into its two fp32 halves
 * for two FMAs. vdpbf16ps flushes results under 2^-126 to zero and the FMAs do not: only there
 * can levels differ.
 *
 * The weight is packed once (quantization.Bf16Linear) in panels of 64 outputs, each input pair's
 * 64 x 2 values contiguous, so a tile of MR rows x 64 outputs loads four vectors of weights a pair
 * and broadcasts each row's pair, as BLIS-style GEMMs do. Panels are split over our thread pool,
 * and each row's result is the same chain whatever the tile or the other rows: batch-invariant.
 */
#include <stdint.h>
#include <stdlib.h>

#include "half.h"
#include "isa.h"
#include "parallel.h"

#define NV 4         /* 16-output vectors a panel */
#define NPO (16 * NV) /* outputs a packed panel */

/* Per level: acc_t holds 16 outputs' fp32 sums; w_t one input pair of 16 outputs (64 bytes of
 * the packed weight); x_t one input pair of a row, broadcast; dot(acc, x, w) adds the odd
 * input's product, then the even one's, each as one fused multiply-add. */
#if defined(SL_AVX512)
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline void acc_store(float *dst, acc_t a) { _mm512_storeu_ps(dst, a); }
static inline void acc_store_plus(float *dst, acc_t a, const float *b) {
    _mm512_storeu_ps(dst, _mm512_add_ps(a, _mm512_loadu_ps(b)));
}
#if defined(SL_AVX512_BF16) && !defined(SL_SIMDE_LEVEL)
#define MR 6 /* 24 accumulators + 4 weight vectors + 1 broadcast */
typedef __m512bh w_t;
typedef __m512bh x_t;
static inline w_t w_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline x_t x_pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32((int)pair); }
static inline acc_t dot(acc_t a, x_t x, w_t w) { return _mm512_dpbf16_ps(a, x, w); }
#else
#define MR 4 /* 16 accumulators + 4 x 2 weight halves + 2 broadcasts */
typedef struct { __m512 odd, even; } w_t;
typedef struct { __m512 odd, even; } x_t;
static inline w_t w_load(const uint16_t *p) {
    const __m512i v = _mm512_loadu_si512((const void *)p);
    const w_t w = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))),
                   _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
    return w;
}
static inline x_t x_pair(uint32_t pair) {
    const x_t x = {_mm512_set1_ps(sl_bits_f32(pair & 0xffff0000u)), _mm512_set1_ps(sl_bits_f32(pair << 16))};
    return x;
}
static inline acc_t dot(acc_t a, x_t x, w_t w) {
    return _mm512_fmadd_ps(x.even, w.even, _mm512_fmadd_ps(x.odd, w.odd, a));
}
#endif
#elif defined(SL_AVX2)
#define MR 1
typedef struct { __m256 lo, hi; } acc_t; /* outputs 0-7 and 8-15 */
typedef struct { const uint16_t *p; } w_t;
typedef struct { __m256 odd, even; } x_t;
static inline acc_t acc_zero(void) { const acc_t a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a; }
static inline void acc_store(float *dst, acc_t a) { _mm256_storeu_ps(dst, a.lo); _mm256_storeu_ps(dst + 8, a.hi); }
static inline void acc_store_plus(float *dst, acc_t a, const float *b) {
    _mm256_storeu_ps(dst, _mm256_add_ps(a.lo, _mm256_loadu_ps(b)));
    _mm256_storeu_ps(dst + 8, _mm256_add_ps(a.hi, _mm256_loadu_ps(b + 8)));
}
static inline w_t w_load(const uint16_t *p) { const w_t w = {p}; return w; }
static inline x_t x_pair(uint32_t pair) {
    const x_t x = {_mm256_set1_ps(sl_bits_f32(pair & 0xffff0000u)), _mm256_set1_ps(sl_bits_f32(pair << 16))};
    return x;
}
static inline __m256 dot8(__m256 a, x_t x, const uint16_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_fmadd_ps(x.even, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_fmadd_ps(x.odd, odd, a));
}
static inline acc_t dot(acc_t a, x_t x, w_t w) {
    a.lo = dot8(a.lo, x, w.p);
    a.hi = dot8(a.hi, x, w.p + 16);
    return a;
}
#else
#define MR 1
typedef struct { float v[16]; } acc_t;
typedef struct { const uint16_t *p; } w_t;
typedef struct { float odd, even; } x_t;
static inline acc_t acc_zero(void) { const acc_t a = {{0}}; return a; }
static inline void acc_store(float *dst, acc_t a) { for (int i = 0; i < 16; i++) dst[i] = a.v[i]; }
static inline void acc_store_plus(float *dst, acc_t a, const float *b) { for (int i = 0; i < 16; i++) dst[i] = a.v[i] + b[i]; }
static inline w_t w_load(const uint16_t *p) { const w_t w = {p}; return w; }
static inline x_t x_pair(uint32_t pair) { const x_t x = {sl_bits_f32(pair & 0xffff0000u), sl_bits_f32(pair << 16)}; return x; }
static inline acc_t dot(acc_t a, x_t x, w_t w) {
    for (int i = 0; i < 16; i++) {
        a.v[i] = __builtin_fmaf(x.odd, sl_bf16_to_f32(w.p[2 * i + 1]), a.v[i]);
        a.v[i] = __builtin_fmaf(x.even, sl_bf16_to_f32(w.p[2 * i]), a.v[i]);
    }
    return a;
}
#endif

/* y[r][o] (+ bias) for mr rows of xb (bf16, rows `pairs` 32-bit pairs apart) and the n <= NPO
 * outputs of one packed panel (pairs x NPO x 2 bf16), mr a constant once inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, const uint16_t *panel, int64_t pairs,
                                                       const uint32_t *xb, int64_t n, const float *bias, float *y,
                                                       int64_t y_stride) {
    acc_t acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = acc_zero();
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *wp = panel + p * NPO * 2;
        w_t w[NV];
        for (int v = 0; v < NV; v++) w[v] = w_load(wp + 32 * v);
        for (int r = 0; r < mr; r++) {
            const x_t x = x_pair(xb[r * pairs + p]);
            for (int v = 0; v < NV; v++) acc[r][v] = dot(acc[r][v], x, w[v]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float *yr = y + r * y_stride;
        float sums[16];
        for (int v = 0; v < NV && 16 * v < n; v++) {
            if (n - 16 * v >= 16) { /* a whole vector; else the valid lanes one by one (the same sums) */
                if (bias) acc_store_plus(yr + 16 * v, acc[r][v], bias + 16 * v);
                else acc_store(yr + 16 * v, acc[r][v]);
                continue;
            }
            acc_store(sums, acc[r][v]);
            for (int64_t i = 0; i < n - 16 * v; i++) yr[16 * v + i] = bias ? sums[i] + bias[16 * v + i] : sums[i];
        }
    }
}

/* One packed panel's outputs for every row: MR rows at a time, then the rest. With more than
 * one row, the next panel (`next`, next_bytes) is fetched a few lines a tile, spread over this
 * one: faster at 2-64 rows, where memory would otherwise wait on the arithmetic (docs/benchmarks.md,
 * "bf16 compute"); one row is a plain stream the hardware prefetches. */
static void panel_rows(const uint16_t *panel, int64_t pairs, int64_t n, const uint32_t *xb, int64_t rows,
                       const float *bias, float *y, int64_t out, const char *next, int64_t next_bytes) {
    const int64_t tiles = (rows + MR - 1) / MR;
    const int64_t per = rows > 1 ? ((next_bytes + 63) / 64 + tiles - 1) / tiles : 0;
    int64_t line = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        for (int64_t i = 0; i < per && line * 64 < next_bytes; i++, line++) __builtin_prefetch(next + line * 64, 0, 3);
        const uint32_t *xr = xb + r0 * pairs;
        float *yr = y + r0 * out;
        switch (rows - r0 < MR ? rows - r0 : MR) { /* constants, so every tile is unrolled */
#if MR >= 6
        case 6: tile(6, panel, pairs, xr, n, bias, yr, out); break;
        case 5: tile(5, panel, pairs, xr, n, bias, yr, out); break;
#endif
#if MR >= 4
        case 4: tile(4, panel, pairs, xr, n, bias, yr, out); break;
        case 3: tile(3, panel, pairs, xr, n, bias, yr, out); break;
        case 2: tile(2, panel, pairs, xr, n, bias, yr, out); break;
#endif
        default: tile(1, panel, pairs, xr, n, bias, yr, out); break;
        }
    }
}

struct bf16_job {
    int64_t pairs, out, rows;
    const uint16_t *w;
    const uint32_t *xb;
    const float *bias;
    float *y;
};

static void panels(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct bf16_job *j = ctx;
    const int64_t panel_elems = j->pairs * NPO * 2;
    for (int64_t p = begin; p < end; p++) {
        const int64_t o0 = p * NPO, n = j->out - o0 < NPO ? j->out - o0 : NPO;
        const uint16_t *w = j->w + p * panel_elems;
        panel_rows(w, j->pairs, n, j->xb, j->rows, j->bias ? j->bias + o0 : NULL, j->y + o0, j->out,
                   (const char *)(w + panel_elems), p + 1 < end ? panel_elems * 2 : 0);
    }
}

/* f rounded to bf16 as the kernel takes it: to nearest even, NaN quieted, under 2^-126 a signed
 * zero (vdpbf16ps treats such inputs as zero). */
static inline uint16_t round_x(float f) {
    const uint16_t h = sl_f32_to_bf16(f);
    return (h & 0x7f80) ? h : (uint16_t)(h & 0x8000);
}

/* The rows of x rounded into xb, 16 at a time at the AVX-512 levels (the same bits; SIMDe lacks
 * some of these intrinsics, so its builds take the scalar loop). */
static void round_rows(const float *x, int64_t n, uint16_t *xb) {
    int64_t i = 0;
#if defined(SL_AVX512) && !defined(SL_SIMDE_LEVEL)
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), exp = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), exp);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        const __mmask16 tiny = _mm512_testn_epi32_mask(r, _mm512_set1_epi32(0x7f80));
        r = _mm512_mask_and_epi32(r, tiny, r, _mm512_set1_epi32(0x8000));
        _mm256_storeu_si256((__m256i *)(xb + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; i++) xb[i] = round_x(x[i]);
}

/* The calling thread's rounded activations (grown, never shrunk). */
static __thread uint16_t *xb_buf;
static __thread size_t xb_len;

/* y [rows, out] = x [rows, in] @ W^T (+ bias [out]; may be NULL), x and y contiguous, W packed
 * as quantization.Bf16Linear packs it: [ceil(out / 64)][ceil(in / 2)][64][2] bf16, zero-padded,
 * the arithmetic the comment at the top states. Returns 0, or -1 when the rounded rows cannot be
 * allocated (y untouched). */
int servelab_bf16_linear_f32(const uint16_t *w, int64_t in, int64_t out, const float *x, int64_t rows,
                             const float *bias, float *y, int64_t threads)
{
    if (rows <= 0 || out <= 0) return 0;
    const int64_t pairs = (in + 1) / 2;
    const size_t need = (size_t)rows * (size_t)pairs * 2;
    if (need > xb_len) {
        uint16_t *grown = realloc(xb_buf, need * sizeof(uint16_t));
        if (grown == NULL) return -1;
        xb_buf = grown;
        xb_len = need;
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = xb_buf + r * pairs * 2;
        round_rows(x + r * in, in, dst);
        if (in & 1) dst[in] = 0;
    }
    struct bf16_job job = {pairs, out, rows, w, (const uint32_t *)xb_buf, bias, y};
    sl_parallel_for(panels, &job, (out + NPO - 1) / NPO, threads < 1 ? 1 : threads);
    return 0;
}
