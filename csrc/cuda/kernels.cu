/* kernels.cu — the CUDA backend's kernels, device allocator and upload path (cuda_ops.h).
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
 *     add) for k = 0 .. K−1; then x += acc — the CPU's order (layer.c).
 * The values differ from the CPU kernels' (another summation order, fma), within the tolerance
 * tests/test_cuda.py states; only the GPU's two paths are bit-identical to each other. */
#include "cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8 = 2, FMT_Q4 = 3 };
enum { SC_F16 = 1, SC_BF16 = 2, SC_F32 = 3 };
enum { MM_WARPS = 8, MM_TT = 8, MM_TZ = 64, ATT_THREADS = 256, ATT_SMEM = 200 * 1024 };

/* ------------------------------------------------------------------ allocator and uploads */

extern "C" const char *smoe_cu_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

extern "C" int smoe_cu_device(int ordinal, char *name, size_t cap, int *sm_major, int *sm_minor, size_t *free_bytes,
                              size_t *total_bytes) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return (int)e;
    if (ordinal >= count) return (int)cudaErrorInvalidDevice;
    if ((e = cudaSetDevice(ordinal)) != cudaSuccess) return (int)e;
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, ordinal)) != cudaSuccess) return (int)e;
    if (name && cap) {
        size_t i = 0;
        for (; i + 1 < cap && p.name[i]; i++) name[i] = p.name[i];
        name[i] = 0;
    }
    *sm_major = p.major;
    *sm_minor = p.minor;
    return (int)cudaMemGetInfo(free_bytes, total_bytes);
}

extern "C" int smoe_cu_alloc(void **p, size_t bytes) { return (int)cudaMalloc(p, bytes ? bytes : 256); }
extern "C" void smoe_cu_free(void *p) { if (p) cudaFree(p); }
extern "C" int smoe_cu_host_alloc(void **p, size_t bytes) { return (int)cudaHostAlloc(p, bytes ? bytes : 64, cudaHostAllocDefault); }
extern "C" void smoe_cu_host_free(void *p) { if (p) cudaFreeHost(p); }
extern "C" int smoe_cu_host_register(void *p, size_t bytes) { return (int)cudaHostRegister(p, bytes, cudaHostRegisterDefault); }
extern "C" void smoe_cu_host_unregister(void *p) { if (p) cudaHostUnregister(p); }
extern "C" int smoe_cu_upload(void *dst, const void *src, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)st);
}
extern "C" int smoe_cu_download(void *dst, const void *src, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)st);
}
extern "C" int smoe_cu_memset(void *dst, int v, size_t bytes, smoe_cu_stream st) {
    return (int)cudaMemsetAsync(dst, v, bytes, (cudaStream_t)st);
}
extern "C" int smoe_cu_stream_new(smoe_cu_stream *st) {
    cudaStream_t s;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *st = e == cudaSuccess ? (void *)s : NULL;
    return (int)e;
}
extern "C" void smoe_cu_stream_free(smoe_cu_stream st) { if (st) cudaStreamDestroy((cudaStream_t)st); }
extern "C" int smoe_cu_stream_sync(smoe_cu_stream st) { return (int)cudaStreamSynchronize((cudaStream_t)st); }
extern "C" int smoe_cu_event_new(smoe_cu_event *ev) {
    cudaEvent_t e;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *ev = r == cudaSuccess ? (void *)e : NULL;
    return (int)r;
}
extern "C" void smoe_cu_event_free(smoe_cu_event ev) { if (ev) cudaEventDestroy((cudaEvent_t)ev); }
extern "C" int smoe_cu_event_record(smoe_cu_event ev, smoe_cu_stream st) {
    return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)st);
}
extern "C" int smoe_cu_event_sync(smoe_cu_event ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }
extern "C" int smoe_cu_stream_wait(smoe_cu_stream st, smoe_cu_event ev) {
    return (int)cudaStreamWaitEvent((cudaStream_t)st, (cudaEvent_t)ev, 0);
}
extern "C" int smoe_cu_last_error(void) { return (int)cudaGetLastError(); }

