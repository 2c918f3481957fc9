/* kernels.h — the math of one layer, as functions of plain arrays.
 *
 * Bit identity between the layer-major and token-serial paths rests on one rule: the value of
 * each output element depends only on its own inputs, never on n (tokens in the batch), on the
 * row range a thread was given, or on the thread count. Every kernel here reduces each output
 * element in one fixed order, whatever the batch.
 *
 * kernels_ref.c holds the portable reference versions (kept forever; the fast ones are checked
 * against them). */
#ifndef SMOE_KERNELS_H
#define SMOE_KERNELS_H

#include "vault.h"

/* y[t·ldy + r] = Σ_c W[r, c] · x[t·ldx + c]   for t in [0, n), r in [r0, r1).
 * w: the tensor's first byte (W->data for dense tensors, blob + W->offset for expert tensors). */
void smoe_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n,
                      float *y, size_t ldy, uint32_t r0, uint32_t r1);

/* Activations quantised to 8 bits for q8/q4 weights (the default; smoe_session_params.
 * float_activations turns it off). Per token, per block of 32 columns: d = max|x| / 127 and codes
 * round(x · 127/max|x|) in [−127, 127]; plus each weight group's float sum for the bias term.
 * Then, with I the exact integer Σ q·code over one block (q the weight's codes),
 *     y = Σ_blocks (s·d)·I + Σ_g b_g·Σ_{c∈g} x_c      (s the scale of the block's group)
 * in the fixed order kernels_ref.c states. Integer sums are exact, so only that float order
 * matters, and it depends on cols and the group size only: never on n, the rows or the threads.
 *
 * The GGML block formats take their activations as ggml's CPU backend quantises them for that
 * weight type (Q8_0, Q8_1 or Q8_K blocks: kernels_ref.c, ref_ggml_prepare), so an imported GGUF
 * computes what llama.cpp computes on it, up to the order of float sums.
 *
 * smoe_qx_prepare fills the three arrays for n tokens for weights of format wfmt (q8, q4 or a GGML
 * format: the code layout differs) and group size `group` (32, 64 or 128: the group sums differ), with the
 * sizes smoe_qx_sizes gives per token. Only gsum_floats depends on the group, and it is largest
 * for group 32, so planes sized for (cols, q8, 32) hold any product of cols or fewer columns. */
typedef struct {
    const void *codes;  /* (n, code_bytes) int8 (q4 weights) or int16 (q8), in the layout of kernels_ref.c */
    const float *d;     /* (n, d_floats) block scales, 8 per 256 columns */
    const float *gsum;  /* (n, gsum_floats) group sums, zero-padded to a multiple of 8 */
    uint32_t cols;
    uint32_t group;     /* the weights' group size the sums were made for */
    uint8_t wformat;    /* SMOE_FMT_Q8, SMOE_FMT_Q4 or the GGML format they were made for */
    const void *tiles;  /* the same codes packed for the AMX kernel (smoe_qx_tiles), or NULL */
} smoe_qx;

typedef struct {
    size_t code_bytes, d_floats, gsum_floats; /* per token */
} smoe_qx_size;

smoe_qx_size smoe_qx_sizes(uint32_t cols, uint8_t wformat, uint32_t group);
void smoe_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                     void *codes, float *d, float *gsum);

/* X's tokens from t0 on, a view of its arrays (without packed tiles: those are X's whole) */
static inline smoe_qx smoe_qx_from(const smoe_qx *X, uint32_t t0) {
    const smoe_qx_size z = smoe_qx_sizes(X->cols, X->wformat, X->group);
    return (smoe_qx){(const uint8_t *)X->codes + (size_t)t0 * z.code_bytes, X->d + (size_t)t0 * z.d_floats,
                     X->gsum + (size_t)t0 * z.gsum_floats, X->cols, X->group, X->wformat, NULL};
}

/* Whether W's products take 8-bit activation codes: q8, q4 and the GGML block formats that
 * ggml_blocks.h gives an integer form (all but F16, whose products take f32 inputs); and
 * the group those codes' sums are made for (the GGML formats take the codes of q4 with group 32). */
bool smoe_qx_takes(const smoe_tensor *W);
uint32_t smoe_qx_group(const smoe_tensor *W);

/* Whether one smoe_qx_prepare of x serves the products of both a and b (the same columns, and the
 * same codes: one format and group, or two GGML formats of one activation type, ggml_blocks.h's
 * gb_act_type); tensors whose products take f32 inputs: of one format. */
