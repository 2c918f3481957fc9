/* rows.cu — the kernels that work row by row: embedding, RMSNorm (with the f16 rows of its output), QK-norm and RoPE with the KV append, residual adds, gathers, SwiGLU (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

/* k_rmsnorm then k_prep on rows [0, rows) in one launch: the same arithmetic, the same bits. A row
 * of up to RP_MAX·256 columns (a multiple of 256) stays in registers: thread i holds columns
 * i + 256k, and the f16 row's order (0 4 1 5 2 6 3 7 within each 8) takes each value from a lane
 * of the same warp; wider rows go through the output row in memory. */
enum { RP_MAX = 16 };
__global__ void k_rmsnorm_prep(float *out, const float *x, uint32_t dim, const uint8_t *wt, uint8_t wfmt, float eps,
                               __half *x16, float *xe) {
    pdl_enter();
    const size_t row = blockIdx.x;
    if (dim % 256 != 0 || dim > RP_MAX * 256) {
        rms_row(out + row * dim, x + row * dim, dim, wt, wfmt, eps);
        __syncthreads(); /* the row's outputs, written by every thread, before any is read */
        prep_row(out + row * dim, dim, row, x16, xe);
        return;
    }
    const float *xr = x + row * dim;
    const uint32_t nk = dim / 256, lane = threadIdx.x & 31;
    float v[RP_MAX], wv[RP_MAX]; /* the weights loaded with the row, not after its sum */
    float s = 0.0f;
#pragma unroll
    for (uint32_t k = 0; k < RP_MAX; k++)
        if (k < nk) {
            const uint32_t c = threadIdx.x + 256 * k;
            v[k] = xr[c];
            wv[k] = wfmt == FMT_F32 ? reinterpret_cast<const float *>(wt)[c]
                                    : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(wt)[c] << 16);
        }
#pragma unroll
    for (uint32_t k = 0; k < RP_MAX; k++)
        if (k < nk) s = __fadd_rn(s, __fmul_rn(v[k], v[k]));
    const float r = 1.0f / sqrtf(tree256(s) / (float)dim + eps);
    float m = 0.0f;
#pragma unroll
    for (uint32_t k = 0; k < RP_MAX; k++)
        if (k < nk) {
            const uint32_t c = threadIdx.x + 256 * k;
            v[k] = __fmul_rn(wv[k], __fmul_rn(v[k], r));
            out[row * dim + c] = v[k];
            m = fmaxf(m, fabsf(v[k]));
        }
    const int e = prep_exp(max256(m));
    const float down = ldexpf(1.0f, -e);
    const uint32_t src = (lane & ~7u) | (lane & 7u) >> 1 | (lane & 1u) << 2; /* 256k is a multiple of 8 */
    __half *o = x16 + row * dim;
#pragma unroll
    for (uint32_t k = 0; k < RP_MAX; k++)
        if (k < nk) o[threadIdx.x + 256 * k] = __float2half_rn(__fmul_rn(__shfl_sync(0xffffffffu, v[k], src), down));
    if (threadIdx.x == 0) xe[row] = ldexpf(1.0f, e);
}

extern "C" int smoe_cu_rmsnorm_prep(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim,
                                    const uint8_t *weight, uint8_t weight_format, float eps, void *x16, float *xe) {
    if (rows == 0) return 0;
    launch_k(PDL_ALL, k_rmsnorm_prep, dim3(rows), dim3(256), 0, (cudaStream_t)st, out, x, dim, weight, weight_format,
             eps, (__half *)x16, xe);
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------------- embedding */

__global__ void k_embed(smoe_cu_tensor T, const uint8_t *w, const int32_t *ids, float *x) {
    pdl_enter();
    const uint32_t t = blockIdx.x, r = (uint32_t)ids[t];
    const size_t rc = (size_t)r * T.cols;
    for (uint32_t c = threadIdx.x; c < T.cols; c += blockDim.x) {
        float v;
        if (T.format == FMT_F32) {
            v = reinterpret_cast<const float *>(w)[rc + c];
        } else if (T.format == FMT_BF16) {
            v = __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(w)[rc + c] << 16);
        } else {
            const uint32_t ng = T.cols / T.group;
            const float s = ld_scale(T.scale_format, w + T.scales_off, (size_t)r * ng + c / T.group);
            const float b = ld_scale(T.scale_format, w + T.biases_off, (size_t)r * ng + c / T.group);
            uint32_t code = T.format == FMT_Q8 ? w[rc + c] : (w[(rc + c) / 2] >> (4 * (c & 1))) & 15u;
            v = __fadd_rn(__fmul_rn(s, (float)code), b);
        }
        x[(size_t)t * T.cols + c] = v;
    }
}

