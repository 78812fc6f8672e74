/* Linears over 16-bit weights: y [rows, out] = x [rows, in] (fp32) @ W [out, in]^T + bias, with W
 * stored as bf16 or fp16 (half.h's KV_BF16 / KV_F16 codes) and every product and sum in fp32.
 *
 * Why: a bf16 or fp16 checkpoint widened to fp32 holds exactly the same values in twice the
 * bytes, and a decode step with few rows is bound by the bytes of weight it streams. Widening in
 * registers (bf16: a 16-bit shift; fp16: F16C's vcvtph2ps) keeps the numbers and halves the bytes
 * (runtime/linear.py's HalfLinear; timings: docs/benchmarks.md, "bf16 storage").
 *
 * One tile does the arithmetic: MR rows x NO outputs, each a vector of partial sums along the
 * inputs (summed across lanes at the end), reading the weight either straight from its 16-bit
 * rows (the GEMV path: each weight row is streamed once, every row of x taken while it is in L1;
 * at one row, tiles of NO_MAX outputs, and a software prefetch that runs linearly ahead)
 * or from an fp32 panel of NP outputs widened once per call (the GEMM path: the widening is
 * shared by all rows of a prefill chunk). Output groups are split over our thread pool.
 *
 * The vector width follows isa.h: 16 lanes with SL_AVX512, 8 with SL_AVX2, else 8 lanes of plain
 * C (portable, for any CPU).
 */
#include <stdint.h>
#include <stdlib.h>

#include "fp.h"
#include "half.h"
#include "isa.h"
#include "parallel.h"

#define MR 4  /* rows a tile */
#define NO 3  /* outputs a tile: 12 accumulators + 3 weight vectors + 1 of x = 16 AVX2 registers */
#define NO_MAX 4 /* outputs a one-row GEMV tile: 4 independent FMA chains, 4 weight streams */
#define ONE_MAX 1 /* GEMV rows up to this take the one-row tiles */
#define NP 24 /* outputs a widened panel (GEMM path) */
#define PF_BYTES 8192 /* GEMV: software prefetch distance (docs/benchmarks.md, "bf16 storage") */
enum { W_F32 = 0 }; /* a tile reading the widened fp32 panel; else KV_F16 / KV_BF16 */

/* The two paths differ only in where a tile reads the weight: a row's sums run in the same lanes
 * and order either way, so its result does not depend on the path or on the other rows
 * (batch-invariant; deterministic mode relies on it). */

