/* cuda_state.h — the CUDA backend's share and session state (backend_cuda.c, moe_cuda.c).
 *
 * What lives where:
 *   the share    the device, its two streams (compute, upload), the dense region in VRAM (uploaded
 *                once, the vault's own bytes), the device tier — a VRAM expert cache of whole
 *                blobs (gpu_cache_bytes / blob_bytes, at least MIN_VSLOTS), evicted least recently
 *                used — and the host retention cache's slots, pinned with cudaHostRegister so that
 *                fills are asynchronous DMA. Sessions of one share run their calls one at a time
 *                (the engine's lock), so one pair of streams serves them all.
 *   a session    its KV cache for the whole context, its activation planes for `chunk` rows, the
 *                RoPE tables (the engine's, copied), its staging buffers, its recorded decode step.
 *
 * A VRAM slot is reused only after the compute stream passed the last product that read it (an
 * event the upload stream waits on), never by host waits. */
#ifndef SMOE_CUDA_STATE_H
#define SMOE_CUDA_STATE_H

#include "backend.h"
#include "cuda/cuda_ops.h"

enum { MIN_VSLOTS = 2, RING = 64, MISS_BATCH = 8, HIST_CAP = 4096, ATT_STREAMS = 8 };

typedef struct {
    smoe_cu_stream cs, us; /* compute, upload */
    /* a batch's per-session attention, side by side (SMOE_CUDA_ATT_STREAMS of them, 0: on cs) */
    smoe_cu_stream as[ATT_STREAMS];
    uint32_t n_as;
    smoe_cu_event ring[RING];
    uint32_t ring_next;
    char name[128];
    int major, minor;
    const smoe_layout *lay;
    const uint8_t *host_dense; /* the vault's dense region, whose offsets the tensors' data keep */
    uint8_t *dense;            /* its copy in VRAM */
    smoe_streamer *streamer;   /* the host tier; NULL without experts */
    uint64_t cache_bytes;      /* gpu_cache_bytes asked */
    bool tier_made;            /* the VRAM expert cache exists (made by the first session, after its planes) */
    /* the device tier */
    uint8_t *vcache;
    uint64_t blob_bytes;
    uint32_t n_vslots;
    int32_t *vslot_of;         /* (layers × experts) */
    int64_t *vslot_key;        /* (n_vslots) −1: empty */
    /* LRU lists over the slots, one a sparse layer (each layer its share of the slots) or one for
     * all (SMOE_CUDA_VRAM_LRU=global, or fewer than 2 slots a layer): list j's sentinel is
     * n_vslots + j, its head the least recent; slot_list[slot] and list_of[layer] say which list. */
    uint32_t *prev, *next;     /* (n_vslots + n_lists) */
    uint32_t n_lists, batch;   /* batch: the most fills in flight in one layer (tier_batch) */
    uint32_t *slot_list;       /* (n_vslots) */
    uint32_t *list_of;         /* (layers) */
    smoe_cu_event *vslot_ev;   /* (n_vslots) the event after the last product that read it, or NULL */
    uint32_t *resident;        /* (layers) experts of the layer in VRAM */
    bool fills_pending;        /* fills since the compute stream last waited for them */
    smoe_cu_event last_fill;   /* the event after the last fill */
    /* the host tier's slots */
    uint32_t n_sslots;
    bool *registered;
    smoe_cu_event *sslot_ev;   /* (n_sslots) after the fill from that slot */
    /* Layers the device routes alone (the cache holds every expert of the model, and every expert
     * of the layer is in it): their blobs' addresses in d_vtab (staged in h_vtab). epoch counts the
     * times a layer stopped being complete: a recorded step older than it is stale. */
    bool device_union;
    bool *complete;            /* (layers) */
    uint32_t n_complete;
    const uint8_t **d_vtab, **h_vtab; /* (layers × experts) */
    uint64_t epoch;
    bool graphs, gpu_sampling;
    bool plain_attention;      /* some layer has sinks or a sliding window: the plain attention kernel */
    /* The Gated DeltaNet layers' small weights widened to f32 once (conv, A_log, dt_bias, norm, in
     * that order), layer l's at lin_w + lin_off[l] (−1: not a linear layer) */
    float *lin_w;
    int64_t *lin_off;          /* (layers) */
    /* counters */
    uint64_t uploads, upload_bytes, hits, misses, other_bytes;
    bool broken;
    char line[320];
} cuda_share;