/* ------------------------------------------------------------------------------ helpers */

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

/* --------------------------------------------------------------------------- matmul */

/* s + w·x over one word's 8 columns, in column order: the one chain every product uses. */
__device__ __forceinline__ float chain8(float s, const float v[8], const float4 a, const float4 b) {
    s = fmaf(v[0], a.x, s); s = fmaf(v[1], a.y, s); s = fmaf(v[2], a.z, s); s = fmaf(v[3], a.w, s);
    s = fmaf(v[4], b.x, s); s = fmaf(v[5], b.y, s); s = fmaf(v[6], b.z, s); s = fmaf(v[7], b.w, s);
    return s;
}

__device__ __forceinline__ float dot8(float s, const float v[8], const float *x) {
    const float4 *xp = reinterpret_cast<const float4 *>(x);
    return chain8(s, v, xp[0], xp[1]);
}

/* The matrix and the tokens a block of a product launch works on: with an item list (one launch
 * over several experts), item blockIdx.y's expert weights and its run of token rows; else the one
 * matrix and every token. */
__device__ __forceinline__ void launch_item(const smoe_cu_rows &R, const uint8_t **w, uint32_t *start,
                                            uint32_t *count) {
    if (R.items) {
        const uint32_t u = R.items[blockIdx.y];
        *w = R.wtab[u] + R.woff;
        *start = R.start[u];
        *count = R.count[u];
    } else {
        *w = R.w;
        *start = 0;
        *count = R.n;
    }
}

template <int FMT>
__global__ void __launch_bounds__(MM_WARPS * 32) k_matmul(smoe_cu_tensor T, smoe_cu_rows R, const float *__restrict__ x,
                                                          size_t ldx, float *__restrict__ y, size_t ldy) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t r = blockIdx.x * MM_WARPS + warp;
    if (r >= T.rows) return;
    const uint8_t *w;
    uint32_t start, count;
    launch_item(R, &w, &start, &count);
    const uint32_t t0 = blockIdx.z * MM_TZ;
    if (t0 >= count) return;
    const uint32_t t1 = min(count, t0 + (uint32_t)MM_TZ), nw = T.cols / 8;
    for (uint32_t tb = t0; tb < t1; tb += MM_TT) {
        const uint32_t nt = min((uint32_t)MM_TT, t1 - tb);
        float acc[MM_TT];
#pragma unroll
        for (int t = 0; t < MM_TT; t++) acc[t] = 0.0f;
        uint32_t wi = lane;
        /* 4 words in flight (their loads issued together), applied in word order */
        for (; wi + 96 < nw; wi += 128) {
            float v[4][8];
#pragma unroll
            for (int q = 0; q < 4; q++) deq8<FMT>(w, T, r, wi + 32 * q, v[q]);
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int t = 0; t < MM_TT; t++)
                    if ((uint32_t)t < nt) acc[t] = dot8(acc[t], v[q], x + (size_t)(start + tb + t) * ldx + 8 * (size_t)(wi + 32 * q));
        }
        for (; wi < nw; wi += 32) {
            float v[8];
            deq8<FMT>(w, T, r, wi, v);
#pragma unroll
            for (int t = 0; t < MM_TT; t++)
                if ((uint32_t)t < nt) acc[t] = dot8(acc[t], v, x + (size_t)(start + tb + t) * ldx + 8 * (size_t)wi);
        }
#pragma unroll
        for (int t = 0; t < MM_TT; t++) {
            if ((uint32_t)t >= nt) break; /* nt is the warp's: the shuffles below stay converged */
            const float sum = warp_sum(acc[t]);
            if (lane == 0) {
                const uint32_t j = start + tb + t;
                const uint32_t out = R.yrow ? R.yrow[j] : j;
                y[(size_t)out * ldy + r] = sum;
            }
        }
    }
}

