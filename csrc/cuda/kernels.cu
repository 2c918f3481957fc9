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
#include <stdlib.h>

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8 = 2, FMT_Q4 = 3 };
enum { SC_F16 = 1, SC_BF16 = 2, SC_F32 = 3 };
enum { MM_WARPS = 8, MM_TT = 8, MM_TZ = 64, ATT_THREADS = 256, ATT_SMEM = 200 * 1024, SAMP_THREADS = 1024 };

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
extern "C" int smoe_cu_out_of_memory(int err) { return err == (int)cudaErrorMemoryAllocation; }
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

extern "C" int smoe_cu_capture_begin(smoe_cu_stream st) {
    return (int)cudaStreamBeginCapture((cudaStream_t)st, cudaStreamCaptureModeThreadLocal);
}

extern "C" int smoe_cu_capture_end(smoe_cu_stream st, int keep, smoe_cu_graph *out) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)st, &g);
    *out = NULL;
    if (e == cudaSuccess && keep) {
        cudaGraphExec_t x;
        e = cudaGraphInstantiate(&x, g, 0);
        if (e == cudaSuccess) *out = (void *)x;
    }
    if (g) cudaGraphDestroy(g);
    return (int)e;
}

extern "C" int smoe_cu_graph_launch(smoe_cu_graph g, smoe_cu_stream st) {
    return (int)cudaGraphLaunch((cudaGraphExec_t)g, (cudaStream_t)st);
}

extern "C" void smoe_cu_graph_free(smoe_cu_graph g) { if (g) cudaGraphExecDestroy((cudaGraphExec_t)g); }
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

template <int FMT>
__global__ void __launch_bounds__(MM_WARPS * 32) k_matmul(smoe_cu_tensor T, smoe_cu_rows R, const float *__restrict__ x,
                                                          size_t ldx, float *__restrict__ y, size_t ldy) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t r = bx * MM_WARPS + warp;
    if (r >= T.rows) return;
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
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t r0 = (bx * MM_WARPS + warp) * RT;
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

/* ------------------------------------------------------------ tensor-core products (q4, q8) */

/* Products with a q4 or q8 tensor whose columns are a multiple of 64 run on the tensor cores
 * (mma.sync m16n8k16, f16 inputs, f32 accumulation), for every n: decode, a chunk and each
 * streamed expert take kernels with the same per-element order, so the GPU's two paths stay
 * bit-identical. The activation is read as f16 rows that k_prep scaled by a power of two per row
 * (its largest |x| to [2^14, 2^15): no overflow, 11 significant bits for every row, the scale
 * undone exactly on the output), its columns permuted within each 8 to 0 4 1 5 2 6 3 7 so that
 * a half2 of them meets a half2 of codes as one bit operation pulls them out of a q4 word. A
 * weight is dequantised to f16 as fma(scale, q, bias) in one rounding (q exact: 1024 + q from
 * the bits, less 1024).
 *
 * The order. The columns go in k-blocks of 64; in a k-block, lane t of a quad (lane = 4g + t)
 * holds the 16 columns 16t … 16t + 15 of its rows and tokens, and k-step s (0–3) feeds the mma
 * the columns 16t + 8(s >> 1) + {p, p + 4, p + 1, p + 5} with p = 2(s & 1) (the mma's k
 * positions 2t, 2t + 1, 2t + 8, 2t + 9). The k-blocks go in `ranges` equal runs (8, 4, 2 or 1:
 * a function of the width alone); run r's sum P_r is one accumulator chained from 0 through its
 * k-blocks and k-steps in order, and an element is (((P_0 + P_1) + P_2) + …) in f32. Which warp,
 * tile, kernel or launch computes an element changes none of that. */
enum { TC_MAXW = 8, TB_WARPS = 4, TB_STAGES = 4, TB_LDS = 72 };

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }

/* Two codes placed as 0x6400 | code in each half: fma(scale, q, bias) in f16. */
__device__ __forceinline__ uint32_t deq2(uint32_t magic, __half2 s, __half2 b) {
    const __half2 q = __hsub2(bits_h2(magic), __float2half2_rn(1024.0f));
    return h2_bits(__hfma2(q, s, b));
}

/* Codes p and p + 4 of a q4 word (8 codes, low nibble first): one lop3. */
__device__ __forceinline__ uint32_t q4_pair(uint32_t v, int p) { return ((v >> (4 * p)) & 0x000f000fu) | 0x64006400u; }

/* Codes p and p + 4 of 8 q8 codes held in words a (codes 0–3) and b (4–7). */
__device__ __forceinline__ uint32_t q8_pair(uint32_t a, uint32_t b, int p) {
    return __byte_perm(__byte_perm(a, b, p | (p + 4) << 4), 0x64u, 0x4140u);
}

/* A k-block's weights for one lane of a tile of MT·16 rows: the words of its rows (q4: .x .y),
 * and their scales and biases in f16. */
template <int MT>
struct TcA {
    uint4 wq[MT][2];
    __half2 s2[MT][2], b2[MT][2];
};

template <int MT>
__device__ __forceinline__ void tc_load_s(TcA<MT> &f, const smoe_cu_tensor &T, const size_t (&srow)[MT][2],
                                          const uint8_t *sc, const uint8_t *bs, uint32_t kb, uint32_t gs, uint32_t t) {
    const uint32_t gi = (64 * kb + 16 * t) >> gs;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            f.s2[i][h] = __float2half2_rn(ld_scale(T.scale_format, sc, srow[i][h] + gi));
            f.b2[i][h] = __float2half2_rn(ld_scale(T.scale_format, bs, srow[i][h] + gi));
        }
}

template <int FMT, int MT>
__device__ __forceinline__ void tc_load_a(TcA<MT> &f, const smoe_cu_tensor &T, const uint8_t *const (&wrow)[MT][2],
                                          const size_t (&srow)[MT][2], const uint8_t *sc, const uint8_t *bs,
                                          uint32_t kb, uint32_t gs, uint32_t t) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (FMT == FMT_Q4) {
                const uint2 v = __ldg(reinterpret_cast<const uint2 *>(wrow[i][h] + 32 * (size_t)kb));
                f.wq[i][h] = make_uint4(v.x, v.y, 0u, 0u);
            } else {
                f.wq[i][h] = __ldg(reinterpret_cast<const uint4 *>(wrow[i][h] + 64 * (size_t)kb));
            }
        }
    tc_load_s<MT>(f, T, srow, sc, bs, kb, gs, t);
}

/* The A fragments of k-step s. */
template <int FMT, int MT>
__device__ __forceinline__ void tc_a(const TcA<MT> &f, int s, uint32_t (&a)[MT][4]) {
    const int p = 2 * (s & 1);
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t lo, hi;
            if (FMT == FMT_Q4) {
                const uint32_t v = s < 2 ? f.wq[i][h].x : f.wq[i][h].y;
                lo = q4_pair(v, p);
                hi = q4_pair(v, p + 1);
            } else {
                const uint32_t va = s < 2 ? f.wq[i][h].x : f.wq[i][h].z, vb = s < 2 ? f.wq[i][h].y : f.wq[i][h].w;
                lo = q8_pair(va, vb, p);
                hi = q8_pair(va, vb, p + 1);
            }
            a[i][h] = deq2(lo, f.s2[i][h], f.b2[i][h]);
            a[i][2 + h] = deq2(hi, f.s2[i][h], f.b2[i][h]);
        }
}

/* Two k-steps (2h, 2h + 1) with one lane's 8 activations of each n-tile in xb. */
/* Only the first nj n-tiles hold tokens (the last tile of an expert is often short): the others
 * are skipped, never stored. */
template <int FMT, int MT, int NT>
__device__ __forceinline__ void tc_half(const TcA<MT> &f, int h, const uint4 (&xb)[NT], float (&acc)[MT][NT][4],
                                        uint32_t nj) {
#pragma unroll
    for (int ss = 0; ss < 2; ss++) {
        uint32_t a[MT][4];
        tc_a<FMT, MT>(f, 2 * h + ss, a);
#pragma unroll
        for (int j = 0; j < NT; j++)
            if ((uint32_t)j < nj)
#pragma unroll
                for (int i = 0; i < MT; i++)
                    mma16816(acc[i][j], a[i], ss ? xb[j].z : xb[j].x, ss ? xb[j].w : xb[j].y);
    }
}

