/* Causal attention for a prefill chunk, fp32: query rows at positions start .. start + n - 1 over
 * keys 0 .. start + n - 1 (grouped-query: query head h reads KV head h / (H / KV)).
 *
 * Why not SDPA: torch's CPU flash-attention kernel is slow at this size (docs/benchmarks.md).
 * Blocked the same way (flash attention: online softmax, nothing n x n in memory), with
 * register-tiled FMA loops:
 *   - scores: 4 query rows x 16 keys in eight accumulators, over K transposed into panels of 16
 *     keys ([d][16], packed once per call) so each d is two vector loads and eight FMAs;
 *   - output: 2 rows x 32 dims of O += P V in eight accumulators, a V row's four vectors and
 *     two broadcast probabilities per key.
 * Blocks of QB = 32 query rows x KB = 64 keys; a block's last key block is masked by position.
 * One call takes every whole-prompt chunk of a step (servelab_prefill_attention_chunks_f32): K^T
 * is packed per (chunk, KV head) and the work split over the threads by (chunk, query head, row
 * block), so 32 short prompts cost two thread-pool jobs a layer, not 32.
 *
 * At SL_AVX512 the same tiles run sixteen lanes: scores 4 rows x two panels (32 keys), output
 * 2 rows x 64 dims (then one tile of the 16, 32 or 48 left, and AVX2's 8-dim step). Every lane sums over d (scores) or over
 * the keys (output) in AVX2's order and the softmax passes keep its bits (vec_exp.h), so every
 * level with AVX2 gives the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "parallel.h"
#include "vec_exp.h"
#include "isa.h"

#define QB 32 /* query rows a block */
#define KB 64 /* keys a block */
#define KP 16 /* keys a packed K^T panel */

/* One chunk of a call: query rows [row, row + n) of q (and of out) at positions start .. start + n
 * - 1, over keys 0 .. start + n - 1 at rows [kv_row, kv_row + start + n) of k and v. */
struct chunk {
    int64_t row, n, start, kv_row;
};

struct prefill_job {
    const float *q, *k, *v;
    const struct chunk *chunks;
    int64_t num_chunks, q_stride, kv_stride, kv_head_stride, heads, kv_heads, dim;
    const int64_t *kt_at, *unit_at; /* per chunk: its K^T's offset in kt, its first work unit */
    float scale;
    float *out, *kt, *scratch;
    int64_t out_stride, scratch_per_part;
};

/* S[r][0 .. keys) = scale * q_r . k_c for 4 rows (pointers may repeat for a short block) over
 * the packed panels starting at `kt` (keys rounded up to KP; padding keys score garbage-free 0). */
static void scores4(const float *const qr[4], const float *kt, int64_t keys, int64_t dim, float scale, float *S) {
#if defined(SL_AVX512)
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t c = 0;
    for (; c + 2 * KP <= keys; c += 2 * KP, kt += 2 * dim * KP) { /* two panels: eight accumulators */
        const float *kt1 = kt + dim * KP;
        __m512 a[4][2];
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * KP), k1 = _mm512_loadu_ps(kt1 + d * KP);
            for (int r = 0; r < 4; r++) {
                const __m512 b = _mm512_set1_ps(qr[r][d]);
                a[r][0] = _mm512_fmadd_ps(b, k0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(b, k1, a[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm512_storeu_ps(S + r * KB + c, _mm512_mul_ps(a[r][0], vs));
            _mm512_storeu_ps(S + r * KB + c + KP, _mm512_mul_ps(a[r][1], vs));
        }
    }
    if (c < keys) { /* an odd last panel */
        __m512 a[4];
        for (int r = 0; r < 4; r++) a[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * KP);
            for (int r = 0; r < 4; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, a[r]);
        }
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(S + r * KB + c, _mm512_mul_ps(a[r], vs));
    }
#else
    for (int64_t c = 0; c < keys; c += KP, kt += dim * KP) {
#ifdef SL_AVX2
        __m256 a[4][2];
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * KP), k1 = _mm256_loadu_ps(kt + d * KP + 8);
            for (int r = 0; r < 4; r++) {
                const __m256 b = _mm256_broadcast_ss(qr[r] + d);
                a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
            }
        }
        const __m256 vs = _mm256_set1_ps(scale);
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(S + r * KB + c, _mm256_mul_ps(a[r][0], vs));
            _mm256_storeu_ps(S + r * KB + c + 8, _mm256_mul_ps(a[r][1], vs));
        }
