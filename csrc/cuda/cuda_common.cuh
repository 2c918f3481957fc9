/* cuda_common.cuh — what the CUDA backend's kernel files share: formats, the reduction-order rule,
 * and the device helpers more than one of them uses (cuda_ops.h declares the kernels).
 *
 * The files, by concern: runtime.cu (allocator, streams, events, graphs), matmul.cu (the
 * products, the tensor cores, the f16 rows they read), rows.cu (embedding, norms, QK-norm and
 * RoPE with the KV append, residual adds, SwiGLU, gathers), attention.cu, moe.cu (routing, the
 * device union, the experts' weighted sum), sample.cu (sampling's selection).
 *
 * The reduction-order rule on the GPU
 * -----------------------------------
 * Each output element is reduced by one warp or one thread in an order fixed by its own shape:
 *
 *   matrix product y[t, r] (smoe_cu_matmul): the columns are taken 8 at a time (a "word": 8
 *     codes of q4, 8 bytes of q8, 8 bf16 or f32 values); lane l of the row's warp takes words
 *     l, l + 32, l + 64, … in that order and accumulates acc = fma(w_c, x_c, acc) over the
 *     word's 8 columns in column order, from +0; then the warp's xor butterfly (offsets 16, 8,
 *     4, 2, 1) adds the 32 lanes. A weight is dequantised as float(scale)·float(q) rounded, plus
 *     float(bias) rounded (no fused multiply-add: the CPU's dequantisation, docs/vault.md).
 *     Tokens are tiled 8 to a warp and 64 to a block, rows 8 to a block, experts one to a
 *     block row; none of it touches a sum's order, so a row computed alone (decode), in a chunk
 *     (prefill), in a group of resident experts or in the launch of one streamed expert has the
 *     same bits.
 *   RMSNorm: thread i of 256 sums x_c² for c ≡ i (mod 256) in order, then a fixed tree.
 *   attention, per (token, head): score p by a warp (lanes over head dims d ≡ l mod 32, then the
 *     butterfly), scaled by 1/√d; softmax with the max (exact in any order), exp, per-thread sums
 *     over p ≡ i (mod 256) in order and a fixed tree; each weight divided by the sum; then
 *     out[d] = fma(weight_p, v_p[d], out[d]) over p = 0, 1, … by one thread.
 *   routing, per token, one warp (k_route says its order).
 *   the experts' weighted sum, per element: acc = 0; acc += w_k·y_k (product rounded, then the
 *     add) for k = 0 .. K−1; then x += acc — the CPU's order (cpu/products.c, combine).
 * The values differ from the CPU kernels' (another summation order, fma), within the tolerance
 * tests/test_cuda.py states; only the GPU's two paths are bit-identical to each other. */
#ifndef SMOE_CUDA_COMMON_CUH
#define SMOE_CUDA_COMMON_CUH

#include "cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdlib.h>

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8 = 2, FMT_Q4 = 3 };
enum { SC_F16 = 1, SC_BF16 = 2, SC_F32 = 3 };
enum { MM_WARPS = 8, MM_TT = 8, MM_TZ = 64, ATT_THREADS = 256, ATT_SMEM = 200 * 1024, SAMP_THREADS = 1024 };

