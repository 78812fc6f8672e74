/* Decode attention over the paged KV cache, one query token per sequence: fp32 arithmetic over
 * keys and values stored as fp32, fp16 or bf16.
 *
 * Why a kernel of our own: in pure PyTorch a decode step must first gather each sequence's keys
 * and values out of the block pool into a padded [B, kv_heads, ctx, head_dim] copy (written,
 * then read again) and then run SDPA, whose CPU kernel is built for many query rows and is
 * inefficient at one. This loop reads each key and value row once, straight from its block,
 * for all the query heads that share it (grouped-query attention), and writes nothing but the
 * output. Plain C, built on first use by servelab/runtime/native.py; the arithmetic is fp32
 * throughout (max-subtracted softmax, like SDPA), only the summation order differs. A 16-bit
 * cache is widened to fp32 as it is loaded: the values are exactly those torch's
 * `.float()` gives. At SL_AVX512 the score and P V tiles run sixteen lanes (another summation
 * order, within the tests' tolerance); the softmax passes (vec_exp.h) run sixteen lanes with
 * AVX2's bits.
 *
 * Layouts (all contiguous unless a stride is given):
 *   q        [B, num_kv_heads * group, head_dim] fp32, row stride q_stride floats between sequences
 *   k, v     [num_kv_heads, num_slots, head_dim] in kv_format: one layer of the pool;
 *            slot = block * block_size + offset
 *   blocks   [B, max_blocks] int64 block table, row stride table_stride; ctx_lens [B] int64 (>= 1)
 *   out      [B, num_kv_heads * group * head_dim] fp32
 *   scratch  group * max(ctx_lens) floats per thread (scratch_per_part apart)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "parallel.h"
#include "vec_exp.h"
#include "isa.h"

#define SL_INLINE static inline __attribute__((always_inline))

/* Element i of a cache tensor in fmt, as fp32. */
SL_INLINE float load1(const void *base, int64_t i, int fmt) {
    if (fmt == KV_F32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    return fmt == KV_F16 ? sl_f16_to_f32(h) : sl_bf16_to_f32(h);
}

/* q . k_i (k row i of a cache tensor, starting at element `at`) with eight independent partial
 * sums, so that the compiler vectorizes without reassociating (no -ffast-math). */
SL_INLINE float dot(const float *q, const void *k, int64_t at, int64_t n, int fmt) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += q[i + j] * load1(k, at + i + j, fmt);
    float s = 0.0f;
    for (; i < n; i++) s += q[i] * load1(k, at + i, fmt);
    return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#ifdef SL_AVX2
/* Elements [i, i + 8) of a cache tensor in fmt, widened to fp32 (F16C comes with AVX2 in our build). */
SL_INLINE __m256 load8(const void *base, int64_t i, int fmt) {
    if (fmt == KV_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (fmt == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Walks the next (sequence, head) pair's key and value rows, pulling a few into L2 at a time
 * from inside this pair's loops. Its blocks are scattered through the pool and each pair is a
 * short walk, so the hardware prefetcher never gets going; asked for all at once, the
 * prefetches stalled the core (docs/benchmarks.md). */
struct row_prefetch {
    const char *k, *v;
    const int64_t *table;
    int64_t block_size, row_bytes, ctx, t;
};

SL_INLINE void prefetch_rows(struct row_prefetch *pf, int64_t n) {
    for (; n > 0 && pf->t < pf->ctx; n--, pf->t++) {
        const int64_t slot = pf->table[pf->t / pf->block_size] * pf->block_size + pf->t % pf->block_size;
        const char *kr = pf->k + slot * pf->row_bytes, *vr = pf->v + slot * pf->row_bytes;
        for (int64_t off = 0; off < pf->row_bytes; off += 64) {
            _mm_prefetch(kr + off, _MM_HINT_T1);
            _mm_prefetch(vr + off, _MM_HINT_T1);
        }
    }
}

/* [sum(a), sum(b), sum(c), sum(d)] */
SL_INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Scores of four consecutive key rows (from element `at`, row stride D, D a multiple of 8) for
 * up to three query heads q0..q2 at once: each key load feeds three FMAs. s_g[0..4) = scale *
 * q_g . k_i; absent heads alias q0 and are computed, not stored. */
SL_INLINE void qk_tile(const float *q0, const float *q1, const float *q2, int64_t ng, const void *k, int64_t at,
                       int64_t D, float scale, float *s0, float *s1, float *s2, int fmt) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 k0 = load8(k, at + d, fmt), k1 = load8(k, at + D + d, fmt);
        const __m256 k2 = load8(k, at + 2 * D + d, fmt), k3 = load8(k, at + 3 * D + d, fmt);
        __m256 x = _mm256_loadu_ps(q0 + d);
        a00 = _mm256_fmadd_ps(x, k0, a00); a01 = _mm256_fmadd_ps(x, k1, a01);
        a02 = _mm256_fmadd_ps(x, k2, a02); a03 = _mm256_fmadd_ps(x, k3, a03);
        x = _mm256_loadu_ps(q1 + d);
        a10 = _mm256_fmadd_ps(x, k0, a10); a11 = _mm256_fmadd_ps(x, k1, a11);
        a12 = _mm256_fmadd_ps(x, k2, a12); a13 = _mm256_fmadd_ps(x, k3, a13);
        x = _mm256_loadu_ps(q2 + d);
        a20 = _mm256_fmadd_ps(x, k0, a20); a21 = _mm256_fmadd_ps(x, k1, a21);
        a22 = _mm256_fmadd_ps(x, k2, a22); a23 = _mm256_fmadd_ps(x, k3, a23);
    }
    const __m128 vs = _mm_set1_ps(scale);
    _mm_storeu_ps(s0, _mm_mul_ps(hsum4(a00, a01, a02, a03), vs));
    if (ng > 1) _mm_storeu_ps(s1, _mm_mul_ps(hsum4(a10, a11, a12, a13), vs));
    if (ng > 2) _mm_storeu_ps(s2, _mm_mul_ps(hsum4(a20, a21, a22, a23), vs));
}

/* out_g[0..32) = inv_g * sum_c p_g[c] * v_c[d0..d0 + 32) over the sequence's blocks, for up to
 * three heads at once: each value load feeds three FMAs, and the twelve accumulators are
 * independent chains. Summed over c in order from zero, like the scalar loop. Absent heads
 * alias p0 and are not stored. One row of the next pair is prefetched every other token. */
SL_INLINE void pv_tile(const float *p0, const float *p1, const float *p2, int64_t ng, const void *v, int64_t vh,
                       const int64_t *table, int64_t block_size, int64_t ctx, int64_t D, const float *inv,
                       float *o0, float *o1, float *o2, struct row_prefetch *pf, int fmt) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
        const int64_t vb = vh + table[c0 / block_size] * block_size * D;
        const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            if (i & 1) prefetch_rows(pf, 1);
            const int64_t vr = vb + i * D;
            const __m256 v0 = load8(v, vr, fmt), v1 = load8(v, vr + 8, fmt);
            const __m256 v2 = load8(v, vr + 16, fmt), v3 = load8(v, vr + 24, fmt);
            __m256 p = _mm256_broadcast_ss(p0 + c0 + i);
            a00 = _mm256_fmadd_ps(p, v0, a00); a01 = _mm256_fmadd_ps(p, v1, a01);
            a02 = _mm256_fmadd_ps(p, v2, a02); a03 = _mm256_fmadd_ps(p, v3, a03);
            p = _mm256_broadcast_ss(p1 + c0 + i);
            a10 = _mm256_fmadd_ps(p, v0, a10); a11 = _mm256_fmadd_ps(p, v1, a11);
            a12 = _mm256_fmadd_ps(p, v2, a12); a13 = _mm256_fmadd_ps(p, v3, a13);
            p = _mm256_broadcast_ss(p2 + c0 + i);
            a20 = _mm256_fmadd_ps(p, v0, a20); a21 = _mm256_fmadd_ps(p, v1, a21);
            a22 = _mm256_fmadd_ps(p, v2, a22); a23 = _mm256_fmadd_ps(p, v3, a23);
        }
    }
