/* test_data.h — random tensors in the vault layout and their naive decoding, for the kernel tests
 * (test_kernels.c, test_kernels_neon.c). Define TEST_DATA_SEED (the generator's first state)
 * before including; include once, after the C library headers and kernels_isa.h. */
#ifndef TEST_DATA_H
#define TEST_DATA_H

/* ------------------------------------------------------------------------- test data */

static uint64_t rng_state = TEST_DATA_SEED;

static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rndf(float lo, float hi) { return lo + (hi - lo) * (float)((rnd() >> 40) * 0x1p-24); }

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float naive_f16(uint16_t h) { /* by ldexp, independent of the kernels' conversion */
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (float)((h & 0x8000) ? -v : v);
}

static float naive_bf16(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static uint64_t align64(uint64_t x) { return (x + 63) / 64 * 64; }

typedef struct {
    smoe_tensor t;
    void *alloc;
    uint8_t *bytes; /* the tensor's first byte: alloc + misalign */
} test_tensor;

/* A random rows × cols tensor in the vault layout (docs/vault.md section 3), q8/q4 in groups of
 * G along cols (0 for f32/bf16), starting `misalign` bytes past a 64-byte boundary (0, or 4:
 * f32-aligned but not 16-byte aligned). */
static test_tensor make_tensor(uint8_t format, uint8_t sf, uint32_t G, uint32_t rows, uint32_t cols,
                               unsigned misalign) {
    test_tensor tt;
    memset(&tt, 0, sizeof tt);
    smoe_tensor *t = &tt.t;
    t->format = format;
    t->scale_format = sf;
    t->rows = rows;
    t->cols = cols;
    t->group = format >= SMOE_FMT_Q8 ? G : 0;
    const uint64_t n = (uint64_t)rows * cols;
    uint64_t codes = 0;
    switch (format) {
    case SMOE_FMT_F32: t->nbytes = 4 * n; break;
    case SMOE_FMT_BF16: t->nbytes = 2 * n; break;
    case SMOE_FMT_Q8: codes = align64(n); break;
    case SMOE_FMT_Q4: codes = align64(n / 2); break;
    }
    if (format >= SMOE_FMT_Q8) {
        const uint64_t sbytes = align64((sf == SMOE_SCALE_F32 ? 4 : 2) * (n / G));
        t->scales_off = codes;
        t->biases_off = codes + sbytes;
        t->nbytes = codes + 2 * sbytes;
    }
    tt.alloc = aligned_alloc(64, align64(t->nbytes + misalign) + 64);
    tt.bytes = (uint8_t *)tt.alloc + misalign;
    t->data = tt.bytes;
    uint8_t *b = tt.bytes;
    if (format == SMOE_FMT_F32) {
        for (uint64_t i = 0; i < n; i++) {
            float f = rndf(-1, 1);
            memcpy(b + 4 * i, &f, 4);
        }
    } else if (format == SMOE_FMT_BF16) {
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h = (uint16_t)(f32_bits(rndf(-1, 1)) >> 16);
            memcpy(b + 2 * i, &h, 2);
        }
    } else {
        for (uint64_t i = 0; i < codes; i++) b[i] = (uint8_t)rnd();
        const uint64_t ng = n / G;
        for (uint64_t g = 0; g < 2 * ng; g++) {
            uint8_t *at = b + (g < ng ? t->scales_off : t->biases_off) + (g % ng) * (sf == SMOE_SCALE_F32 ? 4 : 2);
            if (sf == SMOE_SCALE_F32) { /* mostly ±2^-8..2^-2, some tiny (f32 subnormal) */
                float f = rnd() % 16 == 0 ? rndf(-1, 1) * 0x1p-140f : rndf(-0.25f, 0.25f);
                memcpy(at, &f, 4);
                continue;
            }
            uint16_t h;
            if (sf == SMOE_SCALE_F16) { /* mostly 2^-6..2^-2, some subnormal */
                int e = (rnd() % 16 == 0) ? 0 : 9 + (int)(rnd() % 5);
                h = (uint16_t)((rnd() & 1) << 15 | e << 10 | (rnd() & 1023));
            } else {
                h = (uint16_t)(f32_bits(rndf(-0.25f, 0.25f)) >> 16);
            }
            memcpy(at, &h, 2);
        }
    }
    return tt;
}

/* scale, bias and code of W[r, c] (q8/q4), decoded independently */
static void naive_q(const smoe_tensor *t, const uint8_t *b, uint32_t r, uint32_t c, float *s, float *bias,
                    unsigned *q) {
    const uint64_t i = (uint64_t)r * t->cols + c, g = (uint64_t)r * (t->cols / t->group) + c / t->group;
    if (t->scale_format == SMOE_SCALE_F32) {
        memcpy(s, b + t->scales_off + 4 * g, 4);
        memcpy(bias, b + t->biases_off + 4 * g, 4);
    } else {
        uint16_t sh, bh;
        memcpy(&sh, b + t->scales_off + 2 * g, 2);
        memcpy(&bh, b + t->biases_off + 2 * g, 2);
        *s = t->scale_format == SMOE_SCALE_F16 ? naive_f16(sh) : naive_bf16(sh);
        *bias = t->scale_format == SMOE_SCALE_F16 ? naive_f16(bh) : naive_bf16(bh);
    }
    if (t->format == SMOE_FMT_Q8) {
        *q = b[i];
    } else {
        uint32_t u;
        memcpy(&u, b + 4 * (i / 8), 4);
        *q = (u >> (4 * (c % 8))) & 15u;
    }
}

/* W[r, c] as docs/vault.md says (float(s)·float(q) + float(b), a separate multiply and add) */
static float naive_w(const smoe_tensor *t, const uint8_t *b, uint32_t r, uint32_t c) {
    const uint64_t i = (uint64_t)r * t->cols + c;
    uint16_t h;
    uint32_t u;
    if (t->format == SMOE_FMT_F32) {
        memcpy(&u, b + 4 * i, 4);
        return bits_f32(u);
    }
    if (t->format == SMOE_FMT_BF16) {
        memcpy(&h, b + 2 * i, 2);
        return naive_bf16(h);
    }
    float s, bias;
    unsigned q;
    naive_q(t, b, r, c, &s, &bias, &q);
    volatile float sq = s * (float)q;
    return sq + bias;
}

/* |s·q| + |b| of W[r, c] (|w| for f32/bf16): the magnitude the affine form's error scales with */
static double affine_mag(const smoe_tensor *t, const uint8_t *b, uint32_t r, uint32_t c) {
    if (t->format < SMOE_FMT_Q8) return fabs(naive_w(t, b, r, c));
    float s, bias;
    unsigned q;
    naive_q(t, b, r, c, &s, &bias, &q);
    return fabs((double)s * q) + fabs((double)bias);
}

/* "q4/g32/f32" and the like */
static const char *fmt_name_g(uint8_t f, uint8_t s, uint32_t G) {
    static const char *names[] = {"f32", "bf16", "q8", "q4"}, *snames[] = {"", "/f16", "/bf16", "/f32"};
    static char buf[32];
    if (f >= SMOE_FMT_Q8)
        snprintf(buf, sizeof buf, "%s/g%u%s", names[f], G, snames[s & 3]);
    else
        snprintf(buf, sizeof buf, "%s", names[f]);
    return buf;
}

#endif
