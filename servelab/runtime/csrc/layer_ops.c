/* The per-layer elementwise work of a decoder layer, fp32, one pass over memory each.
 *
 * Why: in PyTorch, F.rms_norm on fp32 runs as ~7 ops (pow, mean, add, rsqrt, mul, ...) and
 * silu(gate) * up as two, each a dispatch plus a pass over memory (what they cost:
 * docs/benchmarks.md). These loops do the same arithmetic in fp32 in one pass. The sampler's
 * greedy argmax over the vocabulary lives here too (servelab_argmax_rows_f32).
 *
 * At SL_AVX512: SwiGLU on exp16, the fp16 K/V store and both argmax passes run sixteen lanes in
 * intrinsics, the same values as AVX2's; the plain-C loops (the residual add and RMSNorm's scaling,
 * RoPE, the bf16 store) the compiler vectorizes itself at that level, and RMSNorm's sum of squares
 * is eight FMA lanes in intrinsics so that every level with AVX2 gives the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "parallel.h"
#include "vec_exp.h"
#include "isa.h"

/* If delta is non-NULL, x += delta first (the residual add, in place); then
 * out = x * rsqrt(mean(x^2) + eps) * weight, row by row. */
void servelab_add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                               int64_t rows, int64_t n, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        float *o = out + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        int64_t i = 0;
#ifdef SL_AVX2
        /* Eight FMA lanes in intrinsics: left to the vectorizer, the AVX-512 build squares in zmm
         * and adds apart (other bits than AVX2's). */
        __m256 acc8 = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc8 = _mm256_fmadd_ps(v, v, acc8);
        }
        const __m128 half4 = _mm_add_ps(_mm256_castps256_ps128(acc8), _mm256_extractf128_ps(acc8, 1));
        float h[4];
        _mm_storeu_ps(h, half4);
        float ss = (h[0] + h[1]) + (h[2] + h[3]);
#else
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  /* vectorizes without reassociation flags */
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += xr[i + j] * xr[i + j];
        float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
#endif
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t k = 0; k < n; k++) o[k] = weight[k] * (xr[k] * inv);
    }
}

/* out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]: the SwiGLU of a fused gate/up output. */
void servelab_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter;
        const float *u = g + inter;
        float *o = out + r * inter;
        int64_t j = 0;
#if defined(SL_AVX512)
        for (; j + 16 <= inter; j += 16) { /* AVX2's operations on sixteen lanes: the same bits */
            const __m512 x = _mm512_loadu_ps(g + j);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), _mm512_loadu_ps(u + j)));
        }
#endif
#ifdef SL_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; j + 8 <= inter; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* One head's row of n fp32 values into a cache row in kv_format (half.h's KV_F32 / F16 / BF16),
 * rounded to nearest even as torch's .half() / .bfloat16() round. */
static void store_row(void *dst, const float *src, int64_t n, int64_t kv_format) {
    if (kv_format == KV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    int64_t i = 0;
    if (kv_format == KV_F16) {
#if defined(SL_AVX512)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
#ifdef SL_AVX2
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) d[i] = sl_f32_to_f16(src[i]);
    } else {
        for (; i < n; i++) d[i] = sl_f32_to_bf16(src[i]);
    }
}

/* RoPE (HF rotate-half convention) in place on the Q and K heads of a fused QKV output, then
 * the token's K and V rows stored into its slot of the layer's pool: what were seven PyTorch
 * ops a layer (cat, neg, two muls, add, two index_copy_), in one pass.
 *   qkv       [T, row_stride]: q heads, then k heads, then v heads, head_dim each
 *   cos, sin  [max_pos, head_dim] tables; positions, slots [T] int64
 *   k, v      [num_kv_heads, num_slots, head_dim] in kv_format (store_row) */
void servelab_rope_store_kv(float *qkv, int64_t T, int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, const float *cos, const float *sin, const int64_t *positions,
                            const int64_t *slots, void *k, void *v, int64_t num_slots, int64_t kv_format)
{
    const int64_t D = head_dim, half = head_dim / 2, row_bytes = D * sl_kv_size(kv_format);
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos + positions[t] * D;
        const float *s = sin + positions[t] * D;
        for (int64_t hh = 0; hh < num_heads + num_kv_heads; hh++) {
            float *x = row + hh * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        const float *kr = row + num_heads * D;
        const float *vr = kr + num_kv_heads * D;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = (h * num_slots + slots[t]) * row_bytes;
            store_row((char *)k + at, kr + h * D, D, kv_format);
            store_row((char *)v + at, vr + h * D, D, kv_format);
        }
    }
}

