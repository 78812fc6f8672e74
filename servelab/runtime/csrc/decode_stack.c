/* Every decoder layer of a decode-only step in one call: the same kernels the model calls one by
 * one (add + RMSNorm, the linears over their GGUF blocks, int8 codes or 16-bit weights, RoPE +
 * K/V store, decode attention, SwiGLU), in the same order with the same arguments, so the
 * results are the per-op path's bit for bit.
 *
 * Why: at batch 1 the per-op path made ~270 ctypes calls and ~190 torch ops a step (~340
 * torch.empty among them); their Python and dispatch were a third of the step, and the gaps
 * between calls let the thread pool's workers fall asleep between kernels (docs/benchmarks.md,
 * "Where a step's time goes"). Here the Python side makes one call per step, and every buffer comes
 * from one arena the caller keeps (servelab_decode_stack_arena_floats says how big).
 *
 * runtime/decode_stack.py fills the structs below (ctypes mirrors of them) once at load, and a
 * struct sl_step per step.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#define SL_MAX_SEGMENTS 4

enum { LINEAR_BLOCKS = 0, LINEAR_INT8 = 1, LINEAR_HALF = 2, LINEAR_BF16 = 3 };

/* Outputs [start, start + rows) of a weight as GGUF blocks of one format (block_quant.PackedRows). */
struct sl_segment {
    int64_t fmt;
    const uint8_t *data;
    int64_t row_bytes, rows, start;
};

/* The same outputs in a layout of csrc/q8_block_linear.c (block_quant.Q8Rows). */
struct sl_q8_segment {
    int64_t fmt;
    const uint8_t *data;
    int64_t rows, start;
};

struct sl_linear {
    int64_t kind, in_features, out_features;
    const float *bias;                  /* NULL or [out_features] */
    int64_t invariant;                  /* the panel kernel at every row count (deterministic mode) */
    int64_t fused_formats;              /* every segment has an in-register kernel */
    int64_t num_segments;
    struct sl_segment seg[SL_MAX_SEGMENTS];
    const uint8_t *int8_packed;         /* LINEAR_INT8: quantization.Int8Linear's tensors */
    const float *int8_scale;
    const int32_t *int8_zero;
    int64_t int8_kp;
    const uint16_t *half_weight;        /* LINEAR_HALF: linear.HalfLinear's bf16/fp16 [out, in];
                                           LINEAR_BF16: quantization.Bf16Linear's packed panels */
    int64_t half_format, half_gemv_max_rows;  /* half.h's KV_F16 / KV_BF16; its GEMV path up to here */
    int64_t q8_min_rows;                /* LINEAR_BLOCKS: from this many rows the int8 dot products (0: never) */
    int64_t q8_passes;                  /* ... with 1 or 2 int8 passes over each activation */
    struct sl_q8_segment q8[SL_MAX_SEGMENTS];  /* ... over these, num_segments of them */
};

struct sl_layer {
    const float *input_norm, *post_norm;
    struct sl_linear qkv, o, gate_up, down;
};

struct sl_stack {
    const struct sl_layer *layers;
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t paged_attention;            /* decode attention in the prefill kernel's order (deterministic) */
    int64_t fused_max_rows, panel_outputs;  /* block_quant.py's FUSED_MAX_ROWS and PANEL_OUTPUTS */
    const float *final_norm;            /* NULL: no head (the model's own embedding and head stay in Python) */
    struct sl_linear head;              /* the LM head [vocab, hidden] */
    const float *embed;                 /* the token embedding [embed_rows, hidden] */
    int64_t embed_rows;
};

struct sl_step {
    int64_t rows;                       /* decodes, one token each */
    const float *cos, *sin;             /* [max_pos, head_dim] */
    const int64_t *positions, *slots;   /* [rows] */
    void *const *k_cache, *const *v_cache;  /* per layer: [kv_heads, num_slots, head_dim] */
    int64_t num_slots, kv_format;
    const int64_t *block_table;         /* [rows, table_stride] */
    int64_t table_stride, block_size;
    const int64_t *ctx_lens;            /* [rows] */
    int64_t max_ctx, threads;
    float *logits;                      /* NULL, or [rows, vocab]: the final norm and the head run too */
    const int64_t *ids;                 /* [rows] token ids, embedded here where the caller passes no x */
    int64_t *greedy;                    /* NULL, or [rows]: with the logits, each row's argmax (-1: a NaN or an inf) */
};

/* the kernels of the other files */
void servelab_add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t rows, int64_t n,
                               float eps);
void servelab_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter);
void servelab_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t threads);
int64_t servelab_nonfinite_rows_f32(const float *x, int64_t rows, int64_t n, uint8_t *bad);
void servelab_rope_store_kv(float *qkv, int64_t T, int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, const float *cos, const float *sin, const int64_t *positions,
                            const int64_t *slots, void *k, void *v, int64_t num_slots, int64_t kv_format);
void servelab_block_quant_linear_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                     int64_t out_features, const float *x, int64_t rows, const float *bias, float *y,
                                     int64_t y_stride, float *scratch, int64_t threads);