typedef struct {
    cuda_share *sh;
    const smoe_layout *lay;
    const smoe_config *cfg;
    uint32_t context, chunk, q_dim, kv_dim, ffn; /* ffn: the widest MLP (dense, expert or shared) */
    uint32_t rot;              /* the leading dims of a head that RoPE rotates (rotary_dim) */
    smoe_cu_act_fn act;        /* the experts' activation (dense MLPs: silu) */
    smoe_kv_dtype kv_dtype;
    size_t kv_elem;
    uint32_t pos0;             /* the staged pass's */
    uint8_t *k, *v;            /* the KV cache, elements of kv_dtype */
    float *cos, *sin;
    float *x, *xn, *q, *att, *router, *topk_w, *slot_out, *xg, *hg, *h, *logits;
    /* the f16 rows the tensor-core products read (cuda_ops.h, smoe_cu_act): of a plane (a16, whose
     * rows a16_of names, or −1), of the gathered rows (g16) and of the SwiGLU output (h16), each with
     * its row scales */
    void *a16, *g16, *h16;
    float *ae, *ge, *he;
    int a16_of;
    uint32_t a16_cols;         /* the width of those rows (a plane's products may read it at another) */
    bool any_tc;               /* some product takes f16 rows: norms into XN prepare them too */
    int32_t *topk_idx;         /* (chunk·K) the host path's ids */
    int32_t *routed;           /* (layers, chunk·K) ids of the layers routed on the device: n·K at l·n·K */
    bool *ran_resident;        /* (layers) moe_resident ran it in this pass */
    /* a pass's first position, then its ids (pass[1 ..]): one upload a pass; the kernels read the
     * position from here, so that a recorded decode step replays at any position */
    int32_t *pass, *h_pass;
    float *ks, *vs;            /* the pass's new K and V rows, normalised and rotated here, then stored */
    /* A layer's index arrays, one block: per union position its first row, row count (ustart,
     * ucount), the launch order (items), each position's VRAM blob (wtab), and each gathered row's
     * t·K + slot (rows, last). The first `experts` call of a union uploads it whole, later ones
     * only their items and blobs. */
    uint8_t *idx, *h_idx;
    size_t idx_rows_off, idx_wtab_off, idx_bytes;
    uint32_t *rows, *ustart, *ucount, *items;
    const uint8_t **wtab;
    uint32_t *h_rows, *h_ustart, *h_ucount, *h_items;
    const uint8_t **h_wtab;
    uint32_t items_used;       /* union positions run so far in this layer */
    bool idx_up;
    uint32_t union_rows;       /* n·K of the layer's union */
    const smoe_expert_layout *xl_now; /* the blob layout of the layer whose MoE step is under way */
    /* pinned staging for what comes back */
    int32_t *h_topk, *h_routed;
    float *h_logits;           /* (SMOE_LOGIT_ROWS, vocab) */
    /* the device union's lists (smoe_cu_union) */
    const uint8_t **d_wtab;
    uint32_t *d_start, *d_count, *d_items, n_items_cap;
    uint32_t *d_counts, *d_used, *d_bad;
    /* the recorded decode step and the share's epoch it was recorded at */
    smoe_cu_graph graph;
    uint64_t graph_epoch;
    /* sampling's selection */
    float *d_sv;
    int32_t *d_hist, *h_hist;
    smoe_cu_sample_out *d_sout, *h_sout;
    float *fa_part;            /* flash attention's splits side by side */
    /* gated attention, a shared expert's gate and the Gated DeltaNet (deltanet.cu) */
    float *gate;               /* (chunk, max(q_dim, lin value dim)) SMOE_PL_GATE */
    float *mix;                /* (chunk, conv_dim) SMOE_PL_MIX */
    float *beta, *decay;       /* (chunk, v_heads) SMOE_PL_BETA, SMOE_PL_DECAY */
    float *sgate;              /* (chunk) SMOE_PL_SGATE */
    smoe_linear_shape lin;
    uint32_t conv_dim, n_linear;
    const int32_t *linear_index; /* (layers) the engine's: layer l's state, −1 none */
    /* the session's recurrent states and their snapshot, in VRAM (cpu_state.h's layout) */
    float *lin_s, *lin_conv, *snap_s, *snap_conv;
    size_t lin_s_bytes, lin_conv_bytes;
    uint64_t other_bytes;      /* this session's VRAM */
    bool broken;
} cuda_state;

