/* vault.h — the parsed vault (docs/vault.md) as the rest of the engine sees it. */
#ifndef SMOE_VAULT_H
#define SMOE_VAULT_H

#include "internal.h"

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

typedef struct {
    const smoe_tensor *input_norm, *post_norm; /* 1 × hidden */
    const smoe_tensor *q, *k, *v, *o;
    const smoe_tensor *q_norm, *k_norm;        /* 1 × head_dim */
    const smoe_tensor *router;                 /* sparse layers, else NULL */
    const smoe_tensor *mlp_gate, *mlp_up, *mlp_down; /* dense layers, else NULL */
    bool sparse;
} smoe_layer_weights;

/* The layout parsed from header + tables: no pointers into memory, only numbers.
 * Produced by smoe_vault_parse, which a fuzzer can drive. */
typedef struct {
    smoe_config cfg;
    uint64_t file_size, table_offset, table_bytes, dense_offset, dense_bytes, blob_bytes;
    uint32_t dense_crc, n_tensors, n_blobs;
    uint8_t *layer_sparse;   /* (layers) */
    smoe_tensor expert[3];   /* gate, up, down: offsets within a blob */
    smoe_tensor *tensors;    /* (n_tensors) dense tensors; .data NULL until bound */
    char (*names)[40];       /* (n_tensors) */
    uint64_t *blob_offset;   /* (layers × experts) 0 for dense layers */
    uint32_t *blob_crc;      /* (layers × experts) */
    smoe_layer_weights *layers; /* (layers) pointers into tensors */
    const smoe_tensor *embed, *final_norm, *lm_head; /* lm_head == embed when tied */
} smoe_layout;

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
    uint8_t *dense;       /* (dense_bytes) 16 KiB aligned, loaded at open */
};

/* fd's identity (fstat); false with errno set if fstat fails. */
bool smoe_file_id_of(int fd, smoe_file_id *out);
bool smoe_file_id_equal(const smoe_file_id *a, const smoe_file_id *b);
/* SMOE_OK if the vault's file still has the size and mtime it had at open; SMOE_ERR_VAULT
 * ("vault.bin changed since it was opened") if it was rewritten in place since. */
smoe_status smoe_vault_check_unchanged(const smoe_vault *v);

/* Byte size of a tensor of this format, scale format, group size and shape (docs/vault.md
 * section 3); 0 if the combination is invalid. */
/* A GGML block format's geometry: columns per block and bytes per block (ggml's block_size and
 * type_size); false for any other format. */
static inline bool smoe_ggml_block(uint8_t format, uint32_t *block, uint32_t *bytes) {
    uint32_t b = 32, t;
    switch (format) {
    case SMOE_FMT_GGML_F16: b = 1, t = 2; break;
    case SMOE_FMT_GGML_Q4_0: t = 18; break;
    case SMOE_FMT_GGML_Q5_0: t = 22; break;
    case SMOE_FMT_GGML_Q8_0: t = 34; break;
    case SMOE_FMT_GGML_Q2_K: b = 256, t = 84; break;
    case SMOE_FMT_GGML_Q3_K: b = 256, t = 110; break;
    case SMOE_FMT_GGML_Q4_K: b = 256, t = 144; break;
    case SMOE_FMT_GGML_Q5_K: b = 256, t = 176; break;
    case SMOE_FMT_GGML_Q6_K: b = 256, t = 210; break;
    case SMOE_FMT_GGML_IQ4_NL: t = 18; break;
    case SMOE_FMT_GGML_IQ4_XS: b = 256, t = 136; break;
    case SMOE_FMT_GGML_MXFP4: t = 17; break;
    default: return false;
    }
    *block = b;
    *bytes = t;
    return true;
}

uint64_t smoe_tensor_bytes(uint8_t format, uint8_t scale_format, uint32_t group, uint32_t rows, uint32_t cols);

#endif
