/* matmul.cu — the products: dense and grouped (experts), on the tensor cores for q4/q8, and the f16 rows they read (cuda_ops.h; the rule of cuda_common.cuh). */
#include "cuda_common.cuh"

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

template <int FMT>
__global__ void __launch_bounds__(MM_WARPS * 32) k_matmul(smoe_cu_tensor T, smoe_cu_rows R, const float *__restrict__ x,
                                                          size_t ldx, float *__restrict__ y, size_t ldy) {
    pdl_trigger();
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t r = bx * MM_WARPS + warp, t0 = blockIdx.z * MM_TZ;
    if (r >= T.rows || t0 >= count) { /* not before the predecessor has ended (cuda_common.cuh) */
        pdl_wait();
        return;
    }
    const uint32_t t1 = min(count, t0 + (uint32_t)MM_TZ), nw = T.cols / 8;
    if (!R.items) { /* a dense product may start early (launch_fp32): its row into L2 meanwhile */
        const size_t rowbytes = FMT == FMT_F32 ? 4 * (size_t)T.cols : FMT == FMT_BF16 ? 2 * (size_t)T.cols
                                : FMT == FMT_Q8 ? (size_t)T.cols : T.cols / 2;
        for (size_t ln = lane; 128 * ln < rowbytes; ln += 32) prefetch_l2(w + r * rowbytes + 128 * ln);
    }
    pdl_wait(); /* x is the predecessor's */
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

/* Products with a q4 or q8 tensor whose columns are a multiple of 64 (and whose scales are f16 or
 * bf16: smoe_cu_tensor_cores) run on the tensor cores
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

/* Few tokens (decode, small experts): a block is `ranges` warps on `per` row tiles of one item in
 * turn, warp r computing P_r of each tile (its k-blocks loaded U at a time, then applied), warp 0
 * adding the others' in order (through one of two shared buffers, so the other warps go on to the
 * next tile while warp 0 adds and stores). The item's blob, its rows, their output rows and
 * scales are looked up once a block, not once a tile; the host picks `per` so that the launch is
 * about one wave of blocks (launch_tc). Row block bx of an item (of nbx, twice the tensor's in a
 * pair launch) multiplies rows 16·MT·bx' of the first tensor or, past half, of the second. */
template <int FMT, int MT, int NT, int U>
__global__ void __launch_bounds__(TC_MAXW * 32) k_tc(smoe_cu_tensor T, smoe_cu_rows R, const __half *__restrict__ x16,
                                                     const float *__restrict__ xe, float *__restrict__ y, size_t ldy,
                                                     uint32_t ranges, uint32_t nbx, uint32_t per) {
    __shared__ float part[2][TC_MAXW - 1][MT * NT * 4][32];
    pdl_trigger();
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t start, count;
    const uint32_t u = item_rows(R, &start, &count); /* item lists and weights: there before the predecessor */
    const uint32_t t0 = blockIdx.z * (NT * 8), bx0 = blockIdx.x * per;
    if (t0 >= count || bx0 >= nbx) { /* the whole block (not before its predecessor has ended: cuda_common.cuh) */
        pdl_wait();
        return;
    }
    const uint8_t *wi = !R.items ? R.w : R.wtab[u];
    const uint32_t cols = T.cols, nkb = cols / 64, gs = __ffs(T.group) - 1, half = R.pair ? nbx / 2 : nbx;
    const uint32_t kb0 = warp * nkb / ranges, kb1 = (warp + 1) * nkb / ranges, bx1 = min(nbx, bx0 + per);
    /* The weights of tile bx for this warp's k-blocks into L2, ahead of their loads (the first two
     * while the predecessor still runs): lane (g, t) takes rows g and g + 8 of each 16, t its
     * 128-byte lines (t = 2, 3 also the scales' and biases'). */
    auto prefetch = [&](uint32_t bx) {
        if (bx >= bx1) return;
        const bool sec = bx >= half;
        const uint8_t *w = wi + (R.items ? (sec ? R.woff2 : R.woff) : 0);
        const size_t rowbytes = FMT == FMT_Q4 ? cols / 2 : cols, kbytes = FMT == FMT_Q4 ? 32 : 64;
        const uint32_t ng = cols >> gs, lines = (uint32_t)(((kb1 - kb0) * kbytes + 127) / 128);
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t r = min((sec ? bx - half : bx) * (MT * 16) + 16 * i + g + 8 * h, T.rows - 1);
                for (uint32_t ln = t; ln < lines; ln += 4) prefetch_l2(w + r * rowbytes + kbytes * kb0 + 128 * ln);
                if (t >= 2) {
                    const size_t sb = T.scale_format == SC_F32 ? 4 : 2;
                    prefetch_l2(w + (t == 2 ? T.scales_off : T.biases_off) + sb * ((size_t)r * ng + ((64 * kb0) >> gs)));
                }
            }
    };
    prefetch(bx0);
    prefetch(bx0 + 1);
    pdl_wait(); /* from here on the predecessor's outputs (x16, xe) are there, and y may be written */
    /* warp 0's outputs: the lane's token rows, where they go and the factor that undoes k_prep's */
    uint32_t orow[NT][2];
    float oxe[NT][2];
    if (warp == 0)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const uint32_t tk = t0 + 8 * j + 2 * t + e, jj = start + min(tk, count - 1);
                orow[j][e] = tk < count ? (R.yrow ? R.yrow[jj] : jj) : 0xFFFFFFFFu;
                oxe[j][e] = xe[jj];
            }
    const __half *xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xr[j] = x16 + (size_t)(start + min(t0 + 8 * j + g, count - 1)) * cols + 16 * t;
    for (uint32_t bx = bx0; bx < bx1; bx++) { /* bounds uniform over the block: its barriers match */
        prefetch(bx + 2);
        const bool second = bx >= half;
        const uint32_t r0 = (second ? bx - half : bx) * (MT * 16), ycol = second ? T.rows : 0;
        const uint8_t *w = wi + (R.items ? (second ? R.woff2 : R.woff) : 0);
        const uint8_t *sc = w + T.scales_off, *bs = w + T.biases_off;
        const uint8_t *wrow[MT][2];
        size_t srow[MT][2];
        tc_rows<FMT, MT>(T, w, r0, g, t, wrow, srow);
        float acc[MT][NT][4];
        tc_zero(acc);
        for (uint32_t kb = kb0; kb < kb1; kb += U) {
            TcA<MT> fa[U];
            uint4 xb[U][2][NT];
#pragma unroll
            for (int uu = 0; uu < U; uu++)
                if (kb + uu < kb1) {
                    tc_load_a<FMT, MT>(fa[uu], T, wrow, srow, sc, bs, kb + uu, gs, t);
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            xb[uu][h][j] = __ldg(reinterpret_cast<const uint4 *>(xr[j] + 64 * (size_t)(kb + uu) + 8 * h));
                }
#pragma unroll
            for (int uu = 0; uu < U; uu++)
                if (kb + uu < kb1) {
                    tc_half<FMT, MT, NT>(fa[uu], 0, xb[uu][0], acc, NT);
                    tc_half<FMT, MT, NT>(fa[uu], 1, xb[uu][1], acc, NT);
                }
        }
        if (ranges > 1) {
            float(*pb)[MT * NT * 4][32] = part[bx & 1];
            if (warp > 0)
#pragma unroll
                for (int i = 0; i < MT; i++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) pb[warp - 1][(i * NT + j) * 4 + e][lane] = acc[i][j][e];
            __syncthreads();
            if (warp > 0) continue;
            for (uint32_t r = 1; r < ranges; r++)
#pragma unroll
                for (int i = 0; i < MT; i++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            acc[i][j][e] = __fadd_rn(acc[i][j][e], pb[r - 1][(i * NT + j) * 4 + e][lane]);
        }
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const uint32_t r = r0 + 16 * i + g + 8 * (e >> 1), o = orow[j][e & 1];
                    if (r < T.rows && o != 0xFFFFFFFFu) y[(size_t)o * ldy + ycol + r] = __fmul_rn(acc[i][j][e], oxe[j][e & 1]);
                }
    }
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

