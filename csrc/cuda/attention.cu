/* attention.cu — causal attention over the KV cache: the plain kernel and flash attention on the tensor cores (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

/* Row t at position pos0 + t sees the positions [first, pos0 + t]: all before it, or the last
 * `window` of them (0: no window). sinks (heads entries, f32 or bf16, or NULL): head h's sink logit
 * joins the softmax's max and, last, its sum (gpt-oss; cpu/kernels.h, smoe_softmax_sink). */
template <typename T>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(float *att, const float *q, const T *k, const T *v,
                                                           uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0,
                                                           const uint8_t *sinks, uint8_t sfmt, uint32_t window) {
    pdl_enter();
    extern __shared__ float sm[];
    __shared__ float red[ATT_THREADS];
    const uint32_t h = blockIdx.x, t = blockIdx.y, seen = pos0 + t + 1;
    const uint32_t first = window && seen > window ? seen - window : 0, n_pos = seen - first;
    const float sink = !sinks ? -INFINITY
                       : sfmt == FMT_F32 ? reinterpret_cast<const float *>(sinks)[h]
                                         : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(sinks)[h] << 16);
    const uint32_t kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = ATT_THREADS / 32;
    float *sq = sm, *sc = sm + hd;
    const float *qv = q + ((size_t)t * heads + h) * hd;
    for (uint32_t d = tid; d < hd; d += ATT_THREADS) sq[d] = qv[d];
    __syncthreads();
    const float scale = (float)(1.0 / sqrt((double)hd));
    const T *kb = k + (size_t)first * kv_dim + (size_t)kvh * hd, *vb = v + (size_t)first * kv_dim + (size_t)kvh * hd;
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
    m = fmaxf(red[0], sink);
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
    sum = __fadd_rn(red[0], expf(__fsub_rn(sink, m))); /* + 0 exactly without a sink */
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
enum { FA_WARPS = 4, FA_BN = 64, FA_STAGE = 8 };

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

/* Positions go in splits of `split` tiles (fa_split), each an online softmax from scratch, the splits then
 * merged in order (fa_scales, fa_mix): so a row's bits do not depend on how many rows share its
 * block. PAR: split blockIdx.z only, its (m, l, o) to part (k_flash_combine merges them), for few
 * rows over many positions (decode); else every split in turn, O kept in shared memory. */