extern "C" int smoe_cu_embed(smoe_cu_stream st, const smoe_cu_tensor *T, const uint8_t *w, const int32_t *ids,
                             uint32_t n, float *x) {
    if (n == 0) return 0;
    if (smoe_cu_ggml(T)) return smoe_cu_embed_ggml(st, T, w, ids, n, x); /* GGML block formats: ggml.cu */
    launch_k(PDL_ALL, k_embed, dim3(n), dim3(256), 0, (cudaStream_t)st, *T, w, ids, x);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------------------- rmsnorm */

__global__ void k_rmsnorm(float *out, const float *x, uint32_t dim, size_t ld, const uint8_t *wt, uint8_t wfmt, float eps) {
    pdl_enter();
    rms_row(out + (size_t)blockIdx.x * ld, x + (size_t)blockIdx.x * ld, dim, wt, wfmt, eps);
}

extern "C" int smoe_cu_rmsnorm(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim, size_t ld,
                               const uint8_t *weight, uint8_t weight_format, float eps) {
    if (rows == 0) return 0;
    launch_k(PDL_ALL, k_rmsnorm, dim3(rows), dim3(256), 0, (cudaStream_t)st, out, x, dim, ld, weight, weight_format,
             eps);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------- QK-norm, RoPE, KV cache */

/* QK-norm, RoPE and the KV append of one layer in one launch: block (t, h) normalises (unless its
 * norm is NULL) and rotates q row h of token t, or (h ≥ heads) K row h − heads, which it then stores
 * with its V row at position *pos0 + t (rotate-half RoPE over the first rot dims, cos/sin tables of
 * (context, rot/2); the dims from rot on pass through); rms_row is k_rmsnorm's arithmetic, so q and
 * K are what the norm kernel would give. */
template <typename T>
__global__ void k_qk_post(float *q, float *ks, const float *vs, T *kc, T *vc, uint32_t heads, uint32_t kv_heads,
                          uint32_t hd, uint32_t rot, const uint8_t *qw, uint8_t qfmt, const uint8_t *kw, uint8_t kfmt,
                          float eps, const float *cs, const float *sn, const uint32_t *pos0) {
    pdl_enter();
    const uint32_t per = heads + kv_heads, t = blockIdx.x / per, h = blockIdx.x % per, half = rot / 2;
    const bool isq = h < heads;
    float *row = isq ? q + ((size_t)t * heads + h) * hd : ks + ((size_t)t * kv_heads + (h - heads)) * hd;
    const uint8_t *nw = isq ? qw : kw; /* the same for the whole block: its branch is uniform */
    if (nw) {
        rms_row(row, row, hd, nw, isq ? qfmt : kfmt, eps);
        __syncthreads();
    }
    const size_t pos = (size_t)*pos0 + t;
    for (uint32_t k = threadIdx.x; k < half; k += blockDim.x) {
        const float c = cs[pos * half + k], s = sn[pos * half + k];
        const float a = row[k], b = row[k + half];
        row[k] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        row[k + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    if (isq) return;
    __syncthreads();
    const uint32_t kvh = h - heads, kv_dim = kv_heads * hd;
    const float *vr = vs + ((size_t)t * kv_heads + kvh) * hd;
    for (uint32_t c = threadIdx.x; c < hd; c += blockDim.x) {
        kc[pos * kv_dim + (size_t)kvh * hd + c] = kv_t<T>(row[c]);
        vc[pos * kv_dim + (size_t)kvh * hd + c] = kv_t<T>(vr[c]);
    }
}

extern "C" int smoe_cu_qk_post(smoe_cu_stream st, float *q, float *ks, const float *vs, void *k, void *v,
                               uint32_t kv_type, uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd,
                               uint32_t rot, const uint8_t *q_norm, uint8_t q_norm_format, const uint8_t *k_norm,
                               uint8_t k_norm_format, float eps, const float *cos, const float *sin,
                               const uint32_t *pos0) {
    if (n == 0) return 0;
    const dim3 grid(n * (heads + kv_heads));
    cudaStream_t s = (cudaStream_t)st;
#define QK_POST(T)                                                                                                     \
    launch_k(PDL_ALL, k_qk_post<T>, grid, dim3(256), 0, s, q, ks, vs, (T *)k, (T *)v, heads, kv_heads, hd, rot,        \
             q_norm, q_norm_format, k_norm, k_norm_format, eps, cos, sin, pos0)
    if (kv_type == 1)
        QK_POST(__nv_bfloat16);
    else if (kv_type == 2)
        QK_POST(__half);
    else
        QK_POST(float);
#undef QK_POST
    return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------------ small kernels */

__global__ void k_add(float *x, const float *y, size_t count) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = __fadd_rn(x[i], y[i]);
}

/* y[t·W + c] += b[c] (f32 or bf16, W entries), t < n. */
__global__ void k_bias(float *y, const uint8_t *b, uint8_t bfmt, uint32_t W, size_t count) {
    pdl_enter();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const uint32_t c = (uint32_t)(i % W);
    const float bv = bfmt == FMT_F32 ? reinterpret_cast<const float *>(b)[c]
                                     : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(b)[c] << 16);
    y[i] = __fadd_rn(y[i], bv);
}

extern "C" int smoe_cu_bias(smoe_cu_stream st, float *y, uint32_t n, uint32_t W, const uint8_t *bias,
                            uint8_t bias_format) {
    const size_t count = (size_t)n * W;
    if (count == 0) return 0;
    launch_k(PDL_ALL, k_bias, dim3((unsigned)((count + 255) / 256)), dim3(256), 0, (cudaStream_t)st, y, bias,
             bias_format, W, count);
    return (int)cudaGetLastError();
}

extern "C" int smoe_cu_add(smoe_cu_stream st, float *x, const float *y, size_t count) {
    if (count == 0) return 0;
    launch_k(PDL_ALL, k_add, dim3((unsigned)((count + 255) / 256)), dim3(256), 0, (cudaStream_t)st, x, y, count);
    return (int)cudaGetLastError();
}

__global__ void k_gather(float *xg, const float *xn, const uint32_t *rows, uint32_t K, uint32_t hidden) {
    pdl_enter();
    const uint32_t j = blockIdx.x, src = rows[j] / K;
    for (uint32_t c = threadIdx.x; c < hidden; c += blockDim.x) xg[(size_t)j * hidden + c] = xn[(size_t)src * hidden + c];
}

/* The same for rows prepared by k_prep: f16 rows (cols halves) and their scales. */
__global__ void k_gather16(__half *g16, float *ge, const __half *a16, const float *ae, const uint32_t *rows, uint32_t K,
                           uint32_t cols) {
    pdl_enter();
    const uint32_t j = blockIdx.x, src = rows[j] / K;
    const uint4 *in = reinterpret_cast<const uint4 *>(a16 + (size_t)src * cols);
    uint4 *out = reinterpret_cast<uint4 *>(g16 + (size_t)j * cols);
    for (uint32_t c = threadIdx.x; c < cols / 8; c += blockDim.x) out[c] = in[c];
    if (threadIdx.x == 0) ge[j] = ae[src];
}

extern "C" int smoe_cu_gather16(smoe_cu_stream st, void *g16, float *ge, const void *a16, const float *ae,
                                const uint32_t *rows, uint32_t K, uint32_t total, uint32_t cols) {
    if (total == 0) return 0;
    launch_k(PDL_ALL, k_gather16, dim3(total), dim3(128), 0, (cudaStream_t)st, (__half *)g16, ge, (const __half *)a16,
             ae, rows, K, cols);
    return (int)cudaGetLastError();
}

extern "C" int smoe_cu_gather(smoe_cu_stream st, float *xg, const float *xn, const uint32_t *rows, uint32_t K,
                              uint32_t total, uint32_t hidden) {
    if (total == 0) return 0;
    launch_k(PDL_ALL, k_gather, dim3(total), dim3(256), 0, (cudaStream_t)st, xg, xn, rows, K, hidden);
    return (int)cudaGetLastError();
}

/* The activation of one element: silu(g) · u, or (act.kind 1, gpt-oss) the clamped SwiGLU with the
 * CPU's steps (cpu/kernels.h, smoe_swiglu_clamped: comparisons, so that a NaN stays a NaN). */
__device__ __forceinline__ float act_of(float g, float u, smoe_cu_act_fn f) {
    if (f.kind == 0) return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    const float gi = g > f.limit ? f.limit : g;
    const float ui = u > f.limit ? f.limit : u < -f.limit ? -f.limit : u;
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(gi, f.alpha))));
    return __fmul_rn(__fadd_rn(ui, 1.0f), __fmul_rn(gi, sig));
}