/* The same products for many tokens: each warp takes RT rows, each block TT2 tokens, and the
 * tokens' columns pass through shared memory 256 at a time (32 words: one per lane), so one load of
 * x feeds RT rows and one dequantised word TT2 tokens. Lane l still takes words l, l + 32, … in
 * order with the same fma chain and the same butterfly: every element has the bits k_matmul gives
 * it, whichever kernel a launch picks. */
enum { RT = 4, TT2 = 16, CHUNK = 256, TILED_MIN = 16 };

template <int FMT>
__global__ void __launch_bounds__(MM_WARPS * 32) k_matmul_tiled(smoe_cu_tensor T, smoe_cu_rows R,
                                                                const float *__restrict__ x, size_t ldx,
                                                                float *__restrict__ y, size_t ldy) {
    __shared__ float4 xs[TT2][CHUNK / 4];
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t r0 = (blockIdx.x * MM_WARPS + warp) * RT;
    const uint8_t *w;
    uint32_t start, count;
    launch_item(R, &w, &start, &count);
    const uint32_t t0 = blockIdx.z * TT2;
    if (t0 >= count) return; /* the whole block */
    const uint32_t nt = min((uint32_t)TT2, count - t0), nw = T.cols / 8;
    float acc[RT][TT2];
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int t = 0; t < TT2; t++) acc[i][t] = 0.0f;
    for (uint32_t c0 = 0; c0 < T.cols; c0 += CHUNK) {
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < TT2 * (CHUNK / 4); i += MM_WARPS * 32) {
            const uint32_t t = i / (CHUNK / 4), q = i % (CHUNK / 4);
            float4 val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t < nt && c0 + 4 * q < T.cols)
                val = *reinterpret_cast<const float4 *>(x + (size_t)(start + t0 + t) * ldx + c0 + 4 * q);
            xs[t][q] = val;
        }
        __syncthreads();
        const uint32_t wi = c0 / 8 + lane;
        if (wi >= nw) continue;
        float v[RT][8];
#pragma unroll
        for (int i = 0; i < RT; i++) {
            if (r0 + i < T.rows)
                deq8<FMT>(w, T, r0 + i, wi, v[i]);
            else
#pragma unroll
                for (int k = 0; k < 8; k++) v[i][k] = 0.0f; /* a row past the end: computed, never stored */
        }
#pragma unroll
        for (int t = 0; t < TT2; t++) {
            const float4 a = xs[t][2 * lane], b = xs[t][2 * lane + 1];
#pragma unroll
            for (int i = 0; i < RT; i++) acc[i][t] = chain8(acc[i][t], v[i], a, b);
        }
    }
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int t = 0; t < TT2; t++) {
            if ((uint32_t)t >= nt || r0 + i >= T.rows) break; /* the block's and the warp's: converged */
            const float sum = warp_sum(acc[i][t]);
            if (lane == 0) {
                const uint32_t j = start + t0 + t;
                const uint32_t out = R.yrow ? R.yrow[j] : j;
                y[(size_t)out * ldy + r0 + i] = sum;
            }
        }
}

extern "C" int smoe_cu_matmul(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R, const float *x,
                              size_t ldx, float *y, size_t ldy) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    dim3 grid((T->rows + MM_WARPS - 1) / MM_WARPS, items, (m + MM_TZ - 1) / MM_TZ);
    cudaStream_t s = (cudaStream_t)st;
    if (m >= TILED_MIN) {
        dim3 g2((T->rows + MM_WARPS * RT - 1) / (MM_WARPS * RT), items, (m + TT2 - 1) / TT2);
        switch (T->format) {
        case FMT_F32: k_matmul_tiled<FMT_F32><<<g2, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
        case FMT_BF16: k_matmul_tiled<FMT_BF16><<<g2, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
        case FMT_Q8: k_matmul_tiled<FMT_Q8><<<g2, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
        default: k_matmul_tiled<FMT_Q4><<<g2, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
        }
        return (int)cudaGetLastError();
    }
    switch (T->format) {
    case FMT_F32: k_matmul<FMT_F32><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
    case FMT_BF16: k_matmul<FMT_BF16><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
    case FMT_Q8: k_matmul<FMT_Q8><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
    default: k_matmul<FMT_Q4><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, x, ldx, y, ldy); break;
    }
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------------- embedding */