void servelab_block_quant_gemm_f32(int64_t qtype, const uint8_t *w, int64_t row_bytes, int64_t in_features,
                                   int64_t out_features, const float *x, int64_t rows, const float *bias, float *y,
                                   int64_t y_stride, float *scratch, int64_t threads);
int servelab_int8_linear_f32(const uint8_t *w, const float *w_scale, const int32_t *w_zero, const float *bias,
                             int64_t in, int64_t kp, int64_t out, const float *x, int64_t rows, float *y,
                             int64_t threads);
void servelab_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v, int64_t num_slots,
                               int64_t kv_format, const int64_t *blocks, int64_t table_stride, int64_t block_size,
                               const int64_t *ctx_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
                               int64_t head_dim, float scale, float *scratch, int64_t scratch_per_part, float *out,
                               int64_t threads);
void servelab_paged_attention_f32(const float *q, int64_t q_stride, const void *k, const void *v, int64_t num_slots,
                                  int64_t kv_format, const int64_t *blocks, int64_t table_stride, int64_t block_size,
                                  const int64_t *ctx_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
                                  int64_t head_dim, int64_t max_ctx, float scale, float *out, float *scratch,
                                  int64_t scratch_per_part, int64_t threads);
int64_t servelab_paged_attention_scratch_floats(int64_t max_ctx, int64_t head_dim);
int servelab_half_linear_f32(int64_t fmt, const uint16_t *w, int64_t in, int64_t out, const float *x, int64_t rows,
                             const float *bias, float *y, int64_t gemm, int64_t threads);
int64_t servelab_q8_act_bytes(int64_t rows, int64_t in);
void servelab_q8_quantize_f32(const float *x, int64_t rows, int64_t in, int64_t passes, uint8_t *buf,
                              int64_t threads);
void servelab_q8_block_linear_f32(int64_t fmt, const uint8_t *w, int64_t in, int64_t out, const uint8_t *act,
                                  int64_t passes, int64_t rows, const float *bias, float *y, int64_t y_stride,
                                  int64_t threads);
int servelab_bf16_linear_f32(const uint16_t *w, int64_t in, int64_t out, const float *x, int64_t rows,
                             const float *bias, float *y, int64_t threads);

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Floats of attention scratch one thread needs. */
static int64_t attention_per_part(const struct sl_stack *s, int64_t max_ctx) {
    if (s->paged_attention) return servelab_paged_attention_scratch_floats(max_ctx, s->head_dim);
    return s->num_heads / s->num_kv_heads * max_ctx;
}

/* Floats of linear scratch (as block_quant.py sizes it: the in-register kernel's per-block sums
 * and row, a panel a thread, or the quantized activations), for the widest input. */
static int64_t linear_scratch(const struct sl_stack *s, int64_t rows, int64_t threads) {
    const int64_t in = max3(s->hidden, s->num_heads * s->head_dim, s->intermediate);
    const int64_t fused = rows * (in / 32) + threads * in, panel = threads * s->panel_outputs * in;
    const int64_t q8 = (servelab_q8_act_bytes(rows, in) + 3) / 4;
    return max3(fused, panel, q8);
}

static int64_t qkv_width(const struct sl_stack *s) { return (s->num_heads + 2 * s->num_kv_heads) * s->head_dim; }

/* The arena servelab_decode_stack needs for `rows` decodes of up to max_ctx positions. */
int64_t servelab_decode_stack_arena_floats(const struct sl_stack *s, int64_t rows, int64_t max_ctx, int64_t threads)
{
    const int64_t per_row = 4 * s->hidden + qkv_width(s) + s->num_heads * s->head_dim + 3 * s->intermediate;
    return rows * per_row + linear_scratch(s, rows, threads) + threads * attention_per_part(s, max_ctx);
}

/* y = x @ W^T (+ bias) as block_quant.BlockQuantLinear, quantization.Int8Linear and Bf16Linear
 * and linear.HalfLinear compute it. */
static int run_linear(const struct sl_stack *s, const struct sl_linear *l, const float *x, int64_t rows, float *y,
                      float *scratch, int64_t threads) {
    if (l->kind == LINEAR_HALF)
        return servelab_half_linear_f32(l->half_format, l->half_weight, l->in_features, l->out_features, x, rows,
                                        l->bias, y, rows > l->half_gemv_max_rows, threads);
    if (l->kind == LINEAR_BF16)
        return servelab_bf16_linear_f32(l->half_weight, l->in_features, l->out_features, x, rows, l->bias, y, threads);
    if (l->kind == LINEAR_INT8)
        return servelab_int8_linear_f32(l->int8_packed, l->int8_scale, l->int8_zero, l->bias, l->in_features,
                                        l->int8_kp, l->out_features, x, rows, y, threads);
    if (l->q8_min_rows && rows >= l->q8_min_rows && !l->invariant) {
        uint8_t *act = (uint8_t *)scratch;
        servelab_q8_quantize_f32(x, rows, l->in_features, l->q8_passes, act, threads);
        for (int64_t i = 0; i < l->num_segments; i++) {
            const struct sl_q8_segment *g = &l->q8[i];
            servelab_q8_block_linear_f32(g->fmt, g->data, l->in_features, g->rows, act, l->q8_passes, rows,
                                         l->bias ? l->bias + g->start : NULL, y + g->start, l->out_features, threads);
        }
        return 0;
    }
    const int fused = rows <= s->fused_max_rows && !l->invariant && l->fused_formats;
    for (int64_t i = 0; i < l->num_segments; i++) {
        const struct sl_segment *g = &l->seg[i];
        const float *bias = l->bias ? l->bias + g->start : NULL;
        (fused ? servelab_block_quant_linear_f32 : servelab_block_quant_gemm_f32)(
            g->fmt, g->data, g->row_bytes, l->in_features, g->rows, x, rows, bias, y + g->start, l->out_features,
            scratch, threads);
    }
    return 0;
}