__global__ void k_swiglu(float *h, const float *hg, uint32_t I, smoe_cu_rows R, smoe_cu_act_fn f) {
    pdl_enter();
    uint32_t start, count;
    item_rows(R, &start, &count);
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)count * I) return;
    const size_t j = start + i / I, c = i % I;
    h[j * I + c] = act_of(hg[j * 2 * I + c], hg[j * 2 * I + I + c], f);
}

extern "C" int smoe_cu_swiglu(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R,
                              smoe_cu_act_fn f) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    dim3 grid((unsigned)(((size_t)m * I + 255) / 256), items);
    launch_k(PDL_ALL, k_swiglu, grid, dim3(256), 0, (cudaStream_t)st, h, hg, I, *R, f);
    return (int)cudaGetLastError();
}

/* y row (yrow[j], or j) += the bias vector of the item's expert (wtab[u] + off: cols entries, f32 or
 * bf16), from column col0, for the rows of each item (an expert's gate, up or down bias). */
__global__ void k_bias_items(float *y, size_t ldy, uint32_t col0, smoe_cu_rows R, uint64_t off, uint8_t fmt,
                             uint32_t cols) {
    pdl_enter();
    uint32_t start, count;
    const uint32_t u = item_rows(R, &start, &count);
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)count * cols) return;
    const size_t j = start + i / cols;
    const uint32_t c = (uint32_t)(i % cols);
    const uint8_t *b = R.wtab[u] + off;
    const float bv = fmt == FMT_F32 ? reinterpret_cast<const float *>(b)[c]
                                    : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(b)[c] << 16);
    float *p = y + (size_t)(R.yrow ? R.yrow[j] : j) * ldy + col0 + c;
    *p = __fadd_rn(*p, bv);
}