/* A failed CUDA call: the session (and the share: its streams' state is unknown) broken. */
smoe_status smoe_cuda_fail(cuda_state *c, int err, const char *what);

#define CU(call)                                                                                                       \
    do {                                                                                                               \
        int e_ = (call);                                                                                               \
        if (e_ != 0) return smoe_cuda_fail(c, e_, #call);                                                              \
    } while (0)

/* cuda_state.c: the helpers the ops share. A tensor's layout for the kernels; a dense tensor's
 * device address; a plane's rows and width; a plane written (a16 no longer holds its rows). */
smoe_cu_tensor smoe_cuda_desc(const smoe_tensor *T);
const uint8_t *smoe_cuda_dev(const cuda_state *c, const smoe_tensor *T);
bool smoe_cuda_tensor_cores(const smoe_tensor *T);
float *smoe_cuda_plane(cuda_state *c, smoe_plane p);
uint32_t smoe_cuda_plane_cols(const cuda_state *c, smoe_plane p);
void smoe_cuda_written(cuda_state *c, smoe_plane p);
/* *a: plane src's rows [0, n) as products read them, with their f16 rows prepared into a16 (unless
 * it holds them already) when need. */
smoe_status smoe_cuda_act(cuda_state *c, smoe_plane src, uint32_t n, bool need, smoe_cu_act *a);
/* The same for products that read the plane's rows `cols` floats wide (a DeltaNet's out-projection
 * reads ATT at its value width). */
smoe_status smoe_cuda_act_cols(cuda_state *c, smoe_plane src, uint32_t n, uint32_t cols, bool need, smoe_cu_act *a);
/* h = SwiGLU of hg's halves for the rows of R, and the activation the down product reads. */
smoe_status smoe_cuda_swiglu(cuda_state *c, bool need, bool expert, uint32_t I, const smoe_cu_rows *R,
                             smoe_cu_act *a);
size_t smoe_cuda_vram_free(void);
smoe_status smoe_cuda_linear(cuda_state *c, const smoe_tensor *T, const smoe_cu_act *a, uint32_t n, float *y,
                             size_t ldy);
smoe_cu_event smoe_cuda_ring_event(cuda_share *sh);
/* The VRAM slot of a handle the tier gave. */
uint32_t smoe_cuda_vslot(const cuda_share *sh, const void *handle);

/* moe_cuda.c: the MoE step's ops, the device tier, the recorded step (backend.h). */
smoe_status smoe_cuda_route(void *b, const smoe_route *r, uint32_t n, int32_t *ids);
smoe_status smoe_cuda_route_grouped(void *b, const smoe_tensor *router, const smoe_tensor *bias, uint32_t K,
                                    bool renorm, uint32_t n, int32_t *ids);
smoe_status smoe_cuda_experts_begin(void *b, const smoe_union *u);
smoe_status smoe_cuda_experts(void *b, const smoe_union *u, const uint32_t *items, uint32_t m);
smoe_status smoe_cuda_combine(void *b, uint32_t K, uint32_t n);
smoe_status smoe_cuda_moe_resident(void *b, uint32_t l, const smoe_route *r, uint32_t n);
smoe_status smoe_cuda_pass_end(void *b, uint32_t n, int32_t *routed);
smoe_status smoe_cuda_replay(void *b, bool *ran);
smoe_status smoe_cuda_record_begin(void *b, bool *recording);
smoe_status smoe_cuda_record_end(void *b, bool keep);
const void *smoe_cuda_tier_lookup(void *b, uint32_t l, uint32_t e);
const void *smoe_cuda_tier_claim(void *b, uint32_t l, uint32_t e);
smoe_status smoe_cuda_tier_fill(void *b, const void *handle, const uint8_t *blob, int slot);
smoe_status smoe_cuda_tier_sync(void *b);
void smoe_cuda_tier_drop(void *b, const void *handle);
uint32_t smoe_cuda_tier_batch(void *b);
void smoe_cuda_tier_clear(void *b);
bool smoe_cuda_tier_resident(void *b, uint32_t l);
/* The tier's slots and tables, once per share (the first session, after its own planes). */
smoe_status smoe_cuda_tier_new(cuda_state *c);
void smoe_cuda_tier_free(cuda_share *sh);
/* The rows of a device union's tiles for n tokens. */
uint32_t smoe_cuda_union_tile(uint32_t n, uint32_t K, uint32_t E);

#endif
