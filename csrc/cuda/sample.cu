/* sample.cu — sampling's selection on the GPU (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

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
