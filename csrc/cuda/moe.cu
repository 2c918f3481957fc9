/* moe.cu — the MoE step's kernels: routing, the union formed on the device, the experts' weighted sum (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

/* One warp per token: lane l holds experts l, l + 32, … (NJ a lane, in registers); the max and the
 * top-k picks are exact in any order (ties: the lower index), the softmax's sum is each lane's in
 * index order and then the butterfly, the renormalisation's in slot order (every lane adds the
 * picks as they are made; lane k keeps pick k). Nothing is read back from memory: each step is a
 * shuffle, not a round trip through L2. */
template <int NJ>
__global__ void k_route(const float *logits, uint32_t n, uint32_t E, uint32_t K, int renorm, int32_t *idx, float *w) {
    pdl_enter();
    const uint32_t t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= n) return;
    const float *p = logits + (size_t)t * E;
    float v[NJ];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const uint32_t i = lane + 32 * j;
        v[j] = i < E ? p[i] : -INFINITY;
        if (i < E) m = fmaxf(m, v[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E) {
            v[j] = expf(__fsub_rn(v[j], m));
            sum = __fadd_rn(sum, v[j]);
        }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E) v[j] = __fdiv_rn(v[j], sum);
    uint32_t taken = 0; /* bit j: expert lane + 32j was picked */
    float tot = 0.0f, mine_w = 0.0f;
    int32_t mine_i = -1;
    for (uint32_t k = 0; k < K; k++) {
        float bv = -INFINITY;
        int32_t bi = -1;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const uint32_t i = lane + 32 * j;
            if (i < E && !(taken >> j & 1u) && (bi < 0 || v[j] > bv)) {
                bv = v[j];
                bi = (int32_t)i;
            }
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
        tot = __fadd_rn(tot, bv);
        if (lane == k) mine_w = bv, mine_i = bi;
    }
    if (lane < K) {
        idx[(size_t)t * K + lane] = mine_i;
        w[(size_t)t * K + lane] = renorm ? __fdiv_rn(mine_w, tot) : mine_w;
    }
}

extern "C" int smoe_cu_route(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, uint32_t K, int renorm,
                             int32_t *idx, float *w) {
    if (n == 0) return 0;
    if (E > 32 * 32 || K > 32) return (int)cudaErrorInvalidValue;
    const dim3 g((n + 3) / 4), b(128);
    cudaStream_t s = (cudaStream_t)st;
    if (E <= 4 * 32)
        launch_k(PDL_ALL, k_route<4>, g, b, 0, s, logits, n, E, K, renorm, idx, w);
    else if (E <= 8 * 32)
        launch_k(PDL_ALL, k_route<8>, g, b, 0, s, logits, n, E, K, renorm, idx, w);
    else if (E <= 16 * 32)
        launch_k(PDL_ALL, k_route<16>, g, b, 0, s, logits, n, E, K, renorm, idx, w);
    else
        launch_k(PDL_ALL, k_route<32>, g, b, 0, s, logits, n, E, K, renorm, idx, w);
    return (int)cudaGetLastError();
}

/* GLM-4.5 / DeepSeek-V3's router (vault router_kind 1; cpu/kernels.h, smoe_route_sigmoid_group), one
 * thread per token, every step in index order: s = sigmoid(logit), the choice c = s + bias (NaN
 * ranks as −inf); with groups, each group's score the sum of its two best c, the topk_group best
 * groups kept (ties: the lower index) and the others' c taken as −inf; the K best c in turn (each
 * pick the best ranking after the last: ties, the lower index), best first; their s summed in slot
 * order, divided by (sum + 1e-20) when renorm, times scale. */
__device__ __forceinline__ float sg_rank(float v) { return v != v ? -INFINITY : v; }
__device__ __forceinline__ bool sg_before(float va, uint32_t a, float vb, uint32_t b) {
    return va > vb || (va == vb && a < b);
}
__device__ __forceinline__ float sg_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

/* The choice score of expert e: its sigmoid plus its correction (f32, or bf16 widened). */
__device__ __forceinline__ float sg_choice(const float *p, const uint8_t *bias, uint8_t bfmt, uint32_t e) {
    const float b = bfmt == FMT_F32 ? reinterpret_cast<const float *>(bias)[e]
                                    : __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(bias)[e] << 16);
    return __fadd_rn(sg_sigmoid(p[e]), b);
}

