/* vault.h — the parsed vault (docs/vault.md) as the rest of the engine sees it. */
#ifndef SMOE_VAULT_H
#define SMOE_VAULT_H

#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

/* One tensor: a dense tensor (data points into the dense region in memory) or an expert-blob
 * tensor (data is NULL; offset is relative to the blob's start). */
typedef struct {
    uint8_t format;       /* smoe_format */
    uint8_t scale_format; /* smoe_scale_format */
    uint32_t rows, cols;
    uint32_t group;      /* q4/q8 group size along cols; 0 otherwise */
    uint64_t offset;      /* dense: relative to dense_offset; blob: relative to blob start */
    uint64_t nbytes;
    const uint8_t *data;  /* dense tensors only */
    /* Derived part offsets relative to the tensor's first byte (q4/q8): */
    uint64_t scales_off, biases_off;
} smoe_tensor;

/* A model family (docs/vault.md 2.2, parameter `family`): which recipe engine/layer.c runs and
 * which dense tensors a vault of it holds. */
typedef enum {
    SMOE_FAMILY_QWEN3_MOE = 0,
    SMOE_FAMILY_MIXTRAL = 1,
    SMOE_FAMILY_OLMOE = 2,
    SMOE_FAMILY_GLM4_MOE = 3,
    SMOE_FAMILY_GPT_OSS = 4,
    SMOE_FAMILY_QWEN3_NEXT = 5,
    SMOE_FAMILY_QWEN3_5_MOE = 6,
    SMOE_FAMILY_COUNT
} smoe_family;

/* How a sparse layer picks its experts (parameter `router_kind`). */
typedef enum {
    SMOE_ROUTER_SOFTMAX_TOPK = 0,   /* softmax over all experts in f32, top-k, renormalised if norm_topk_prob */
    SMOE_ROUTER_SIGMOID_GROUP = 1,  /* GLM-4.5 / DeepSeek-V3: sigmoid, + router.bias for the choice,
                                       group-limited top-k, renormalised if norm_topk_prob, × routed_scaling_factor */
    SMOE_ROUTER_TOPK_SOFTMAX = 2,   /* gpt-oss: top-k of the logits, softmax over those k */
    SMOE_ROUTER_KINDS
} smoe_router_kind;

/* Where q_norm and k_norm apply (parameter `qk_norm`). */
typedef enum {
    SMOE_QK_NORM_NONE = 0,  /* no q_norm / k_norm tensors */
    SMOE_QK_NORM_HEAD = 1,  /* per head, 1 × head_dim (Qwen3-MoE, GLM's use_qk_norm) */
    SMOE_QK_NORM_WHOLE = 2, /* over the whole projection, 1 × heads·head_dim and 1 × kv_heads·head_dim (OLMoE) */
} smoe_qk_norm;

/* A layer's attention kind (bits 1–2 of its kind byte). */
typedef enum { SMOE_ATTN_FULL = 0, SMOE_ATTN_SLIDING = 1, SMOE_ATTN_LINEAR = 2 } smoe_attn_kind;

/* The model parameters beyond the config block (docs/vault.md 2.2), with their defaults filled in
 * (a version-2 vault is all defaults: Qwen3-MoE). */
typedef struct {
    uint32_t family;              /* smoe_family */
    uint32_t rotary_dim;          /* leading dims of each head that RoPE rotates; head_dim = all */
    uint32_t sliding_window;      /* positions a sliding-window layer sees (0: none) */
    uint32_t router_kind;         /* smoe_router_kind */
    uint32_t n_group, topk_group; /* SMOE_ROUTER_SIGMOID_GROUP: experts in n_group groups, topk_group kept */
    float routed_scaling_factor;  /* the routed experts' weights are scaled by it (1: none) */
    uint32_t shared_intermediate; /* width of the shared expert beside the routed ones (0: none) */
    uint32_t attention_bias;      /* 0 none, 1 q/k/v biases, 2 q/k/v/o biases */
    uint32_t qk_norm;             /* smoe_qk_norm */
    float swiglu_alpha, swiglu_limit; /* gpt-oss's clamped SwiGLU (its experts' activation) */
    /* YaRN RoPE when yarn_factor > 1 (transformers' _compute_yarn_parameters; engine/session.c) */
    double yarn_factor, yarn_original_max, yarn_beta_fast, yarn_beta_slow, yarn_attention_factor;
    uint32_t yarn_truncate;       /* round the correction range outwards (transformers' `truncate`) */
    /* The Gated DeltaNet of linear-attention layers (Qwen3-Next, Qwen3.5-MoE; 0 without): q and k
     * heads of linear_k_dim, v heads of linear_v_dim, a causal convolution of linear_conv_kernel taps */
    uint32_t linear_k_heads, linear_v_heads, linear_k_dim, linear_v_dim, linear_conv_kernel;
    /* Which key head a value head reads: 0 grouped (v head h reads k head h / (v/k), the checkpoints'
     * order), 1 tiled (k head h mod k_heads: llama.cpp's qwen35moe files) */
    uint32_t linear_v_tiled;
} smoe_model_params;