/* The lane's rows (clamped: a row past the end is computed, never stored) and their scale rows. */
template <int FMT, int MT>
__device__ __forceinline__ void tc_rows(const smoe_cu_tensor &T, const uint8_t *w, uint32_t r0, uint32_t g, uint32_t t,
                                        const uint8_t *(&wrow)[MT][2], size_t (&srow)[MT][2]) {
    const size_t rowbytes = FMT == FMT_Q4 ? T.cols / 2 : T.cols;
    const uint32_t ng = T.cols >> (__ffs(T.group) - 1);
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint32_t r = min(r0 + 16 * i + g + 8 * h, T.rows - 1);
            wrow[i][h] = w + (size_t)r * rowbytes + (FMT == FMT_Q4 ? 8 : 16) * t;
            srow[i][h] = (size_t)r * ng;
        }
}

template <int MT, int NT>
__device__ __forceinline__ void tc_store(const float (&acc)[MT][NT][4], const smoe_cu_tensor &T, const smoe_cu_rows &R,
                                         uint32_t r0, uint32_t t0, uint32_t start, uint32_t count, uint32_t g,
                                         uint32_t t, const float *xe, float *y, size_t ldy) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const uint32_t r = r0 + 16 * i + g + 8 * (e >> 1), tk = t0 + 8 * j + 2 * t + (e & 1);
                if (r < T.rows && tk < count) {
                    const uint32_t jj = start + tk, out = R.yrow ? R.yrow[jj] : jj;
                    y[(size_t)out * ldy + r] = __fmul_rn(acc[i][j][e], xe[jj]);
                }
            }
}

template <int MT, int NT>
__device__ __forceinline__ void tc_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
}

/* Few tokens (decode, small experts): a block is `ranges` warps on one tile, warp r computing P_r
 * (its k-blocks loaded U at a time, then applied), warp 0 adding the others' in order. */
template <int FMT, int MT, int NT, int U>
__global__ void __launch_bounds__(TC_MAXW * 32) k_tc(smoe_cu_tensor T, smoe_cu_rows R, const __half *__restrict__ x16,
                                                     const float *__restrict__ xe, float *__restrict__ y, size_t ldy,
                                                     uint32_t ranges) {
    __shared__ float part[TC_MAXW - 1][MT * NT * 4][32];
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t t0 = blockIdx.z * (NT * 8), r0 = bx * (MT * 16);
    if (t0 >= count || r0 >= T.rows) return; /* the whole block */
    const uint32_t cols = T.cols, nkb = cols / 64, gs = __ffs(T.group) - 1;
    const uint8_t *sc = w + T.scales_off, *bs = w + T.biases_off;
    const uint8_t *wrow[MT][2];
    size_t srow[MT][2];
    tc_rows<FMT, MT>(T, w, r0, g, t, wrow, srow);
    const __half *xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xr[j] = x16 + (size_t)(start + min(t0 + 8 * j + g, count - 1)) * cols + 16 * t;
    float acc[MT][NT][4];
    tc_zero(acc);
    const uint32_t kb0 = warp * nkb / ranges, kb1 = (warp + 1) * nkb / ranges;
    for (uint32_t kb = kb0; kb < kb1; kb += U) {
        TcA<MT> fa[U];
        uint4 xb[U][2][NT];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kb + u < kb1) {
                tc_load_a<FMT, MT>(fa[u], T, wrow, srow, sc, bs, kb + u, gs, t);
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        xb[u][h][j] = __ldg(reinterpret_cast<const uint4 *>(xr[j] + 64 * (size_t)(kb + u) + 8 * h));
            }
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kb + u < kb1) {
                tc_half<FMT, MT, NT>(fa[u], 0, xb[u][0], acc, NT);
                tc_half<FMT, MT, NT>(fa[u], 1, xb[u][1], acc, NT);
            }
    }
    if (ranges > 1) {
        if (warp > 0)
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) part[warp - 1][(i * NT + j) * 4 + e][lane] = acc[i][j][e];
        __syncthreads();
        if (warp > 0) return;
        for (uint32_t r = 1; r < ranges; r++)
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        acc[i][j][e] = __fadd_rn(acc[i][j][e], part[r - 1][(i * NT + j) * 4 + e][lane]);
    }
    tc_store(acc, T, R, r0, t0, start, count, g, t, xe, y, ldy);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Many tokens (prefill): a block is 4 warps on 4 row tiles of the same NT·8 tokens. The tokens'
 * activations and the block's weight words pass through shared memory (cp.async, TB_STAGES
 * k-blocks in flight), the scales one k-block ahead in registers; each warp runs the ranges one
 * after another. Shared memory per stage: NT·8 activation rows of TB_LDS halves, then the weight
 * rows (q4: 32 bytes a k-block, q8: 64; 16 of padding). */
template <int FMT>
__host__ __device__ constexpr int tb_arow() { return FMT == FMT_Q4 ? 48 : 80; }
template <int FMT, int MT, int NT>
__host__ __device__ constexpr int tb_stage_bytes() { return NT * 8 * TB_LDS * 2 + TB_WARPS * MT * 16 * tb_arow<FMT>(); }

template <int FMT, int MT, int NT>
__global__ void __launch_bounds__(TB_WARPS * 32) k_tcb(smoe_cu_tensor T, smoe_cu_rows R, const __half *__restrict__ x16,
                                                       const float *__restrict__ xe, float *__restrict__ y, size_t ldy,
                                                       uint32_t ranges) {
    extern __shared__ __align__(16) uint8_t sm_tcb[];
    constexpr int SB = tb_stage_bytes<FMT, MT, NT>(), AROW = tb_arow<FMT>(), ABYTES = FMT == FMT_Q4 ? 32 : 64;
    constexpr int BROWS = NT * 8, AROWS = TB_WARPS * MT * 16;
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t t0 = blockIdx.z * (NT * 8), rb = bx * AROWS, r0 = rb + warp * (MT * 16);
    if (t0 >= count || rb >= T.rows) return; /* the whole block */
    const uint32_t cols = T.cols, nkb = cols / 64, gs = __ffs(T.group) - 1, nj = min((uint32_t)NT, (count - t0 + 7) / 8);
    const size_t rowbytes = FMT == FMT_Q4 ? cols / 2 : cols;
    const uint8_t *sc = w + T.scales_off, *bs = w + T.biases_off;
    const uint8_t *wrow[MT][2];
    size_t srow[MT][2];
    tc_rows<FMT, MT>(T, w, min(r0, T.rows - 1), g, t, wrow, srow);
    auto issue = [&](uint32_t kb) {
        uint8_t *st = sm_tcb + (kb % TB_STAGES) * SB;
        for (uint32_t c = threadIdx.x; c < BROWS * 8; c += TB_WARPS * 32) {
            const uint32_t tok = c >> 3, part = c & 7;
            cp_async16(st + tok * (TB_LDS * 2) + 16 * part,
                       x16 + (size_t)(start + min(t0 + tok, count - 1)) * cols + 64 * (size_t)kb + 8 * part);
        }
        uint8_t *sa = st + BROWS * TB_LDS * 2;
        for (uint32_t c = threadIdx.x; c < AROWS * (ABYTES / 16); c += TB_WARPS * 32) {
            const uint32_t row = c / (ABYTES / 16), part = c % (ABYTES / 16);
            cp_async16(sa + row * AROW + 16 * part,
                       w + (size_t)min(rb + row, T.rows - 1) * rowbytes + (size_t)ABYTES * kb + 16 * part);
        }
    };
#pragma unroll
    for (int st = 0; st < TB_STAGES - 1; st++) {
        if ((uint32_t)st < nkb) issue(st);
        cp_commit();
    }
    float acc[MT][NT][4], tot[MT][NT][4];
    tc_zero(acc);
    tc_zero(tot);
    uint32_t r = 0, kend = nkb / ranges;
    TcA<MT> cur, nxt; /* scales and biases here; the words come from shared memory */
    tc_load_s<MT>(cur, T, srow, sc, bs, 0, gs, t);
    for (uint32_t kb = 0; kb < nkb; kb++) {
        cp_wait<TB_STAGES - 2>();
        __syncthreads();
        if (kb + TB_STAGES - 1 < nkb) issue(kb + TB_STAGES - 1);
        cp_commit();
        if (kb + 1 < nkb) tc_load_s<MT>(nxt, T, srow, sc, bs, kb + 1, gs, t);
        const uint8_t *st = sm_tcb + (kb % TB_STAGES) * SB, *sa = st + BROWS * TB_LDS * 2;
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint8_t *p = sa + (warp * MT * 16 + 16 * i + g + 8 * h) * AROW + (ABYTES / 4) * t;
                if (FMT == FMT_Q4) {
                    const uint2 v = *reinterpret_cast<const uint2 *>(p);
                    cur.wq[i][h] = make_uint4(v.x, v.y, 0u, 0u);
                } else {
                    cur.wq[i][h] = *reinterpret_cast<const uint4 *>(p);
                }
            }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint4 xb[NT];
#pragma unroll
            for (int j = 0; j < NT; j++)
                xb[j] = *reinterpret_cast<const uint4 *>(st + ((8 * j + g) * TB_LDS + 16 * t + 8 * h) * 2);
            tc_half<FMT, MT, NT>(cur, h, xb, acc, nj);
        }
        cur = nxt;
        if (kb + 1 == kend) { /* the end of range r: tot = P_0, then tot + P_r */
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        tot[i][j][e] = r == 0 ? acc[i][j][e] : __fadd_rn(tot[i][j][e], acc[i][j][e]);
                        acc[i][j][e] = 0.0f;
                    }
            r++;
            kend = (r + 1) * nkb / ranges;
        }
    }
    tc_store(tot, T, R, r0, t0, start, count, g, t, xe, y, ldy);
}