__global__ void k_route_grouped(const float *logits, uint32_t n, uint32_t E, const uint8_t *bias, uint8_t bfmt,
                                uint32_t n_group, uint32_t topk_group, uint32_t K, int renorm, float scale,
                                int32_t *idx, float *w) {
    pdl_enter();
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float *p = logits + (size_t)t * E;
    uint64_t keep = ~0ull; /* bit g: group g kept */
    const bool grouped = n_group > 1 && topk_group < n_group;
    const uint32_t per = grouped ? E / n_group : E;
    if (grouped) {
        float gs[SMOE_CU_MAX_GROUPS];
        for (uint32_t g = 0; g < n_group; g++) {
            float v1 = -INFINITY, v2 = -INFINITY, r1 = -INFINITY, r2 = -INFINITY;
            uint32_t i1 = 0xFFFFFFFFu, i2 = 0xFFFFFFFFu;
            for (uint32_t e = g * per; e < (g + 1) * per; e++) {
                const float c = sg_choice(p, bias, bfmt, e), r = sg_rank(c);
                if (i1 == 0xFFFFFFFFu || sg_before(r, e, r1, i1)) {
                    v2 = v1, r2 = r1, i2 = i1;
                    v1 = c, r1 = r, i1 = e;
                } else if (i2 == 0xFFFFFFFFu || sg_before(r, e, r2, i2)) {
                    v2 = c, r2 = r, i2 = e;
                }
            }
            gs[g] = __fadd_rn(v1, v2);
        }
        keep = 0;
        for (uint32_t g = 0; g < n_group; g++) {
            uint32_t rank = 0; /* the groups ranking before g */
            for (uint32_t h = 0; h < n_group; h++) rank += sg_before(sg_rank(gs[h]), h, sg_rank(gs[g]), g);
            if (rank < topk_group) keep |= 1ull << g;
        }
    }
    int32_t *it = idx + (size_t)t * K;
    float *wt = w + (size_t)t * K;
    float pr = INFINITY; /* the last pick's rank and index: the next ranks after it */
    uint32_t pi = 0;
    for (uint32_t k = 0; k < K; k++) {
        float br = -INFINITY;
        uint32_t bi = 0xFFFFFFFFu;
        for (uint32_t e = 0; e < E; e++) {
            const float r = keep >> (e / per) & 1u ? sg_rank(sg_choice(p, bias, bfmt, e)) : -INFINITY;
            if (k > 0 && !sg_before(pr, pi, r, e)) continue; /* picked already */
            if (bi == 0xFFFFFFFFu || sg_before(r, e, br, bi)) br = r, bi = e;
        }
        pr = br, pi = bi;
        it[k] = (int32_t)bi;
    }
    float sum = 0.0f;
    for (uint32_t k = 0; k < K; k++) {
        wt[k] = sg_sigmoid(p[it[k]]);
        sum = __fadd_rn(sum, wt[k]);
    }
    for (uint32_t k = 0; k < K; k++) wt[k] = __fmul_rn(renorm ? __fdiv_rn(wt[k], __fadd_rn(sum, 1e-20f)) : wt[k], scale);
}

extern "C" int smoe_cu_route_grouped(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E,
                                     const uint8_t *bias, uint8_t bias_format, uint32_t n_group, uint32_t topk_group, uint32_t K, int renorm, float scale,
                                     int32_t *idx, float *w) {
    if (n == 0) return 0;
    if (K > E || n_group > SMOE_CU_MAX_GROUPS || (n_group > 1 && E % n_group != 0)) return (int)cudaErrorInvalidValue;
    launch_k(PDL_ALL, k_route_grouped, dim3((n + 127) / 128), dim3(128), 0, (cudaStream_t)st, logits, n, E, bias,
             bias_format, n_group, topk_group, K, renorm, scale, idx, w);
    return (int)cudaGetLastError();
}

/* gpt-oss's router (vault router_kind 2; cpu/kernels.h, smoe_topk_softmax), one thread per token:
 * the K largest logits in turn (NaN ranks as −inf; ties, the lower index), best first, then a
 * softmax over those K in slot order. */
__global__ void k_route_topk_softmax(const float *logits, uint32_t n, uint32_t E, uint32_t K, int32_t *idx, float *w) {
    pdl_enter();
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float *p = logits + (size_t)t * E;
    int32_t *it = idx + (size_t)t * K;
    float *wt = w + (size_t)t * K;
    float pr = INFINITY;
    uint32_t pi = 0;
    for (uint32_t k = 0; k < K; k++) {
        float br = -INFINITY;
        uint32_t bi = 0xFFFFFFFFu;
        for (uint32_t e = 0; e < E; e++) {
            const float r = sg_rank(p[e]);
            if (k > 0 && !sg_before(pr, pi, r, e)) continue; /* picked already */
            if (bi == 0xFFFFFFFFu || sg_before(r, e, br, bi)) br = r, bi = e;
        }
        pr = br, pi = bi;
        it[k] = (int32_t)bi;
        wt[k] = p[bi];
    }
    float m = wt[0];
    for (uint32_t k = 1; k < K; k++)
        if (wt[k] > m) m = wt[k];
    float sum = 0.0f;
    for (uint32_t k = 0; k < K; k++) {
        wt[k] = expf(__fsub_rn(wt[k], m));
        sum = __fadd_rn(sum, wt[k]);
    }
    for (uint32_t k = 0; k < K; k++) wt[k] = __fdiv_rn(wt[k], sum);
}

extern "C" int smoe_cu_route_topk_softmax(smoe_cu_stream st, const float *logits, uint32_t n, uint32_t E, uint32_t K,
                                          int32_t *idx, float *w) {
    if (n == 0) return 0;
    if (K == 0 || K > E) return (int)cudaErrorInvalidValue;
    launch_k(PDL_ALL, k_route_topk_softmax, dim3((n + 127) / 128), dim3(128), 0, (cudaStream_t)st, logits, n, E, K, idx,
             w);
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
    pdl_enter();
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
    pdl_enter();
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
        launch_k(PDL_ALL, k_union1, dim3(1), dim3(32), 0, (cudaStream_t)st, idx, nk, E, n_items, vtab, wtab, start,
                 count, items, rows, counts, used, bad);
    else
        launch_k(PDL_ALL, k_union, dim3(1), dim3(UNION_WARPS * 32), 0, (cudaStream_t)st, idx, nk, E, tile, n_items,
                 vtab, wtab, start, count, items, rows, counts, used, bad);
    return (int)cudaGetLastError();
}

/* One thread an element (block (t, column chunk)): one token's sum is spread over the GPU. */
__global__ void k_moe_sum(float *x, const float *y, const float *w, uint32_t K, uint32_t hidden) {
    pdl_enter();
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
    launch_k(PDL_ALL, k_moe_sum, dim3(n, (hidden + 127) / 128), dim3(128), 0, (cudaStream_t)st, x, y, w, K, hidden);
    return (int)cudaGetLastError();
}