typedef struct {
    const smoe_tensor *input_norm, *post_norm; /* 1 × hidden */
    const smoe_tensor *q, *k, *v, *o;
    const smoe_tensor *q_bias, *k_bias, *v_bias, *o_bias; /* 1 × rows of their product, or NULL */
    const smoe_tensor *q_norm, *k_norm;        /* see smoe_qk_norm; NULL without */
    const smoe_tensor *router;                 /* sparse layers, else NULL */
    const smoe_tensor *router_bias;            /* 1 × experts: SMOE_ROUTER_SIGMOID_GROUP's correction, else NULL */
    const smoe_tensor *mlp_gate, *mlp_up, *mlp_down; /* dense layers, else NULL */
    const smoe_tensor *shared_gate, *shared_up, *shared_down; /* sparse layers with a shared expert, else NULL */
    const smoe_tensor *sinks;                  /* 1 × heads: attention sinks (gpt-oss), else NULL */
    /* Qwen3-Next / Qwen3.5-MoE: gated attention's output gate (q rows × hidden) and the shared
     * expert's sigmoid gate (1 × hidden); a linear-attention layer's Gated DeltaNet in place of
     * q, k, v, o: in-projections qkv (conv_dim), z (v_heads·v_dim), b and a (v_heads), the
     * convolution (conv_dim × kernel), A_log and dt_bias (1 × v_heads), the gated norm (1 × v_dim)
     * and the out-projection (hidden × v_heads·v_dim). NULL where the layer has none. */
    const smoe_tensor *q_gate, *shared_expert_gate;
    const smoe_tensor *lin_qkv, *lin_z, *lin_b, *lin_a, *lin_conv, *lin_a_log, *lin_dt_bias, *lin_norm, *lin_out;
    bool sparse;
    uint8_t attn;                              /* smoe_attn_kind */
} smoe_layer_weights;

/* The tensors of a blob, by their index in smoe_expert_layout.t (docs/vault.md 2.4). */
enum { SMOE_XT_GATE, SMOE_XT_UP, SMOE_XT_DOWN, SMOE_XT_GATE_BIAS, SMOE_XT_UP_BIAS, SMOE_XT_DOWN_BIAS, SMOE_XT_COUNT };

/* One layer's blob layout: which tensors each of its blobs holds and where (offsets within the
 * blob), and the blob's length. A dense layer's is empty (bytes 0). */
typedef struct {
    uint64_t bytes;               /* multiple of 16 KiB */
    uint32_t n;                   /* descriptors in the file */
    bool has[SMOE_XT_COUNT];
    smoe_tensor t[SMOE_XT_COUNT]; /* t[i] meaningful where has[i] */
} smoe_expert_layout;

/* The layout parsed from header + tables: no pointers into memory, only numbers.
 * Produced by smoe_vault_parse, which a fuzzer can drive. */