#define SL_STORE(O, I, A0, A1, A2, A3)                                                                   \
    {                                                                                                    \
        const __m256 s = _mm256_set1_ps(inv[I]);                                                         \
        _mm256_storeu_ps(O, _mm256_mul_ps(A0, s)); _mm256_storeu_ps(O + 8, _mm256_mul_ps(A1, s));         \
        _mm256_storeu_ps(O + 16, _mm256_mul_ps(A2, s)); _mm256_storeu_ps(O + 24, _mm256_mul_ps(A3, s));   \
    }
    SL_STORE(o0, 0, a00, a01, a02, a03)
    if (ng > 1) SL_STORE(o1, 1, a10, a11, a12, a13)
    if (ng > 2) SL_STORE(o2, 2, a20, a21, a22, a23)
#undef SL_STORE
}

#if defined(SL_AVX512)
/* load8 sixteen at a time. */
SL_INLINE __m512 load16(const void *base, int64_t i, int fmt) {
    if (fmt == KV_F32) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (fmt == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SL_INLINE __m256 fold(__m512 a) { return _mm256_add_ps(sl_lo256(a), sl_hi256(a)); }

/* qk_tile with sixteen lanes (D a multiple of 16). */
SL_INLINE void qk_tile16(const float *q0, const float *q1, const float *q2, int64_t ng, const void *k, int64_t at,
                         int64_t D, float scale, float *s0, float *s1, float *s2, int fmt) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 k0 = load16(k, at + d, fmt), k1 = load16(k, at + D + d, fmt);
        const __m512 k2 = load16(k, at + 2 * D + d, fmt), k3 = load16(k, at + 3 * D + d, fmt);
        __m512 x = _mm512_loadu_ps(q0 + d);
        a00 = _mm512_fmadd_ps(x, k0, a00); a01 = _mm512_fmadd_ps(x, k1, a01);
        a02 = _mm512_fmadd_ps(x, k2, a02); a03 = _mm512_fmadd_ps(x, k3, a03);
        x = _mm512_loadu_ps(q1 + d);
        a10 = _mm512_fmadd_ps(x, k0, a10); a11 = _mm512_fmadd_ps(x, k1, a11);
        a12 = _mm512_fmadd_ps(x, k2, a12); a13 = _mm512_fmadd_ps(x, k3, a13);
        x = _mm512_loadu_ps(q2 + d);
        a20 = _mm512_fmadd_ps(x, k0, a20); a21 = _mm512_fmadd_ps(x, k1, a21);
        a22 = _mm512_fmadd_ps(x, k2, a22); a23 = _mm512_fmadd_ps(x, k3, a23);
    }
    const __m128 vs = _mm_set1_ps(scale);
    _mm_storeu_ps(s0, _mm_mul_ps(hsum4(fold(a00), fold(a01), fold(a02), fold(a03)), vs));
    if (ng > 1) _mm_storeu_ps(s1, _mm_mul_ps(hsum4(fold(a10), fold(a11), fold(a12), fold(a13)), vs));
    if (ng > 2) _mm_storeu_ps(s2, _mm_mul_ps(hsum4(fold(a20), fold(a21), fold(a22), fold(a23)), vs));
}