__global__ void k_embed(smoe_cu_tensor T, const uint8_t *w, const int32_t *ids, float *x) {
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
    k_embed<<<n, 256, 0, (cudaStream_t)st>>>(*T, w, ids, x);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------------------- rmsnorm */

__global__ void k_rmsnorm(float *out, const float *x, uint32_t dim, size_t ld, const uint8_t *wt, uint8_t wfmt, float eps) {
    __shared__ float sh[256];
    const float *xr = x + (size_t)blockIdx.x * ld;
    float *orow = out + (size_t)blockIdx.x * ld;
    float s = 0.0f;
    for (uint32_t c = threadIdx.x; c < dim; c += 256) s = __fadd_rn(s, __fmul_rn(xr[c], xr[c]));
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int k = 128; k > 0; k >>= 1) {
        if (threadIdx.x < (unsigned)k) sh[threadIdx.x] = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + k]);
        __syncthreads();
    }
    const float r = 1.0f / sqrtf(sh[0] / (float)dim + eps);
    for (uint32_t c = threadIdx.x; c < dim; c += 256) {
        const float wv = wfmt == FMT_F32 ? reinterpret_cast<const float *>(wt)[c]
                                         : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(wt)[c] << 16);
        orow[c] = __fmul_rn(wv, __fmul_rn(xr[c], r));
    }
}

extern "C" int smoe_cu_rmsnorm(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim, size_t ld,
                               const uint8_t *weight, uint8_t weight_format, float eps) {
    if (rows == 0) return 0;
    k_rmsnorm<<<rows, 256, 0, (cudaStream_t)st>>>(out, x, dim, ld, weight, weight_format, eps);
    return (int)cudaGetLastError();
}

/* -------------------------------------------------------------------------------- RoPE */