#else
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < KP; j++) {
                float s = 0.f;
                for (int64_t d = 0; d < dim; d++) s += qr[r][d] * kt[d * KP + j];
                S[r * KB + c + j] = s * scale;
            }
#endif
    }
#endif
}

#if defined(SL_AVX512)
/* pv2's tile on nv (1..4) sixteen-lane vectors a row, dims [0, 16 nv) of o0, o1 and v's rows. */
static inline __attribute__((always_inline)) void pv2_x16(const int nv, const float *P0, const float *P1,
                                                          const float *v, int64_t v_stride, int64_t keys, float *o0,
                                                          float *o1, float alpha0, float alpha1) {
    __m512 a0[4], a1[4];
    const __m512 f0 = _mm512_set1_ps(alpha0), f1 = _mm512_set1_ps(alpha1);
    for (int j = 0; j < nv; j++) {
        a0[j] = _mm512_mul_ps(_mm512_loadu_ps(o0 + 16 * j), f0);
        a1[j] = _mm512_mul_ps(_mm512_loadu_ps(o1 + 16 * j), f1);
    }
    for (int64_t c = 0; c < keys; c++) {
        const float *vr = v + c * v_stride;
        const __m512 p0 = _mm512_set1_ps(P0[c]), p1 = _mm512_set1_ps(P1[c]);
        for (int j = 0; j < nv; j++) {
            const __m512 vv = _mm512_loadu_ps(vr + 16 * j);
            a0[j] = _mm512_fmadd_ps(p0, vv, a0[j]);
            a1[j] = _mm512_fmadd_ps(p1, vv, a1[j]);
        }
    }
    for (int j = 0; j < nv; j++) _mm512_storeu_ps(o0 + 16 * j, a0[j]), _mm512_storeu_ps(o1 + 16 * j, a1[j]);
}
#endif

/* O[r] = alpha_r * O[r] + sum_c P[r][c] V[c] for two rows (o1 may be a dummy row) over `keys` keys. */
static void pv2(const float *P0, const float *P1, const float *v, int64_t v_stride, int64_t keys, int64_t dim,
                float *o0, float *o1, float alpha0, float alpha1) {
    int64_t d0 = 0;
#if defined(SL_AVX512)
    for (; d0 + 64 <= dim; d0 += 64) pv2_x16(4, P0, P1, v + d0, v_stride, keys, o0 + d0, o1 + d0, alpha0, alpha1);
    switch ((dim - d0) / 16) { /* constants, so each tile is unrolled */
    case 3: pv2_x16(3, P0, P1, v + d0, v_stride, keys, o0 + d0, o1 + d0, alpha0, alpha1); break;
    case 2: pv2_x16(2, P0, P1, v + d0, v_stride, keys, o0 + d0, o1 + d0, alpha0, alpha1); break;
    case 1: pv2_x16(1, P0, P1, v + d0, v_stride, keys, o0 + d0, o1 + d0, alpha0, alpha1); break;
    default: break;
    }
    d0 += (dim - d0) / 16 * 16;
#endif
#ifdef SL_AVX2
    for (; d0 + 32 <= dim; d0 += 32) {
        __m256 a0[4], a1[4];
        const __m256 f0 = _mm256_set1_ps(alpha0), f1 = _mm256_set1_ps(alpha1);
        for (int j = 0; j < 4; j++) {
            a0[j] = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0 + 8 * j), f0);
            a1[j] = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0 + 8 * j), f1);
        }
        for (int64_t c = 0; c < keys; c++) {
            const float *vr = v + c * v_stride + d0;
            const __m256 p0 = _mm256_broadcast_ss(P0 + c), p1 = _mm256_broadcast_ss(P1 + c);
            for (int j = 0; j < 4; j++) {
                const __m256 vv = _mm256_loadu_ps(vr + 8 * j);
                a0[j] = _mm256_fmadd_ps(p0, vv, a0[j]);
                a1[j] = _mm256_fmadd_ps(p1, vv, a1[j]);
            }
        }
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(o0 + d0 + 8 * j, a0[j]), _mm256_storeu_ps(o1 + d0 + 8 * j, a1[j]);
    }
    for (; d0 + 8 <= dim; d0 += 8) {
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(o0 + d0), _mm256_set1_ps(alpha0));
        __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(o1 + d0), _mm256_set1_ps(alpha1));
        for (int64_t c = 0; c < keys; c++) {
            const __m256 vv = _mm256_loadu_ps(v + c * v_stride + d0);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(P0 + c), vv, a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(P1 + c), vv, a1);
        }
        _mm256_storeu_ps(o0 + d0, a0), _mm256_storeu_ps(o1 + d0, a1);
    }
