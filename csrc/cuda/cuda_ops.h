/* cuda_ops.h — the CUDA backend's device side: its kernels, its device allocator and its upload
 * path, behind plain C functions (the .cu files implement them, by concern: cuda_common.cuh lists
 * them; backend_cuda.c and moe_cuda.c drive them).
 *
 * Nothing here knows a session: arguments are device pointers, shapes and streams. Every kernel
 * computes each output element in one fixed order that depends on that element's own shape only,
 * never on the number of tokens n, on which launch (a group of experts or one) computed it, or on
 * stream timing. That is what keeps layer-major and token-serial bit-identical on the GPU, as
 * kernels.h's rule does on the CPU (the orders are stated in kernels.cu).
 *
 * Every function returns 0 or a CUDA error code (cudaError_t as int); smoe_cu_error_string names it. */
#ifndef SMOE_CUDA_OPS_H
#define SMOE_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void *smoe_cu_stream; /* cudaStream_t */
typedef void *smoe_cu_event;  /* cudaEvent_t */
typedef void *smoe_cu_graph;  /* cudaGraphExec_t */

/* A weight tensor's layout (smoe_tensor's numbers; vault.h), without its address. */
typedef struct {
    uint8_t format, scale_format; /* smoe_format, smoe_scale_format */
    uint32_t rows, cols, group;
    uint64_t scales_off, biases_off; /* from the tensor's first byte (q8/q4) */
} smoe_cu_tensor;

/* Which weights and rows one matrix product covers. Dense: w is the tensor, rows [0, n) of x and y.
 * Grouped (experts): item i of [0, n_items) is union position u = items[i], whose tensor starts
 * at wtab[u] + woff and which multiplies rows [start[u], start[u] + count[u]) of x; y row j of
 * those goes to yrow[j] when yrow is not NULL. All arrays in device memory.
 * Tiled (tile > 0; the lists smoe_cu_union makes): items[i] is u << 16 | j, the rows
 * [start[u] + j·tile, start[u] + min((j + 1)·tile, count[u])), or SMOE_CU_NO_ITEM (no rows); a launch
 * then covers n_items items of at most max_count = tile rows, n_items a bound the host knows. */
#define SMOE_CU_NO_ITEM 0xFFFFFFFFu
typedef struct {
    const uint8_t *w;             /* dense */
    uint32_t n;                   /* dense: tokens */
    const uint8_t *const *wtab;   /* grouped: per union position, the blob in VRAM */
    uint64_t woff;
    const uint32_t *items, *start, *count, *yrow;
    uint32_t n_items, max_count;  /* launches cover max_count rows per item */
    uint32_t tile;                /* 0, or tiled item lists (above) */
    /* grouped: a pair launch also multiplies the tensor at wtab[u] + woff2 (the same shape and
     * layout as the one at woff: an expert's gate and up), its outputs T.rows columns after the
     * first's in each y row */
    uint32_t pair;
    uint64_t woff2;
} smoe_cu_rows;

const char *smoe_cu_error_string(int err);
int smoe_cu_device(int ordinal, char *name, size_t cap, int *sm_major, int *sm_minor, size_t *free_bytes,
                   size_t *total_bytes);

/* The device allocator and upload path. */
int smoe_cu_alloc(void **p, size_t bytes);
int smoe_cu_out_of_memory(int err); /* 1 when err says the device had no memory left */
void smoe_cu_free(void *p);
int smoe_cu_host_alloc(void **p, size_t bytes); /* pinned */
void smoe_cu_host_free(void *p);
int smoe_cu_host_register(void *p, size_t bytes); /* pins existing host memory (the streamer's slots) */
void smoe_cu_host_unregister(void *p);
int smoe_cu_upload(void *dst, const void *src, size_t bytes, smoe_cu_stream st);   /* async */
int smoe_cu_download(void *dst, const void *src, size_t bytes, smoe_cu_stream st); /* async */
int smoe_cu_copy(void *dst, const void *src, size_t bytes, smoe_cu_stream st);     /* device to device, async */
int smoe_cu_memset(void *dst, int v, size_t bytes, smoe_cu_stream st);
int smoe_cu_stream_new(smoe_cu_stream *st);
void smoe_cu_stream_free(smoe_cu_stream st);
int smoe_cu_stream_sync(smoe_cu_stream st);
int smoe_cu_event_new(smoe_cu_event *ev);
void smoe_cu_event_free(smoe_cu_event ev);
int smoe_cu_event_record(smoe_cu_event ev, smoe_cu_stream st);
int smoe_cu_event_sync(smoe_cu_event ev);
int smoe_cu_stream_wait(smoe_cu_stream st, smoe_cu_event ev);
int smoe_cu_last_error(void); /* and clears it */
/* Recording what is enqueued on st (this thread's calls only) and replaying it: capture_end
 * instantiates the recording into *out when keep (else drops it; *out NULL). */