extern "C" int smoe_cu_bias_items(smoe_cu_stream st, float *y, size_t ldy, uint32_t col0, const smoe_cu_rows *R,
                                  uint64_t off, uint8_t bias_format, uint32_t cols) {
    if (!R->items || R->n_items == 0 || R->max_count == 0) return 0;
    dim3 grid((unsigned)(((size_t)R->max_count * cols + 255) / 256), R->n_items);
    launch_k(PDL_ALL, k_bias_items, grid, dim3(256), 0, (cudaStream_t)st, y, ldy, col0, *R, off, bias_format,
             cols);
    return (int)cudaGetLastError();
}

/* k_swiglu then k_prep, a row a block (grid as k_prep's): the same arithmetic, the same bits. */
__global__ void k_swiglu_prep(float *h, const float *hg, uint32_t I, smoe_cu_rows R, smoe_cu_act_fn f, __half *h16,
                              float *he) {
    pdl_enter();
    uint32_t start, count;
    item_rows(R, &start, &count);
    if (blockIdx.x >= count) return;
    const size_t j = start + blockIdx.x;
    for (uint32_t c = threadIdx.x; c < I; c += blockDim.x) h[j * I + c] = act_of(hg[j * 2 * I + c], hg[j * 2 * I + I + c], f);
    __syncthreads(); /* the row, written by every thread, before any is read */
    prep_row(h + j * I, I, j, h16, he);
}

extern "C" int smoe_cu_swiglu_prep(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R,
                                   smoe_cu_act_fn f, void *h16, float *he) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    launch_k(PDL_ALL, k_swiglu_prep, dim3(m, items), dim3(256), 0, (cudaStream_t)st, h, hg, I, *R, f, (__half *)h16,
             he);
    return (int)cudaGetLastError();
}