bool smoe_qx_shared(const smoe_tensor *a, const smoe_tensor *b);

/* The codes of n tokens packed once for the AMX kernel, where the product of n tokens of X will
 * run there (kernels.c's dispatch; else 0): its bytes and its work items, which smoe_qx_tiles
 * packs a range of (any split: the same bytes) into buf; then X->tiles = buf. Every product and
 * thread that takes X reads them instead of each packing its own (the same bits either way).
 * smoe_qx_tiles_cap: the bytes a buffer needs for any X of up to cols columns and n tokens (0
 * where this CPU runs no AMX). */
size_t smoe_qx_tiles_bytes(const smoe_qx *X, uint32_t n, uint32_t *items);
void smoe_qx_tiles(const smoe_qx *X, uint32_t n, void *buf, uint32_t i0, uint32_t i1);
size_t smoe_qx_tiles_cap(uint32_t cols, uint32_t n);

/* Where block B (columns 32B…32B+31) of a token keeps its d: kernels_ref.c's layout. */
static inline uint32_t smoe_qx_dpos(uint32_t B) { return 8 * (B / 8) + (B / 2) % 4 + 4 * (B % 2); }

/* y[t·ldy + r] for t in [0, n), r in [r0, r1), W q8 or q4 with W->cols == X->cols and the same
 * format and group as X was prepared for. */
void smoe_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                         uint32_t r0, uint32_t r1);

/* Row `row` of W dequantised into out (cols floats): embedding lookup. */
void smoe_dequant_row(const smoe_tensor *W, const uint8_t *w, uint32_t row, float *out);

/* out = x / sqrt(mean(x²) + eps) · weight; weight a 1 × dim tensor (f32 or bf16). out may be x. */
void smoe_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps);

/* Rotate-half RoPE in place on the first rot (even, ≤ head_dim) dims of n_heads vectors of head_dim:
 * for i < rot/2, (x_i, x_{i+rot/2}) ← (x_i·cos_i − x_{i+rot/2}·sin_i, x_{i+rot/2}·cos_i + x_i·sin_i);
 * dims from rot on pass through. cos, sin: rot/2 entries for this position. */
void smoe_rope(float *x, uint32_t n_heads, uint32_t head_dim, uint32_t rot, const float *cos, const float *sin);

/* y[i] += w[i] for i < w->cols: a bias vector (1 × cols, f32 or bf16) added to one row. */
void smoe_add_bias(float *y, const smoe_tensor *w);

enum { SMOE_MAX_GROUPS = 1024 }; /* n_group's bound: the vault's bound on experts */

/* GLM-4.5 / DeepSeek-V3 routing of one row (vault router_kind 1) from its E router logits: scores
 * s = sigmoid(logits); choice c = s + bias (1 × E, f32 or bf16); the experts in n_group groups of E/n_group,
 * each group scored by the sum of its two largest c (n_group > 1); the topk_group best groups kept
 * (ties: lower index); the k largest c among their experts into idx, best first (ties: lower
 * index); val = their s, divided by (Σ val + 1e-20) if renorm, times scale. scratch: E floats. */
void smoe_route_sigmoid_group(const float *logits, uint32_t E, const smoe_tensor *bias, uint32_t n_group,
                              uint32_t topk_group, uint32_t k, bool renorm, float scale, int32_t *idx, float *val,
                              float *scratch);

/* One query head against positions [0, n_pos) of the cache: out = softmax(q·K/√d) · V, where the
 * softmax's denominator also holds exp(sink) (gpt-oss's attention sinks: a learned logit per head
 * that takes probability mass and adds no value; −INFINITY: none, and exactly the plain softmax's
 * bits). A sliding window is the caller's: k and v then point at the window's first position.
 * k, v point at position 0 of this KV head, elements of kv_dtype (smoe_kv_dtype, widened to f32
 * exactly as they are read); consecutive positions are `stride` elements apart. scratch: n_pos
 * floats. Every implementation (portable, AVX2, NEON) computes the same bits:
 *     scratch[p] = hsum8(acc) · (1/√d), acc = fma(q[8v..8v+8), k_p[8v..8v+8), acc) for v = 0, 1, …
 *                  (8 lanes from +0, a last partial vector zero-padded; hsum8 the tree
 *                  ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)))
 *     smoe_softmax_sink(scratch, sink)
 *     out[d] = fma(scratch[p], v_p[d], out[d]) for p = 0, 1, … in order, from +0. */