template <int HD, typename T, bool PAR>
__global__ void __launch_bounds__(FA_WARPS * 32) k_flash(float *__restrict__ att, const float *__restrict__ q,
                                                         const T *__restrict__ k, const T *__restrict__ v,
                                                         uint32_t n, uint32_t heads, uint32_t kv_heads,
                                                         const uint32_t *dpos, float *__restrict__ part,
                                                         uint32_t split) {
    pdl_enter();
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
    const uint32_t nsplit = (ntiles + split - 1) / split;
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
        for (uint32_t tile = z * split; tile < min(ntiles, (z + 1) * split); tile++) {
            const uint32_t p0 = tile * FA_BN;
            __syncthreads();
            /* K row by row (coalesced); V transposed, position fastest (conflict-free stores); each
             * thread's loads issued FA_STAGE at a time before any is stored, not one round trip each */
            constexpr int PER = FA_BN * (HD / 4) / (FA_WARPS * 32), NB = PER < FA_STAGE ? PER : FA_STAGE;
            static_assert(PER * FA_WARPS * 32 == FA_BN * (HD / 4) && PER % NB == 0, "a tile in whole rounds");
#pragma unroll
            for (int j0 = 0; j0 < PER; j0 += NB) {
                __half2 ka[NB][2], va[NB][2];
#pragma unroll
                for (int j = 0; j < NB; j++) {
                    const uint32_t i = threadIdx.x + (j0 + j) * FA_WARPS * 32;
                    const uint32_t p = i / (HD / 4), d = 4 * (i % (HD / 4)), pv = i % FA_BN, dv = 4 * (i / FA_BN);
                    ka[j][0] = ka[j][1] = va[j][0] = va[j][1] = __float2half2_rn(0.0f);
                    if (p0 + p <= last) kv_h4(k + (size_t)(p0 + p) * kv_dim + (size_t)kvh * HD + d, &ka[j][0], &ka[j][1]);
                    if (p0 + pv <= last)
                        kv_h4(v + (size_t)(p0 + pv) * kv_dim + (size_t)kvh * HD + dv, &va[j][0], &va[j][1]);
                }
#pragma unroll
                for (int j = 0; j < NB; j++) {
                    const uint32_t i = threadIdx.x + (j0 + j) * FA_WARPS * 32;
                    const uint32_t p = i / (HD / 4), d = 4 * (i % (HD / 4)), pv = i % FA_BN, dv = 4 * (i / FA_BN);
                    *reinterpret_cast<__half2 *>(Ks + p * LDK + d) = ka[j][0];
                    *reinterpret_cast<__half2 *>(Ks + p * LDK + d + 2) = ka[j][1];
                    Vt[(dv + 0) * LDV + pv] = __low2half(va[j][0]);
                    Vt[(dv + 1) * LDV + pv] = __high2half(va[j][0]);
                    Vt[(dv + 2) * LDV + pv] = __low2half(va[j][1]);
                    Vt[(dv + 3) * LDV + pv] = __high2half(va[j][1]);
                }
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
                                uint32_t kv_heads, uint32_t zmax, const uint32_t *dpos, uint32_t split) {
    pdl_enter();
    const uint32_t gq = heads / kv_heads, r = blockIdx.x, tk = r / gq, hh = r % gq, c = threadIdx.x;
    (void)n;
    const uint32_t kvh = blockIdx.y, qpos = *dpos + tk, nsplit = qpos / (FA_BN * split) + 1;
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

/* The tiles of a split: 2 (128 positions), so that a decode step over a long cache runs many
 * splits side by side (each walking 2 tiles, not 8); SMOE_CUDA_FA_SPLIT=N (for comparisons; read
 * once per process) takes N. Both forms of k_flash use it, so they agree for any N. */
static uint32_t fa_split(void) {
    static uint32_t v;
    if (!v) {
        const char *e = getenv("SMOE_CUDA_FA_SPLIT");
        const long n = e ? strtol(e, NULL, 10) : 2;
        v = n < 1 ? 1 : n > 64 ? 64 : (uint32_t)n;
    }
    return v;
}

static bool flash_head(uint32_t hd) {
    static const bool on = env_on("SMOE_CUDA_FLASH");
    return on && (hd == 32 || hd == 64 || hd == 128);
}

/* The plain kernel's shared memory: ATT_SMEM, or less where the GPU opts in to less per block (99 KiB
 * on sm_86, sm_89 and sm_120; 163 KiB on sm_80), which bounds the positions it attends over. */
static int att_smem(void) {
    static int bytes;
    if (!bytes) {
        int dev = 0, optin = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || optin <= 0)
            optin = 48 * 1024;
        bytes = optin < ATT_SMEM ? optin : ATT_SMEM;
    }
    return bytes;
}

extern "C" int smoe_cu_attention_max_positions(uint32_t hd, int plain) {
    return flash_head(hd) && !plain ? 1 << 30 : att_smem() / 4 - 512;
}

extern "C" int smoe_cu_attention_fixed(uint32_t hd, int plain) { return flash_head(hd) && !plain; }

template <int HD, typename T>
static int launch_flash(cudaStream_t s, float *att, const float *q, const T *k, const T *v, uint32_t n,
                        uint32_t heads, uint32_t kv_heads, const uint32_t *dpos, float *part, uint32_t zmax) {
    const uint32_t rows = n * (heads / kv_heads);
    /* few rows over a long cache: the splits side by side (a combine launch more; not worth it below 4) */
    if (part && zmax >= 4 && rows <= FA_WARPS * 16) {
        launch_k(PDL_ALL, k_flash<HD, T, true>, dim3(kv_heads, 1, zmax), dim3(FA_WARPS * 32), 0, s, att, q, k, v, n,
                 heads, kv_heads, dpos, part, fa_split());
        launch_k(PDL_ALL, k_flash_combine<HD>, dim3(rows, kv_heads), dim3(HD), 0, s, att, part, n, heads, kv_heads,
                 zmax, dpos, fa_split());
        return (int)cudaGetLastError();
    }
    constexpr int smem = HD / 8 * 4 * FA_WARPS * 32 * sizeof(float);
    static bool configured;
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(k_flash<HD, T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return (int)e;
        configured = true;
    }
    launch_k(PDL_ALL, k_flash<HD, T, false>, dim3(kv_heads, (rows + FA_WARPS * 16 - 1) / (FA_WARPS * 16)),
             dim3(FA_WARPS * 32), smem, s, att, q, k, v, n, heads, kv_heads, dpos, nullptr, fa_split());
    return (int)cudaGetLastError();
}

template <typename T>
static int launch_attention(cudaStream_t s, float *att, const float *q, const T *k, const T *v, uint32_t n,
                            uint32_t heads, uint32_t kv_heads, uint32_t hd, uint32_t pos0, const uint32_t *dpos,
                            float *part, uint32_t zmax, const uint8_t *sinks, uint8_t sfmt, uint32_t window) {
    if (flash_head(hd) && !sinks && !window) {
        if (hd == 32) return launch_flash<32, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
        if (hd == 64) return launch_flash<64, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
        return launch_flash<128, T>(s, att, q, k, v, n, heads, kv_heads, dpos, part, zmax);
    }
    static int configured;
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(k_attention<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, att_smem());
        if (e != cudaSuccess) return (int)e;
        configured = 1;
    }
    size_t smem = (size_t)(hd + pos0 + n) * sizeof(float);
    launch_k(PDL_ALL, k_attention<T>, dim3(heads, n), dim3(ATT_THREADS), smem, s, att, q, k, v, heads, kv_heads, hd,
             pos0, sinks, sfmt, window);
    return (int)cudaGetLastError();
}

extern "C" size_t smoe_cu_attention_part_floats(uint32_t kv_heads, uint32_t hd, uint32_t context) {
    if (!flash_head(hd)) return 0;
    const uint32_t zmax = (context + FA_BN * fa_split() - 1) / (FA_BN * fa_split());
    return (size_t)kv_heads * FA_WARPS * 16 * zmax * (hd + 2);
}

extern "C" int smoe_cu_attention(smoe_cu_stream st, float *att, const float *q, const void *k, const void *v,
                                 uint32_t kv_type, uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t hd,
                                 uint32_t pos0, const uint32_t *dpos, float *part, uint32_t context,
                                 const uint8_t *sinks, uint8_t sinks_format, uint32_t window) {
    if (n == 0) return 0;
    cudaStream_t s = (cudaStream_t)st;
    const uint32_t zmax = (context + FA_BN * fa_split() - 1) / (FA_BN * fa_split());
    if (kv_type == 1)
        return launch_attention(s, att, q, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, n, heads, kv_heads, hd,
                                pos0, dpos, part, zmax, sinks, sinks_format, window);
    if (kv_type == 2)
        return launch_attention(s, att, q, (const __half *)k, (const __half *)v, n, heads, kv_heads, hd, pos0, dpos,
                                part, zmax, sinks, sinks_format, window);
    return launch_attention(s, att, q, (const float *)k, (const float *)v, n, heads, kv_heads, hd, pos0, dpos, part,
                            zmax, sinks, sinks_format, window);
}
