/* Decode attention over the paged KV cache, fp32, one query token per sequence.
 *
 * Why a kernel of our own: in pure PyTorch a decode step must first gather each sequence's keys
 * and values out of the block pool into a padded [B, kv_heads, ctx, head_dim] copy (written,
 * then read again) and then run SDPA, whose CPU kernel is built for many query rows and is
 * inefficient at one. This loop reads each key and value row once, straight from its block,
 * for all the query heads that share it (grouped-query attention), and writes nothing but the
 * output. Plain C, built on first use by servelab/engine/native.py; the arithmetic is fp32
 * throughout (max-subtracted softmax, like SDPA), only the summation order differs.
 *
 * Layouts (all contiguous unless a stride is given):
 *   q        [B, num_kv_heads * group, head_dim], row stride q_stride floats between sequences
 *   k, v     [num_kv_heads, num_slots, head_dim]: one layer of the pool; slot = block * block_size + offset
 *   blocks   [B, max_blocks] int64 block table, row stride table_stride; ctx_lens [B] int64 (>= 1)
 *   out      [B, num_kv_heads * group * head_dim]
 *   scratch  group * max(ctx_lens) floats per thread (scratch_per_part apart)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "vec_exp.h"

/* Eight independent partial sums so the compiler vectorizes the dot product without being
 * allowed to reassociate floating point (no -ffast-math). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#ifdef __AVX2__
/* The eight horizontal sums of a0..a7 as one vector: [sum(a0), ..., sum(a7)]. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* q . k_i for eight consecutive key rows (row stride D, D a multiple of 8): one query load
 * feeds eight FMAs, and the eight reductions share one hadd tree. */
static inline __m256 dot8(const float *q, const float *k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + D + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * D + d), a7);
    }
    return hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

#endif

/* s[0..n) = exp(s - max(s)); returns the sum. */
static float softmax_numerators(float *s, int64_t n) {
    float m = s[0];
    for (int64_t c = 1; c < n; c++) m = s[c] > m ? s[c] : m;
    float sum = 0.0f;
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), vm));
        _mm256_storeu_ps(s + c, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vsum);
    sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; c < n; c++) {
        s[c] = expf(s[c] - m);
        sum += s[c];
    }
    return sum;
}

struct attention_job {
    const float *q, *k, *v;
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

/* (sequence, KV head) pairs [begin, end) in order, pair = b * num_kv_heads + h. */
static void attention_part(const void *ctx_, int64_t part, int64_t begin, int64_t end)
{
    const struct attention_job *j = ctx_;
    const float *q = j->q, *k = j->k, *v = j->v;
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
        const float *kh = k + h * num_slots * D;
        const float *vh = v + h * num_slots * D;
        const float *qh = q + b * q_stride + h * G * D;
        float *oh = out + (b * num_kv_heads + h) * G * D;
#ifdef __AVX2__
        /* The blocks are scattered through the pool and each (sequence, head) is a short
         * walk, so the hardware prefetcher never gets going: ask for the next pair's keys
         * and values (into L2) while this one computes. */
        {
            const int64_t nb = h + 1 < num_kv_heads ? b : b + 1, nh = h + 1 < num_kv_heads ? h + 1 : 0;
            if (nb < j->batch && nb * num_kv_heads + nh < end) {
                const int64_t *nt = blocks + nb * table_stride;
                const float *nk = k + nh * num_slots * D, *nv = v + nh * num_slots * D;
                for (int64_t c0 = 0; c0 < ctx_lens[nb]; c0 += block_size) {
                    const int64_t rows = ctx_lens[nb] - c0 < block_size ? ctx_lens[nb] - c0 : block_size;
                    const char *kb = (const char *)(nk + nt[c0 / block_size] * block_size * D);
                    const char *vb = (const char *)(nv + nt[c0 / block_size] * block_size * D);
                    for (int64_t off = 0; off < rows * D * 4; off += 64) {
                        _mm_prefetch(kb + off, _MM_HINT_T1);
                        _mm_prefetch(vb + off, _MM_HINT_T1);
                    }
                }
            }
        }
#endif
        /* scores[g * ctx + c] = q_g . k_c * scale, walking the sequence's blocks in order */
        for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
            const float *kb = kh + table[c0 / block_size] * block_size * D;
            const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
            for (int64_t g = 0; g < G; g++) {
                float *s = scratch + g * ctx + c0;
                int64_t i = 0;
#ifdef __AVX2__
                if (D % 8 == 0)
                    for (; i + 8 <= n; i += 8)
                        _mm256_storeu_ps(s + i, _mm256_mul_ps(dot8(qh + g * D, kb + i * D, D), _mm256_set1_ps(scale)));
#endif
                for (; i < n; i++) s[i] = dot(qh + g * D, kb + i * D, D) * scale;
            }
        }
        float inv_sum[G > 0 ? G : 1];
        for (int64_t g = 0; g < G; g++) inv_sum[g] = 1.0f / softmax_numerators(scratch + g * ctx, ctx);
        /* out_g = sum_c p[g, c] * v_c / sum_c p[g, c] */
        memset(oh, 0, (size_t)(G * D) * sizeof(float));
        for (int64_t c0 = 0; c0 < ctx; c0 += block_size) {
            const float *vb = vh + table[c0 / block_size] * block_size * D;
            const int64_t n = ctx - c0 < block_size ? ctx - c0 : block_size;
            for (int64_t g = 0; g < G; g++) {
                const float *p = scratch + g * ctx + c0;
                float *o = oh + g * D;
                int64_t d = 0;
#ifdef __AVX2__
                /* 32 output dims stay in four registers while the block's rows stream by */
                for (; d + 32 <= D; d += 32) {
                    __m256 o0 = _mm256_loadu_ps(o + d), o1 = _mm256_loadu_ps(o + d + 8);
                    __m256 o2 = _mm256_loadu_ps(o + d + 16), o3 = _mm256_loadu_ps(o + d + 24);
                    for (int64_t i = 0; i < n; i++) {
                        const __m256 pi = _mm256_set1_ps(p[i]);
                        const float *vr = vb + i * D + d;
                        o0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr), o0);
                        o1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr + 8), o1);
                        o2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr + 16), o2);
                        o3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr + 24), o3);
                    }
                    _mm256_storeu_ps(o + d, o0);
                    _mm256_storeu_ps(o + d + 8, o1);
                    _mm256_storeu_ps(o + d + 16, o2);
                    _mm256_storeu_ps(o + d + 24, o3);
                }
#endif
                for (; d < D; d++)
                    for (int64_t i = 0; i < n; i++) o[d] += p[i] * vb[i * D + d];
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) oh[g * D + d] *= inv_sum[g];
    }
}

/* Decode attention for `batch` sequences, the (sequence, KV head) pairs split over up to
 * `threads` threads (parallel.c); scratch holds threads * group * max(ctx_lens) floats. */
void servelab_decode_attention_f32(
    const float *q, int64_t q_stride,
    const float *k, const float *v, int64_t num_slots,
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
    sl_parallel_for(attention_part, &job, batch * num_kv_heads, threads < max_parts ? threads : max_parts);
}