/* pv_tile's 32 dims as two sixteen-lane vectors a head (six chains; the same order over c). */
SL_INLINE void pv_tile16(const float *p0, const float *p1, const float *p2, int64_t ng, const void *v, int64_t vh,
                         const int64_t *table, int64_t block_size, int64_t ctx, int64_t D, const float *inv,
                         float *o0, float *o1, float *o2, struct row_prefetch *pf, int fmt) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
        const int64_t vb = vh + table[c0 / block_size] * block_size * D;
        const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            if (i & 1) prefetch_rows(pf, 1);
            const int64_t vr = vb + i * D;
            const __m512 v0 = load16(v, vr, fmt), v1 = load16(v, vr + 16, fmt);
            __m512 p = _mm512_set1_ps(p0[c0 + i]);
            a00 = _mm512_fmadd_ps(p, v0, a00); a01 = _mm512_fmadd_ps(p, v1, a01);
            p = _mm512_set1_ps(p1[c0 + i]);
            a10 = _mm512_fmadd_ps(p, v0, a10); a11 = _mm512_fmadd_ps(p, v1, a11);
            p = _mm512_set1_ps(p2[c0 + i]);
            a20 = _mm512_fmadd_ps(p, v0, a20); a21 = _mm512_fmadd_ps(p, v1, a21);
        }
    }
