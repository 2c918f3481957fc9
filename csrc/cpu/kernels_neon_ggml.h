/* kernels_neon_ggml.h — the GGML block formats' 8-bit-activation product of kernels_neon.c,
 * included there twice: once for ARMv8.0 (GQ_DOT 0: widening multiplies) and once under the
 * dot-product target (GQ_DOT 1: SDOT). The two differ only in how a block's exact integer sum is
 * formed; the integers are the same, so the results are the same bits.
 *
 * Before including: GQ(name) (the instance's name for name), GQ_DOT. No include guard, on purpose. */

/* The GGML block formats' 8-bit-activation product with the bits of kernels_ref.c's ref_ggml_qx:
 * per step of 8 blocks (256 columns), the row's blocks decoded once by the reference's decoder
 * (gb_qx_decode) and multiplied by every token's codes; each block's integer sum exact, from
 * vmull_s8 / vmlal_high_s8 (two products per int16 lane, < 2^15) and vpaddlq_s16 (GQ_DOT 0) or
 * from vdotq_s32 (GQ_DOT 1); then the reference's float operations on 8 lanes (lane j: block
 * 2·(j%4) + j/4 of the step). */
static bool GQ(g_matmul_qx_neon)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                 size_t ldy, uint32_t r0, uint32_t r1) {
    enum { GT = 32 }; /* tokens of a tile: their accumulators live on the stack */
    const uint8_t fmt = W->format;
    const uint32_t cols = W->cols, nb = cols / 32, steps = (nb + 7) / 8;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    if (cols % bs) return false;
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool has_min = gb_has_min(fmt), q2k = fmt == SMOE_FMT_GGML_Q2_K;
    const size_t row_bytes = (size_t)(cols / bs) * ts;
    f8 tot[GT], bia[GT];
    int16_t mm[16];
    float nu[8], nul[8];
    _Alignas(16) int8_t q[8 * 32];
    int16_t sub[16];
    float sg[8], sl[8], mu[8];
    for (uint32_t t0 = 0; t0 < n; t0 += GT) {
        const uint32_t nt = n - t0 < GT ? n - t0 : GT;
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            for (uint32_t t = 0; t < nt; t++) tot[t] = bia[t] = f8_zero();
            for (uint32_t k = 0; k < steps; k++) {
                const uint32_t valid = nb - 8 * k < 8 ? nb - 8 * k : 8;
                memset(q, 0, sizeof q);
                memset(sub, 0, sizeof sub);
                for (int i = 0; i < 8; i++) sg[i] = mu[i] = 0.0f;
                gb_qx_decode(fmt, row, 8 * k, valid, q, sub, sg, mu);
                for (int j = 0; j < 8; j++) sl[j] = sg[2 * (j % 4) + j / 4];
#if GQ_DOT
                /* the sub-scales in the lanes' block order: blocks 0, 2, 4, 6 (halves 0, 1), then 1, 3, 5, 7 */
                const int16x4x4_t sv = vld4_s16(sub);
                const int32x4_t se0 = vmovl_s16(sv.val[0]), se1 = vmovl_s16(sv.val[1]);
                const int32x4_t so0 = vmovl_s16(sv.val[2]), so1 = vmovl_s16(sv.val[3]);
#endif
                if (q2k) { /* Q2_K's mins per 16 columns (valid is 8: 256-column blocks) */
                    for (int i = 0; i < 8; i++) nu[i] = gb_q2k_mins(row, 8 * k + (uint32_t)i, mm + 2 * i);
                    for (int j = 0; j < 8; j++) nul[j] = nu[2 * (j % 4) + j / 4];
                }
                for (uint32_t t = 0; t < nt; t++) {
                    const int8_t *ct = (const int8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes + 256 * (size_t)k;
                    const float *dt = X->d + (size_t)(t0 + t) * z.d_floats + 8 * k;
                    int32_t M[8];
#if GQ_DOT
                    /* each half block's sum by SDOT, four blocks' reduced by pairwise adds (sum4x4),
                       then its sub-scales: the same integers as the widening form below */
                    int32x4_t h[8][2];
                    for (int b = 0; b < 8; b++)
                        for (int half = 0; half < 2; half++)
                            h[b][half] = vdotq_s32(vdupq_n_s32(0), vld1q_s8(q + 32 * b + 16 * half),
                                                   vld1q_s8(ct + 32 * b + 16 * half));
                    const int32x4_t i0 = vmlaq_s32(vmulq_s32(sum4x4(h[0][0], h[2][0], h[4][0], h[6][0]), se0),
                                                   sum4x4(h[0][1], h[2][1], h[4][1], h[6][1]), se1);
                    const int32x4_t i1 = vmlaq_s32(vmulq_s32(sum4x4(h[1][0], h[3][0], h[5][0], h[7][0]), so0),
                                                   sum4x4(h[1][1], h[3][1], h[5][1], h[7][1]), so1);
                    const f8 If = {vcvtq_f32_s32(i0), vcvtq_f32_s32(i1)};
#else
                    int32_t I[8];
                    for (int j = 0; j < 8; j++) {
                        const int b = 2 * (j % 4) + j / 4;
                        const int8x16_t w0 = vld1q_s8(q + 32 * b), w1 = vld1q_s8(q + 32 * b + 16);
                        const int8x16_t c0 = vld1q_s8(ct + 32 * b), c1 = vld1q_s8(ct + 32 * b + 16);
                        const int16x8_t p0 = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(c0)), w0, c0);
                        const int16x8_t p1 = vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(c1)), w1, c1);
                        I[j] = sub[2 * b] * vaddvq_s32(vpaddlq_s16(p0)) + sub[2 * b + 1] * vaddvq_s32(vpaddlq_s16(p1));
                    }
                    const f8 If = {vcvtq_f32_s32(vld1q_s32(I)), vcvtq_f32_s32(vld1q_s32(I + 4))};
#endif
                    if (q2k) /* Q2_K's mins against each half block's sum of codes */
                        for (int j = 0; j < 8; j++) {
                            const int b = 2 * (j % 4) + j / 4;
                            const int8x16_t c0 = vld1q_s8(ct + 32 * b), c1 = vld1q_s8(ct + 32 * b + 16);
                            M[j] = mm[2 * b] * vaddvq_s16(vpaddlq_s8(c0)) + mm[2 * b + 1] * vaddvq_s16(vpaddlq_s8(c1));
                        }
                    tot[t] = f8_fma(tot[t], If, f8_mul(f8_load(sl), f8_load(dt)));
                    if (has_min)
                        bia[t] = f8_fma(bia[t], f8_load(mu), f8_load(X->gsum + (size_t)(t0 + t) * z.gsum_floats + 8 * k));
                    if (q2k) {
                        const f8 Mf = {vcvtq_f32_s32(vld1q_s32(M)), vcvtq_f32_s32(vld1q_s32(M + 4))};
                        bia[t] = f8_fma(bia[t], Mf, f8_mul(f8_load(nul), f8_load(dt)));
                    }
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ldy + r] = has_min || q2k ? hsum8(tot[t]) + hsum8(bia[t]) : hsum8(tot[t]);
        }
    }
    return true;
}