#endif
    for (; d0 < dim; d0++) {
        float s0 = o0[d0] * alpha0, s1 = o1[d0] * alpha1;
        for (int64_t c = 0; c < keys; c++) s0 += P0[c] * v[c * v_stride + d0], s1 += P1[c] * v[c * v_stride + d0];
        o0[d0] = s0, o1[d0] = s1;
    }
}

/* Row r of a score block -> probabilities in place, against the running max m and sum l; returns
 * the factor the row's earlier output must be scaled by (0 on the first block). Keys from
 * `visible` on are masked. */
static float softmax_row(float *S, int64_t keys, int64_t visible, float *m, float *l) {
    const int64_t n = visible > 0 ? visible : 0;
    const float m_new = sl_max_f32(S, n, *m);
    const float alpha = expf(*m - m_new); /* 0 while *m is -inf */
    const float sum = sl_exp_sub_sum_f32(S, n, m_new);
    for (int64_t c = n; c < keys; c++) S[c] = 0.f;
    *m = m_new;
    *l = *l * alpha + sum;
    return alpha;
}

/* Attention of `rows` (<= QB) query rows over keys [0, max position + 1): row r is at qr[r],
 * sits at position pos[r] (sees keys 0 .. pos[r]) and writes out[r]. kt: K^T panels from key 0
 * ([t / KP][d][t % KP]); v: key t's row at v + t * v_stride. scratch: QB * KB + QB * D + 3 * QB + D
 * floats. Both the prefill kernel and the paged one (deterministic decode) run their rows through
 * this one routine: a row's arithmetic depends only on its position and its keys, never on the
 * other rows or how the prompt was chunked, so a token gets the same bits decoded or recomputed. */
static void attend_rows(const float *const *qr_all, const int64_t *pos, int64_t rows, const float *kt, const float *v,
                        int64_t v_stride, int64_t D, float scale, float *const *out, float *scratch) {
    float *S = scratch;                                   /* [QB][KB] scores, then probabilities */
    float *O = S + QB * KB;                               /* [QB][D] */
    float *m = O + QB * D, *l = m + QB, *alpha = l + QB; /* per row: running max and sum, rescale factor */
    float *dummy = alpha + QB;                           /* [D]: the second row of an odd block's last pair */
    memset(dummy, 0, sizeof(float) * (size_t)D);       /* written, never read; 0 * garbage could be NaN */
    memset(O, 0, sizeof(float) * (size_t)(rows * D)); /* only the rows in use are read */
    int64_t key_end = 0;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY, l[r] = 0.f;
        key_end = pos[r] + 1 > key_end ? pos[r] + 1 : key_end;
    }
    for (int64_t k0 = 0; k0 < key_end; k0 += KB) {
        const int64_t keys = key_end - k0 < KB ? key_end - k0 : KB;
        const int64_t keys_pad = (keys + KP - 1) / KP * KP;
        for (int64_t r = 0; r < rows; r += 4) { /* a short block's last rows repeat its last row */
            const float *qr[4];
            for (int i = 0; i < 4; i++) qr[i] = qr_all[r + i < rows ? r + i : rows - 1];
            scores4(qr, kt + k0 * D, keys_pad, D, scale, S + r * KB);
        }
        for (int64_t r = 0; r < rows; r++) {
            int64_t visible = pos[r] + 1 - k0; /* keys <= the row's position */
            visible = visible < keys ? visible : keys;
            alpha[r] = softmax_row(S + r * KB, keys, visible, m + r, l + r);
        }
        for (int64_t r = 0; r < rows; r += 2) {
            const int pair = r + 1 < rows;
            pv2(S + r * KB, S + (pair ? r + 1 : r) * KB, v + k0 * v_stride, v_stride, keys, D, O + r * D,
                pair ? O + (r + 1) * D : dummy, alpha[r], pair ? alpha[r + 1] : 0.f);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) out[r][d] = O[r * D + d] * inv;
    }
}

