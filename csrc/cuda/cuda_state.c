/* cuda_state.c — the CUDA backend's helpers that its ops share (cuda_state.h): failures, tensors'
 * device addresses and layouts, planes and their f16 rows, the products' calls. */
#include "cuda/cuda_state.h"

#include <stdlib.h>
#include <string.h>

smoe_status smoe_cuda_fail(cuda_state *c, int err, const char *what) {
    c->broken = true;
    if (c->sh) c->sh->broken = true;
    return smoe_fail(SMOE_ERR_INTERNAL, "cuda: %s: %s (the session must be reset)", what, smoe_cu_error_string(err));
}

smoe_cu_tensor smoe_cuda_desc(const smoe_tensor *T) {
    smoe_cu_tensor d = {T->format, T->scale_format, T->rows, T->cols, T->group, T->scales_off, T->biases_off};
    return d;
}

const uint8_t *smoe_cuda_dev(const cuda_state *c, const smoe_tensor *T) {
    return c->sh->dense + (T->data - c->sh->host_dense);
}

bool smoe_cuda_tensor_cores(const smoe_tensor *T) {
    smoe_cu_tensor d = smoe_cuda_desc(T);
    return smoe_cu_tensor_cores(&d) != 0;
}

smoe_cu_event smoe_cuda_ring_event(cuda_share *sh) {
    smoe_cu_event ev = sh->ring[sh->ring_next];
    sh->ring_next = (sh->ring_next + 1) % RING;
    return ev;
}

float *smoe_cuda_plane(cuda_state *c, smoe_plane p) {
    switch (p) {
    case SMOE_PL_X: return c->x;
    case SMOE_PL_XN: return c->xn;
    case SMOE_PL_Q: return c->q;
    case SMOE_PL_K: return c->ks;
    case SMOE_PL_V: return c->vs;
    case SMOE_PL_ATT: return c->att;
    case SMOE_PL_Y: return c->xg; /* its first chunk × hidden floats: free outside the MoE step */
    case SMOE_PL_GATE: return c->gate;
    case SMOE_PL_MIX: return c->mix;
    case SMOE_PL_BETA: return c->beta;
    case SMOE_PL_DECAY: return c->decay;
    case SMOE_PL_SGATE: return c->sgate;
    }
    return NULL;
}

/* The hybrids' planes have widths of their own (their products write them packed, W.rows wide). */
uint32_t smoe_cuda_plane_cols(const cuda_state *c, smoe_plane p) {
    switch (p) {
    case SMOE_PL_MIX: return c->conv_dim;
    case SMOE_PL_BETA:
    case SMOE_PL_DECAY: return c->lin.v_heads;
    case SMOE_PL_SGATE: return 1;
    default: return smoe_plane_width(c->cfg, p);
    }
}

/* The f16 rows of plane src (rows [0, n), cols wide) into a16, unless it holds them already. */
static smoe_status prep(cuda_state *c, smoe_plane src, uint32_t n, uint32_t cols) {
    if (c->a16_of == (int)src && c->a16_cols == cols) return SMOE_OK;
    smoe_cu_rows R = {.n = n};
    CU(smoe_cu_prep(c->sh->cs, smoe_cuda_plane(c, src), cols, cols, &R, c->a16, c->ae));
    c->a16_of = (int)src;
    c->a16_cols = cols;
    return SMOE_OK;
}

smoe_status smoe_cuda_act(cuda_state *c, smoe_plane src, uint32_t n, bool need, smoe_cu_act *a) {
    return smoe_cuda_act_cols(c, src, n, smoe_cuda_plane_cols(c, src), need, a);
}

smoe_status smoe_cuda_act_cols(cuda_state *c, smoe_plane src, uint32_t n, uint32_t cols, bool need, smoe_cu_act *a) {
    *a = (smoe_cu_act){.x = smoe_cuda_plane(c, src), .ldx = cols};
    if (!need) return SMOE_OK;
    smoe_status st = prep(c, src, n, cols);
    if (st != SMOE_OK) return st;
    a->x16 = c->a16;
    a->xe = c->ae;
    return SMOE_OK;
}

smoe_status smoe_cuda_linear(cuda_state *c, const smoe_tensor *T, const smoe_cu_act *a, uint32_t n, float *y,
                             size_t ldy) {
    smoe_cu_tensor d = smoe_cuda_desc(T);
    smoe_cu_rows R = {.w = smoe_cuda_dev(c, T), .n = n};
    CU(smoe_cu_matmul(c->sh->cs, &d, &R, a, y, ldy));
    return SMOE_OK;
}

/* A plane is written: a16 no longer holds its f16 rows. */
void smoe_cuda_written(cuda_state *c, smoe_plane p) {
    if (c->a16_of == (int)p) c->a16_of = -1;
}

/* VRAM free now (SMOE_CUDA_VRAM_FREE, in bytes, lowers it: for tests). */
size_t smoe_cuda_vram_free(void) {
    char name[8];
    int major, minor;
    size_t free_b = 0, total_b = 0;
    if (smoe_cu_device(0, name, sizeof name, &major, &minor, &free_b, &total_b) != 0) return 0;
    const char *lim = getenv("SMOE_CUDA_VRAM_FREE");
    if (lim && strtoull(lim, NULL, 10) < free_b) free_b = (size_t)strtoull(lim, NULL, 10);
    return free_b;
}

/* h (rows of R) = SwiGLU of hg's gate and up halves (I columns each) — the experts' activation
 * (c->act) when expert, else silu — and *a the activation the down product reads: with its f16 rows
 * in the h16 plane, prepared in the same launch, when need. */
smoe_status smoe_cuda_swiglu(cuda_state *c, bool need, bool expert, uint32_t I, const smoe_cu_rows *R,
                             smoe_cu_act *a) {
    *a = (smoe_cu_act){.x = c->h, .ldx = I};
    const smoe_cu_act_fn f = expert ? c->act : (smoe_cu_act_fn){0, 0.0f, 0.0f};
    if (!need) {
        CU(smoe_cu_swiglu(c->sh->cs, c->h, c->hg, I, R, f));
        return SMOE_OK;
    }
    CU(smoe_cu_swiglu_prep(c->sh->cs, c->h, c->hg, I, R, f, c->h16, c->he));
    a->x16 = c->h16;
    a->xe = c->he;
    return SMOE_OK;
}