/* Runs every layer for st->rows decodes. x [rows, hidden]: the embedded tokens in, the residual
 * stream out, with the last layer's MLP output in delta [rows, hidden] still to be added (as the
 * model's loop leaves them). With st->logits (and a head), x and delta may be NULL: then the
 * layers start from st->ids' embedding rows, both live in the arena, and the final norm and the
 * LM head run as the model runs them after its loop, writing the step's logits of every row.
 * Returns 0, -1 where an int8 or half linear found no memory, -2 for a token id outside the
 * embedding. */
int servelab_decode_stack(const struct sl_stack *s, const struct sl_step *st, float *x, float *delta, float *arena)
{
    const int64_t rows = st->rows, threads = st->threads, hidden = s->hidden;
    const int64_t H = s->num_heads, KV = s->num_kv_heads, D = s->head_dim, qkv_n = qkv_width(s);
    float *h = arena, *qkv = h + rows * hidden, *attn = qkv + rows * qkv_n, *o = attn + rows * H * D;
    float *own = o + rows * hidden;  /* 2 * rows * hidden: x and delta where the caller has none */
    if (!x) {
        if (!st->logits || !s->embed) return -2;
        x = own;
        for (int64_t r = 0; r < rows; r++) {
            if (st->ids[r] < 0 || st->ids[r] >= s->embed_rows) return -2;
            memcpy(x + r * hidden, s->embed + st->ids[r] * hidden, hidden * sizeof(float));
        }
    }
    if (!delta) delta = own + rows * hidden;
    float *gate_up = own + 2 * rows * hidden, *act = gate_up + rows * 2 * s->intermediate;
    float *lin_scratch = act + rows * s->intermediate, *att_scratch = lin_scratch + linear_scratch(s, rows, threads);
    const int64_t per_part = attention_per_part(s, st->max_ctx);
    for (int64_t i = 0; i < s->num_layers; i++) {
        const struct sl_layer *L = &s->layers[i];
        servelab_add_rms_norm_f32(x, i == 0 ? NULL : delta, L->input_norm, h, rows, hidden, s->eps);
        if (run_linear(s, &L->qkv, h, rows, qkv, lin_scratch, threads)) return -1;
        servelab_rope_store_kv(qkv, rows, qkv_n, H, KV, D, st->cos, st->sin, st->positions, st->slots, st->k_cache[i],
                               st->v_cache[i], st->num_slots, st->kv_format);
        if (s->paged_attention)
            servelab_paged_attention_f32(qkv, qkv_n, st->k_cache[i], st->v_cache[i], st->num_slots, st->kv_format,
                                         st->block_table, st->table_stride, st->block_size, st->ctx_lens, rows, KV,
                                         H / KV, D, st->max_ctx, s->scale, attn, att_scratch, per_part, threads);
        else
            servelab_decode_attention(qkv, qkv_n, st->k_cache[i], st->v_cache[i], st->num_slots, st->kv_format,
                                      st->block_table, st->table_stride, st->block_size, st->ctx_lens, rows, KV, H / KV,
                                      D, s->scale, att_scratch, per_part, attn, threads);
        if (run_linear(s, &L->o, attn, rows, o, lin_scratch, threads)) return -1;
        servelab_add_rms_norm_f32(x, o, L->post_norm, h, rows, hidden, s->eps);
        if (run_linear(s, &L->gate_up, h, rows, gate_up, lin_scratch, threads)) return -1;
        servelab_silu_mul_f32(gate_up, act, rows, s->intermediate);
        if (run_linear(s, &L->down, act, rows, delta, lin_scratch, threads)) return -1;
    }
    if (st->logits && s->final_norm) {  /* x += delta, its norm into h, then the head */
        servelab_add_rms_norm_f32(x, delta, s->final_norm, h, rows, hidden, s->eps);
        if (run_linear(s, &s->head, h, rows, st->logits, lin_scratch, threads)) return -1;
        if (st->greedy) {  /* the greedy sampler's reads of the logits, while they are still in cache */
            const int64_t vocab = s->head.out_features;
            servelab_argmax_rows_f32(st->logits, rows, vocab, st->greedy, threads);
            for (int64_t r = 0; r < rows; r++) {
                uint8_t bad;
                if (servelab_nonfinite_rows_f32(st->logits + r * vocab, 1, vocab, &bad)) st->greedy[r] = -1;
            }
        }
    }
    return 0;
}