/* SMOE_CUDA_TC=0 or SMOE_CUDA_FLASH=0 (read once per process) turn the tensor-core products or the
 * tensor-core attention off, for comparisons: the older kernels, in their own fixed orders. */
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}

extern "C" int smoe_cu_tensor_cores(const smoe_cu_tensor *T) {
    static const bool on = env_on("SMOE_CUDA_TC");
    return on && (T->format == FMT_Q4 || T->format == FMT_Q8) && T->cols % 64 == 0 && T->group >= 16;
}

/* One row by a block of 256 threads: the sum of squares strided by thread, then a tree. */
__device__ __forceinline__ void rms_row(float *orow, const float *xr, uint32_t dim, const uint8_t *wt, uint8_t wfmt,
                                        float eps) {
    __shared__ float sh[256];
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

/* One row to f16 by a block of 256 threads (k_prep: the rows of R, as the products take them),
 * scaled by the power of two that puts its largest |x| in [2^14, 2^15); xe holds the factor that
 * undoes it. The maximum is exact in any order. */
__device__ __forceinline__ void prep_row(const float *xr, uint32_t cols, size_t row, __half *x16, float *xe) {
    __shared__ float red[256];
    float m = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += 256) m = fmaxf(m, fabsf(xr[c]));
    red[threadIdx.x] = m;
    __syncthreads();
    for (int k = 128; k > 0; k >>= 1) {
        if (threadIdx.x < (unsigned)k) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + k]);
        __syncthreads();
    }
    m = red[0];
    int ex = 0;
    if (m > 0.0f && isfinite(m)) frexpf(m, &ex); /* else 0, or a row holding inf/NaN (its outputs are not finite anyway) */
    const int e = max(ex - 15, -100);
    const float down = ldexpf(1.0f, -e);
    __half *o = x16 + row * cols;
    /* within each 8 columns, the order 0 4 1 5 2 6 3 7 (k_tc's order) */
    for (uint32_t c = threadIdx.x; c < cols; c += 256)
        o[c] = __float2half_rn(__fmul_rn(xr[(c & ~7u) | (c & 7u) >> 1 | (c & 1u) << 2], down));
    if (threadIdx.x == 0) xe[row] = ldexpf(1.0f, e);
}

__global__ void k_prep(const float *x, size_t ldx, uint32_t cols, smoe_cu_rows R, __half *x16, float *xe) {
    uint32_t start, count;
    item_rows(R, &start, &count);
    if (blockIdx.x >= count) return;
    const size_t row = start + blockIdx.x;
    prep_row(x + row * ldx, cols, row, x16, xe);
}

/* k_rmsnorm then k_prep on rows [0, rows) in one launch: the same arithmetic, the same bits. */
__global__ void k_rmsnorm_prep(float *out, const float *x, uint32_t dim, const uint8_t *wt, uint8_t wfmt, float eps,
                               __half *x16, float *xe) {
    const size_t row = blockIdx.x;
    rms_row(out + row * dim, x + row * dim, dim, wt, wfmt, eps);
    __syncthreads(); /* the row's outputs, written by every thread, before any is read */
    prep_row(out + row * dim, dim, row, x16, xe);
}

extern "C" int smoe_cu_rmsnorm_prep(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim,
                                    const uint8_t *weight, uint8_t weight_format, float eps, void *x16, float *xe) {
    if (rows == 0) return 0;
    k_rmsnorm_prep<<<rows, 256, 0, (cudaStream_t)st>>>(out, x, dim, weight, weight_format, eps, (__half *)x16, xe);
    return (int)cudaGetLastError();
}

extern "C" int smoe_cu_prep(smoe_cu_stream st, const float *x, size_t ldx, uint32_t cols, const smoe_cu_rows *R,
                            void *x16, float *xe) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    k_prep<<<dim3(m, items), 256, 0, (cudaStream_t)st>>>(x, ldx, cols, *R, (__half *)x16, xe);
    return (int)cudaGetLastError();
}

/* The ranges of a tensor's k-blocks (k_tc's order): a function of its width alone. */
static uint32_t tc_ranges(uint32_t cols) {
    const uint32_t nkb = cols / 64;
    return nkb % 8 == 0 ? 8 : nkb % 4 == 0 ? 4 : nkb % 2 == 0 ? 2 : 1;
}

template <int FMT>
static void launch_tc(const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a, float *y, size_t ldy,
                      uint32_t items, uint32_t m, cudaStream_t s) {
    const __half *x16 = (const __half *)a->x16;
    const uint32_t ranges = tc_ranges(T->cols);
    /* Tiles change no bits (only the ranges do), so they follow n. SMOE_CUDA_TILE (for comparisons)
     * picks the many-token tile: 0 = 32 rows × 64 tokens a warp, 1 = 32 × 32, 2 = 64 × 32. */
    static const int big = getenv("SMOE_CUDA_TILE") ? atoi(getenv("SMOE_CUDA_TILE")) : 0;
    const uint32_t px = R->pair ? 2 : 1; /* a pair launch: twice the row blocks (launch_item) */
#define TC_SMALL(MT, NT, U)                                                                                            \
    k_tc<FMT, MT, NT, U><<<dim3(px * ((T->rows + 16 * MT - 1) / (16 * MT)), items, (m + 8 * NT - 1) / (8 * NT)),      \
                           32 * ranges,                                                                            \
                           0, s>>>(*T, *R, x16, a->xe, y, ldy, ranges)
#define TC_BIG(MT, NT)                                                                                                 \
    do {                                                                                                               \
        constexpr int smem = TB_STAGES * tb_stage_bytes<FMT, MT, NT>();                                                \
        static bool configured;                                                                                        \
        if (!configured) {                                                                                             \
            cudaFuncSetAttribute(k_tcb<FMT, MT, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);               \
            configured = true;                                                                                         \
        }                                                                                                              \
        k_tcb<FMT, MT, NT><<<dim3(px * ((T->rows + TB_WARPS * 16 * MT - 1) / (TB_WARPS * 16 * MT)), items,             \
                                  (m + 8 * NT - 1) / (8 * NT)),                                                        \
                             TB_WARPS * 32, smem, s>>>(*T, *R, x16, a->xe, y, ldy, ranges);                             \
    } while (0)
    if (m <= 8)
        TC_SMALL(1, 1, 4);
    else if (m <= 16)
        TC_SMALL(1, 2, 4);
    else if (m <= 32 || big == 1)
        TC_BIG(2, 4);
    else if (big == 2)
        TC_BIG(4, 4);
    else
        TC_BIG(2, 8);
#undef TC_SMALL
#undef TC_BIG
}