static inline int64_t ctx_pad_of(const struct chunk *c) { return (c->start + c->n + KP - 1) / KP * KP; }

/* K^T of (chunk, KV head) pairs [begin, end), in panels of KP keys: [t / KP][d][t % KP], zero past the context. */
static void pack_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    (void)part;
    const struct prefill_job *j = ctx;
    const int64_t dim = j->dim;
    for (int64_t p = begin; p < end; p++) {
        const struct chunk *c = &j->chunks[p / j->kv_heads];
        const int64_t g = p % j->kv_heads, ctx_len = c->start + c->n, ctx_pad = ctx_pad_of(c);
        const float *k = j->k + c->kv_row * j->kv_stride + g * j->kv_head_stride;
        float *kt = j->kt + j->kt_at[p / j->kv_heads] + g * ctx_pad * dim;
        for (int64_t t0 = 0; t0 < ctx_pad; t0 += KP) {
            float *panel = kt + t0 * dim;
            for (int64_t t = t0; t < t0 + KP; t++)
                for (int64_t d = 0; d < dim; d++) panel[d * KP + (t - t0)] = t < ctx_len ? k[t * j->kv_stride + d] : 0.f;
        }
    }
}

/* Work units [begin, end): unit u of chunk c is (query head, block of QB rows), numbered from unit_at[c]. */
static void prefill_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    const struct prefill_job *j = ctx;
    const int64_t D = j->dim, group = j->heads / j->kv_heads;
    float *scratch = j->scratch + part * j->scratch_per_part;
    int64_t lo = 0, hi = j->num_chunks - 1; /* the chunk holding unit `begin` */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (j->unit_at[mid] <= begin) lo = mid; else hi = mid - 1;
    }
    for (int64_t u = begin, ci = lo; u < end; u++) {
        while (u >= j->unit_at[ci + 1]) ci++;
        const struct chunk *c = &j->chunks[ci];
        const int64_t blocks = (c->n + QB - 1) / QB, local = u - j->unit_at[ci];
        const int64_t h = local / blocks, i0 = (local % blocks) * QB;
        const int64_t rows = c->n - i0 < QB ? c->n - i0 : QB, kh = h / group;
        const float *qr[QB];
        float *out[QB];
        int64_t pos[QB];
        for (int64_t r = 0; r < rows; r++) {
            qr[r] = j->q + (c->row + i0 + r) * j->q_stride + h * D;
            out[r] = j->out + (c->row + i0 + r) * j->out_stride + h * D;
            pos[r] = c->start + i0 + r;
        }
        attend_rows(qr, pos, rows, j->kt + j->kt_at[ci] + kh * ctx_pad_of(c) * D,
                    j->v + c->kv_row * j->kv_stride + kh * j->kv_head_stride, j->kv_stride, D, j->scale, out, scratch);
    }
}

/* Floats of scratch servelab_prefill_attention_chunks_f32 needs per thread, after the K^T panels;
 * and before them, for two int64 per chunk and one more, rounded up to a cache line. */
#define PER_PART(dim) (QB * KB + QB * (dim) + 3 * QB + (dim))
#define HEADER_FLOATS(num_chunks) ((4 * (num_chunks) + 2 + 15) / 16 * 16)

/* Causal attention for num_chunks prefill chunks of one step in one call (struct chunk: chunks is
 * [num_chunks][4] int64 row, n, start, kv_row), so a step of many short prompts pays one dispatch
 * a layer, not one a prompt. q: row r at q + r * q_stride, head h at + h * dim; k, v: token t of
 * KV head g at + t * kv_stride + g * kv_head_stride; out: row r at out + r * out_stride. Every
 * row is attend_rows' arithmetic, so it has the bits of the one-chunk call. scratch:
 * HEADER_FLOATS(num_chunks) floats, kv_heads * dim * sum(ctx_pad) for K^T (ctx_pad =
 * start + n rounded up to 16), then threads * (QB * KB + QB * dim + 3 * QB + dim). */