/* f32 scales and biases (a vault converted from an f32 checkpoint, or with --scale-dtype f32) take the
 * FP32 cores: rounded to f16 for fma(scale, q, bias), a bias's error would shift its whole group of
 * weights alike, which sums over the group instead of averaging out (on tests/test_cuda.py's
 * family models, logits 2–3 times as far from the CPU's as the f16 rows and weights alone put them:
 * bench/cuda_q4_rounding.py). f16 scales are f16 already; bf16 ones are exact in f16 (from 2^-14 to 65504). */
extern "C" int smoe_cu_tensor_cores(const smoe_cu_tensor *T) {
    static const bool on = env_on("SMOE_CUDA_TC");
    return on && (T->format == FMT_Q4 || T->format == FMT_Q8) && T->cols % 64 == 0 && T->group >= 16 &&
           T->scale_format != SC_F32;
}

__global__ void k_prep(const float *x, size_t ldx, uint32_t cols, smoe_cu_rows R, __half *x16, float *xe) {
    pdl_enter();
    uint32_t start, count;
    item_rows(R, &start, &count);
    if (blockIdx.x >= count) return;
    const size_t row = start + blockIdx.x;
    prep_row(x + row * ldx, cols, row, x16, xe);
}

extern "C" int smoe_cu_prep(smoe_cu_stream st, const float *x, size_t ldx, uint32_t cols, const smoe_cu_rows *R,
                            void *x16, float *xe) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    launch_k(PDL_ALL, k_prep, dim3(m, items), dim3(256), 0, (cudaStream_t)st, x, ldx, cols, *R, (__half *)x16, xe);
    return (int)cudaGetLastError();
}