int smoe_cu_capture_begin(smoe_cu_stream st);
int smoe_cu_capture_end(smoe_cu_stream st, int keep, smoe_cu_graph *out);
int smoe_cu_graph_launch(smoe_cu_graph g, smoe_cu_stream st);
void smoe_cu_graph_free(smoe_cu_graph g);

/* An activation as the products read it: f32 rows ldx floats apart and, for the products that run
 * on the tensor cores, the same rows as smoe_cu_prep wrote them (f16, cols apart, and per row the
 * power of two that undoes its scaling). Row indices are the products' (those of smoe_cu_rows). */
typedef struct {
    const float *x;
    size_t ldx;
    const void *x16;
    const float *xe;
} smoe_cu_act;

/* Kernels, all enqueued on st. */
/* 1 when products with T run on the tensor cores (q4 or q8, columns a multiple of 64): they read
 * the activation's f16 rows, which must then have been prepared. A function of T's shape alone. */
int smoe_cu_tensor_cores(const smoe_cu_tensor *T);
/* The f16 rows of x (rows of R; ldx floats apart) for products with cols columns. */
int smoe_cu_prep(smoe_cu_stream st, const float *x, size_t ldx, uint32_t cols, const smoe_cu_rows *R, void *x16,
                 float *xe);
/* y (rows of R, T.rows) = x · Wᵀ, y rows ldy floats apart. */
int smoe_cu_matmul(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a, float *y,
                   size_t ldy);
/* x[t] ← row ids[t] of the embedding tensor, dequantised; ids in device memory. */
int smoe_cu_embed(smoe_cu_stream st, const smoe_cu_tensor *T, const uint8_t *w, const int32_t *ids, uint32_t n,
                  float *x);
/* out rows [0, rows) = rmsnorm(x rows) · weight (f32 or bf16, dim entries); rows ld floats apart. */
int smoe_cu_rmsnorm(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim, size_t ld,
                    const uint8_t *weight, uint8_t weight_format, float eps);
/* rmsnorm (as smoe_cu_rmsnorm, rows dim apart) and the f16 rows of its output (as smoe_cu_prep) in
 * one launch: the same bits as the two. */
int smoe_cu_rmsnorm_prep(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim,
                         const uint8_t *weight, uint8_t weight_format, float eps, void *x16, float *xe);
/* A layer's new q (n × heads rows of hd) and K rows (ks, n × kv_heads) normalised by q_norm and
 * k_norm (each skipped when NULL) and rotated for positions *pos0 + t over their first rot dims (cos,
 * sin: (context, rot/2)), then K and the V rows of vs stored in the KV cache
 * (k, v: elements of kv_type, rounded to nearest even) at those positions, in one launch. The
 * position is read on the GPU, so that a recorded launch serves any position. */
int smoe_cu_qk_post(smoe_cu_stream st, float *q, float *ks, const float *vs, void *k, void *v, uint32_t kv_type,
                    uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t rot, const uint8_t *q_norm,
                    uint8_t q_norm_format, const uint8_t *k_norm, uint8_t k_norm_format, float eps, const float *cos,
                    const float *sin, const uint32_t *pos0);
/* att (n, heads·hd) = causal attention of q (n, heads·hd) over k/v (positions, kv_dim elements of
 * kv_type) of one layer: token t sees positions [0, pos0 + t], or the last `window` of them (0: no
 * window); sinks (heads entries, f32 or bf16; NULL: none) puts head h's sink logit in its softmax's
 * denominator (gpt-oss). dpos holds pos0 in device memory too. Flash attention (head sizes 32, 64,
 * 128, without sinks or a window) rounds K and V to f16 as it loads them, so an f16 cache gives it
 * the very values an f32 one does; the others run the plain kernel (f32). */
int smoe_cu_attention(smoe_cu_stream st, float *att, const float *q, const void *k, const void *v, uint32_t kv_type,
                      uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0, const uint32_t *dpos,
                      float *part, uint32_t context, const uint8_t *sinks, uint8_t sinks_format, uint32_t window);
/* Flash attention takes the positions in splits of 512, merged in order; with part (device, this
 * many floats for a cache of context positions) a launch of few rows runs the splits side by
 * side, with the same bits. 0: the head size takes no splits. */