#if defined(SL_AVX2)
/* 8 lanes widened from 16 bits */
static inline __m256 widen8(const uint16_t *p, const int fmt) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (fmt == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(SL_AVX512)
/* 16 lanes: a widening is one 32-byte load and one unpack (+ shift) or vcvtph2ps; the lane sum
 * goes through the 256-bit halves (isa.h's SL_SIMDE_LEVEL builds check this path on hosts
 * without AVX-512). */
#define VW 16
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}
static inline vf v_widen(const uint16_t *p, const int fmt) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (fmt == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#elif defined(SL_AVX2)
#define VW 8
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) { return sum8(a); }
static inline vf v_widen(const uint16_t *p, const int fmt) { return widen8(p, fmt); }
#else
#define VW 8
typedef struct { float v[VW]; } vf;
static inline vf v_zero(void) { vf a = {{0}}; return a; }
static inline vf v_load(const float *p) { vf a; for (int i = 0; i < VW; i++) a.v[i] = p[i]; return a; }
static inline void v_store(float *p, vf a) { for (int i = 0; i < VW; i++) p[i] = a.v[i]; }
static inline vf v_fma(vf a, vf b, vf c) { for (int i = 0; i < VW; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline float v_sum(vf a) { float s = 0.f; for (int i = 0; i < VW; i++) s += a.v[i]; return s; }
static inline vf v_widen(const uint16_t *p, const int fmt) {
    vf a;
    for (int i = 0; i < VW; i++) a.v[i] = fmt == KV_BF16 ? sl_bf16_to_f32(p[i]) : sl_f16_to_f32(p[i]);
    return a;
}
#endif

static inline float widen1(uint16_t h, const int fmt) { return fmt == KV_BF16 ? sl_bf16_to_f32(h) : sl_f16_to_f32(h); }

/* The weight's vector at input k of the output row `w`: 16-bit rows widened here, or the panel. */
static inline __attribute__((always_inline)) vf w_vec(const void *w, int64_t k, const int wkind) {
    return wkind == W_F32 ? v_load((const float *)w + k) : v_widen((const uint16_t *)w + k, wkind);
}

static inline __attribute__((always_inline)) float w_one(const void *w, int64_t k, const int wkind) {
    return wkind == W_F32 ? ((const float *)w)[k] : widen1(((const uint16_t *)w)[k], wkind);
}

/* y[r][o] = sum_k x[r][k] * w[o][k] (+ bias[o]) for the first mr rows and no outputs (constants
 * once inlined). Weight rows are w_stride elements apart, x rows in apart, y rows y_stride.
 * A pair's lane j sums k = j, j + VW, j + 2 VW, ... in that order, whatever mr and no. */
static inline __attribute__((always_inline)) void tile(const int mr, const int no, const int wkind, const void *w,
                                                       int64_t w_stride, const float *x, int64_t in,
                                                       const float *bias, float *y, int64_t y_stride) {
    const int64_t esize = wkind == W_F32 ? 4 : 2;
    const char *wr[NO_MAX];
    for (int o = 0; o < no; o++) wr[o] = (const char *)w + o * w_stride * esize;
    vf acc[MR][NO_MAX];
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < no; o++) acc[r][o] = v_zero();
    int64_t k = 0;
    for (; k + 2 * VW <= in; k += 2 * VW) {
#if defined(SL_AVX2)
        /* the tile's rows are one contiguous block read a line of each row at a time: prefetch as
         * many lines, in address order, PF_BYTES past the block's start (a linear stream) */
        if (wkind != W_F32 && (k & 31) == 0)
            for (int o = 0; o < no; o++) _mm_prefetch(wr[0] + PF_BYTES + (k / 32 * no + o) * 64, _MM_HINT_T0);
#endif
        vf lo[NO_MAX], hi[NO_MAX];
        for (int o = 0; o < no; o++) lo[o] = w_vec(wr[o], k, wkind), hi[o] = w_vec(wr[o], k + VW, wkind);
        for (int r = 0; r < mr; r++) {
            const vf xl = v_load(x + r * in + k), xh = v_load(x + r * in + k + VW);
            for (int o = 0; o < no; o++) acc[r][o] = v_fma(xh, hi[o], v_fma(xl, lo[o], acc[r][o]));
        }
    }
    if (k + VW <= in) {
        for (int o = 0; o < no; o++) {
            const vf wv = w_vec(wr[o], k, wkind);
            for (int r = 0; r < mr; r++) acc[r][o] = v_fma(v_load(x + r * in + k), wv, acc[r][o]);
        }
        k += VW;
    }
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < no; o++) {
            float s = v_sum(acc[r][o]);
            for (int64_t t = k; t < in; t++) { /* the product rounded on its own: both paths, the same bits */
                float p = x[r * in + t] * w_one(wr[o], t, wkind);
                SL_ROUNDED(p);
                s += p;
            }
            y[r * y_stride + o] = bias ? s + bias[o] : s;
        }
}

/* Every row of x against `no` outputs starting at w: one row at a time when no > NO (the GEMV's
 * wide one-row tiles), else MR at a time. */
static inline __attribute__((always_inline)) void rows_against(const int no, const int wkind, const void *w,
                                                               int64_t w_stride, const float *x, int64_t rows,
                                                               int64_t in, const float *bias, float *y, int64_t out) {
    int64_t m = 0;
    if (no > NO) {
        for (; m < rows; m++) tile(1, no, wkind, w, w_stride, x + m * in, in, bias, y + m * out, out);
        return;
    }
    for (; m + MR <= rows; m += MR) tile(MR, no, wkind, w, w_stride, x + m * in, in, bias, y + m * out, out);
    switch (rows - m) {
    case 1: tile(1, no, wkind, w, w_stride, x + m * in, in, bias, y + m * out, out); break;
    case 2: tile(2, no, wkind, w, w_stride, x + m * in, in, bias, y + m * out, out); break;
    case 3: tile(3, no, wkind, w, w_stride, x + m * in, in, bias, y + m * out, out); break;
    default: break;
    }
}

/* Outputs [n0, n0 + n) in groups of `group` (NO or NO_MAX), the weight rows read as `wkind`
 * from w (row n0 first); the last group may be short. */