__device__ __forceinline__ float ld_scale(uint8_t sf, const uint8_t *p, size_t i) {
    if (sf == SC_F32) return reinterpret_cast<const float *>(p)[i];
    uint16_t v = reinterpret_cast<const uint16_t *>(p)[i];
    if (sf == SC_F16) return __half2float(__ushort_as_half(v));
    return __uint_as_float((uint32_t)v << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The 8 columns of word wi of row r, dequantised. */
template <int FMT>
__device__ __forceinline__ void deq8(const uint8_t *w, const smoe_cu_tensor &T, uint32_t r, uint32_t wi, float v[8]) {
    const size_t rc = (size_t)r * T.cols;
    if (FMT == FMT_F32) {
        const float4 *p = reinterpret_cast<const float4 *>(w + 4 * (rc + 8 * (size_t)wi));
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else if (FMT == FMT_BF16) {
        uint4 q = *reinterpret_cast<const uint4 *>(w + 2 * (rc + 8 * (size_t)wi));
        uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            v[2 * j] = __uint_as_float(u[j] << 16);
            v[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
        }
    } else {
        const uint32_t gs = __ffs(T.group) - 1; /* groups are 32, 64 or 128: shifts, not divisions */
        const uint32_t ng = T.cols >> gs, g = (8 * wi) >> gs;
        const float s = ld_scale(T.scale_format, w + T.scales_off, (size_t)r * ng + g);
        const float b = ld_scale(T.scale_format, w + T.biases_off, (size_t)r * ng + g);
        if (FMT == FMT_Q8) {
            uint2 q = *reinterpret_cast<const uint2 *>(w + rc + 8 * (size_t)wi);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t code = ((k < 4 ? q.x : q.y) >> (8 * (k & 3))) & 255u;
                v[k] = __fadd_rn(__fmul_rn(s, (float)code), b);
            }
        } else {
            uint32_t q = *reinterpret_cast<const uint32_t *>(w + rc / 2 + 4 * (size_t)wi);
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = __fadd_rn(__fmul_rn(s, (float)((q >> (4 * k)) & 15u)), b);
        }
    }
}

/* The token rows a block works on: item blockIdx.y's run with an item list (a tile of it when
 * tiled), else rows [0, n); returns the item's union position. */
__device__ __forceinline__ uint32_t item_rows(const smoe_cu_rows &R, uint32_t *start, uint32_t *count) {
    *start = 0;
    *count = R.n;
    if (!R.items) return 0;
    const uint32_t v = R.items[blockIdx.y];
    if (!R.tile) {
        *start = R.start[v];
        *count = R.count[v];
        return v;
    }
    *count = 0;
    if (v == SMOE_CU_NO_ITEM) return 0;
    const uint32_t u = v >> 16, j0 = (v & 0xFFFFu) * R.tile;
    *start = R.start[u] + j0;
    *count = min(R.tile, R.count[u] - j0);
    return u;
}

/* The matrix and the tokens a block of a product launch works on: with an item list (one launch
 * over several experts), item blockIdx.y's expert weights and its run of token rows; else the one
 * matrix and every token. *bx is the block's row block: a pair launch (R.pair) has twice the row
 * blocks, the second half multiplying the tensor at R.woff2 into the T.rows columns after the
 * first's (y + *ycol). */
__device__ __forceinline__ void launch_item(const smoe_cu_rows &R, const smoe_cu_tensor &T, uint32_t *ycol,
                                            uint32_t *bx, const uint8_t **w, uint32_t *start, uint32_t *count) {
    const uint32_t u = item_rows(R, start, count), half = gridDim.x / 2;
    const bool second = R.pair && blockIdx.x >= half;
    *bx = second ? blockIdx.x - half : blockIdx.x;
    *ycol = second ? T.rows : 0;
    *w = !R.items ? R.w : *count ? R.wtab[u] + (second ? R.woff2 : R.woff) : nullptr;
}

/* Programmatic dependent launch (sm_90 on): a kernel that calls pdl_trigger lets the next kernel
 * in its stream, when that one is launched so, start before it ends; that kernel reads only what was
 * there before its predecessor's predecessor ended until pdl_wait returns, which is when the
 * predecessor has finished and its writes are visible. Both are no-ops for a kernel not launched
 * so, and below sm_90. The products (matmul.cu) trigger at once and prefetch their weights before
 * they wait; every other kernel that may be launched so begins with pdl_enter — wait, then trigger —
 * so that a kernel that starts early behind it finds the one before it finished (what the products'
 * early reads rely on), and a grid never ends before its predecessor has. */
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

/* Which launches start early (runtime.cu, read once per process; 0 below sm_90): 0 none
 * (SMOE_CUDA_PDL=0), 1 the one-token products, 2 (SMOE_CUDA_PDL=2) every kernel of the step that
 * begins with pdl_enter too. Changes no bits. */
extern "C" int smoe_cu_pdl_level(void);
#define PDL_ALL (smoe_cu_pdl_level() >= 2)

/* k<<<grid, block, smem, s>>>(args...), launched to start early when pdl (see above). */
template <typename... P, typename... A>
static inline void launch_k(bool pdl, void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                            A... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaLaunchKernelEx(&cfg, k, args...);
}
__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

/* One m16n8k16 tensor-core product: f16 inputs, f32 accumulation (matmul.cu, attention.cu). */
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }

/* SMOE_CUDA_TC=0 or SMOE_CUDA_FLASH=0 (read once per process) turn the tensor-core products or the
 * tensor-core attention off, for comparisons: the older kernels, in their own fixed orders. */
static inline bool env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}

/* The fixed tree of 256 partial sums (thread i's) of rms_row: s[i] += s[i + k] for k = 128, 64, …, 1,
 * the last five levels by warp 0's shuffles (lane i adds lane i + k's: the same adds in the same
 * order as the shared-memory levels they replace). Every thread gets the total. */