size_t smoe_cu_attention_part_floats(uint32_t kv_heads, uint32_t hd, uint32_t context);
/* 1 when an attention launch for head size hd reads its position from dpos alone (its shape does
 * not follow pos0), so that it can be recorded once and replayed at any position. plain: some
 * layer has sinks or a window (the plain kernel, whose shape follows pos0). */
int smoe_cu_attention_fixed(uint32_t hd, int plain);
int smoe_cu_attention_max_positions(uint32_t hd, int plain); /* positions one launch can attend over */
/* y rows [0, n) (W floats each) += bias (W entries, f32 or bf16). */
int smoe_cu_bias(smoe_cu_stream st, float *y, uint32_t n, uint32_t W, const uint8_t *bias, uint8_t bias_format);
/* x[i] += y[i], i < count */
int smoe_cu_add(smoe_cu_stream st, float *x, const float *y, size_t count);
/* Per token: softmax over E router logits, top-k (ties: lower index), renormalised when renorm. */
int smoe_cu_route(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, uint32_t K, int renorm,
                  int32_t *idx, float *w);
/* Per token, GLM-4.5's router (smoe_route_sigmoid_group's steps, cpu/kernels.h): sigmoid scores,
 * bias (E entries, f32 or bf16, device) added for the choice, the experts in n_group groups of E/n_group with the
 * topk_group best kept (n_group ≤ SMOE_CU_MAX_GROUPS), the K best into idx, best first (ties: lower
 * index), their scores into w, renormalised when renorm, × scale. */
enum { SMOE_CU_MAX_GROUPS = 64 };
int smoe_cu_route_grouped(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, const uint8_t *bias,
                          uint8_t bias_format, uint32_t n_group, uint32_t topk_group, uint32_t K, int renorm, float scale, int32_t *idx,
                          float *w);
/* Per token, gpt-oss's router (smoe_topk_softmax): the K largest logits (ties: lower index) into idx,
 * best first, and the softmax over those K into w. */
int smoe_cu_route_topk_softmax(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, uint32_t K,
                               int32_t *idx, float *w);
/* xg row j = xn row rows[j] / K, j < total (hidden floats each). */
int smoe_cu_gather(smoe_cu_stream st, float *xg, const float *xn, const uint32_t *rows, uint32_t K, uint32_t total,
                   uint32_t hidden);
/* The same for f16 rows prepared by smoe_cu_prep (cols a multiple of 8) and their scales. */
int smoe_cu_gather16(smoe_cu_stream st, void *g16, float *ge, const void *a16, const float *ae, const uint32_t *rows,
                     uint32_t K, uint32_t total, uint32_t cols);
/* The activation between gate/up and down (backend.h's smoe_act): kind 0 silu(gate) · up, kind 1
 * gpt-oss's clamped SwiGLU with its alpha and limit. */
typedef struct {
    int kind;
    float alpha, limit;
} smoe_cu_act_fn;
/* For the rows of items (as smoe_cu_rows) or rows [0, n) when items is NULL: h row = f(gate, up)
 * with hg rows (2I) holding gate then up. */
int smoe_cu_swiglu(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R, smoe_cu_act_fn f);
/* smoe_cu_swiglu and then smoe_cu_prep of h (I columns) in one launch: the same bits as the two. */
int smoe_cu_swiglu_prep(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R,
                        smoe_cu_act_fn f, void *h16, float *he);
/* For the rows of R's items (an item list): y row (R->yrow[j], or j), columns [col0, col0 + cols) +=
 * the bias vector at R->wtab[u] + off of the item's expert u (cols entries, f32 or bf16). */
int smoe_cu_bias_items(smoe_cu_stream st, float *y, size_t ldy, uint32_t col0, const smoe_cu_rows *R, uint64_t off,
                       uint8_t bias_format, uint32_t cols);
/* A layer's union formed on the device, for a layer whose every expert is in VRAM (no host round
 * trip): from the top-k ids idx (nk = n·K of them), per expert e the rows of the tokens routed to it
 * (rows[start[e] ..], each t·K + slot in increasing order; count[e] of them, 0 when unused),
 * wtab[e] = vtab[e], and the tiled item list (smoe_cu_rows) of tile rows in expert order, padded
 * with SMOE_CU_NO_ITEM to n_items (which must bound the tiles: smoe_cu_union_items). Adds each
 * count to counts[e] and writes the number of experts used to *used; an id outside [0, E) sets *bad
 * (and counts as expert 0). E ≤ 1024; start and count hold E entries. */