/* The products on the FP32 cores: k_matmul_tiled from TILED_MIN tokens on, k_matmul below. */
template <int FMT>
static void launch_fp32(const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a, float *y, size_t ldy,
                        uint32_t items, uint32_t m, cudaStream_t s) {
    const uint32_t px = R->pair ? 2 : 1; /* a pair launch: twice the row blocks (launch_item) */
    if (m >= TILED_MIN) {
        dim3 grid(px * ((T->rows + MM_WARPS * RT - 1) / (MM_WARPS * RT)), items, (m + TT2 - 1) / TT2);
        k_matmul_tiled<FMT><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, a->x, a->ldx, y, ldy);
    } else {
        dim3 grid(px * ((T->rows + MM_WARPS - 1) / MM_WARPS), items, (m + MM_TZ - 1) / MM_TZ);
        k_matmul<FMT><<<grid, MM_WARPS * 32, 0, s>>>(*T, *R, a->x, a->ldx, y, ldy);
    }
}

extern "C" int smoe_cu_matmul(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a,
                              float *y, size_t ldy) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    cudaStream_t s = (cudaStream_t)st;
    if (smoe_cu_tensor_cores(T)) {
        if (!a->x16 || !a->xe) return (int)cudaErrorInvalidValue;
        if (T->format == FMT_Q4)
            launch_tc<FMT_Q4>(T, R, a, y, ldy, items, m, s);
        else
            launch_tc<FMT_Q8>(T, R, a, y, ldy, items, m, s);
        return (int)cudaGetLastError();
    }
    switch (T->format) {
    case FMT_F32: launch_fp32<FMT_F32>(T, R, a, y, ldy, items, m, s); break;
    case FMT_BF16: launch_fp32<FMT_BF16>(T, R, a, y, ldy, items, m, s); break;
    case FMT_Q8: launch_fp32<FMT_Q8>(T, R, a, y, ldy, items, m, s); break;
    default: launch_fp32<FMT_Q4>(T, R, a, y, ldy, items, m, s); break;
    }
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------------- sampling */

/* The ids and (penalised, tempered) logits smoe_sample's top-k would pick, chosen on the GPU, so
 * that only the candidates come back (sample.h: smoe_sample_top draws among them on the host). */

__global__ void k_samp_clean(const float *logits, float *v, uint32_t V) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < V) {
        const float x = logits[i];
        v[i] = x != x ? -INFINITY : x;
    }
}

/* sample.c's repetition penalty, one thread in history order: each distinct id once. */
__global__ void k_samp_penalty(const float *logits, float *v, uint32_t V, const int32_t *hist, uint32_t n,
                               float pen) {
    for (uint32_t h = 0; h < n; h++) {
        const int32_t id = hist[h];
        if (id < 0 || (uint32_t)id >= V) continue;
        const float x = logits[id], c = x != x ? -INFINITY : x;
        if (v[id] != c) continue;
        v[id] = v[id] > 0.0f ? __fdiv_rn(v[id], pen) : __fmul_rn(v[id], pen);
    }
}

/* a float's order as an unsigned key */
__device__ __forceinline__ uint32_t fkey(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* (a, ia) ranks before (b, ib): larger value, or equal and lower id (sample.c's order) */
__device__ __forceinline__ bool samp_better(float a, int32_t ia, float b, int32_t ib) {
    return a > b || (a == b && ia < ib);
}

/* One block of SAMP_THREADS. The argmax (first maximum, as sample.c's); then, unless that ends it
 * (greedy, all −inf, an overflowing temperature: flags 1), the k largest of v / temperature by a
 * radix select on their keys (4 passes of 8 bits), gathered in id order (ties: the lower ids), and
 * sorted best first by a bitonic sort. */
__global__ void __launch_bounds__(SAMP_THREADS) k_samp_select(const float *v, uint32_t V, float temp, uint32_t k,
                                                              smoe_cu_sample_out *out) {
    __shared__ float sv[SAMPLE_CAP];
    __shared__ int32_t si[SAMPLE_CAP];
    __shared__ uint32_t hist[256];
    __shared__ unsigned long long scan[SAMP_THREADS];
    __shared__ float rv[SAMP_THREADS / 32];
    __shared__ int32_t ri[SAMP_THREADS / 32];
    __shared__ uint32_t s_prefix, s_left;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    float bv = -INFINITY;
    int32_t bi = 0x7FFFFFFF;
    for (uint32_t i = tid; i < V; i += SAMP_THREADS)
        if (samp_better(v[i], (int32_t)i, bv, bi)) bv = v[i], bi = (int32_t)i;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
        const int32_t oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
        if (samp_better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) rv[warp] = bv, ri[warp] = bi;
    __syncthreads();
    if (tid == 0) {
        for (uint32_t w = 1; w < SAMP_THREADS / 32; w++)
            if (samp_better(rv[w], ri[w], rv[0], ri[0])) rv[0] = rv[w], ri[0] = ri[w];
        out->best = ri[0];
        out->count = 0;
        out->flags = 0;
        const float m = temp > 0.0f && rv[0] != -INFINITY ? __fdiv_rn(rv[0], temp) : 0.0f;
        out->m = m;
        if (!(temp > 0.0f) || rv[0] == -INFINITY || m == INFINITY)
            out->flags = 1; /* the draw is the argmax */
        else if (k == 0 || k > SAMPLE_CAP || k >= V)
            out->flags = 2; /* not for this kernel: the host samples */
    }
    __syncthreads();
    if (out->flags) return;

    /* the k-th largest key: digit by digit from the top, counting the elements above first */
    uint32_t prefix = 0, mask = 0;
    if (tid == 0) s_left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint32_t d = tid; d < 256; d += SAMP_THREADS) hist[d] = 0;
        __syncthreads();
        for (uint32_t i0 = 0; i0 < V; i0 += SAMP_THREADS) {
            const uint32_t i = i0 + tid;
            const uint32_t key = i < V ? fkey(__fdiv_rn(v[i], temp)) : 0;
            const bool in = i < V && (key & mask) == prefix;
            const uint32_t d = in ? (key >> shift) & 255u : 256u;
            const uint32_t peers = __match_any_sync(0xFFFFFFFFu, d);
            if (in && lane == (uint32_t)__ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t left = s_left, d = 255;
            for (;; d--) {
                if (left <= hist[d] || d == 0) break;
                left -= hist[d];
            }
            s_left = left;
            s_prefix = prefix | d << shift;
        }
        __syncthreads();
        prefix = s_prefix;
        mask |= 255u << shift;
    }
    const uint32_t T = prefix, ties = s_left; /* take every key above T and the first `ties` equal to it */

    /* gathered in id order: thread tid owns ids [tid·chunk, (tid + 1)·chunk) */
    const uint32_t chunk = (V + SAMP_THREADS - 1) / SAMP_THREADS, c0 = min(V, tid * chunk), c1 = min(V, c0 + chunk);
    uint32_t gt = 0, eq = 0;
    for (uint32_t i = c0; i < c1; i++) {
        const uint32_t key = fkey(__fdiv_rn(v[i], temp));
        gt += key > T;
        eq += key == T;
    }
    /* inclusive scans of gt and eq, packed in 64 bits (each total < 2^32) */
    scan[tid] = (unsigned long long)gt << 32 | eq;
    __syncthreads();
    for (uint32_t o = 1; o < SAMP_THREADS; o <<= 1) {
        const unsigned long long x = tid >= o ? scan[tid - o] : 0;
        __syncthreads();
        scan[tid] += x;
        __syncthreads();
    }
    const unsigned long long incl = scan[tid];
    const uint32_t total_gt = (uint32_t)(scan[SAMP_THREADS - 1] >> 32);
    uint32_t pg = (uint32_t)(incl >> 32) - gt, pe = (uint32_t)incl - eq;
    for (uint32_t i = c0; i < c1; i++) {
        const float x = __fdiv_rn(v[i], temp);
        const uint32_t key = fkey(x);
        if (key > T) {
            sv[pg] = x, si[pg] = (int32_t)i, pg++;
        } else if (key == T) {
            if (pe < ties) sv[total_gt + pe] = x, si[total_gt + pe] = (int32_t)i;
            pe++;
        }
    }
    __syncthreads();
    /* best first: bitonic sort of the next power of two, padded after every candidate */
    uint32_t n2 = 1;
    while (n2 < k) n2 <<= 1;
    for (uint32_t j = k + tid; j < n2; j += SAMP_THREADS) sv[j] = -INFINITY, si[j] = 0x7FFFFFFF;
    __syncthreads();
    for (uint32_t size = 2; size <= n2; size <<= 1)
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t j = tid; j < n2; j += SAMP_THREADS) {
                const uint32_t o = j ^ stride;
                if (o > j) {
                    const bool first = (j & size) == 0; /* this run best first, the other worst first */
                    const bool swap = first ? samp_better(sv[o], si[o], sv[j], si[j])
                                            : samp_better(sv[j], si[j], sv[o], si[o]);
                    if (swap) {
                        const float tv = sv[j];
                        const int32_t ti = si[j];
                        sv[j] = sv[o], si[j] = si[o];
                        sv[o] = tv, si[o] = ti;
                    }
                }
            }
            __syncthreads();
        }
    for (uint32_t j = tid; j < k; j += SAMP_THREADS) out->vals[j] = sv[j], out->ids[j] = si[j];
    if (tid == 0) out->count = k;
}