struct argmax_job {
    const float *x;
    int64_t n;
    int64_t *out;
};

/* Rows [begin, end): the first index of each row's largest value. Two passes, the row staying in
 * L2 between them: the maximum (vectorized), then the first position that equals it. */
static void argmax_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct argmax_job *j = ctx;
    const int64_t n = j->n;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * n;
        float m = x[0];
        int64_t i = 0;
#if defined(SL_AVX512)
        if (n >= 64) {
            __m512 m0 = _mm512_loadu_ps(x), m1 = _mm512_loadu_ps(x + 16);
            __m512 m2 = _mm512_loadu_ps(x + 32), m3 = _mm512_loadu_ps(x + 48);
            for (i = 64; i + 64 <= n; i += 64) {
                m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + i));
                m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + i + 16));
                m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + i + 32));
                m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + i + 48));
            }
            m0 = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
            for (; i + 16 <= n; i += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + i));
            float lanes[16];
            _mm512_storeu_ps(lanes, m0);
            for (int k = 0; k < 16; k++) m = lanes[k] > m ? lanes[k] : m;
        }
#elif defined(SL_AVX2)
        if (n >= 32) {
            __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
            __m256 m2 = _mm256_loadu_ps(x + 16), m3 = _mm256_loadu_ps(x + 24);
            for (i = 32; i + 32 <= n; i += 32) {
                m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
                m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
                m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
                m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
            for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
        }
#endif
        for (; i < n; i++) m = x[i] > m ? x[i] : m;
        int64_t at = 0;
#if defined(SL_AVX512)
        const __m512 vm16 = _mm512_set1_ps(m);
        for (; at + 16 <= n; at += 16) { /* once found, the 8-lane loop below finds it again at once */
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), vm16, _CMP_EQ_OQ);
            if (hit) {
                at += __builtin_ctz((unsigned)hit);
                break;
            }
        }
#endif
#ifdef SL_AVX2
        const __m256 vm = _mm256_set1_ps(m);
        for (; at + 8 <= n; at += 8) {
            const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), vm, _CMP_EQ_OQ));
            if (mask) {
                at += __builtin_ctz((unsigned)mask);
                break;
            }
        }
#endif
        while (at < n && x[at] != m) at++;
        j->out[r] = at < n ? at : 0; /* (only a NaN row finds nothing; never an id past the row) */
    }
}

/* out[r] = the first index of the largest value of row r of a contiguous fp32 [rows, n], as
 * torch.argmax gives it, rows split over up to `threads` threads. The rows must hold no NaN (the
 * sampler sets non-finite rows aside first). Faster than torch's CPU argmax, which runs every
 * greedy step. */
void servelab_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t threads)
{
    struct argmax_job job = {x, n, out};
    const int64_t max_parts = rows * n / 32768; /* a part of at least ~32k values, so a wake-up pays */
    sl_parallel_for(argmax_part, &job, rows, threads < max_parts ? threads : max_parts);
}

/* bad[r] = 1 if row r of a contiguous fp32 [rows, n] holds a NaN or an infinity (exponent all
 * ones), else 0; returns how many rows are bad. The sampler's check of every step's logits, in one
 * pass on the calling thread (torch's reduction over a vocabulary-wide row wakes its thread pool
 * for ~50 us). Integer ops only, so the compiler vectorizes it at every level and it is exact. */
int64_t servelab_nonfinite_rows_f32(const float *x, int64_t rows, int64_t n, uint8_t *bad)
{
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *bits = (const uint32_t *)(x + r * n);
        uint32_t any = 0;
        for (int64_t i = 0; i < n; i++) any |= (bits[i] & 0x7f800000u) == 0x7f800000u;
        bad[r] = (uint8_t)(any != 0);
        count += any != 0;
    }
    return count;
}