void smoe_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                 uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch);

/* Bytes of one KV element of kv_dtype (4, 2 or 2). */
size_t smoe_kv_elem_bytes(uint32_t kv_dtype);

/* dst[i] = src[i] rounded to kv_dtype (nearest, ties to even; f16 overflows to ±inf; a NaN stays a
 * quiet NaN with the top bits of its payload, as F16C's vcvtps2ph gives), i < n. One portable
 * implementation serves every build, so the stored bits never depend on the instruction set. */
void smoe_kv_store(void *dst, const float *src, size_t n, uint32_t kv_dtype);

/* dst[i] = src[i] of kv_dtype widened to f32 (exact), i < n. */
void smoe_kv_load(float *dst, const void *src, size_t n, uint32_t kv_dtype);

/* In-place softmax over n floats (f32, max-subtracted). */
void smoe_softmax(float *x, uint32_t n);

/* The same with one more logit, sink, in the denominator only: m = max(sink, x…); x[i] =
 * exp(x[i] − m) / (Σ_i exp(x[i] − m) + exp(sink − m)), the sum in index order and the sink's term
 * added last. sink = −INFINITY gives smoe_softmax's bits. */
void smoe_softmax_sink(float *x, uint32_t n, float sink);

/* The k largest of p[0..n) in descending order (ties: lower index first) into idx, their values
 * into val. If renorm, val is divided by its sum. */
void smoe_topk(const float *p, uint32_t n, uint32_t k, bool renorm, int32_t *idx, float *val);

/* The top k of the logits (smoe_topk's order), then a softmax over those k alone: gpt-oss's
 * router (GptOssTopKRouter). */
void smoe_topk_softmax(const float *logits, uint32_t n, uint32_t k, int32_t *idx, float *val);

/* h[i] = silu(g[i]) · u[i] */
void smoe_swiglu(float *h, const float *g, const float *u, uint32_t n);

/* gpt-oss's clamped SwiGLU (GptOssExperts._apply_gate): g' = min(g, limit), u' = clamp(u, −limit,
 * limit), h = (u' + 1) · g' · sigmoid(alpha · g'), sigmoid(x) = 1 / (1 + exp(−x)). */
void smoe_swiglu_clamped(float *h, const float *g, const float *u, uint32_t n, float alpha, float limit);

/* y[i] += b[i]: a bias */
void smoe_add_row(float *y, const float *b, uint32_t n);

/* y[i] += a · x[i] */
void smoe_axpy(float *y, float a, const float *x, uint32_t n);

/* ----------------------------------------------- Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE)
 * transformers' torch fallbacks (causal_conv1d_update, torch_recurrent_gated_delta_rule,
 * RMSNormGated), one token at a time: the layer-major prefill and the token-serial step call them
 * row by row in token order, so both paths give the same bits. Every sum runs in index order. */

/* One token of a depthwise causal convolution of `kernel` taps over ch channels, then silu:
 * out[c] = silu(Σ_{j < kernel−1} w[c·kernel + j]·state[j·ch + c] + w[c·kernel + kernel−1]·x[c]), j in
 * order; state (kernel−1, ch): the previous inputs, oldest first, then shifted to end with x.
 * out must not alias x or state. */
void smoe_conv1d_step(float *out, float *state, const float *x, const float *w, uint32_t ch, uint32_t kernel);

/* x[i] ← x[i] / sqrt(Σ x² + eps) · scale (the FLA library's l2norm, then a scale). */
void smoe_l2norm(float *x, uint32_t n, float eps, float scale);

/* One token of one value head through the gated delta rule, S (dk, dv) in place:
 *     S ← S·decay;  delta = (v − Sᵀk)·beta;  S ← S + k·deltaᵀ;  out = Sᵀq
 * (decay = exp(g)), each sum over i = 0 … dk−1 in order. scratch: dv floats. */
void smoe_delta_step(float *out, float *S, const float *q, const float *k, const float *v, float decay, float beta,
                     uint32_t dk, uint32_t dv, float *scratch);

/* out[j] = (x[j] / sqrt(mean(x²) + eps)) · w[j] · silu(z[j]), j < dim. out may be x. */
void smoe_rmsnorm_gated(float *out, const float *x, const float *z, const float *w, uint32_t dim, float eps);

/* torch's softplus (threshold 20: x itself above it) and sigmoid, as the layer uses them. */
float smoe_softplus(float x);
float smoe_sigmoid(float x);

#endif