extern "C" int smoe_cu_sample_select(smoe_cu_stream st, const float *logits, float *v, uint32_t V,
                                     const int32_t *hist, uint32_t n_hist, float penalty, float temperature,
                                     uint32_t top_k, smoe_cu_sample_out *out) {
    if (V == 0) return (int)cudaErrorInvalidValue;
    cudaStream_t s = (cudaStream_t)st;
    k_samp_clean<<<(V + 255) / 256, 256, 0, s>>>(logits, v, V);
    if (n_hist > 0) k_samp_penalty<<<1, 1, 0, s>>>(logits, v, V, hist, n_hist, penalty);
    k_samp_select<<<1, SAMP_THREADS, 0, s>>>(v, V, temperature, top_k, out);
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
    rms_row(out + (size_t)blockIdx.x * ld, x + (size_t)blockIdx.x * ld, dim, wt, wfmt, eps);
}

extern "C" int smoe_cu_rmsnorm(smoe_cu_stream st, float *out, const float *x, uint32_t rows, uint32_t dim, size_t ld,
                               const uint8_t *weight, uint8_t weight_format, float eps) {
    if (rows == 0) return 0;
    k_rmsnorm<<<rows, 256, 0, (cudaStream_t)st>>>(out, x, dim, ld, weight, weight_format, eps);
    return (int)cudaGetLastError();
}

/* ----------------------------------------------------------------- QK-norm, RoPE, KV cache */

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

/* QK-norm, RoPE and the KV append of one layer in one launch: block (t, h) normalises and rotates
 * q row h of token t, or (h ≥ heads) K row h − heads, which it then stores with its V row at
 * position *pos0 + t (rotate-half RoPE, cos/sin tables of (context, hd/2)); rms_row is k_rmsnorm's
 * arithmetic, so q and K are what the norm kernel would give. */
template <typename T>
__global__ void k_qk_post(float *q, float *ks, const float *vs, T *kc, T *vc, uint32_t heads, uint32_t kv_heads,
                          uint32_t hd, const uint8_t *qw, uint8_t qfmt, const uint8_t *kw, uint8_t kfmt, float eps,
                          const float *cs, const float *sn, const uint32_t *pos0) {
    const uint32_t per = heads + kv_heads, t = blockIdx.x / per, h = blockIdx.x % per, half = hd / 2;
    const bool isq = h < heads;
    float *row = isq ? q + ((size_t)t * heads + h) * hd : ks + ((size_t)t * kv_heads + (h - heads)) * hd;
    rms_row(row, row, hd, isq ? qw : kw, isq ? qfmt : kfmt, eps);
    __syncthreads();
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
                               const uint8_t *q_norm, uint8_t q_norm_format, const uint8_t *k_norm,
                               uint8_t k_norm_format, float eps, const float *cos, const float *sin,
                               const uint32_t *pos0) {
    if (n == 0) return 0;
    const dim3 grid(n * (heads + kv_heads));
    cudaStream_t s = (cudaStream_t)st;
#define QK_POST(T)                                                                                                     \
    k_qk_post<T><<<grid, 256, 0, s>>>(q, ks, vs, (T *)k, (T *)v, heads, kv_heads, hd, q_norm, q_norm_format, k_norm,   \
                                      k_norm_format, eps, cos, sin, pos0)
    if (kv_type == 1)
        QK_POST(__nv_bfloat16);
    else if (kv_type == 2)
        QK_POST(__half);
    else
        QK_POST(float);
#undef QK_POST
    return (int)cudaGetLastError();
}

/* --------------------------------------------------------------------------- attention */

template <typename T>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(float *att, const float *q, const T *k, const T *v,
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
    const T *kb = k + (size_t)kvh * hd, *vb = v + (size_t)kvh * hd;
    for (uint32_t p = warp; p < n_pos; p += nwarps) {
        const T *kp = kb + (size_t)p * kv_dim;
        float part = 0.0f;
#pragma unroll 4
        for (uint32_t d = lane; d < hd; d += 32) part = fmaf(sq[d], kv_f(kp[d]), part);
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
        for (uint32_t p = 0; p < n_pos; p++) acc = fmaf(sc[p], kv_f(vb[(size_t)p * kv_dim + d]), acc);
        o[d] = acc;
    }
}

/* Attention on the tensor cores for head sizes 32, 64 and 128 (flash attention's order, with tiles
 * of positions fixed from position 0). A block takes one KV head and 64 rows (token, head of the
 * group); a warp 16 of them. Per tile of 64 positions: K and V (f32 in VRAM) to f16 in shared
 * memory; S = Q·Kᵀ by mma (q to f16; the f32 sum scaled by 1/√d), masked past each row's position;
 * the row's running max m over the tiles so far (exact in any order), corr = exp(m_old − m_new),
 * p = exp(s − m_new); the lane's partial sum l = l·corr, then + p over its columns in order; O =
 * O·corr + P·V by mma (p to f16). At the end l is the quad's sum (xor 1, then 2) and the output
 * O / l. A row's tiles are 0, 1, … up to its own position's, whichever rows share its block: a tile
 * wholly past its position changes none of its bits (corr = 1, p = 0). */
enum { FA_WARPS = 4, FA_BN = 64, FA_SPLIT = 8 /* tiles a split */ };

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) { return h2_bits(__floats2half2_rn(lo, hi)); }

/* The merge of a split's (m, l, o) into a row's running (M, L, O), in split order: the one
 * arithmetic of k_flash's sequential form and of k_flash_combine. */
__device__ __forceinline__ void fa_scales(float M, float m, float *Mn, float *a, float *b) {
    *Mn = fmaxf(M, m);
    *a = expf(__fsub_rn(M, *Mn)); /* 0 while M is −inf */
    *b = expf(__fsub_rn(m, *Mn));
}
__device__ __forceinline__ float fa_mix(float X, float a, float x, float b) {
    return __fadd_rn(__fmul_rn(X, a), __fmul_rn(x, b));
}

/* Positions go in splits of FA_SPLIT tiles, each an online softmax from scratch, the splits then
 * merged in order (fa_scales, fa_mix): so a row's bits do not depend on how many rows share its
 * block. PAR: split blockIdx.z only, its (m, l, o) to part (k_flash_combine merges them), for few
 * rows over many positions (decode); else every split in turn, O kept in shared memory. */