typedef struct {
    smoe_config cfg;
    uint64_t file_size, table_offset, table_bytes, dense_offset, dense_bytes;
    uint64_t blob_bytes;     /* the largest layer's blob (the streamer's slot size) */
    uint32_t dense_crc, n_tensors, n_blobs;
    uint32_t version;        /* of the file: 2, 3 or 4 */
    /* Version 4, the embedding on disk (docs/vault.md 4.1): the dense region's last paged_bytes
     * bytes hold the (untied) embedding, read row by row when a pass needs them and checked page by
     * page against page_crc, not loaded at open nor covered by dense_crc. 0: all of it in memory. */
    uint64_t paged_bytes;
    uint32_t page_bytes, n_pages; /* a power of two in [4 KiB, 1 MiB]; ceil(paged_bytes / page_bytes) */
    uint32_t *page_crc;      /* (n_pages) */
    smoe_model_params mp;
    uint8_t *layer_sparse;   /* (layers) */
    uint8_t *layer_attn;     /* (layers) smoe_attn_kind */
    smoe_expert_layout *xl;  /* (layers) each layer's blob layout */
    uint64_t *layer_blob_bytes; /* (layers) xl[l].bytes: each layer's blob length, 0 for dense layers */
    const smoe_tensor *expert; /* the first sparse layer's gate, up, down (xl[l].t); NULL without one */
    bool uniform_experts;    /* every sparse layer's blob layout is the same */
    smoe_tensor *tensors;    /* (n_tensors) dense tensors; .data NULL until bound */
    char (*names)[40];       /* (n_tensors) */
    uint64_t *blob_offset;   /* (layers × experts) 0 for dense layers */
    uint32_t *blob_crc;      /* (layers × experts) */
    smoe_layer_weights *layers; /* (layers) pointers into tensors */
    const smoe_tensor *embed, *final_norm, *lm_head; /* lm_head == embed when tied */
} smoe_layout;

/* Layer l's blob tensors (gate, up, down, then the optional ones: see has[]). */
static inline const smoe_tensor *smoe_expert_of(const smoe_layout *L, uint32_t l) { return L->xl[l].t; }

/* The family's name ("qwen3_moe", "mixtral", ...), "?" for an unknown number. */
const char *smoe_family_name(uint32_t family);

/* Parses bytes [0, len) of vault.bin (len ≥ 256 and covering the whole table region), checking
 * everything docs/vault.md lists against file_size (the real size of the file). Allocates the
 * layout's arrays; on failure frees them and returns an error with a message. Pure: no I/O. */
smoe_status smoe_vault_parse(const uint8_t *bytes, size_t len, uint64_t file_size, smoe_layout *out);
void smoe_layout_free(smoe_layout *layout);

/* Bytes of header + tables that smoe_vault_parse needs, read from the first 256 bytes: 0 if
 * they are not a plausible header (the parse then reports why). */
uint64_t smoe_vault_head_bytes(const uint8_t *header256);

/* What identifies the file a vault opened: a file replaced or rewritten since differs. */
typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_s, mtime_ns;
} smoe_file_id;

struct smoe_vault {
    char *dir;
    char *path;           /* DIR/vault.bin */
    int fd;               /* vault.bin as opened: sessions read blobs through this file, not the path */
    smoe_file_id id;      /* of fd at open */
    smoe_layout lay;
    uint8_t *dense;       /* (dense_bytes) 16 KiB aligned, loaded at open but for a paged embedding */
    pthread_mutex_t paged_mu; /* smoe_vault_load_paged's */
    _Atomic bool paged_loaded; /* the paged embedding is in dense too (a backend that needs it whole asked) */
    /* A deferred lm_head (vault.c): its bytes [defer_lo, defer_hi) of dense read by dense_th after
     * open returns, then dense_crc checked over the loaded region; dense_state 0 while that runs,
     * 1 when sound, −1 when it failed (dense_err, dense_msg). */
    pthread_t dense_th;
    bool dense_th_live;
    int pid; /* the process that opened it (smoe_process_id): dense_th is its thread */
    pthread_mutex_t dense_mu;
    pthread_cond_t dense_cv;
    _Atomic int dense_state;
    smoe_status dense_err;
    char dense_msg[512];
    uint64_t defer_lo, defer_hi;
};

/* SMOE_OK once every dense byte the vault holds in memory is loaded and has matched dense_crc:
 * at once, but while a deferred lm_head is still arriving, when this waits for it; the error it
 * met otherwise (every time). A pass calls it before its logits and before it ends. */
smoe_status smoe_vault_dense_ready(smoe_vault *v);

/* The embedding on disk (lay.paged_bytes ≠ 0). Rows come from the file page by page, each page
 * checked against its checksum (a mismatch: SMOE_ERR_IO naming the page; nothing is kept, so the
 * next call reads it again). The scratch a reader needs: smoe_vault_row_scratch_bytes. */