static inline __attribute__((always_inline)) void outputs(const int group, const int wkind, const void *w,
                                                          int64_t w_stride, int64_t n, const float *x, int64_t rows,
                                                          int64_t in, const float *bias, float *y, int64_t out) {
    const int64_t esize = wkind == W_F32 ? 4 : 2;
    for (int64_t o = 0; o < n; o += group) {
        const void *wo = (const char *)w + o * w_stride * esize;
        const float *bo = bias ? bias + o : NULL;
        if (n - o >= group) {
            rows_against(group, wkind, wo, w_stride, x, rows, in, bo, y + o, out);
            continue;
        }
        switch (n - o) { /* constants, so every tile is unrolled (a short group: under NO_MAX = 4) */
        case 1: rows_against(1, wkind, wo, w_stride, x, rows, in, bo, y + o, out); break;
        case 2: rows_against(2, wkind, wo, w_stride, x, rows, in, bo, y + o, out); break;
        case 3: rows_against(3, wkind, wo, w_stride, x, rows, in, bo, y + o, out); break;
        default: break;
        }
    }
}

/* Outputs a GEMV group: wide one-row tiles for few rows */
static inline int64_t gemv_group(int64_t rows) { return rows <= ONE_MAX ? NO_MAX : NO; }

struct half_job {
    int64_t fmt, in, out, rows;
    const uint16_t *w;
    const float *x, *bias;
    float *y, *scratch; /* GEMM: a panel [NP][in] a part */
};

/* GEMV: parts are ranges of output groups; each group's 16-bit rows are widened in registers. */
static void gemv_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct half_job *j = ctx;
    const int64_t g = gemv_group(j->rows);
    const int64_t n0 = begin * g, n1 = end * g < j->out ? end * g : j->out;
    const uint16_t *w = j->w + n0 * j->in;
    const float *bias = j->bias ? j->bias + n0 : NULL;
#define GEMV_CALL(G, F) outputs(G, F, w, j->in, n1 - n0, j->x, j->rows, j->in, bias, j->y + n0, j->out)
    if (j->fmt == KV_BF16) {
        if (g == NO_MAX) GEMV_CALL(NO_MAX, KV_BF16); else GEMV_CALL(NO, KV_BF16);
    } else {
        if (g == NO_MAX) GEMV_CALL(NO_MAX, KV_F16); else GEMV_CALL(NO, KV_F16);
    }
#undef GEMV_CALL
}

/* Panel p's weight rows widened into `panel` [n][in] fp32. */
static void widen_panel(int fmt, const uint16_t *w, int64_t n, int64_t in, float *panel) {
    for (int64_t o = 0; o < n; o++) {
        const uint16_t *src = w + o * in;
        float *dst = panel + o * in;
        int64_t k = 0;
        if (fmt == KV_BF16) {
            for (; k + VW <= in; k += VW) v_store(dst + k, v_widen(src + k, KV_BF16));
        } else {
            for (; k + VW <= in; k += VW) v_store(dst + k, v_widen(src + k, KV_F16));
        }
        for (; k < in; k++) dst[k] = widen1(src[k], (int)fmt);
    }
}

/* GEMM: parts are ranges of panels; a panel is widened once and every row runs against it. */
static void gemm_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    const struct half_job *j = ctx;
    float *panel = j->scratch + part * NP * j->in;
    for (int64_t p = begin; p < end; p++) {
        const int64_t n0 = p * NP, n = j->out - n0 < NP ? j->out - n0 : NP;
        widen_panel((int)j->fmt, j->w + n0 * j->in, n, j->in, panel);
        outputs(NO, W_F32, panel, j->in, n, j->x, j->rows, j->in, j->bias ? j->bias + n0 : NULL, j->y + n0, j->out);
    }
}

/* The calling thread's panels (grown, never shrunk). */
static __thread float *scratch;
static __thread size_t scratch_floats;

/* y [rows, out] = x [rows, in] @ W^T (+ bias; may be NULL), all contiguous; W [out, in] in `fmt`
 * (KV_F16 or KV_BF16). `gemm`: widen panels once and share them over the rows (for many rows),
 * else widen in registers. Returns 0, or -1 when the panels cannot be allocated (y untouched). */
int servelab_half_linear_f32(int64_t fmt, const uint16_t *w, int64_t in, int64_t out, const float *x, int64_t rows,
                             const float *bias, float *y, int64_t gemm, int64_t threads)
{
    if (rows <= 0 || out <= 0) return 0;
    if (threads < 1) threads = 1;
    struct half_job job = {fmt, in, out, rows, w, x, bias, y, NULL};
    if (!gemm) {
        sl_parallel_for(gemv_part, &job, (out + gemv_group(rows) - 1) / gemv_group(rows), threads);
        return 0;
    }
    const size_t need = (size_t)threads * NP * (size_t)in;
    if (need > scratch_floats) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (grown == NULL) return -1;
        scratch = grown;
        scratch_floats = need;
    }
    job.scratch = scratch;
    sl_parallel_for(gemm_part, &job, (out + NP - 1) / NP, threads);
    return 0;
}