template <int HD, typename T, bool PAR>
__global__ void __launch_bounds__(FA_WARPS * 32) k_flash(float *__restrict__ att, const float *__restrict__ q,
                                                         const T *__restrict__ k, const T *__restrict__ v,
                                                         uint32_t n, uint32_t heads, uint32_t kv_heads,
                                                         const uint32_t *dpos, float *__restrict__ part) {
    extern __shared__ float Os[]; /* (!PAR) per thread its 2 · HD / 4 output elements, [i · 128 + tid] */
    const uint32_t pos0 = *dpos;
    constexpr int KS = HD / 16, ND = HD / 8, NP = FA_BN / 8, LDK = HD + 8, LDV = FA_BN + 8;
    __shared__ __align__(16) __half Ks[FA_BN * LDK];
    __shared__ __align__(16) __half Vt[HD * LDV];
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t gq = heads / kv_heads, kvh = blockIdx.x, kv_dim = kv_heads * HD, nrows = n * gq;
    const uint32_t R0 = blockIdx.y * (FA_WARPS * 16), Rw = R0 + warp * 16;
    const uint32_t last = pos0 + min(R0 + FA_WARPS * 16 - 1, nrows - 1) / gq, ntiles = last / FA_BN + 1;
    const bool active = Rw < nrows;
    uint32_t tok[2], head[2], qpos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t r = min(Rw + g + 8 * h, nrows - 1);
        tok[h] = r / gq;
        head[h] = kvh * gq + r % gq;
        qpos[h] = pos0 + tok[h];
    }
    uint32_t qa[KS][4];
#pragma unroll
    for (int kd = 0; kd < KS; kd++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float *qr = q + ((size_t)tok[h] * heads + head[h]) * HD + 16 * kd + 2 * t;
            qa[kd][h] = pack_h2(qr[0], qr[1]);
            qa[kd][2 + h] = pack_h2(qr[8], qr[9]);
        }
    const float scale = (float)(1.0 / sqrt((double)HD));
    const uint32_t nsplit = (ntiles + FA_SPLIT - 1) / FA_SPLIT;
    uint32_t z0 = 0, z1 = nsplit;
    if constexpr (PAR) {
        z0 = blockIdx.z, z1 = z0 + 1;
        if (z0 >= nsplit) return; /* past this block's rows (the whole block) */
    } else {
#pragma unroll
        for (int i = 0; i < ND * 4; i++) Os[i * FA_WARPS * 32 + threadIdx.x] = 0.0f;
    }
    float Mrun[2] = {-INFINITY, -INFINITY}, Lrun[2] = {0.0f, 0.0f};
    float o[ND][4];
    for (uint32_t z = z0; z < z1; z++) {
#pragma unroll
        for (int d = 0; d < ND; d++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[d][e] = 0.0f;
        float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
        for (uint32_t tile = z * FA_SPLIT; tile < min(ntiles, (z + 1) * FA_SPLIT); tile++) {
            const uint32_t p0 = tile * FA_BN;
            __syncthreads();
            /* K row by row (coalesced); V transposed, position fastest (conflict-free stores) */
            for (uint32_t i = threadIdx.x; i < FA_BN * (HD / 4); i += FA_WARPS * 32) {
                const uint32_t p = i / (HD / 4), d = 4 * (i % (HD / 4));
                __half2 a = __float2half2_rn(0.0f), b = a;
                if (p0 + p <= last) kv_h4(k + (size_t)(p0 + p) * kv_dim + (size_t)kvh * HD + d, &a, &b);
                *reinterpret_cast<__half2 *>(Ks + p * LDK + d) = a;
                *reinterpret_cast<__half2 *>(Ks + p * LDK + d + 2) = b;
            }
            for (uint32_t i = threadIdx.x; i < FA_BN * (HD / 4); i += FA_WARPS * 32) {
                const uint32_t p = i % FA_BN, d = 4 * (i / FA_BN);
                __half2 a = __float2half2_rn(0.0f), b = a;
                if (p0 + p <= last) kv_h4(v + (size_t)(p0 + p) * kv_dim + (size_t)kvh * HD + d, &a, &b);
                Vt[(d + 0) * LDV + p] = __low2half(a);
                Vt[(d + 1) * LDV + p] = __high2half(a);
                Vt[(d + 2) * LDV + p] = __low2half(b);
                Vt[(d + 3) * LDV + p] = __high2half(b);
            }
            __syncthreads();
            if (!active) continue;
            float sa[NP][4];
#pragma unroll
            for (int np = 0; np < NP; np++)
#pragma unroll
                for (int e = 0; e < 4; e++) sa[np][e] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KS; kd++)
#pragma unroll
                for (int np = 0; np < NP; np++) {
                    const __half *kr = Ks + (np * 8 + g) * LDK + 16 * kd + 2 * t;
                    mma16816(sa[np], qa[kd], *reinterpret_cast<const uint32_t *>(kr),
                             *reinterpret_cast<const uint32_t *>(kr + 8));
                }
            float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
            for (int np = 0; np < NP; np++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1;
                    const uint32_t pos = p0 + np * 8 + 2 * t + (e & 1);
                    const float sv = pos <= qpos[h] ? __fmul_rn(sa[np][e], scale) : -INFINITY;
                    sa[np][e] = sv;
                    mx[h] = fmaxf(mx[h], sv);
                }
            float corr[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                corr[h] = mx[h] == -INFINITY ? 1.0f : expf(__fsub_rn(mrow[h], mx[h])); /* a row with no position yet */
                mrow[h] = mx[h];
                lrow[h] = __fmul_rn(lrow[h], corr[h]);
            }
            uint32_t pa[FA_BN / 16][4];
#pragma unroll
            for (int np = 0; np < NP; np++) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1;
                    p[e] = mrow[h] == -INFINITY ? 0.0f : expf(__fsub_rn(sa[np][e], mrow[h]));
                    lrow[h] = __fadd_rn(lrow[h], p[e]);
                }
                pa[np / 2][2 * (np & 1)] = pack_h2(p[0], p[1]);
                pa[np / 2][2 * (np & 1) + 1] = pack_h2(p[2], p[3]);
            }
#pragma unroll
            for (int d = 0; d < ND; d++) {
                o[d][0] = __fmul_rn(o[d][0], corr[0]);
                o[d][1] = __fmul_rn(o[d][1], corr[0]);
                o[d][2] = __fmul_rn(o[d][2], corr[1]);
                o[d][3] = __fmul_rn(o[d][3], corr[1]);
            }
#pragma unroll
            for (int kk = 0; kk < FA_BN / 16; kk++)
#pragma unroll
                for (int d = 0; d < ND; d++) {
                    const __half *vr = Vt + (d * 8 + g) * LDV + 16 * kk + 2 * t;
                    mma16816(o[d], pa[kk], *reinterpret_cast<const uint32_t *>(vr),
                             *reinterpret_cast<const uint32_t *>(vr + 8));
                }
        }
        /* the split's (m, l, o): to part (PAR), or merged into (M, L, O) */
        float l[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l[h] = __fadd_rn(lrow[h], __shfl_xor_sync(0xffffffffu, lrow[h], 1));
            l[h] = __fadd_rn(l[h], __shfl_xor_sync(0xffffffffu, l[h], 2));
        }
        if (!active) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if constexpr (PAR) {
                if (Rw + g + 8 * h >= nrows) continue;
                /* part: per (kv head, row of the block's 64, split) m, l and the HD outputs */
                float *pr = part + (((size_t)kvh * (FA_WARPS * 16) + warp * 16 + g + 8 * h) * gridDim.z + z) * (HD + 2);
                if (t == 0) pr[0] = mrow[h], pr[1] = l[h];
#pragma unroll
                for (int d = 0; d < ND; d++) {
                    pr[2 + 8 * d + 2 * t] = o[d][2 * h];
                    pr[3 + 8 * d + 2 * t] = o[d][2 * h + 1];
                }
            } else if (mrow[h] != -INFINITY) {
                float Mn, a, b;
                fa_scales(Mrun[h], mrow[h], &Mn, &a, &b);
                Lrun[h] = fa_mix(Lrun[h], a, l[h], b);
#pragma unroll
                for (int d = 0; d < ND; d++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float *O = Os + ((d * 2 + h) * 2 + e) * FA_WARPS * 32 + threadIdx.x;
                        *O = fa_mix(*O, a, o[d][2 * h + e], b);
                    }
                Mrun[h] = Mn;
            }
        }
    }
    if constexpr (!PAR) {
        if (!active) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (Rw + g + 8 * h >= nrows) continue;
            float *orow = att + ((size_t)tok[h] * heads + head[h]) * HD + 2 * t;
#pragma unroll
            for (int d = 0; d < ND; d++) {
                orow[8 * d] = __fdiv_rn(Os[((d * 2 + h) * 2) * FA_WARPS * 32 + threadIdx.x], Lrun[h]);
                orow[8 * d + 1] = __fdiv_rn(Os[((d * 2 + h) * 2 + 1) * FA_WARPS * 32 + threadIdx.x], Lrun[h]);
            }
        }
    }
}