#define SL_STORE(O, I, A0, A1)                                                                           \
    {                                                                                                    \
        const __m512 s = _mm512_set1_ps(inv[I]);                                                         \
        _mm512_storeu_ps(O, _mm512_mul_ps(A0, s)); _mm512_storeu_ps(O + 16, _mm512_mul_ps(A1, s));       \
    }
    SL_STORE(o0, 0, a00, a01)
    if (ng > 1) SL_STORE(o1, 1, a10, a11)
    if (ng > 2) SL_STORE(o2, 2, a20, a21)
#undef SL_STORE
}
#endif
#endif

/* s[0..n) = exp(s - max(s)); returns the sum. */
static float softmax_numerators(float *s, int64_t n) {
    return sl_exp_sub_sum_f32(s, n, sl_max_f32(s, n, s[0]));
}

struct attention_job {
    const float *q;
    const void *k, *v;
    int64_t q_stride, num_slots;
    const int64_t *blocks;
    int64_t table_stride, block_size;
    const int64_t *ctx_lens;
    int64_t batch, num_kv_heads, group, head_dim;
    float scale;
    float *scratch;  /* group * max_ctx floats per part */
    int64_t scratch_per_part;
    float *out;
};

/* (sequence, KV head) pairs [begin, end) in order, pair = b * num_kv_heads + h; one copy per
 * cache format (fmt is a constant in each). Cache offsets are in elements. */
SL_INLINE void attention_pairs(const struct attention_job *j, int64_t part, int64_t begin, int64_t end, int fmt)
{
    const float *q = j->q;
    const void *k = j->k, *v = j->v;
    const int64_t q_stride = j->q_stride, num_slots = j->num_slots, table_stride = j->table_stride;
    const int64_t block_size = j->block_size, num_kv_heads = j->num_kv_heads;
    const int64_t *blocks = j->blocks, *ctx_lens = j->ctx_lens;
    const float scale = j->scale;
    float *scratch = j->scratch + part * j->scratch_per_part, *out = j->out;
    const int64_t D = j->head_dim, G = j->group;
    for (int64_t pair = begin; pair < end; pair++) {
        const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *table = blocks + b * table_stride;
        const int64_t kh = h * num_slots * D, vh = kh; /* this head's slots, in elements */
        const float *qh = q + b * q_stride + h * G * D;
        float *oh = out + (b * num_kv_heads + h) * G * D;
#ifdef SL_AVX2
        struct row_prefetch pf = {(const char *)k, (const char *)v, NULL, block_size, D * sl_kv_size(fmt), 0, 0};
        if (pair + 1 < end) {
            const int64_t nb = (pair + 1) / num_kv_heads, nh = (pair + 1) % num_kv_heads;
            pf.k += nh * num_slots * D * sl_kv_size(fmt);
            pf.v += nh * num_slots * D * sl_kv_size(fmt);
            pf.table = blocks + nb * table_stride;
            pf.ctx = ctx_lens[nb];
        }
#endif
        /* scores[g * ctx + c] = q_g . k_c * scale, walking the sequence's blocks in order */
        for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
            const int64_t kb = kh + table[c0 / block_size] * block_size * D;
            const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
            int64_t i = 0;
#ifdef SL_AVX2
            if (D % 8 == 0)
                for (int64_t g = 0; g < G; g += 3) {
                    const int64_t ng = G - g < 3 ? G - g : 3;
                    const float *q0 = qh + g * D, *q1 = q0 + (ng > 1) * D, *q2 = q0 + (ng > 2) * 2 * D;
                    /* absent heads' rows alias s0 (never stored: not even formed past the scratch) */
                    float *s0 = scratch + g * ctx + c0, *s1 = s0 + (ng > 1) * ctx, *s2 = s0 + (ng > 2) * 2 * ctx;
                    for (i = 0; i + 4 <= n; i += 4) {
                        prefetch_rows(&pf, 1);
#if defined(SL_AVX512)
                        if (D % 16 == 0) {
                            qk_tile16(q0, q1, q2, ng, k, kb + i * D, D, scale, s0 + i, s1 + i, s2 + i, fmt);
                            continue;
                        }
#endif
                        qk_tile(q0, q1, q2, ng, k, kb + i * D, D, scale, s0 + i, s1 + i, s2 + i, fmt);
                    }
                }
#endif
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = i; t < n; t++) scratch[g * ctx + c0 + t] = dot(qh + g * D, k, kb + t * D, D, fmt) * scale;
        }
        float inv_sum[G > 0 ? G : 1];
        for (int64_t g = 0; g < G; g++) inv_sum[g] = 1.0f / softmax_numerators(scratch + g * ctx, ctx);
        /* out_g = sum_c p[g, c] * v_c / sum_c p[g, c] */
        int64_t d0 = 0;