void servelab_prefill_attention_chunks_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                           int64_t kv_stride, int64_t kv_head_stride, const int64_t *chunks,
                                           int64_t num_chunks, int64_t heads, int64_t kv_heads, int64_t dim,
                                           float scale, float *out, int64_t out_stride, float *scratch,
                                           int64_t threads)
{
    const struct chunk *cs = (const struct chunk *)chunks;
    int64_t *kt_at = (int64_t *)scratch, *unit_at = kt_at + num_chunks; /* unit_at has num_chunks + 1 entries */
    int64_t kt_floats = 0;
    unit_at[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        kt_at[c] = kt_floats;
        kt_floats += kv_heads * ctx_pad_of(&cs[c]) * dim;
        unit_at[c + 1] = unit_at[c] + heads * ((cs[c].n + QB - 1) / QB);
    }
    float *kt = scratch + HEADER_FLOATS(num_chunks);
    struct prefill_job job = {q, k, v, cs, num_chunks, q_stride, kv_stride, kv_head_stride, heads, kv_heads, dim,
                              kt_at, unit_at, scale, out, kt, kt + kt_floats, out_stride, PER_PART(dim)};
    sl_parallel_for(pack_part, &job, num_chunks * kv_heads, threads);
    sl_parallel_for(prefill_part, &job, unit_at[num_chunks], threads);
}

/* out [n, heads * dim] (contiguous) = causal attention of q (row r at q + r * q_stride, head h at
 * + h * dim) over k and v (token t of KV head g at + t * kv_stride + g * kv_head_stride, for
 * t < start + n): one chunk. scratch: 16 floats, kv_heads * ctx_pad * dim floats for K^T (ctx_pad
 * = start + n rounded up to 16), then QB * KB + QB * dim + 3 * QB + dim floats per thread. */
void servelab_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                    int64_t kv_head_stride, int64_t n, int64_t start, int64_t heads, int64_t kv_heads,
                                    int64_t dim, float scale, float *out, float *scratch, int64_t threads)
{
    const int64_t chunk[4] = {0, n, start, 0};
    servelab_prefill_attention_chunks_f32(q, q_stride, k, v, kv_stride, kv_head_stride, chunk, 1, heads, kv_heads, dim,
                                          scale, out, heads * dim, scratch, threads);
}

/* The paged kernel: one query token per sequence (a decode), each attending over its own blocks
 * of the KV cache like servelab_decode_attention, but through attend_rows, so that its output has
 * exactly the bits the prefill kernel gives the same token at the same position (decode's own
 * kernel sums in another order). Deterministic mode's decode path. Per (sequence, KV head): the
 * context's keys are packed into K^T panels and its values gathered (both widened to fp32) in
 * the thread's scratch, then the group's query heads attend as rows at one position.
 * scratch per part: ctx_pad * D (K^T) + max_ctx * D (V) + QB * KB + QB * D + 3 * QB + D floats,
 * ctx_pad = max_ctx rounded up to KP. */
struct paged_job {
    const float *q;
    const void *k, *v;
    int64_t q_stride, num_slots, kv_format;
    const int64_t *blocks;
    int64_t table_stride, block_size;
    const int64_t *ctx_lens;
    int64_t num_kv_heads, group, dim, max_ctx;
    float scale;
    float *out, *scratch;
    int64_t scratch_per_part;
};

/* One (sequence, KV head)'s context into the thread's scratch, widened to fp32: keys as K^T
 * panels ([t / KP][d][t % KP], zero past ctx), values as rows. One copy per cache format (fmt
 * is a constant in each), so the inner loops have no branch. */