/* The ranges of a tensor's k-blocks (k_tc's order): a function of its width alone. */
static uint32_t tc_ranges(uint32_t cols) {
    const uint32_t nkb = cols / 64;
    return nkb % 8 == 0 ? 8 : nkb % 4 == 0 ? 4 : nkb % 2 == 0 ? 2 : 1;
}

/* How many row tiles a k_tc block takes in turn: enough that the launch is about one wave of
 * blocks (fit blocks an SM), so that an item's lookups and a block's start are paid once for
 * several tiles, up to TC_PER_MAX. SMOE_CUDA_TC_PER=N (for comparisons) fixes it; 1 is a tile a
 * block. Changes no bits. */
enum { TC_PER_MAX = 4 };
static uint32_t tc_per(uint32_t nbx, uint32_t others, uint32_t fit) {
    static const int forced = getenv("SMOE_CUDA_TC_PER") ? atoi(getenv("SMOE_CUDA_TC_PER")) : 0;
    static int sms;
    if (forced > 0) return (uint32_t)forced < nbx ? (uint32_t)forced : nbx;
    if (!sms) {
        int dev = 0;
        if (cudaGetDevice(&dev) != 0 || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != 0 || sms < 1)
            sms = 1;
    }
    const uint64_t wave = (uint64_t)(fit ? fit : 1) * (uint32_t)sms;
    uint64_t gx = wave / (others ? others : 1);
    if (gx < 1) gx = 1;
    if (gx > nbx) gx = nbx;
    /* at most TC_PER_MAX: a block's tiles run one after another, and a launch of many items (a
     * prompt's experts) would otherwise leave most of a wave to few long blocks */
    const uint32_t per = (uint32_t)((nbx + gx - 1) / gx);
    return per < (uint32_t)TC_PER_MAX ? per : (uint32_t)TC_PER_MAX;
}

/* The one-token products start early (programmatic dependent launch, cuda_common.cuh) on sm_90
 * and later, for dense products and the device union's tiled lists (whose lists a kernel before
 * the predecessor wrote); SMOE_CUDA_PDL=0 launches them plainly. Changes no bits. */