#ifdef SL_AVX2
        for (; d0 + 32 <= D; d0 += 32)
            for (int64_t g = 0; g < G; g += 3) {
                const int64_t ng = G - g < 3 ? G - g : 3;
                const float *p0 = scratch + g * ctx, *p1 = p0 + (ng > 1) * ctx, *p2 = p0 + (ng > 2) * 2 * ctx;
                float *o0 = oh + g * D + d0, *o1 = o0 + (ng > 1) * D, *o2 = o0 + (ng > 2) * 2 * D;
#if defined(SL_AVX512)
                pv_tile16(p0, p1, p2, ng, v, vh + d0, table, block_size, ctx, D, inv_sum + g, o0, o1, o2, &pf, fmt);
#else
                pv_tile(p0, p1, p2, ng, v, vh + d0, table, block_size, ctx, D, inv_sum + g, o0, o1, o2, &pf, fmt);
#endif
            }
#endif
        if (d0 < D) { /* the dims the tiles did not cover (all of them without AVX2) */
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = d0; d < D; d++) oh[g * D + d] = 0.0f;
            for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
                const int64_t vb = vh + table[c0 / block_size] * block_size * D;
                const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = d0; d < D; d++)
                        for (int64_t i = 0; i < n; i++)
                            oh[g * D + d] += scratch[g * ctx + c0 + i] * load1(v, vb + i * D + d, fmt);
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = d0; d < D; d++) oh[g * D + d] *= inv_sum[g];
        }
    }
}

static void attention_f32(const void *j, int64_t part, int64_t begin, int64_t end) {
    attention_pairs(j, part, begin, end, KV_F32);
}
static void attention_f16(const void *j, int64_t part, int64_t begin, int64_t end) {
    attention_pairs(j, part, begin, end, KV_F16);
}
static void attention_bf16(const void *j, int64_t part, int64_t begin, int64_t end) {
    attention_pairs(j, part, begin, end, KV_BF16);
}

/* Decode attention for `batch` sequences, the (sequence, KV head) pairs split over up to
 * `threads` threads (parallel.c); scratch holds threads * group * max(ctx_lens) floats.
 * kv_format: 0 fp32, 1 fp16, 2 bf16 (k and v). */
void servelab_decode_attention(
    const float *q, int64_t q_stride,
    const void *k, const void *v, int64_t num_slots, int64_t kv_format,
    const int64_t *blocks, int64_t table_stride, int64_t block_size,
    const int64_t *ctx_lens, int64_t batch,
    int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale,
    float *scratch, int64_t scratch_per_part, float *out, int64_t threads)
{
    struct attention_job job = {q, k, v, q_stride, num_slots, blocks, table_stride, block_size, ctx_lens, batch,
                                num_kv_heads, group, head_dim, scale, scratch, scratch_per_part, out};
    /* a part of at least ~64k key and value elements (~10 us), so that waking a worker pays */
    int64_t work = 0;
    for (int64_t b = 0; b < batch; b++) work += ctx_lens[b];
    work *= num_kv_heads * head_dim * 2;
    const int64_t max_parts = work / 65536;
    sl_parallel_for(kv_format == KV_F16 ? attention_f16 : kv_format == KV_BF16 ? attention_bf16 : attention_f32, &job,
                    batch * num_kv_heads, threads < max_parts ? threads : max_parts);
}