__global__ void k_rope(float *x, uint32_t n, uint32_t heads, uint32_t hd, size_t ld, const float *cs, const float *sn,
                       uint32_t pos0) {
    const uint32_t half = hd / 2;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * heads * half) return;
    const uint32_t k = (uint32_t)(i % half), h = (uint32_t)(i / half % heads), t = (uint32_t)(i / half / heads);
    float *v = x + (size_t)t * ld + (size_t)h * hd;
    const float c = cs[(size_t)(pos0 + t) * half + k], s = sn[(size_t)(pos0 + t) * half + k];
    const float a = v[k], b = v[k + half];
    v[k] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[k + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

extern "C" int smoe_cu_rope(smoe_cu_stream st, float *x, uint32_t n, uint32_t heads, uint32_t hd, size_t ld,
                            const float *cos, const float *sin, uint32_t pos0) {
    size_t total = (size_t)n * heads * (hd / 2);
    if (total == 0) return 0;
    k_rope<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)st>>>(x, n, heads, hd, ld, cos, sin, pos0);
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------------- attention */

__global__ void __launch_bounds__(ATT_THREADS) k_attention(float *att, const float *q, const float *k, const float *v,
                                                           uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0) {
    extern __shared__ float sm[];
    __shared__ float red[ATT_THREADS];
    const uint32_t h = blockIdx.x, t = blockIdx.y, n_pos = pos0 + t + 1;
    const uint32_t kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = ATT_THREADS / 32;
    float *sq = sm, *sc = sm + hd;
    const float *qv = q + ((size_t)t * heads + h) * hd;
    for (uint32_t d = tid; d < hd; d += ATT_THREADS) sq[d] = qv[d];
    __syncthreads();
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float *kb = k + (size_t)kvh * hd, *vb = v + (size_t)kvh * hd;
    for (uint32_t p = warp; p < n_pos; p += nwarps) {
        const float *kp = kb + (size_t)p * kv_dim;
        float part = 0.0f;
#pragma unroll 4
        for (uint32_t d = lane; d < hd; d += 32) part = fmaf(sq[d], kp[d], part);
        part = warp_sum(part);
        if (lane == 0) sc[p] = __fmul_rn(part, scale);
    }
    __syncthreads();
    float m = -INFINITY;
    for (uint32_t p = tid; p < n_pos; p += ATT_THREADS) m = fmaxf(m, sc[p]);
    red[tid] = m;
    __syncthreads();
    for (int s = ATT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < (unsigned)s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (uint32_t p = tid; p < n_pos; p += ATT_THREADS) {
        const float e = expf(__fsub_rn(sc[p], m));
        sc[p] = e;
        sum = __fadd_rn(sum, e);
    }
    red[tid] = sum;
    __syncthreads();
    for (int s = ATT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < (unsigned)s) red[tid] = __fadd_rn(red[tid], red[tid + s]);
        __syncthreads();
    }
    sum = red[0];
    for (uint32_t p = tid; p < n_pos; p += ATT_THREADS) sc[p] = __fdiv_rn(sc[p], sum);
    __syncthreads();
    float *o = att + ((size_t)t * heads + h) * hd;
    for (uint32_t d = tid; d < hd; d += ATT_THREADS) {
        float acc = 0.0f;
#pragma unroll 8
        for (uint32_t p = 0; p < n_pos; p++) acc = fmaf(sc[p], vb[(size_t)p * kv_dim + d], acc);
        o[d] = acc;
    }
}

extern "C" int smoe_cu_attention_max_positions(void) { return ATT_SMEM / 4 - 512; }

extern "C" int smoe_cu_attention(smoe_cu_stream st, float *att, const float *q, const float *k, const float *v,
                                 uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0) {
    static int configured;
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM);
        if (e != cudaSuccess) return (int)e;
        configured = 1;
    }
    if (n == 0) return 0;
    size_t smem = (size_t)(hd + pos0 + n) * sizeof(float);
    dim3 grid(heads, n);
    k_attention<<<grid, ATT_THREADS, smem, (cudaStream_t)st>>>(att, q, k, v, heads, kv_heads, hd, pos0);
    return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------------ small kernels */

__global__ void k_add(float *x, const float *y, size_t count) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = __fadd_rn(x[i], y[i]);
}

extern "C" int smoe_cu_add(smoe_cu_stream st, float *x, const float *y, size_t count) {
    if (count == 0) return 0;
    k_add<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)st>>>(x, y, count);
    return (int)cudaGetLastError();
}

/* One warp per token: lane l holds experts l, l + 32, …; the max and the top-k picks are exact in
 * any order (ties: the lower index), the softmax's sum is each lane's in index order and then the
 * butterfly, the renormalisation's in slot order. */
