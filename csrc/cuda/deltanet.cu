/* deltanet.cu — the hybrids' ops (Qwen3-Next, Qwen3.5-MoE): sigmoid gates, and the Gated DeltaNet's
 * causal convolution, q/k L2 norms, gated delta rule and gated RMSNorm (cuda_ops.h; the rule of
 * cuda_common.cuh). transformers' torch fallbacks are the definition; cpu/kernels_ref.c's
 * smoe_conv1d_step, smoe_l2norm, smoe_delta_step and smoe_rmsnorm_gated are the CPU's version.
 *
 * The recurrence runs in token order on the GPU as on the CPU: a launch over n rows walks them one
 * after the other, each row's arithmetic the same whatever n is, so the layer-major pass (the
 * chunk's rows in one launch), the token-serial step (n = 1) and a batch (one launch per row, each
 * with its own session's states) give the same bits. The orders:
 *
 *   convolution, per channel c (one thread, the rows in order): acc = Σ_{j < kernel−1} w[c, j] ·
 *     state[j, c] in j order, + w[c, kernel−1] · x[c], every product and sum rounded (no fma, the
 *     CPU's), then silu; the state shifted to end with x.
 *   L2 norm of a q or k head, per row: one warp, lanes over i ≡ lane (mod 32) in order, then the
 *     butterfly.
 *   delta rule, per value head (one block; thread j owns column j of the dk × dv state): S[i, j]
 *     decayed and Sᵀk summed over i in order, delta, then S[i, j] += k_i · delta_j and out_j =
 *     Σ_i S[i, j] · q_i over i in order — the CPU's operations, rounded alike. The state is worked
 *     on in shared memory when it fits (a choice of the shape and the device, never of n), else in
 *     place in VRAM: the same operations either way.
 *   gated RMSNorm of a head's output: each warp's butterfly, then the warps' sums in warp order. */
#include "cuda_common.cuh"

__device__ __forceinline__ float sigm(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* ------------------------------------------------------------------------------ gates */

__global__ void k_sigmoid_gate(float *y, const float *g, uint32_t width, uint32_t gw, size_t count) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const size_t t = i / width, c = i % width;
    const float s = sigm(g[t * gw + (gw == 1 ? 0 : c)]);
    y[i] = __fmul_rn(y[i], s);
}

extern "C" int smoe_cu_sigmoid_gate(smoe_cu_stream st, float *y, const float *g, uint32_t width, uint32_t gate_width,
                                    uint32_t n) {
    const size_t count = (size_t)n * width;
    if (count == 0) return 0;
    k_sigmoid_gate<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)st>>>(y, g, width, gate_width, count);
    return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------------ convolution */

__global__ void k_conv(float *mix, uint32_t n, float *state, const float *w, uint32_t ch, uint32_t kernel) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    const uint32_t past = kernel - 1;
    const float *wc = w + (size_t)c * kernel;
    for (uint32_t r = 0; r < n; r++) {
        float *x = mix + (size_t)r * ch + c;
        const float xv = *x;
        float acc = 0.0f;
        for (uint32_t j = 0; j < past; j++) acc = __fadd_rn(acc, __fmul_rn(wc[j], state[(size_t)j * ch + c]));
        acc = __fadd_rn(acc, __fmul_rn(wc[past], xv));
        for (uint32_t j = 0; j + 1 < past; j++) state[(size_t)j * ch + c] = state[(size_t)(j + 1) * ch + c];
        if (past) state[(size_t)(past - 1) * ch + c] = xv;
        *x = silu(acc);
    }
}

/* Per row, one warp per q or k head: x ← x / sqrt(Σ x² + 1e-6) · scale (q: 1/√dk, k: 1). */
__global__ void k_qk_l2(float *mix, uint32_t ch, uint32_t k_heads, uint32_t dk, float qscale) {
    const uint32_t r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    float *x = mix + (size_t)r * ch + (size_t)h * dk;
    float ss = 0.0f;
    for (uint32_t i = lane; i < dk; i += 32) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
    ss = warp_sum(ss);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ss, 1e-6f)));
    const float scale = h < k_heads ? qscale : 1.0f;
    for (uint32_t i = lane; i < dk; i += 32) x[i] = __fmul_rn(__fmul_rn(x[i], inv), scale);
}