uint64_t smoe_vault_row_scratch_bytes(const smoe_layout *L);
/* Row `row` of the embedding, dequantised into out (hidden_size floats), read from the file. */
smoe_status smoe_vault_embed_row(const smoe_vault *v, uint32_t row, uint8_t *scratch, float *out);
/* Asks the OS to start reading the pages of these ids' rows (posix_fadvise WILLNEED), so that the
 * row reads after it find them read or in flight together, not one disk round trip each. Only
 * the rows asked for; ids out of range are skipped. */
void smoe_vault_embed_prefetch(const smoe_vault *v, const int32_t *ids, uint32_t n);
/* Reads the paged embedding whole into the dense region (once; thread-safe) and points the
 * embedding's data at it: for a backend that keeps the embedding table itself (cuda). */
smoe_status smoe_vault_load_paged(smoe_vault *v);
/* Dense bytes the vault holds in memory: the dense region, less a paged embedding not loaded. */
uint64_t smoe_vault_resident_bytes(const smoe_vault *v);

/* fd's identity (fstat); false with errno set if fstat fails. */
bool smoe_file_id_of(int fd, smoe_file_id *out);
bool smoe_file_id_equal(const smoe_file_id *a, const smoe_file_id *b);
/* SMOE_OK if the vault's file still has the size and mtime it had at open; SMOE_ERR_VAULT
 * ("vault.bin changed since it was opened") if it was rewritten in place since. */
smoe_status smoe_vault_check_unchanged(const smoe_vault *v);

/* Byte size of a tensor of this format, scale format, group size and shape (docs/vault.md
 * section 3); 0 if the combination is invalid. */
/* A GGML block format's geometry: columns per block and bytes per block (ggml's block_size and
 * type_size); false (and 0, 0) for any other format. */
static inline bool smoe_ggml_block(uint8_t format, uint32_t *block, uint32_t *bytes) {
    uint32_t b = 32, t;
    switch (format) {
    case SMOE_FMT_GGML_F16: b = 1, t = 2; break;
    case SMOE_FMT_GGML_Q4_0: t = 18; break;
    case SMOE_FMT_GGML_Q4_1: t = 20; break;
    case SMOE_FMT_GGML_Q5_0: t = 22; break;
    case SMOE_FMT_GGML_Q5_1: t = 24; break;
    case SMOE_FMT_GGML_Q8_0: t = 34; break;
    case SMOE_FMT_GGML_Q2_K: b = 256, t = 84; break;
    case SMOE_FMT_GGML_Q3_K: b = 256, t = 110; break;
    case SMOE_FMT_GGML_Q4_K: b = 256, t = 144; break;
    case SMOE_FMT_GGML_Q5_K: b = 256, t = 176; break;
    case SMOE_FMT_GGML_Q6_K: b = 256, t = 210; break;
    case SMOE_FMT_GGML_IQ4_NL: t = 18; break;
    case SMOE_FMT_GGML_IQ4_XS: b = 256, t = 136; break;
    case SMOE_FMT_GGML_IQ2_XXS: b = 256, t = 66; break;
    case SMOE_FMT_GGML_IQ2_XS: b = 256, t = 74; break;
    case SMOE_FMT_GGML_IQ2_S: b = 256, t = 82; break;
    case SMOE_FMT_GGML_IQ3_XXS: b = 256, t = 98; break;
    case SMOE_FMT_GGML_IQ3_S: b = 256, t = 110; break;
    case SMOE_FMT_GGML_IQ1_S: b = 256, t = 50; break;
    case SMOE_FMT_GGML_IQ1_M: b = 256, t = 56; break;
    case SMOE_FMT_GGML_MXFP4: t = 17; break;
    default: b = t = 0; break;
    }
    *block = b;
    *bytes = t;
    return b != 0;
}

/* IQ1_M's f16 d (its bits): the top nibbles of the four scale words at blk + 48, the block's one
 * scale not kept in one place */
static inline uint16_t smoe_ggml_iq1m_d(const uint8_t *blk) {
    uint16_t w[4];
    memcpy(w, blk + 48, 8);
    return (uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xF0u) | ((w[2] >> 4) & 0xF00u) | (w[3] & 0xF000u));
}

/* "f32", "bf16", "q8", "q4" or ggml's name of a GGML format ("Q4_K", ...); "?" for any other. */
const char *smoe_format_name(uint8_t format);

uint64_t smoe_tensor_bytes(uint8_t format, uint8_t scale_format, uint32_t group, uint32_t rows, uint32_t cols);

#endif