int smoe_cu_union(smoe_cu_stream st, const int32_t *idx, uint32_t nk, uint32_t E, uint32_t tile, uint32_t n_items,
                  const uint8_t *const *vtab, const uint8_t **wtab, uint32_t *start, uint32_t *count, uint32_t *items,
                  uint32_t *rows, uint32_t *counts, uint32_t *used, uint32_t *bad);
/* The most tiles of `tile` rows nk routed rows over E experts can need. */
uint32_t smoe_cu_union_items(uint32_t nk, uint32_t E, uint32_t tile);
/* Sampling's selection on the GPU (sample.c's steps 1–4): the logits cleaned (NaN → −inf) into v
 * (V floats of scratch), the repetition penalty over hist[0..n_hist) in order (each distinct id
 * once), the argmax (first maximum) into out->best; then, unless the draw ends there (temperature
 * ≤ 0, every logit −inf, m = max / temperature overflowing: flags 1, the draw is best), the top_k
 * largest of v / temperature, best first (ties: the lower id), into out->vals and out->ids, and m;
 * smoe_sample_top draws among them as smoe_sample would. top_k outside [1, SAMPLE_CAP] or not below
 * V: flags 2, nothing selected. */
enum { SAMPLE_CAP = 1024 };
typedef struct {
    int32_t best;
    uint32_t count, flags;
    float m;
    float vals[SAMPLE_CAP];
    int32_t ids[SAMPLE_CAP];
} smoe_cu_sample_out;
int smoe_cu_sample_select(smoe_cu_stream st, const float *logits, float *v, uint32_t V, const int32_t *hist,
                          uint32_t n_hist, float penalty, float temperature, uint32_t top_k, smoe_cu_sample_out *out);
/* x[t] += Σ_k w[t,k] · y[t·K + k] in slot order, t < n. */
int smoe_cu_moe_sum(smoe_cu_stream st, float *x, const float *y, const float *w, uint32_t n, uint32_t K,
                    uint32_t hidden);

/* deltanet.cu: the hybrids' ops (Qwen3-Next, Qwen3.5-MoE; backend.h's sigmoid_gate and linear_attend).
 * y rows [0, n) (width floats each) *= sigmoid(g): elementwise (gate_width == width) or one gate per
 * row (gate_width 1). */
int smoe_cu_sigmoid_gate(smoe_cu_stream st, float *y, const float *g, uint32_t width, uint32_t gate_width,
                         uint32_t n);
/* A Gated DeltaNet's mix rows [0, n) (conv_dim = 2·k_heads·k_dim + v_heads·v_dim floats each) through
 * the causal convolution (conv_w: conv_dim × kernel f32; conv_state: (kernel − 1, conv_dim), advanced
 * by the n rows in order) and silu, in place; then each row's q heads L2-normed and scaled by
 * 1/√k_dim, its k heads L2-normed. */
int smoe_cu_deltanet_conv(smoe_cu_stream st, float *mix, uint32_t n, float *conv_state, const float *conv_w,
                          uint32_t k_heads, uint32_t k_dim, uint32_t conv_dim, uint32_t kernel);
/* Rows [0, n) in order through the gated delta rule per value head (state: v_heads × k_dim × v_dim
 * f32, advanced), then each head's output RMS-normed · norm (v_dim f32) · silu(z): att and z rows
 * v_heads·v_dim floats, beta and decay rows v_heads (the b and a projections), a_log and dt_bias
 * v_heads f32 each. v_dim ≤ 1024. Value head h reads key head h / (v_heads / k_heads), or
 * h mod k_heads when v_tiled (backend.h's smoe_linear_shape). */
/* Once per process before smoe_cu_deltanet_rule (at share creation): the shared memory it may use. */
int smoe_cu_deltanet_setup(void);
int smoe_cu_deltanet_rule(smoe_cu_stream st, float *att, const float *mix, const float *beta, const float *decay,
                          const float *z, float *state, const float *a_log, const float *dt_bias, const float *norm,
                          uint32_t n, uint32_t k_heads, uint32_t v_heads, uint32_t k_dim, uint32_t v_dim,
                          uint32_t v_tiled, float eps);

/* ggml.cu: GGML block formats (smoe.h's SMOE_FMT_GGML_*: ggml_type + 32). 1 when T is one. */
int smoe_cu_ggml(const smoe_cu_tensor *T);
/* smoe_cu_matmul for a GGML tensor (f32 activations: a->x), and smoe_cu_embed for one. */
int smoe_cu_matmul_ggml(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a,
                        float *y, size_t ldy);
int smoe_cu_embed_ggml(smoe_cu_stream st, const smoe_cu_tensor *T, const uint8_t *w, const int32_t *ids, uint32_t n,
                       float *x);

#ifdef __cplusplus
}
#endif
#endif