__device__ __forceinline__ float tree256(float s) {
    __shared__ float sh[256];
    __shared__ float total;
    sh[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x < 128) sh[threadIdx.x] = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + 128]);
    __syncthreads();
    if (threadIdx.x < 64) sh[threadIdx.x] = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + 64]);
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + 32]);
#pragma unroll
        for (int k = 16; k > 0; k >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, k));
        if (threadIdx.x == 0) total = v;
    }
    __syncthreads();
    return total;
}

/* One row by a block of 256 threads: the sum of squares strided by thread, then a tree. */
__device__ __forceinline__ void rms_row(float *orow, const float *xr, uint32_t dim, const uint8_t *wt, uint8_t wfmt,
                                        float eps) {
    float s = 0.0f;
    for (uint32_t c = threadIdx.x; c < dim; c += 256) s = __fadd_rn(s, __fmul_rn(xr[c], xr[c]));
    const float r = 1.0f / sqrtf(tree256(s) / (float)dim + eps);
    for (uint32_t c = threadIdx.x; c < dim; c += 256) {
        const float wv = wfmt == FMT_F32 ? reinterpret_cast<const float *>(wt)[c]
                                         : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(wt)[c] << 16);
        orow[c] = __fmul_rn(wv, __fmul_rn(xr[c], r));
    }
}

/* The largest of 256 threads' values (exact in any order). */
__device__ __forceinline__ float max256(float m) {
    __shared__ float red[8];
#pragma unroll
    for (int k = 16; k > 0; k >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, k));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int w = 1; w < 8; w++) m = fmaxf(m, red[w]);
    return m;
}

/* The power of two e for a row whose largest |x| is m: m · 2^-e in [2^14, 2^15). */
__device__ __forceinline__ int prep_exp(float m) {
    int ex = 0;
    if (m > 0.0f && isfinite(m)) frexpf(m, &ex); /* else 0, or a row holding inf/NaN (its outputs are not finite anyway) */
    return max(ex - 15, -100);
}

/* One row to f16 by a block of 256 threads (k_prep: the rows of R, as the products take them),
 * scaled by the power of two that puts its largest |x| in [2^14, 2^15); xe holds the factor that
 * undoes it. The maximum is exact in any order. */
__device__ __forceinline__ void prep_row(const float *xr, uint32_t cols, size_t row, __half *x16, float *xe) {
    float m = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += 256) m = fmaxf(m, fabsf(xr[c]));
    const int e = prep_exp(max256(m));
    const float down = ldexpf(1.0f, -e);
    __half *o = x16 + row * cols;
    /* within each 8 columns, the order 0 4 1 5 2 6 3 7 (k_tc's order) */
    for (uint32_t c = threadIdx.x; c < cols; c += 256)
        o[c] = __float2half_rn(__fmul_rn(xr[(c & ~7u) | (c & 7u) >> 1 | (c & 1u) << 2], down));
    if (threadIdx.x == 0) xe[row] = ldexpf(1.0f, e);
}

/* The KV cache's element types (smoe_kv_dtype: 0 f32, 1 bf16, 2 f16): stored rounded to nearest
 * even, read widened exactly, or as the f16 the tensor cores take (RN from f32 or from bf16's f32). */
__device__ __forceinline__ float kv_f(float x) { return x; }
__device__ __forceinline__ float kv_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float kv_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T kv_t(float x);
template <> __device__ __forceinline__ float kv_t<float>(float x) { return x; }
template <> __device__ __forceinline__ __half kv_t<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 kv_t<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
/* four consecutive elements (16-byte aligned for f32, 8 for the others) as two f16 pairs */
__device__ __forceinline__ void kv_h4(const float *p, __half2 *a, __half2 *b) {
    const float4 x = *reinterpret_cast<const float4 *>(p);
    *a = __floats2half2_rn(x.x, x.y);
    *b = __floats2half2_rn(x.z, x.w);
}
__device__ __forceinline__ void kv_h4(const __half *p, __half2 *a, __half2 *b) {
    const uint2 x = *reinterpret_cast<const uint2 *>(p);
    *a = *reinterpret_cast<const __half2 *>(&x.x);
    *b = *reinterpret_cast<const __half2 *>(&x.y);
}
__device__ __forceinline__ void kv_h4(const __nv_bfloat16 *p, __half2 *a, __half2 *b) {
    const uint2 x = *reinterpret_cast<const uint2 *>(p);
    *a = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&x.x)));
    *b = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&x.y)));
}

#endif