static bool pdl_on(void) { return smoe_cu_pdl_level() >= 1; }

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
    do {                                                                                                               \
        static int fit[TC_MAXW + 1]; /* blocks of 32·ranges threads an SM can hold */                                  \
        if (!fit[ranges] &&                                                                                            \
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit[ranges], k_tc<FMT, MT, NT, U>, 32 * ranges, 0) != 0)   \
            fit[ranges] = 1;                                                                                           \
        const uint32_t nbx = px * ((T->rows + 16 * MT - 1) / (16 * MT)), nz = (m + 8 * NT - 1) / (8 * NT);            \
        const uint32_t per = tc_per(nbx, items * nz, (uint32_t)fit[ranges]);                                           \
        cudaLaunchConfig_t cfg = {};                                                                                   \
        cudaLaunchAttribute at[1];                                                                                     \
        cfg.gridDim = dim3((nbx + per - 1) / per, items, nz);                                                          \
        cfg.blockDim = dim3(32 * ranges);                                                                              \
        cfg.stream = s;                                                                                                \
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;                                                 \
        at[0].val.programmaticStreamSerializationAllowed = 1;                                                          \
        cfg.attrs = at;                                                                                                \
        cfg.numAttrs = pdl_on() && (!R->items || R->tile) ? 1 : 0;                                                     \
        cudaLaunchKernelEx(&cfg, k_tc<FMT, MT, NT, U>, *T, *R, x16, a->xe, y, ldy, ranges, nbx, per);                  \
    } while (0)
#define TC_BIG(MT, NT)                                                                                                 \
    do {                                                                                                               \
        constexpr int smem = TB_STAGES * tb_stage_bytes<FMT, MT, NT>();                                                \
        static_assert(smem <= 99 * 1024, "a tile must fit the 99 KiB a block may opt in to on sm_86/89/120");          \
        static bool configured;                                                                                        \
        if (!configured) {                                                                                             \
            cudaFuncSetAttribute(k_tcb<FMT, MT, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);               \
            configured = true;                                                                                         \
        }                                                                                                              \
        k_tcb<FMT, MT, NT><<<dim3(px * ((T->rows + TB_WARPS * 16 * MT - 1) / (TB_WARPS * 16 * MT)), items,             \
                                  (m + 8 * NT - 1) / (8 * NT)),                                                        \
                             TB_WARPS * 32, smem, s>>>(*T, *R, x16, a->xe, y, ldy, ranges);                             \
    } while (0)
    /* SMOE_CUDA_TC_MT (1, 2 or 4: 16·MT rows a warp's tile) for few tokens, for comparisons: more rows
     * a tile keep more of a warp's weights in flight */
    static const int mt = getenv("SMOE_CUDA_TC_MT") ? atoi(getenv("SMOE_CUDA_TC_MT")) : 1;
    if (m <= 8 && mt == 4)
        TC_SMALL(4, 1, 4);
    else if (m <= 8 && mt == 2)
        TC_SMALL(2, 1, 4);
    else if (m <= 8)
        TC_SMALL(1, 1, 4);
    else if (m <= 16 && mt >= 2)
        TC_SMALL(2, 2, 4);
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
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        cfg.gridDim = dim3(px * ((T->rows + MM_WARPS - 1) / MM_WARPS), items, (m + MM_TZ - 1) / MM_TZ);
        cfg.blockDim = dim3(MM_WARPS * 32);
        cfg.stream = s;
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl_on() && !R->items ? 1 : 0; /* dense: the router of an f32 vault, say */
        cudaLaunchKernelEx(&cfg, k_matmul<FMT>, *T, *R, a->x, a->ldx, y, ldy);
    }
}

extern "C" int smoe_cu_matmul(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R, const smoe_cu_act *a,
                              float *y, size_t ldy) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    if (smoe_cu_ggml(T)) return smoe_cu_matmul_ggml(st, T, R, a, y, ldy); /* GGML block formats: ggml.cu */
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