/* k_flash<PAR>'s splits merged in order for each row (a block a row of (token, head), a thread a
 * column): the arithmetic of the sequential form, so the same bits. */
template <int HD>
__global__ void k_flash_combine(float *__restrict__ att, const float *__restrict__ part, uint32_t n, uint32_t heads,
                                uint32_t kv_heads, uint32_t zmax, const uint32_t *dpos) {
    const uint32_t gq = heads / kv_heads, r = blockIdx.x, tk = r / gq, hh = r % gq, c = threadIdx.x;
    (void)n;
    const uint32_t kvh = blockIdx.y, qpos = *dpos + tk, nsplit = qpos / (FA_BN * FA_SPLIT) + 1;
    const float *pr = part + ((size_t)kvh * (FA_WARPS * 16) + r) * zmax * (HD + 2);
    float M = -INFINITY, L = 0.0f, O = 0.0f;
    for (uint32_t z = 0; z < nsplit; z++, pr += HD + 2) {
        if (pr[0] == -INFINITY) continue;
        float Mn, a, b;
        fa_scales(M, pr[0], &Mn, &a, &b);
        L = fa_mix(L, a, pr[1], b);
        O = fa_mix(O, a, pr[2 + c], b);
        M = Mn;
    }
    att[((size_t)tk * heads + kvh * gq + hh) * HD + c] = __fdiv_rn(O, L);
}

static bool flash_head(uint32_t hd) {
    static const bool on = env_on("SMOE_CUDA_FLASH");
    return on && (hd == 32 || hd == 64 || hd == 128);
}

extern "C" int smoe_cu_attention_max_positions(uint32_t hd) { return flash_head(hd) ? 1 << 30 : ATT_SMEM / 4 - 512; }

extern "C" int smoe_cu_attention_fixed(uint32_t hd) { return flash_head(hd); }

template <int HD, typename T>
static int launch_flash(cudaStream_t s, float *att, const float *q, const T *k, const T *v, uint32_t n,
                        uint32_t heads, uint32_t kv_heads, const uint32_t *dpos, float *part, uint32_t zmax) {
    const uint32_t rows = n * (heads / kv_heads);
    /* few rows over a long cache: the splits side by side (a combine launch more; not worth it below 4) */
    if (part && zmax >= 4 && rows <= FA_WARPS * 16) {
        k_flash<HD, T, true><<<dim3(kv_heads, 1, zmax), FA_WARPS * 32, 0, s>>>(att, q, k, v, n, heads, kv_heads, dpos,
                                                                              part);
        k_flash_combine<HD><<<dim3(rows, kv_heads), HD, 0, s>>>(att, part, n, heads, kv_heads, zmax, dpos);
        return (int)cudaGetLastError();
    }
    constexpr int smem = HD / 8 * 4 * FA_WARPS * 32 * sizeof(float);
    static bool configured;
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(k_flash<HD, T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return (int)e;
        configured = true;
    }
    k_flash<HD, T, false><<<dim3(kv_heads, (rows + FA_WARPS * 16 - 1) / (FA_WARPS * 16)), FA_WARPS * 32, smem, s>>>(
        att, q, k, v, n, heads, kv_heads, dpos, nullptr);
    return (int)cudaGetLastError();
}

template <typename T>
static int launch_attention(cudaStream_t s, float *att, const float *q, const T *k, const T *v, uint32_t n,
                            uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0, const uint32_t *dpos,
                            float *part, uint32_t zmax) {
    if (flash_head(hd)) {
        if (hd == 32) return launch_flash<32, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
        if (hd == 64) return launch_flash<64, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
        return launch_flash<128, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
    }
    static int configured;
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(k_attention<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM);
        if (e != cudaSuccess) return (int)e;
        configured = 1;
    }
    size_t smem = (size_t)(hd + pos0 + n) * sizeof(float);
    k_attention<T><<<dim3(heads, n), ATT_THREADS, smem, s>>>(att, q, k, v, heads, kv_heads, hd, pos0);
    return (int)cudaGetLastError();
}

extern "C" size_t smoe_cu_attention_part_floats(uint32_t kv_heads, uint32_t hd, uint32_t context) {
    if (!flash_head(hd)) return 0;
    const uint32_t zmax = (context + FA_BN * FA_SPLIT - 1) / (FA_BN * FA_SPLIT);
    return (size_t)kv_heads * FA_WARPS * 16 * zmax * (hd + 2);
}