extern "C" int smoe_cu_deltanet_conv(smoe_cu_stream st, float *mix, uint32_t n, float *conv_state, const float *conv_w,
                                     uint32_t k_heads, uint32_t k_dim, uint32_t conv_dim, uint32_t kernel) {
    if (n == 0) return 0;
    cudaStream_t s = (cudaStream_t)st;
    k_conv<<<(conv_dim + 127) / 128, 128, 0, s>>>(mix, n, conv_state, conv_w, conv_dim, kernel);
    k_qk_l2<<<dim3(n, 2 * k_heads), 32, 0, s>>>(mix, conv_dim, k_heads, k_dim, 1.0f / sqrtf((float)k_dim));
    return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------------- delta rule */

struct delta_args {
    const float *mix, *beta, *decay, *z, *a_log, *dt_bias, *norm;
    float *att, *state;
    uint32_t n, conv_dim, k_heads, v_heads, dk, dv;
    float eps;
    int in_smem;
    uint32_t v_tiled; /* value head h reads key head h mod k_heads (llama.cpp's qwen35moe order), else h / (v/k) */
};

__global__ void k_delta(delta_args a) {
    extern __shared__ float sm[];
    const uint32_t h = blockIdx.x, j = threadIdx.x, dk = a.dk, dv = a.dv, nw = blockDim.x / 32;
    const uint32_t kh = a.v_tiled ? h % a.k_heads : h / (a.v_heads / a.k_heads);
    const size_t key_dim = (size_t)a.k_heads * dk, vdim = (size_t)a.v_heads * dv;
    float *qs = sm, *ks = sm + dk, *red = ks + dk; /* red: nw + 1 floats */
    float *Sg = a.state + (size_t)h * dk * dv, *S = Sg;
    if (a.in_smem) {
        S = red + 33;
        for (size_t i = threadIdx.x; i < (size_t)dk * dv; i += blockDim.x) S[i] = Sg[i];
    }
    const float A = -expf(a.a_log[h]), dtb = a.dt_bias[h];
    for (uint32_t r = 0; r < a.n; r++) {
        const float *row = a.mix + (size_t)r * a.conv_dim;
        for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[(size_t)kh * dk + i];
            ks[i] = row[key_dim + (size_t)kh * dk + i];
        }
        __syncthreads(); /* q and k of the row, and (first row) the state, before anyone reads them */
        const float g = __fmul_rn(A, softplus(__fadd_rn(a.decay[(size_t)r * a.v_heads + h], dtb)));
        const float dec = expf(g), beta = sigm(a.beta[(size_t)r * a.v_heads + h]);
        float out = 0.0f;
        if (j < dv) {
            const float v = row[2 * key_dim + (size_t)h * dv + j];
            float kv = 0.0f;
            for (uint32_t i = 0; i < dk; i++) {
                const float s = __fmul_rn(S[(size_t)i * dv + j], dec);
                S[(size_t)i * dv + j] = s;
                kv = __fadd_rn(kv, __fmul_rn(s, ks[i]));
            }
            const float delta = __fmul_rn(__fsub_rn(v, kv), beta);
            for (uint32_t i = 0; i < dk; i++) {
                const float s = __fadd_rn(S[(size_t)i * dv + j], __fmul_rn(ks[i], delta));
                S[(size_t)i * dv + j] = s;
                out = __fadd_rn(out, __fmul_rn(s, qs[i]));
            }
        }
        /* the gated RMSNorm over the head's dv outputs */
        const float sq = warp_sum(j < dv ? __fmul_rn(out, out) : 0.0f);
        if ((j & 31) == 0) red[j >> 5] = sq;
        __syncthreads();
        if (j == 0) {
            float t = 0.0f;
            for (uint32_t w = 0; w < nw; w++) t = __fadd_rn(t, red[w]);
            red[32] = t;
        }
        __syncthreads();
        if (j < dv) {
            const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(red[32], (float)dv), a.eps)));
            const float zi = a.z[(size_t)r * vdim + (size_t)h * dv + j];
            a.att[(size_t)r * vdim + (size_t)h * dv + j] =
                __fmul_rn(__fmul_rn(a.norm[j], __fmul_rn(out, inv)), silu(zi));
        }
        __syncthreads(); /* red, qs and ks are the next row's */
    }
    if (a.in_smem)
        for (size_t i = threadIdx.x; i < (size_t)dk * dv; i += blockDim.x) Sg[i] = S[i];
}

static size_t delta_small(uint32_t dk) { return (2 * (size_t)dk + 33) * sizeof(float); }

/* The shared memory a block may opt in to, read once per process (smoe_cu_deltanet_setup, at share
 * creation: never while a decode step is being recorded). */
static int delta_optin = -1;

extern "C" int smoe_cu_deltanet_setup(void) {
    if (delta_optin >= 0) return 0;
    int dev = 0, v = 48 * 1024;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess && v > 48 * 1024)
        e = cudaFuncSetAttribute(k_delta, cudaFuncAttributeMaxDynamicSharedMemorySize, v);
    if (e != cudaSuccess) return (int)e;
    delta_optin = v;
    return 0;
}

extern "C" int smoe_cu_deltanet_rule(smoe_cu_stream st, float *att, const float *mix, const float *beta,
                                     const float *decay, const float *z, float *state, const float *a_log,
                                     const float *dt_bias, const float *norm, uint32_t n, uint32_t k_heads,
                                     uint32_t v_heads, uint32_t k_dim, uint32_t v_dim, uint32_t v_tiled, float eps) {
    if (n == 0) return 0;
    if (delta_optin < 0) return (int)cudaErrorInitializationError; /* smoe_cu_deltanet_setup first */
    /* the shared-memory choice: a function of the shape and the device alone */
    const size_t small = delta_small(k_dim), whole = small + (size_t)k_dim * v_dim * sizeof(float);
    const int in_smem = whole <= (size_t)delta_optin;
    const size_t smem = in_smem ? whole : small;
    delta_args a = {mix, beta, decay, z, a_log, dt_bias, norm, att, state, n, 2 * k_heads * k_dim + v_heads * v_dim,
                    k_heads, v_heads, k_dim, v_dim, eps, in_smem, v_tiled};
    const uint32_t threads = (v_dim + 31) / 32 * 32;
    k_delta<<<v_heads, threads, smem, (cudaStream_t)st>>>(a);
    return (int)cudaGetLastError();
}