static inline __attribute__((always_inline)) void gather_context(const struct paged_job *j, int64_t head,
                                                                 const int64_t *table, int64_t ctx, float *kt,
                                                                 float *vv, int64_t fmt) {
    const int64_t D = j->dim, ctx_pad = (ctx + KP - 1) / KP * KP;
    for (int64_t t = 0; t < ctx_pad; t++) {
        float *panel = kt + (t / KP) * D * KP + t % KP;
        if (t >= ctx) {
            for (int64_t d = 0; d < D; d++) panel[d * KP] = 0.f;
            continue;
        }
        const int64_t at = head + (table[t / j->block_size] * j->block_size + t % j->block_size) * D;
        if (fmt == KV_F32) {
            const float *kr = (const float *)j->k + at;
            for (int64_t d = 0; d < D; d++) panel[d * KP] = kr[d];
            memcpy(vv + t * D, (const float *)j->v + at, sizeof(float) * (size_t)D);
        } else {
            const uint16_t *kr = (const uint16_t *)j->k + at, *vr = (const uint16_t *)j->v + at;
            for (int64_t d = 0; d < D; d++) {
                panel[d * KP] = fmt == KV_F16 ? sl_f16_to_f32(kr[d]) : sl_bf16_to_f32(kr[d]);
                vv[t * D + d] = fmt == KV_F16 ? sl_f16_to_f32(vr[d]) : sl_bf16_to_f32(vr[d]);
            }
        }
    }
}

static void paged_part(const void *ctx, int64_t part, int64_t begin, int64_t end) {
    const struct paged_job *j = ctx;
    const int64_t D = j->dim, G = j->group, ctx_pad_max = (j->max_ctx + KP - 1) / KP * KP;
    float *kt = j->scratch + part * j->scratch_per_part, *vv = kt + ctx_pad_max * D, *work = vv + j->max_ctx * D;
    for (int64_t pair = begin; pair < end; pair++) {
        const int64_t b = pair / j->num_kv_heads, h = pair % j->num_kv_heads, ctx = j->ctx_lens[b];
        const int64_t *table = j->blocks + b * j->table_stride, head = h * j->num_slots * D;
        switch (j->kv_format) {
        case KV_F16: gather_context(j, head, table, ctx, kt, vv, KV_F16); break;
        case KV_BF16: gather_context(j, head, table, ctx, kt, vv, KV_BF16); break;
        default: gather_context(j, head, table, ctx, kt, vv, KV_F32); break;
        }
        const float *qr[QB];
        float *out[QB];
        int64_t pos[QB];
        for (int64_t g0 = 0; g0 < G; g0 += QB) {
            const int64_t rows = G - g0 < QB ? G - g0 : QB;
            for (int64_t r = 0; r < rows; r++) {
                qr[r] = j->q + b * j->q_stride + (h * G + g0 + r) * D;
                out[r] = j->out + (b * j->num_kv_heads * G + h * G + g0 + r) * D;
                pos[r] = ctx - 1;
            }
            attend_rows(qr, pos, rows, kt, vv, D, D, j->scale, out, work);
        }
    }
}

/* Same layouts as servelab_decode_attention (q [B, KV * group, D] with row stride q_stride; k, v
 * one layer of the pool in kv_format; block table and ctx_lens; out [B, KV * group * D]). */
void servelab_paged_attention_f32(const float *q, int64_t q_stride, const void *k, const void *v, int64_t num_slots,
                                  int64_t kv_format, const int64_t *blocks, int64_t table_stride, int64_t block_size,
                                  const int64_t *ctx_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
                                  int64_t head_dim, int64_t max_ctx, float scale, float *out, float *scratch,
                                  int64_t scratch_per_part, int64_t threads)
{
    struct paged_job job = {q, k, v, q_stride, num_slots, kv_format, blocks, table_stride, block_size, ctx_lens,
                            num_kv_heads, group, head_dim, max_ctx, scale, out, scratch, scratch_per_part};
    sl_parallel_for(paged_part, &job, batch * num_kv_heads, threads);
}

/* The scratch_per_part servelab_paged_attention_f32 needs for contexts of up to max_ctx. */
int64_t servelab_paged_attention_scratch_floats(int64_t max_ctx, int64_t head_dim)
{
    const int64_t ctx_pad = (max_ctx + KP - 1) / KP * KP;
    return ctx_pad * head_dim + max_ctx * head_dim + QB * KB + QB * head_dim + 3 * QB + head_dim;
}