extern "C" int smoe_cu_attention(smoe_cu_stream st, float *att, const float *q, const void *k, const void *v,
                                 uint32_t kv_type, uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd,
                                 uint32_t pos0, const uint32_t *dpos, float *part, uint32_t context) {
    if (n == 0) return 0;
    cudaStream_t s = (cudaStream_t)st;
    const uint32_t zmax = (context + FA_BN * FA_SPLIT - 1) / (FA_BN * FA_SPLIT);
    if (kv_type == 1)
        return launch_attention(s, att, q, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, n, heads, kv_heads, hd,
                                pos0, dpos, part, zmax);
    if (kv_type == 2)
        return launch_attention(s, att, q, (const __half *)k, (const __half *)v, n, heads, kv_heads, hd, pos0, dpos,
                                part, zmax);
    return launch_attention(s, att, q, (const float *)k, (const float *)v, n, heads, kv_heads, hd, pos0, dpos, part,
                            zmax);
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

/* The same for rows prepared by k_prep: f16 rows (cols halves) and their scales. */
__global__ void k_gather16(__half *g16, float *ge, const __half *a16, const float *ae, const uint32_t *rows, uint32_t K,
                           uint32_t cols) {
    const uint32_t j = blockIdx.x, src = rows[j] / K;
    const uint4 *in = reinterpret_cast<const uint4 *>(a16 + (size_t)src * cols);
    uint4 *out = reinterpret_cast<uint4 *>(g16 + (size_t)j * cols);
    for (uint32_t c = threadIdx.x; c < cols / 8; c += blockDim.x) out[c] = in[c];
    if (threadIdx.x == 0) ge[j] = ae[src];
}

extern "C" int smoe_cu_gather16(smoe_cu_stream st, void *g16, float *ge, const void *a16, const float *ae,
                                const uint32_t *rows, uint32_t K, uint32_t total, uint32_t cols) {
    if (total == 0) return 0;
    k_gather16<<<total, 128, 0, (cudaStream_t)st>>>((__half *)g16, ge, (const __half *)a16, ae, rows, K, cols);
    return (int)cudaGetLastError();
}

extern "C" int smoe_cu_gather(smoe_cu_stream st, float *xg, const float *xn, const uint32_t *rows, uint32_t K,
                              uint32_t total, uint32_t hidden) {
    if (total == 0) return 0;
    k_gather<<<total, 256, 0, (cudaStream_t)st>>>(xg, xn, rows, K, hidden);
    return (int)cudaGetLastError();
}

__global__ void k_swiglu(float *h, const float *hg, uint32_t I, smoe_cu_rows R) {
    uint32_t start, count;
    item_rows(R, &start, &count);
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

/* k_swiglu then k_prep, a row a block (grid as k_prep's): the same arithmetic, the same bits. */
__global__ void k_swiglu_prep(float *h, const float *hg, uint32_t I, smoe_cu_rows R, __half *h16, float *he) {
    uint32_t start, count;
    item_rows(R, &start, &count);
    if (blockIdx.x >= count) return;
    const size_t j = start + blockIdx.x;
    for (uint32_t c = threadIdx.x; c < I; c += blockDim.x) {
        const float g = hg[j * 2 * I + c], u = hg[j * 2 * I + I + c];
        const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
        h[j * I + c] = __fmul_rn(silu, u);
    }
    __syncthreads(); /* the row, written by every thread, before any is read */
    prep_row(h + j * I, I, j, h16, he);
}

extern "C" int smoe_cu_swiglu_prep(smoe_cu_stream st, float *h, const float *hg, uint32_t I, const smoe_cu_rows *R,
                                   void *h16, float *he) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    k_swiglu_prep<<<dim3(m, items), 256, 0, (cudaStream_t)st>>>(h, hg, I, *R, (__half *)h16, he);
    return (int)cudaGetLastError();
}

enum { UNION_WARPS = 8 };

/* A warp's walk over its segment of the ids, 32 at a time: lanes holding the same expert are peers
 * (match_any); the lowest is the leader. Returns the lane's rank among its peers. */
__device__ __forceinline__ uint32_t union_peers(int32_t e, uint32_t lane, uint32_t *peers) {
    *peers = __match_any_sync(0xFFFFFFFFu, e);
    return __popc(*peers & ((1u << lane) - 1u));
}

/* One block of UNION_WARPS warps, warp w owning the ids [w·seg, (w + 1)·seg). Per warp and expert
 * the count (wc), per expert the sum and, in warp order, where each warp's rows begin; the starts
 * and tile starts in expert order (thread 0); then each warp places its rows, peers by lane. An
 * expert's rows are so in increasing t·K + slot, whatever the timing. */
__global__ void __launch_bounds__(UNION_WARPS * 32) k_union(const int32_t *idx, uint32_t nk, uint32_t E, uint32_t tile,
                                                            uint32_t n_items, const uint8_t *const *vtab,
                                                            const uint8_t **wtab, uint32_t *start, uint32_t *count,
                                                            uint32_t *items, uint32_t *rows, uint32_t *counts,
                                                            uint32_t *used, uint32_t *bad) {
    __shared__ uint32_t wc[UNION_WARPS][1024], cnt[1024], base[1024], tbase[1024], n_tiles;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t seg = (nk + UNION_WARPS * 32 - 1) / (UNION_WARPS * 32) * 32, i0 = warp * seg;
    const uint32_t i1 = min(nk, i0 + seg);
    for (uint32_t e = lane; e < E; e += 32) wc[warp][e] = 0;
    __syncwarp();
    for (uint32_t i = i0 + lane; i - lane < i1; i += 32) {
        int32_t e = i < i1 ? idx[i] : -1;
        if (i < i1 && (e < 0 || (uint32_t)e >= E)) {
            atomicOr(bad, 1u);
            e = 0;
        }
        uint32_t peers;
        union_peers(e, lane, &peers);
        if (i < i1 && lane == (uint32_t)__ffs(peers) - 1) wc[warp][e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    for (uint32_t e = tid; e < E; e += UNION_WARPS * 32) {
        uint32_t c = 0;
        for (uint32_t w = 0; w < UNION_WARPS; w++) {
            const uint32_t v = wc[w][e];
            wc[w][e] = c;
            c += v;
        }
        cnt[e] = c;
    }
    __syncthreads();
    if (tid == 0) {
        uint32_t r = 0, t = 0, u = 0;
        for (uint32_t e = 0; e < E; e++) {
            base[e] = r;
            tbase[e] = t;
            r += cnt[e];
            t += (cnt[e] + tile - 1) / tile;
            u += cnt[e] > 0;
        }
        n_tiles = t;
        *used = u;
    }
    __syncthreads();
    for (uint32_t e = tid; e < E; e += UNION_WARPS * 32) {
        start[e] = base[e];
        count[e] = cnt[e];
        wtab[e] = vtab[e];
        counts[e] += cnt[e];
        for (uint32_t j = 0; j * tile < cnt[e]; j++) items[tbase[e] + j] = e << 16 | j;
    }
    for (uint32_t i = n_tiles + tid; i < n_items; i += UNION_WARPS * 32) items[i] = SMOE_CU_NO_ITEM;
    for (uint32_t i = i0 + lane; i - lane < i1; i += 32) {
        int32_t e = i < i1 ? idx[i] : -1;
        if (i < i1 && (e < 0 || (uint32_t)e >= E)) e = 0;
        uint32_t peers;
        const uint32_t rank = union_peers(e, lane, &peers);
        if (i < i1) rows[base[e] + wc[warp][e] + rank] = i;
        __syncwarp();
        if (i < i1 && lane == (uint32_t)__ffs(peers) - 1) wc[warp][e] += __popc(peers);
        __syncwarp();
    }
}

/* One token (tile 1, nk = K ≤ 32 distinct ids): lane k takes slot k's expert as item k. Only the
 * entries of the experts used are written, the only ones the items reach. */
__global__ void k_union1(const int32_t *idx, uint32_t nk, uint32_t E, uint32_t n_items, const uint8_t *const *vtab,
                         const uint8_t **wtab, uint32_t *start, uint32_t *count, uint32_t *items, uint32_t *rows,
                         uint32_t *counts, uint32_t *used, uint32_t *bad) {
    const uint32_t k = threadIdx.x;
    if (k < nk) {
        int32_t e = idx[k];
        if (e < 0 || (uint32_t)e >= E) {
            atomicOr(bad, 1u);
            e = 0;
        }
        start[e] = k;
        count[e] = 1;
        wtab[e] = vtab[e];
        counts[e] += 1;
        items[k] = (uint32_t)e << 16;
        rows[k] = k;
    } else if (k < n_items) {
        items[k] = SMOE_CU_NO_ITEM;
    }
    if (k == 0) *used = nk;
}

extern "C" uint32_t smoe_cu_union_items(uint32_t nk, uint32_t E, uint32_t tile) {
    /* Σ ⌈c_e / tile⌉ ≤ Σ (c_e + tile − 1) / tile over the experts used, at most min(E, nk) of them */
    const uint64_t used = nk < E ? nk : E;
    return (uint32_t)(((uint64_t)nk + (uint64_t)(tile - 1) * used) / tile);
}

extern "C" int smoe_cu_union(smoe_cu_stream st, const int32_t *idx, uint32_t nk, uint32_t E, uint32_t tile,
                             uint32_t n_items, const uint8_t *const *vtab, const uint8_t **wtab, uint32_t *start,
                             uint32_t *count, uint32_t *items, uint32_t *rows, uint32_t *counts, uint32_t *used,
                             uint32_t *bad) {
    if (E == 0 || E > 1024 || tile == 0 || tile > 0xFFFFu || n_items < smoe_cu_union_items(nk, E, tile))
        return (int)cudaErrorInvalidValue;
    if (tile == 1 && nk <= 32 && n_items <= 32) /* one token: its K ids are distinct (top-k) */
        k_union1<<<1, 32, 0, (cudaStream_t)st>>>(idx, nk, E, n_items, vtab, wtab, start, count, items, rows, counts,
                                                used, bad);
    else
        k_union<<<1, UNION_WARPS * 32, 0, (cudaStream_t)st>>>(idx, nk, E, tile, n_items, vtab, wtab, start, count,
                                                             items, rows, counts, used, bad);
    return (int)cudaGetLastError();
}

/* One thread an element (block (t, column chunk)): one token's sum is spread over the GPU. */
__global__ void k_moe_sum(float *x, const float *y, const float *w, uint32_t K, uint32_t hidden) {
    const uint32_t t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float acc = 0.0f;
    for (uint32_t k = 0; k < K; k++)
        acc = __fadd_rn(acc, __fmul_rn(w[(size_t)t * K + k], y[((size_t)t * K + k) * hidden + c]));
    x[(size_t)t * hidden + c] = __fadd_rn(x[(size_t)t * hidden + c], acc);
}

extern "C" int smoe_cu_moe_sum(smoe_cu_stream st, float *x, const float *y, const float *w, uint32_t n, uint32_t K,
                               uint32_t hidden) {
    if (n == 0) return 0;
    k_moe_sum<<<dim3(n, (hidden + 127) / 128), 128, 0, (cudaStream_t)st>>>(x, y, w, K, hidden);
    return (int)cudaGetLastError();
}