__global__ void k_route(float *logits, uint32_t n, uint32_t E, uint32_t K, int renorm, int32_t *idx, float *w) {
    const uint32_t t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= n) return;
    float *p = logits + (size_t)t * E;
    float m = -INFINITY;
    for (uint32_t i = lane; i < E; i += 32) m = fmaxf(m, p[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.0f;
    for (uint32_t i = lane; i < E; i += 32) {
        const float e = expf(__fsub_rn(p[i], m));
        p[i] = e;
        sum = __fadd_rn(sum, e);
    }
    sum = warp_sum(sum);
    for (uint32_t i = lane; i < E; i += 32) p[i] = __fdiv_rn(p[i], sum);
    __syncwarp();
    uint32_t taken = 0; /* bit j: expert lane + 32j was picked */
    int32_t *it = idx + (size_t)t * K;
    float *wt = w + (size_t)t * K;
    for (uint32_t k = 0; k < K; k++) {
        float bv = -INFINITY;
        int32_t bi = -1;
        for (uint32_t i = lane, j = 0; i < E; i += 32, j++)
            if (!(taken >> j & 1u) && (bi < 0 || p[i] > bv)) {
                bv = p[i];
                bi = (int32_t)i;
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi >= 0 && (uint32_t)bi % 32 == lane) taken |= 1u << (bi / 32);
        if (lane == 0) {
            it[k] = bi;
            wt[k] = bv;
        }
    }
    if (lane == 0 && renorm) {
        float tot = 0.0f;
        for (uint32_t k = 0; k < K; k++) tot = __fadd_rn(tot, wt[k]);
        for (uint32_t k = 0; k < K; k++) wt[k] = __fdiv_rn(wt[k], tot);
    }
}

extern "C" int smoe_cu_route(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, uint32_t K, int renorm,
                             int32_t *idx, float *w) {
    if (n == 0) return 0;
    if (E > 32 * 32) return (int)cudaErrorInvalidValue;
    k_route<<<(n + 3) / 4, 128, 0, (cudaStream_t)st>>>((float *)logits, n, E, K, renorm, idx, w);
    return (int)cudaGetLastError();
}

__global__ void k_gather(float *xg, const float *xn, const uint32_t *rows, uint32_t K, uint32_t hidden) {
    const uint32_t j = blockIdx.x, src = rows[j] / K;
    for (uint32_t c = threadIdx.x; c < hidden; c += blockDim.x) xg[(size_t)j * hidden + c] = xn[(size_t)src * hidden + c];
}

extern "C" int smoe_cu_gather(smoe_cu_stream st, float *xg, const float *xn, const uint32_t *rows, uint32_t K,
                              uint32_t total, uint32_t hidden) {
    if (total == 0) return 0;
    k_gather<<<total, 256, 0, (cudaStream_t)st>>>(xg, xn, rows, K, hidden);
    return (int)cudaGetLastError();
}

__global__ void k_swiglu(float *h, const float *hg, uint32_t I, smoe_cu_rows R) {
    uint32_t start, count;
    if (R.items) {
        const uint32_t u = R.items[blockIdx.y];
        start = R.start[u];
        count = R.count[u];
    } else {
        start = 0;
        count = R.n;
    }
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)count * I) return;
    const size_t j = start + i / I, c = i % I;
    const float g = hg[j * 2 * I + c], u = hg[j * 2 * I + I + c];
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    h[j * I + c] = __fmul_rn(silu, u);
}

extern "C" int smoe_cu_swiglu(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    dim3 grid((unsigned)(((size_t)m * I + 255) / 256), items);
    k_swiglu<<<grid, 256, 0, (cudaStream_t)st>>>(h, hg, I, *R);
    return (int)cudaGetLastError();
}

__global__ void k_moe_sum(float *x, const float *y, const float *w, uint32_t K, uint32_t hidden) {
    const uint32_t t = blockIdx.x;
    for (uint32_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t k = 0; k < K; k++)
            acc = __fadd_rn(acc, __fmul_rn(w[(size_t)t * K + k], y[((size_t)t * K + k) * hidden + c]));
        x[(size_t)t * hidden + c] = __fadd_rn(x[(size_t)t * hidden + c], acc);
    }
}

extern "C" int smoe_cu_moe_sum(smoe_cu_stream st, float *x, const float *y, const float *w, uint32_t n, uint32_t K,
                               uint32_t hidden) {
    if (n == 0) return 0;
    k_moe_sum<<<n, 256, 0, (cudaStream_t)st>>>(x, y, w, K, hidden);
    return (int)cudaGetLastError();
}
