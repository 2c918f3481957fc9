/* vault.c — reading a vault: parse and validate vault.bin, load the dense region, verify.
 *
 * The format (version 4, versions 2 and 3 still read; docs/vault.md is the full text and the contract).
 * Every checksum is smoe_checksum (CRC-32C over 4 lanes, util.c; docs/vault.md section 6).
 *
 *   1. Header, bytes [0, 256): magic "SMOEVLT\0", version 4 (or 3, 2), header_crc (checksum of
 *      [0, table_offset + table_bytes) with the crc field read as 0), file_size (exact),
 *      table_offset (256), table_bytes (≤ 64 MiB), dense_offset (16 KiB multiple, after the
 *      tables), dense_bytes, dense_crc, n_tensors, blob_bytes (the largest layer's blob, 16 KiB
 *      multiple, 0 iff no sparse layer), n_blobs (layers × experts); v4: paged_bytes, page_bytes
 *      (the embedding on disk, 4.1); everything else zero.
 *   2. Tables, exactly table_bytes, in this order:
 *      2.1 config block (96 bytes): the model's sizes, flags, rms_norm_eps, rope_theta;
 *      2.2 (v3) parameters: u32 n, u32 0, n × {char key[32], f64}: family, qk_norm, rotary_dim,
 *          router_kind, ... (smoe_model_params); an unknown key is refused;
 *      2.3 layer kinds: one byte per layer (bit 0 sparse; v3: bits 1-2 attention kind), padded to 8;
 *      2.4 expert blob layouts: v3 per layer {u64 bytes, u32 n, u32 0} + n descriptors (gate, up,
 *          down, optional biases; offsets within the blob); v2 one set of gate, up, down for all;
 *      2.5 dense tensors: n_tensors descriptors, each name the family and parameters call for
 *          present exactly once with its shape;
 *      2.6 blob table: n_blobs × {u64 offset, u32 crc, u32 0}, index layer × experts + expert;
 *          offset 0 for dense layers, else a 16 KiB multiple past the dense region;
 *      2.7 (v4) page checksums: ⌈paged_bytes / page_bytes⌉ × u32, padded to 8.
 *      A descriptor is 64 bytes: char name[40] (NUL-padded), u8 format (f32, bf16, q8, q4),
 *      u8 scale_format (none for f32/bf16; f16, bf16 or f32 for q8/q4), u16 group_size (32, 64
 *      or 128 for q8/q4, 0 otherwise), u32 rows, u32 cols, u32 0, u64 offset (multiple of 64;
 *      dense: from dense_offset, blob: from the blob start).
 *   3. Tensor bytes: row-major; q8/q4 (cols % group_size == 0) store codes, scales, biases, each
 *      part starting at a 64-byte boundary from the tensor's offset; w = scale·q + bias per group.
 *   4. Dense region (loaded at open, dense_crc checked; a paged embedding, its tail, is not: its rows
 *      are read when a pass needs them, each page checked), then the blobs, each its layer's length.
 *
 * The file is untrusted: smoe_vault_parse checks every number against the file size and the
 * rules above before anything uses it, and is a pure function of the bytes so a fuzzer can
 * drive it (tests/c/fuzz_vault.c). Reading is open + pread only; the library never prints.
 * The vault keeps vault.bin open (and its identity: device, inode, size, mtime) so that its
 * sessions read the very file whose tables and dense weights it loaded (streamer.c). A
 * non-regular vault.bin is refused before any read, opened O_NONBLOCK so a FIFO cannot block.
 */
#include "vault.h"
#include "smoe_testing.h"
#include "cpu/cpu.h"

#include "cpu/kernels.h"

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER_BYTES 256u
#define CONFIG_BYTES 96u
#define DESC_BYTES 64u
#define BLOB_ENTRY_BYTES 16u
#define MAX_TABLE_BYTES (64ull << 20)
#define MAX_LAYERS 1024u
#define MAX_EXPERTS 1024u
#define MAX_DIM 65536u
#define MAX_VOCAB (1u << 24)
#define VERIFY_CHUNK (16u << 20) /* bytes per pread in smoe_verify_vault */
#define VAULT_VERSION 4u
#define PARAMS_HEAD_BYTES 8u   /* u32 count, u32 0 */
#define PARAM_BYTES 40u        /* char key[32], f64 value */
#define PARAM_KEY_BYTES 32u
#define MAX_PARAMS 256u
#define LAYOUT_ENTRY_BYTES 16u /* u64 blob bytes, u32 descriptors, u32 0 */
#define HEADER_CRC_AT 12u /* header_crc's offset: read as zero by its own checksum */
#define MIN_PAGE_BYTES 4096u    /* a paged embedding's checksummed page (4.1) */
#define MAX_PAGE_BYTES (1u << 20)

static const char MAGIC[8] = {'S', 'M', 'O', 'E', 'V', 'L', 'T', '\0'};

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static float rdf32(const uint8_t *p) {
    uint32_t u = rd32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double rdf64(const uint8_t *p) {
    uint64_t u = rd64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* smoe_checksum of [0, n) with the 4 bytes of header_crc read as zero, without copying. */
static uint32_t header_checksum(const uint8_t *b, uint64_t n) {
    static const uint8_t zero4[4] = {0};
    uint64_t lane[5];
    smoe_checksum_lanes(n, lane);
    uint32_t c[4];
    for (int i = 0; i < 4; i++) {
        uint64_t lo = lane[i], hi = lane[i + 1], hole = HEADER_CRC_AT, hole_end = HEADER_CRC_AT + 4;
        uint32_t crc = 0;
        if (lo < hole) crc = smoe_crc32c(crc, b + lo, (size_t)((hi < hole ? hi : hole) - lo));
        if (lo < hole_end && hi > hole) { /* the part of the hole inside this lane */
            uint64_t a = lo > hole ? lo : hole, e = hi < hole_end ? hi : hole_end;
            crc = smoe_crc32c(crc, zero4, (size_t)(e - a));
        }
        if (hi > hole_end) {
            uint64_t a = lo > hole_end ? lo : hole_end;
            crc = smoe_crc32c(crc, b + a, (size_t)(hi - a));
        }
        c[i] = crc;
    }
    return smoe_checksum_combine(c);
}

static bool all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return false;
    return true;
}

/* ----------------------------------------------------------------------- tensor byte sizes */

static bool is_quant(uint8_t format) { return format == SMOE_FMT_Q8 || format == SMOE_FMT_Q4; }

/* Bytes of one scale (or bias) value; 0 for an unknown scale format. */
static uint32_t scale_size(uint8_t scale_format) {
    switch (scale_format) {
    case SMOE_SCALE_F16:
    case SMOE_SCALE_BF16: return 2;
    case SMOE_SCALE_F32: return 4;
    }
    return 0;
}

/* Bytes of each of the scales and biases parts (before their 64-byte alignment). */
static uint64_t scale_part_bytes(uint8_t scale_format, uint32_t group, uint32_t rows, uint32_t cols) {
    return (uint64_t)rows * (cols / group) * scale_size(scale_format);
}

uint64_t smoe_tensor_bytes(uint8_t format, uint8_t scale_format, uint32_t group, uint32_t rows, uint32_t cols) {
    if (rows == 0 || cols == 0) return 0;
    uint64_t n = (uint64_t)rows * cols; /* < 2^64: both factors < 2^32 */
    if (n > UINT64_MAX / 8) return 0;
    switch (format) {
    case SMOE_FMT_F32: return group || scale_format != SMOE_SCALE_NONE ? 0 : 4 * n;
    case SMOE_FMT_BF16: return group || scale_format != SMOE_SCALE_NONE ? 0 : 2 * n;
    case SMOE_FMT_Q8:
    case SMOE_FMT_Q4:
        if ((group != 32 && group != 64 && group != 128) || cols % group || !scale_size(scale_format)) return 0;
        return smoe_align_up(format == SMOE_FMT_Q8 ? n : n / 2, 64) +
               2 * smoe_align_up(scale_part_bytes(scale_format, group, rows, cols), 64);
    }
    uint32_t bs, ts;
    if (smoe_ggml_block(format, &bs, &ts)) /* whole blocks of ggml's layout, nothing else */
        return group || scale_format != SMOE_SCALE_NONE || cols % bs ? 0 : n / bs * ts;
    return 0;
}

/* Format, scale format, group, size and part offsets of a tensor; false if the combination is
 * invalid. */
static bool tensor_init(smoe_tensor *t, uint8_t format, uint8_t scale_format, uint32_t group, uint32_t rows,
                        uint32_t cols) {
    uint64_t nbytes = smoe_tensor_bytes(format, scale_format, group, rows, cols);
    if (nbytes == 0) return false;
    memset(t, 0, sizeof *t);
    t->format = format;
    t->scale_format = scale_format;
    t->rows = rows;
    t->cols = cols;
    t->group = group;
    t->nbytes = nbytes;
    if (is_quant(format)) {
        uint64_t n = (uint64_t)rows * cols;
        t->scales_off = smoe_align_up(format == SMOE_FMT_Q8 ? n : n / 2, 64);
        t->biases_off = t->scales_off + smoe_align_up(scale_part_bytes(scale_format, group, rows, cols), 64);
    }
    return true;
}

const char *smoe_format_name(uint8_t f) {
    static const char *names[] = {"f32", "bf16", "q8", "q4"};
    switch (f) {
    case SMOE_FMT_GGML_F16: return "F16";
    case SMOE_FMT_GGML_Q4_0: return "Q4_0";
    case SMOE_FMT_GGML_Q4_1: return "Q4_1";
    case SMOE_FMT_GGML_Q5_0: return "Q5_0";
    case SMOE_FMT_GGML_Q5_1: return "Q5_1";
    case SMOE_FMT_GGML_Q8_0: return "Q8_0";
    case SMOE_FMT_GGML_Q2_K: return "Q2_K";
    case SMOE_FMT_GGML_Q3_K: return "Q3_K";
    case SMOE_FMT_GGML_Q4_K: return "Q4_K";
    case SMOE_FMT_GGML_Q5_K: return "Q5_K";
    case SMOE_FMT_GGML_Q6_K: return "Q6_K";
    case SMOE_FMT_GGML_IQ4_NL: return "IQ4_NL";
    case SMOE_FMT_GGML_IQ4_XS: return "IQ4_XS";
    case SMOE_FMT_GGML_IQ2_XXS: return "IQ2_XXS";
    case SMOE_FMT_GGML_IQ2_XS: return "IQ2_XS";
    case SMOE_FMT_GGML_IQ2_S: return "IQ2_S";
    case SMOE_FMT_GGML_IQ3_XXS: return "IQ3_XXS";
    case SMOE_FMT_GGML_IQ3_S: return "IQ3_S";
    case SMOE_FMT_GGML_IQ1_S: return "IQ1_S";
    case SMOE_FMT_GGML_IQ1_M: return "IQ1_M";
    case SMOE_FMT_GGML_MXFP4: return "MXFP4";
    }
    return f <= SMOE_FMT_Q4 ? names[f] : "?";
}

/* ---------------------------------------------------------------------------------- parse */

/* A name from the file, made printable for a message (the file may hold anything). */
static const char *printable(const char name[40], char buf[40]) {
    size_t i = 0;
    for (; i < 39 && name[i]; i++) buf[i] = (name[i] >= 0x20 && name[i] < 0x7f) ? name[i] : '?';
    buf[i] = '\0';
    return buf;
}

/* One 64-byte descriptor (docs/vault.md 2.3): everything that does not depend on where the
 * tensor lives. `what` names the descriptor in messages. */
static smoe_status parse_desc(const uint8_t *d, const char *what, char name[40], smoe_tensor *t) {
    memcpy(name, d, 40);
    const char *nul = memchr(name, '\0', 40);
    if (!nul) return smoe_fail(SMOE_ERR_VAULT, "%s: name is not NUL-terminated within 40 bytes", what);
    char pn[40];
    printable(name, pn);
    if (!all_zero((const uint8_t *)nul, (size_t)(name + 40 - nul)))
        return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): name not NUL-padded", what, pn);
    uint8_t format = d[40], scale_format = d[41];
    uint32_t group = rd16(d + 42), rows = rd32(d + 44), cols = rd32(d + 48);
    uint64_t offset = rd64(d + 56);
    if (rd32(d + 52)) return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): reserved field not zero", what, pn);
    uint32_t ggml_bs, ggml_ts;
    const bool ggml = smoe_ggml_block(format, &ggml_bs, &ggml_ts);
    if (format > SMOE_FMT_Q4 && !ggml)
        return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): unknown format %u", what, pn, format);
    if (!tensor_init(t, format, scale_format, group, rows, cols)) {
        bool quant = is_quant(format);
        if (rows == 0 || cols == 0)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): empty shape %ux%u", what, pn, rows, cols);
        if (ggml && cols % ggml_bs)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): %s needs cols %% %u == 0, cols is %u", what, pn,
                             smoe_format_name(format), ggml_bs, cols);
        if (quant ? !scale_size(scale_format) : scale_format != SMOE_SCALE_NONE)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): scale_format %u does not go with format %s", what, pn,
                             scale_format, smoe_format_name(format));
        if (quant && group != 32 && group != 64 && group != 128)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): %s group_size %u (must be 32, 64 or 128)", what, pn,
                             smoe_format_name(format), group);
        if (!quant && group)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): group_size %u for %s (must be 0)", what, pn, group,
                             smoe_format_name(format));
        if (quant && cols % group)
            return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): %s needs cols %% group_size == 0, cols is %u, group_size %u",
                             what, pn, smoe_format_name(format), cols, group);
        return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): %ux%u is too large", what, pn, rows, cols);
    }
    if (offset % 64) return smoe_fail(SMOE_ERR_VAULT, "%s ('%s'): offset %llu not a multiple of 64", what, pn,
                                      (unsigned long long)offset);
    t->offset = offset;
    return SMOE_OK;
}

/* Dense tensor slots: three global ones, then LAYER_SLOTS per layer. Which slots a layer fills
 * depends on its kind and the model parameters (slot_wanted); every wanted slot is present exactly
 * once, and any other name is refused. */
enum { G_EMBED, G_NORM, G_LM_HEAD, N_GLOBAL };
enum {
    L_INPUT_NORM, L_POST_NORM, L_Q, L_K, L_V, L_O, L_Q_NORM, L_K_NORM, L_ROUTER, L_MLP_GATE, L_MLP_UP,
    L_MLP_DOWN, L_Q_BIAS, L_K_BIAS, L_V_BIAS, L_O_BIAS, L_ROUTER_BIAS, L_SHARED_GATE, L_SHARED_UP, L_SHARED_DOWN,
    L_SINKS, L_Q_GATE, L_SHARED_XGATE, L_LIN_QKV, L_LIN_Z, L_LIN_B, L_LIN_A, L_LIN_CONV, L_LIN_A_LOG, L_LIN_DT_BIAS,
    L_LIN_NORM, L_LIN_OUT, LAYER_SLOTS
};
static const char *const LAYER_SUFFIX[LAYER_SLOTS] = {
    "input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
    "q_norm", "k_norm", "router", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "router.bias",
    "shared.gate_proj", "shared.up_proj", "shared.down_proj", "sinks",
    "q_gate_proj", "shared_gate", "linear.qkv", "linear.z", "linear.b", "linear.a", "linear.conv", "linear.A_log",
    "linear.dt_bias", "linear.norm", "linear.out",
};

/* Qwen3-Next and Qwen3.5-MoE: gated attention, Gated DeltaNet layers, a gated shared expert. */
static bool hybrid_family(const smoe_model_params *m) {
    return m->family == SMOE_FAMILY_QWEN3_NEXT || m->family == SMOE_FAMILY_QWEN3_5_MOE;
}

/* Whether layer l of this vault holds the tensor of slot s (a LAYER_SLOTS index). */
static bool slot_wanted(const smoe_layout *L, uint32_t l, int s) {
    const smoe_model_params *m = &L->mp;
    const bool sparse = L->layer_sparse[l], linear = L->layer_attn[l] == SMOE_ATTN_LINEAR;
    if (s >= L_LIN_QKV && s <= L_LIN_OUT) return linear;
    if (linear && ((s >= L_Q && s <= L_K_NORM) || (s >= L_Q_BIAS && s <= L_O_BIAS) || s == L_Q_GATE)) return false;
    switch (s) {
    case L_Q_GATE: return hybrid_family(m);
    case L_SHARED_XGATE: return hybrid_family(m) && sparse && m->shared_intermediate > 0;
    case L_Q_NORM:
    case L_K_NORM: return m->qk_norm != SMOE_QK_NORM_NONE;
    case L_ROUTER: return sparse;
    case L_ROUTER_BIAS: return sparse && m->router_kind != SMOE_ROUTER_SOFTMAX_TOPK;
    case L_SINKS: return m->family == SMOE_FAMILY_GPT_OSS;
    case L_MLP_GATE:
    case L_MLP_UP:
    case L_MLP_DOWN: return !sparse;
    case L_Q_BIAS:
    case L_K_BIAS:
    case L_V_BIAS: return m->attention_bias >= 1;
    case L_O_BIAS: return m->attention_bias == 2;
    case L_SHARED_GATE:
    case L_SHARED_UP:
    case L_SHARED_DOWN: return sparse && m->shared_intermediate > 0;
    default: return true;
    }
}

/* Slot of a dense tensor name, or -1 if no tensor of this vault may have it. */
static int64_t name_slot(const char *name, const smoe_layout *L) {
    uint32_t nl = L->cfg.num_hidden_layers;
    if (!strcmp(name, "embed_tokens")) return G_EMBED;
    if (!strcmp(name, "norm")) return G_NORM;
    if (!strcmp(name, "lm_head")) return L->cfg.tie_word_embeddings ? -1 : G_LM_HEAD;
    if (strncmp(name, "layers.", 7)) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (*p == '0' && p[1] != '.')) return -1;
    uint32_t l = 0;
    for (const char *start = p; *p >= '0' && *p <= '9'; p++) {
        if (p - start == 4) return -1; /* layers < 1024 */
        l = l * 10 + (uint32_t)(*p - '0');
    }
    if (*p++ != '.' || l >= nl) return -1;
    for (int s = 0; s < LAYER_SLOTS; s++) {
        if (strcmp(p, LAYER_SUFFIX[s])) continue;
        if (!slot_wanted(L, l, s)) return -1;
        return N_GLOBAL + (int64_t)l * LAYER_SLOTS + s;
    }
    return -1;
}

/* Expected shape of a slot; *norm set for vectors that must be f32/bf16 (norms and biases). */
static void slot_shape(const smoe_layout *L, int64_t slot, uint64_t *rows, uint64_t *cols, bool *norm) {
    const smoe_config *c = &L->cfg;
    uint64_t h = c->hidden_size, v = c->vocab_size, hd = c->head_dim;
    uint64_t q = (uint64_t)c->num_attention_heads * hd, kv = (uint64_t)c->num_key_value_heads * hd;
    uint64_t I = c->intermediate_size, S = L->mp.shared_intermediate;
    bool whole = L->mp.qk_norm == SMOE_QK_NORM_WHOLE;
    const smoe_model_params *m = &L->mp;
    const uint64_t nv = m->linear_v_heads, vd = (uint64_t)nv * m->linear_v_dim;
    const uint64_t conv = 2ull * m->linear_k_heads * m->linear_k_dim + vd;
    *norm = false;
    if (slot < N_GLOBAL) {
        *norm = slot == G_NORM;
        *rows = slot == G_NORM ? 1 : v;
        *cols = h;
        return;
    }
    *rows = 1;
    switch ((slot - N_GLOBAL) % LAYER_SLOTS) {
    case L_INPUT_NORM:
    case L_POST_NORM: *norm = true, *cols = h; return;
    case L_Q: *rows = q, *cols = h; return;
    case L_K:
    case L_V: *rows = kv, *cols = h; return;
    case L_O: *rows = h, *cols = q; return;
    case L_Q_NORM: *norm = true, *cols = whole ? q : hd; return;
    case L_K_NORM: *norm = true, *cols = whole ? kv : hd; return;
    case L_ROUTER: *rows = c->num_experts, *cols = h; return;
    case L_MLP_GATE:
    case L_MLP_UP: *rows = I, *cols = h; return;
    case L_MLP_DOWN: *rows = h, *cols = I; return;
    case L_Q_BIAS: *norm = true, *cols = q; return;
    case L_K_BIAS:
    case L_V_BIAS: *norm = true, *cols = kv; return;
    case L_O_BIAS: *norm = true, *cols = h; return;
    case L_ROUTER_BIAS: *norm = true, *cols = c->num_experts; return;
    case L_SHARED_GATE:
    case L_SHARED_UP: *rows = S, *cols = h; return;
    case L_SINKS: *norm = true, *cols = c->num_attention_heads; return;
    case L_Q_GATE: *rows = q, *cols = h; return;
    case L_SHARED_XGATE: *cols = h; return;
    case L_LIN_QKV: *rows = conv, *cols = h; return;
    case L_LIN_Z: *rows = vd, *cols = h; return;
    case L_LIN_B:
    case L_LIN_A: *rows = nv, *cols = h; return;
    case L_LIN_CONV: *norm = true, *rows = conv, *cols = m->linear_conv_kernel; return;
    case L_LIN_A_LOG:
    case L_LIN_DT_BIAS: *norm = true, *cols = nv; return;
    case L_LIN_NORM: *norm = true, *cols = m->linear_v_dim; return;
    case L_LIN_OUT: *rows = h, *cols = vd; return;
    default: *rows = h, *cols = S; return; /* L_SHARED_DOWN */
    }
}

void smoe_layout_free(smoe_layout *L) {
    if (!L) return;
    smoe_free(L->layers);
    smoe_free(L->blob_crc);
    smoe_free(L->page_crc);
    smoe_free(L->blob_offset);
    smoe_free(L->names);
    smoe_free(L->tensors);
    smoe_free(L->layer_blob_bytes);
    smoe_free(L->xl);
    smoe_free(L->layer_attn);
    smoe_free(L->layer_sparse);
    memset(L, 0, sizeof *L);
}

uint64_t smoe_vault_head_bytes(const uint8_t *h) {
    if (!h || memcmp(h, MAGIC, 8)) return 0;
    uint32_t version = rd32(h + 8);
    if (version < 2 || version > VAULT_VERSION) return 0;
    uint64_t table_offset = rd64(h + 24), table_bytes = rd64(h + 32);
    if (table_offset != HEADER_BYTES || table_bytes > MAX_TABLE_BYTES) return 0;
    return table_offset + table_bytes;
}

static int cmp_u64_pair(const void *a, const void *b) {
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

static smoe_status parse_header(const uint8_t *b, size_t len, uint64_t real_size, smoe_layout *L) {
    if (len < HEADER_BYTES)
        return smoe_fail(SMOE_ERR_VAULT, "header truncated: %zu bytes, the header is %u", len, HEADER_BYTES);
    if (memcmp(b, MAGIC, 8)) return smoe_fail(SMOE_ERR_VAULT, "not a pysmoe vault (bad magic)");
    uint32_t version = rd32(b + 8);
    if (version == 1)
        return smoe_fail(SMOE_ERR_VAULT, "vault format version 1 is no longer supported; re-create it with "
                                         "`pysmoe convert` or `pysmoe synth`");
    if (version < 2 || version > VAULT_VERSION)
        return smoe_fail(SMOE_ERR_VAULT,
                         version > VAULT_VERSION
                             ? "vault format version %u needs a newer pysmoe (this libsmoe reads versions 2 to %u)"
                             : "unsupported vault version %u (this libsmoe reads versions 2 to %u)",
                         version, VAULT_VERSION);
    L->version = version;
    L->file_size = rd64(b + 16);
    L->table_offset = rd64(b + 24);
    L->table_bytes = rd64(b + 32);
    L->dense_offset = rd64(b + 40);
    L->dense_bytes = rd64(b + 48);
    L->dense_crc = rd32(b + 56);
    L->n_tensors = rd32(b + 60);
    L->blob_bytes = rd64(b + 64);
    L->n_blobs = rd32(b + 72);
    if (version >= 4) {
        L->paged_bytes = rd64(b + 80);
        L->page_bytes = rd32(b + 88);
    }
    if (L->table_offset != HEADER_BYTES)
        return smoe_fail(SMOE_ERR_VAULT, "header: table_offset %llu, must be 256", (unsigned long long)L->table_offset);
    if (L->table_bytes < CONFIG_BYTES || L->table_bytes > MAX_TABLE_BYTES)
        return smoe_fail(SMOE_ERR_VAULT, "header: table_bytes %llu outside [%u, 64 MiB]",
                         (unsigned long long)L->table_bytes, CONFIG_BYTES);
    uint64_t table_end = L->table_offset + L->table_bytes;
    if (len < table_end)
        return smoe_fail(SMOE_ERR_VAULT, "tables truncated: %zu bytes of header and tables, need %llu", len,
                         (unsigned long long)table_end);
    uint32_t stored = rd32(b + 12);
    uint32_t crc = header_checksum(b, table_end);
    if (crc != stored)
        return smoe_fail(SMOE_ERR_VAULT, "header checksum mismatch (computed %08x, header_crc %08x): corrupted header or tables",
                         crc, stored);
    if (real_size < L->file_size)
        return smoe_fail(SMOE_ERR_VAULT, "truncated: the file is %llu bytes, its header says %llu",
                         (unsigned long long)real_size, (unsigned long long)L->file_size);
    if (real_size > L->file_size)
        return smoe_fail(SMOE_ERR_VAULT, "the file is %llu bytes, its header says %llu (trailing bytes)",
                         (unsigned long long)real_size, (unsigned long long)L->file_size);
    const size_t used = version >= 4 ? 92 : 80; /* v4: paged_bytes, page_bytes */
    if (rd32(b + 76) || !all_zero(b + used, HEADER_BYTES - used))
        return smoe_fail(SMOE_ERR_VAULT, "header: reserved bytes not zero");
    if (L->dense_offset % SMOE_PAGE || L->dense_offset < table_end)
        return smoe_fail(SMOE_ERR_VAULT, "header: dense_offset %llu must be a multiple of %u at or past the tables' end %llu",
                         (unsigned long long)L->dense_offset, SMOE_PAGE, (unsigned long long)table_end);
    if (L->dense_offset > L->file_size || L->dense_bytes > L->file_size - L->dense_offset)
        return smoe_fail(SMOE_ERR_VAULT, "header: dense region [%llu, +%llu) runs past the end of the file (%llu bytes)",
                         (unsigned long long)L->dense_offset, (unsigned long long)L->dense_bytes,
                         (unsigned long long)L->file_size);
    if (L->blob_bytes % SMOE_PAGE)
        return smoe_fail(SMOE_ERR_VAULT, "header: blob_bytes %llu not a multiple of %u",
                         (unsigned long long)L->blob_bytes, SMOE_PAGE);
    if ((L->paged_bytes == 0) != (L->page_bytes == 0))
        return smoe_fail(SMOE_ERR_VAULT, "header: paged_bytes %llu with page_bytes %u (both 0, or neither)",
                         (unsigned long long)L->paged_bytes, L->page_bytes);
    if (L->paged_bytes) {
        const uint32_t pb = L->page_bytes;
        if (pb < MIN_PAGE_BYTES || pb > MAX_PAGE_BYTES || (pb & (pb - 1)))
            return smoe_fail(SMOE_ERR_VAULT, "header: page_bytes %u must be a power of two in [%u, %u]", pb,
                             MIN_PAGE_BYTES, MAX_PAGE_BYTES);
        if (L->paged_bytes > L->dense_bytes || (L->dense_bytes - L->paged_bytes) % SMOE_PAGE)
            return smoe_fail(SMOE_ERR_VAULT, "header: paged_bytes %llu must be the dense region's (%llu bytes) last "
                             "bytes, starting at a multiple of %u", (unsigned long long)L->paged_bytes,
                             (unsigned long long)L->dense_bytes, SMOE_PAGE);
        const uint64_t pages = L->paged_bytes / pb + (L->paged_bytes % pb != 0);
        if (pages > MAX_TABLE_BYTES / 4)
            return smoe_fail(SMOE_ERR_VAULT, "header: %llu pages of %u bytes do not fit the tables",
                             (unsigned long long)pages, pb);
        L->n_pages = (uint32_t)pages;
    }
    return SMOE_OK;
}

static smoe_status parse_config(const uint8_t *c, smoe_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->vocab_size = rd32(c + 0);
    cfg->hidden_size = rd32(c + 4);
    cfg->num_hidden_layers = rd32(c + 8);
    cfg->num_attention_heads = rd32(c + 12);
    cfg->num_key_value_heads = rd32(c + 16);
    cfg->head_dim = rd32(c + 20);
    cfg->intermediate_size = rd32(c + 24);
    cfg->moe_intermediate_size = rd32(c + 28);
    cfg->num_experts = rd32(c + 32);
    cfg->num_experts_per_tok = rd32(c + 36);
    cfg->max_position_embeddings = rd32(c + 40);
    uint32_t flags = rd32(c + 44);
    cfg->rms_norm_eps = rdf32(c + 48);
    cfg->rope_theta = rdf64(c + 56);
    cfg->norm_topk_prob = flags & 1;
    cfg->tie_word_embeddings = (flags >> 1) & 1;

    static const char *const field[] = {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
        "max_position_embeddings",
    };
    for (unsigned i = 0; i < sizeof field / sizeof *field; i++)
        if (rd32(c + 4 * i) == 0) return smoe_fail(SMOE_ERR_VAULT, "config: %s is 0", field[i]);
    if (flags & ~3u) return smoe_fail(SMOE_ERR_VAULT, "config: unknown flags 0x%x", flags);
    if (rd32(c + 52) || !all_zero(c + 64, CONFIG_BYTES - 64))
        return smoe_fail(SMOE_ERR_VAULT, "config: reserved bytes not zero");
    if (cfg->vocab_size > MAX_VOCAB)
        return smoe_fail(SMOE_ERR_VAULT, "config: vocab_size %u > 2^24", cfg->vocab_size);
    if (cfg->num_hidden_layers > MAX_LAYERS)
        return smoe_fail(SMOE_ERR_VAULT, "config: num_hidden_layers %u > %u", cfg->num_hidden_layers, MAX_LAYERS);
    if (cfg->num_experts > MAX_EXPERTS || cfg->num_experts_per_tok > cfg->num_experts)
        return smoe_fail(SMOE_ERR_VAULT, "config: need num_experts_per_tok (%u) <= num_experts (%u) <= %u",
                         cfg->num_experts_per_tok, cfg->num_experts, MAX_EXPERTS);
    if (cfg->hidden_size > MAX_DIM || cfg->head_dim > MAX_DIM || cfg->intermediate_size > MAX_DIM ||
        cfg->moe_intermediate_size > MAX_DIM)
        return smoe_fail(SMOE_ERR_VAULT, "config: hidden_size, head_dim and widths must be <= %u", MAX_DIM);
    if (cfg->num_attention_heads % cfg->num_key_value_heads)
        return smoe_fail(SMOE_ERR_VAULT, "config: num_attention_heads %u not a multiple of num_key_value_heads %u",
                         cfg->num_attention_heads, cfg->num_key_value_heads);
    if (cfg->head_dim % 2) return smoe_fail(SMOE_ERR_VAULT, "config: head_dim %u is odd", cfg->head_dim);
    /* Not in the limits list, but no model runs with them and they would poison every layer. */
    if (!(isfinite(cfg->rms_norm_eps) && cfg->rms_norm_eps > 0))
        return smoe_fail(SMOE_ERR_VAULT, "config: rms_norm_eps %g is not a positive number", (double)cfg->rms_norm_eps);
    if (!(isfinite(cfg->rope_theta) && cfg->rope_theta > 0))
        return smoe_fail(SMOE_ERR_VAULT, "config: rope_theta %g is not a positive number", cfg->rope_theta);
    return SMOE_OK;
}

/* The three expert tensors of every blob (2.3). */

/* ------------------------------------------------------------------ model parameters (2.2) */

typedef enum { P_FAMILY, P_ROTARY_DIM, P_SLIDING_WINDOW, P_ROUTER_KIND, P_N_GROUP, P_TOPK_GROUP, P_ROUTED_SCALING,
               P_SHARED_INTERMEDIATE, P_ATTENTION_BIAS, P_QK_NORM, P_SWIGLU_ALPHA, P_SWIGLU_LIMIT, P_YARN_FACTOR,
               P_YARN_ORIGINAL_MAX, P_YARN_BETA_FAST, P_YARN_BETA_SLOW, P_YARN_ATTENTION_FACTOR, P_YARN_TRUNCATE,
               P_LIN_K_HEADS, P_LIN_V_HEADS, P_LIN_K_DIM, P_LIN_V_DIM, P_LIN_CONV, P_LIN_V_ORDER, N_PARAMS } param_id;
static const char *const PARAM_KEY[N_PARAMS] = {
    "family", "rotary_dim", "sliding_window", "router_kind", "n_group", "topk_group", "routed_scaling_factor",
    "shared_intermediate_size", "attention_bias", "qk_norm", "swiglu_alpha", "swiglu_limit", "yarn_factor",
    "yarn_original_max_position", "yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor", "yarn_truncate",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "linear_value_head_order",
};
static const char *const FAMILY_NAME[SMOE_FAMILY_COUNT] = {
    "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe",
};

const char *smoe_family_name(uint32_t family) { return family < SMOE_FAMILY_COUNT ? FAMILY_NAME[family] : "?"; }

/* The defaults of a version-2 vault and of any key a version-3 vault leaves out. */
static void default_params(const smoe_config *c, smoe_model_params *m) {
    memset(m, 0, sizeof *m);
    m->family = SMOE_FAMILY_QWEN3_MOE;
    m->rotary_dim = c->head_dim;
    m->router_kind = SMOE_ROUTER_SOFTMAX_TOPK;
    m->n_group = m->topk_group = 1;
    m->routed_scaling_factor = 1.0f;
    m->qk_norm = SMOE_QK_NORM_HEAD;
    m->yarn_factor = 1.0; /* no YaRN */
    m->yarn_beta_fast = 32.0;
    m->yarn_beta_slow = 1.0;
    m->yarn_attention_factor = 1.0;
    m->yarn_truncate = 1;
}

/* value as a finite number in [lo, hi], or an error naming the key. */
static smoe_status param_real(const char *key, double value, double lo, double hi, double *out) {
    if (!(value >= lo && value <= hi))
        return smoe_fail(SMOE_ERR_VAULT, "parameter '%s' is %g, must be a number in [%g, %g]", key, value, lo, hi);
    *out = value;
    return SMOE_OK;
}

/* value as an integer in [lo, hi], or an error naming the key. */
static smoe_status param_int(const char *key, double value, double lo, double hi, uint32_t *out) {
    if (!(value >= lo && value <= hi) || value != floor(value))
        return smoe_fail(SMOE_ERR_VAULT, "parameter '%s' is %g, must be an integer in [%g, %g]", key, value, lo, hi);
    *out = (uint32_t)value;
    return SMOE_OK;
}

/* n entries of 40 bytes: char key[32] NUL-padded, f64 value; each key known and at most once. */
static smoe_status parse_params(const uint8_t *d, uint32_t n, smoe_layout *L) {
    const smoe_config *c = &L->cfg;
    smoe_model_params *m = &L->mp;
    default_params(c, m);
    bool seen[N_PARAMS] = {0};
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *e = d + (size_t)i * PARAM_BYTES;
        char key[PARAM_KEY_BYTES], pk[40];
        memcpy(key, e, PARAM_KEY_BYTES);
        const char *nul = memchr(key, '\0', PARAM_KEY_BYTES);
        if (!nul) return smoe_fail(SMOE_ERR_VAULT, "parameter %u: key is not NUL-terminated within 32 bytes", i);
        if (!all_zero((const uint8_t *)nul, (size_t)(key + PARAM_KEY_BYTES - nul)))
            return smoe_fail(SMOE_ERR_VAULT, "parameter %u: key not NUL-padded", i);
        char kb[40] = {0};
        memcpy(kb, key, PARAM_KEY_BYTES);
        printable(kb, pk);
        int id = -1;
        for (int k = 0; k < N_PARAMS; k++)
            if (!strcmp(key, PARAM_KEY[k])) id = k;
        if (id < 0)
            return smoe_fail(SMOE_ERR_VAULT, "this vault needs a newer pysmoe: unknown parameter '%s'", pk);
        if (seen[id]) return smoe_fail(SMOE_ERR_VAULT, "parameter '%s' appears twice", pk);
        seen[id] = true;
        double v = rdf64(e + PARAM_KEY_BYTES);
        smoe_status rc = SMOE_OK;
        switch ((param_id)id) {
        case P_FAMILY:
            rc = param_int(pk, v, 0, 255, &m->family);
            if (rc == SMOE_OK && m->family >= SMOE_FAMILY_COUNT)
                rc = smoe_fail(SMOE_ERR_VAULT, "this vault needs a newer pysmoe: unknown model family %u",
                               m->family);
            break;
        case P_ROTARY_DIM: rc = param_int(pk, v, 2, c->head_dim, &m->rotary_dim); break;
        case P_SLIDING_WINDOW: rc = param_int(pk, v, 0, 4294967295.0, &m->sliding_window); break;
        case P_ROUTER_KIND: rc = param_int(pk, v, 0, SMOE_ROUTER_KINDS - 1, &m->router_kind); break;
        case P_N_GROUP: rc = param_int(pk, v, 1, MAX_EXPERTS, &m->n_group); break;
        case P_TOPK_GROUP: rc = param_int(pk, v, 1, MAX_EXPERTS, &m->topk_group); break;
        case P_ROUTED_SCALING:
            if (!(isfinite(v) && v > 0 && v < 1e6))
                rc = smoe_fail(SMOE_ERR_VAULT, "parameter '%s' is %g, must be a positive number", pk, v);
            m->routed_scaling_factor = (float)v;
            break;
        case P_SHARED_INTERMEDIATE: rc = param_int(pk, v, 0, MAX_DIM, &m->shared_intermediate); break;
        case P_ATTENTION_BIAS: rc = param_int(pk, v, 0, 2, &m->attention_bias); break;
        case P_QK_NORM: rc = param_int(pk, v, 0, 2, &m->qk_norm); break;
        case P_SWIGLU_ALPHA:
        case P_SWIGLU_LIMIT: {
            double x = 0;
            rc = param_real(pk, v, 0, 1e6, &x);
            *(id == P_SWIGLU_ALPHA ? &m->swiglu_alpha : &m->swiglu_limit) = (float)x;
            break;
        }
        case P_YARN_FACTOR: rc = param_real(pk, v, 1, 1e6, &m->yarn_factor); break;
        case P_YARN_ORIGINAL_MAX: rc = param_real(pk, v, 1, 4294967295.0, &m->yarn_original_max); break;
        case P_YARN_BETA_FAST: rc = param_real(pk, v, 1e-6, 1e6, &m->yarn_beta_fast); break;
        case P_YARN_BETA_SLOW: rc = param_real(pk, v, 1e-6, 1e6, &m->yarn_beta_slow); break;
        case P_YARN_ATTENTION_FACTOR: rc = param_real(pk, v, 1e-6, 1e6, &m->yarn_attention_factor); break;
        case P_YARN_TRUNCATE: rc = param_int(pk, v, 0, 1, &m->yarn_truncate); break;
        case P_LIN_K_HEADS: rc = param_int(pk, v, 1, 1024, &m->linear_k_heads); break;
        case P_LIN_V_HEADS: rc = param_int(pk, v, 1, 1024, &m->linear_v_heads); break;
        case P_LIN_K_DIM: rc = param_int(pk, v, 1, 1024, &m->linear_k_dim); break;
        case P_LIN_V_DIM: rc = param_int(pk, v, 1, 1024, &m->linear_v_dim); break;
        case P_LIN_CONV: rc = param_int(pk, v, 1, 64, &m->linear_conv_kernel); break;
        case P_LIN_V_ORDER: rc = param_int(pk, v, 0, 1, &m->linear_v_tiled); break;
        default: break;
        }
        if (rc) return rc;
    }
    if (m->rotary_dim % 2) return smoe_fail(SMOE_ERR_VAULT, "parameter 'rotary_dim' %u is odd", m->rotary_dim);
    if (m->yarn_factor > 1 && !seen[P_YARN_ORIGINAL_MAX])
        return smoe_fail(SMOE_ERR_VAULT, "parameters: YaRN (yarn_factor %g) needs yarn_original_max_position", m->yarn_factor);
    if (m->family == SMOE_FAMILY_GPT_OSS && !(seen[P_SWIGLU_ALPHA] && seen[P_SWIGLU_LIMIT]))
        return smoe_fail(SMOE_ERR_VAULT, "parameters: a gpt_oss vault needs swiglu_alpha and swiglu_limit");
    bool linear = false;
    for (uint32_t l = 0; l < c->num_hidden_layers; l++) linear |= L->layer_attn[l] == SMOE_ATTN_LINEAR;
    const bool sized = m->linear_k_heads && m->linear_v_heads && m->linear_k_dim && m->linear_v_dim &&
                       m->linear_conv_kernel;
    const bool any = (m->linear_k_heads | m->linear_v_heads | m->linear_k_dim | m->linear_v_dim |
                      m->linear_conv_kernel) != 0;
    if (linear != sized || any != sized)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: the linear_* sizes must be given, all of them, exactly when a "
                                         "layer is linear attention (%s)", linear ? "there is one" : "there is none");
    if (m->linear_v_tiled && !sized)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: linear_value_head_order without a linear-attention layer");
    if (sized && m->linear_v_heads % m->linear_k_heads)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: linear_num_value_heads %u is not a multiple of "
                                         "linear_num_key_heads %u", m->linear_v_heads, m->linear_k_heads);
    if (c->num_experts % m->n_group || m->topk_group > m->n_group)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: n_group %u must divide num_experts %u, topk_group %u <= n_group",
                         m->n_group, c->num_experts, m->topk_group);
    if (m->router_kind == SMOE_ROUTER_SIGMOID_GROUP &&
        (uint64_t)m->topk_group * (c->num_experts / m->n_group) < c->num_experts_per_tok)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: topk_group %u groups of %u experts hold fewer than top-k %u",
                         m->topk_group, c->num_experts / m->n_group, c->num_experts_per_tok);
    if (m->router_kind == SMOE_ROUTER_SIGMOID_GROUP && m->n_group > 1 && c->num_experts / m->n_group < 2)
        return smoe_fail(SMOE_ERR_VAULT, "parameters: group-limited routing needs at least 2 experts per group");
    return SMOE_OK;
}

/* ------------------------------------------------------------------ expert blob layouts (2.4) */

static const char *const EXPERT_NAME[SMOE_XT_COUNT] = {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"};

/* Checks layer l's blob layout x (its tensors parsed) against the config and its own length. */
static smoe_status check_expert_layout(const smoe_layout *L, uint32_t l, const smoe_expert_layout *x) {
    const smoe_config *c = &L->cfg;
    const uint32_t I = c->moe_intermediate_size, H = c->hidden_size;
    const uint32_t shape[SMOE_XT_COUNT][2] = {{I, H}, {I, H}, {H, I}, {1, I}, {1, I}, {1, H}};
    for (int i = 0; i < SMOE_XT_COUNT; i++) {
        if (!x->has[i]) {
            if (i < 3)
                return smoe_fail(SMOE_ERR_VAULT, "layer %u: its blobs lack the expert tensor '%s'", l, EXPERT_NAME[i]);
            continue;
        }
        const smoe_tensor *t = &x->t[i];
        if (t->rows != shape[i][0] || t->cols != shape[i][1])
            return smoe_fail(SMOE_ERR_VAULT, "layer %u: expert tensor '%s': shape %ux%u, expected %ux%u", l,
                             EXPERT_NAME[i], t->rows, t->cols, shape[i][0], shape[i][1]);
        if (i >= 3 && t->format != SMOE_FMT_F32 && t->format != SMOE_FMT_BF16)
            return smoe_fail(SMOE_ERR_VAULT, "layer %u: expert tensor '%s': a bias must be f32 or bf16", l, EXPERT_NAME[i]);
        if (t->offset > x->bytes || t->nbytes > x->bytes - t->offset)
            return smoe_fail(SMOE_ERR_VAULT, "layer %u: expert tensor '%s': bytes [%llu, +%llu) run past the blob (%llu bytes)",
                             l, EXPERT_NAME[i], (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                             (unsigned long long)x->bytes);
        for (int j = 0; j < i; j++) {
            const smoe_tensor *u = &x->t[j];
            if (x->has[j] && t->offset < u->offset + u->nbytes && u->offset < t->offset + t->nbytes)
                return smoe_fail(SMOE_ERR_VAULT, "layer %u: expert tensors '%s' and '%s' overlap", l, EXPERT_NAME[j],
                                 EXPERT_NAME[i]);
        }
    }
    return SMOE_OK;
}

/* Version 2: one layout of gate, up, down (3 descriptors) for every sparse layer. */
static smoe_status parse_expert_layout_v2(const uint8_t *d, smoe_layout *L) {
    smoe_expert_layout x;
    memset(&x, 0, sizeof x);
    x.bytes = L->blob_bytes;
    x.n = 3;
    for (int i = 0; i < 3; i++) {
        char what[48], name[40], pn[40];
        snprintf(what, sizeof what, "expert tensor %d", i);
        smoe_status rc = parse_desc(d + (size_t)i * DESC_BYTES, what, name, &x.t[i]);
        if (rc) return rc;
        if (strcmp(name, EXPERT_NAME[i]))
            return smoe_fail(SMOE_ERR_VAULT, "%s is named '%s', expected '%s'", what, printable(name, pn), EXPERT_NAME[i]);
        x.has[i] = true;
    }
    for (uint32_t l = 0; l < L->cfg.num_hidden_layers; l++) {
        if (!L->layer_sparse[l]) continue;
        smoe_status rc = check_expert_layout(L, l, &x);
        if (rc) return rc;
        L->xl[l] = x;
    }
    if (!L->cfg.num_sparse_layers) { /* the descriptors are unused, but still checked for shape */
        const smoe_config *c = &L->cfg;
        const uint32_t I = c->moe_intermediate_size, H = c->hidden_size;
        const uint32_t shape[3][2] = {{I, H}, {I, H}, {H, I}};
        for (int i = 0; i < 3; i++)
            if (x.t[i].rows != shape[i][0] || x.t[i].cols != shape[i][1])
                return smoe_fail(SMOE_ERR_VAULT, "expert tensor '%s': shape %ux%u, expected %ux%u", EXPERT_NAME[i],
                                 x.t[i].rows, x.t[i].cols, shape[i][0], shape[i][1]);
    }
    return SMOE_OK;
}

/* Version 3: per layer {u64 bytes, u32 n, u32 0} and n descriptors; *used: the bytes it took,
 * within avail. */
static smoe_status parse_expert_layouts_v3(const uint8_t *d, uint64_t avail, smoe_layout *L, uint64_t *used) {
    const smoe_config *c = &L->cfg;
    uint64_t pos = 0, largest = 0;
    for (uint32_t l = 0; l < c->num_hidden_layers; l++) {
        if (avail - pos < LAYOUT_ENTRY_BYTES)
            return smoe_fail(SMOE_ERR_VAULT, "tables: the expert layout of layer %u runs past table_bytes", l);
        smoe_expert_layout *x = &L->xl[l];
        memset(x, 0, sizeof *x);
        x->bytes = rd64(d + pos);
        x->n = rd32(d + pos + 8);
        if (rd32(d + pos + 12)) return smoe_fail(SMOE_ERR_VAULT, "layer %u: expert layout reserved field not zero", l);
        pos += LAYOUT_ENTRY_BYTES;
        if (!L->layer_sparse[l]) {
            if (x->bytes || x->n)
                return smoe_fail(SMOE_ERR_VAULT, "layer %u is dense but has an expert layout (%u tensors, %llu bytes)", l,
                                 x->n, (unsigned long long)x->bytes);
            continue;
        }
        if (x->bytes == 0 || x->bytes % SMOE_PAGE)
            return smoe_fail(SMOE_ERR_VAULT, "layer %u: blob length %llu is not a positive multiple of %u", l,
                             (unsigned long long)x->bytes, SMOE_PAGE);
        if (x->n < 3 || x->n > SMOE_XT_COUNT)
            return smoe_fail(SMOE_ERR_VAULT, "layer %u: %u expert tensors (3 to %u)", l, x->n, SMOE_XT_COUNT);
        if (avail - pos < (uint64_t)x->n * DESC_BYTES)
            return smoe_fail(SMOE_ERR_VAULT, "tables: the expert layout of layer %u runs past table_bytes", l);
        for (uint32_t i = 0; i < x->n; i++) {
            char what[64], name[40], pn[40];
            smoe_tensor t;
            snprintf(what, sizeof what, "layer %u expert tensor %u", l, i);
            smoe_status rc = parse_desc(d + pos, what, name, &t);
            if (rc) return rc;
            pos += DESC_BYTES;
            int k = -1;
            for (int j = 0; j < SMOE_XT_COUNT; j++)
                if (!strcmp(name, EXPERT_NAME[j])) k = j;
            if (k < 0) return smoe_fail(SMOE_ERR_VAULT, "%s: unexpected name '%s'", what, printable(name, pn));
            if (x->has[k]) return smoe_fail(SMOE_ERR_VAULT, "%s: '%s' appears twice", what, EXPERT_NAME[k]);
            if (k >= 3 && L->mp.family != SMOE_FAMILY_GPT_OSS)
                return smoe_fail(SMOE_ERR_VAULT, "%s: family %s has no expert '%s'", what, smoe_family_name(L->mp.family),
                                 EXPERT_NAME[k]);
            x->has[k] = true;
            x->t[k] = t;
        }
        smoe_status rc = check_expert_layout(L, l, x);
        if (rc) return rc;
        if (x->bytes > largest) largest = x->bytes;
    }
    if (largest != L->blob_bytes)
        return smoe_fail(SMOE_ERR_VAULT, "header: blob_bytes %llu, the largest layer's blob is %llu",
                         (unsigned long long)L->blob_bytes, (unsigned long long)largest);
    *used = pos;
    return SMOE_OK;
}

/* The first sparse layer's layout as L->expert, and whether every sparse layer has the same. */
static void summarise_experts(smoe_layout *L) {
    const smoe_expert_layout *f = NULL;
    L->expert = NULL;
    L->uniform_experts = true;
    for (uint32_t l = 0; l < L->cfg.num_hidden_layers; l++) {
        L->layer_blob_bytes[l] = L->xl[l].bytes;
        if (!L->layer_sparse[l]) continue;
        const smoe_expert_layout *x = &L->xl[l];
        if (!f) {
            f = x;
            L->expert = x->t;
            continue;
        }
        bool same = x->bytes == f->bytes && !memcmp(x->has, f->has, sizeof x->has);
        for (int i = 0; i < SMOE_XT_COUNT && same; i++)
            if (x->has[i]) {
                const smoe_tensor *a = &x->t[i], *b = &f->t[i];
                same = a->format == b->format && a->scale_format == b->scale_format && a->group == b->group &&
                       a->offset == b->offset && a->nbytes == b->nbytes;
            }
        if (!same) L->uniform_experts = false;
    }
}

/* ------------------------------------------------------------------ dense tensors (2.5) */

static uint64_t wanted_tensors(const smoe_layout *L) {
    uint64_t n = L->cfg.tie_word_embeddings ? 2 : 3;
    for (uint32_t l = 0; l < L->cfg.num_hidden_layers; l++)
        for (int s = 0; s < LAYER_SLOTS; s++) n += slot_wanted(L, l, s);
    return n;
}

static smoe_status parse_dense_table(const uint8_t *d, smoe_layout *L) {
    const smoe_config *c = &L->cfg;
    size_t n_slots = N_GLOBAL + (size_t)c->num_hidden_layers * LAYER_SLOTS;
    int32_t *slot_of = smoe_alloc(n_slots * sizeof *slot_of, 64); /* tensor index + 1, 0 = empty */
    if (!slot_of) return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate the tensor index");
    memset(slot_of, 0, n_slots * sizeof *slot_of);
    smoe_status rc = SMOE_OK;
    for (uint32_t i = 0; i < L->n_tensors && rc == SMOE_OK; i++) {
        char what[32], pn[40];
        snprintf(what, sizeof what, "dense tensor %u", i);
        smoe_tensor *t = &L->tensors[i];
        if ((rc = parse_desc(d + (size_t)i * DESC_BYTES, what, L->names[i], t))) break;
        const char *name = printable(L->names[i], pn);
        int64_t slot = name_slot(L->names[i], L);
        if (slot < 0) {
            rc = smoe_fail(SMOE_ERR_VAULT, "%s: unexpected name '%s' (for a %s vault)", what, name,
                           smoe_family_name(L->mp.family));
            break;
        }
        if (slot_of[slot]) {
            rc = smoe_fail(SMOE_ERR_VAULT, "%s: '%s' appears twice (first as tensor %d)", what, name, slot_of[slot] - 1);
            break;
        }
        slot_of[slot] = (int32_t)i + 1;
        uint64_t rows, cols;
        bool norm;
        slot_shape(L, slot, &rows, &cols, &norm);
        if (t->rows != rows || t->cols != cols)
            rc = smoe_fail(SMOE_ERR_VAULT, "%s '%s': shape %ux%u, expected %llux%llu", what, name, t->rows, t->cols,
                           (unsigned long long)rows, (unsigned long long)cols);
        else if (norm && t->format != SMOE_FMT_F32 && t->format != SMOE_FMT_BF16)
            rc = smoe_fail(SMOE_ERR_VAULT, "%s '%s': a bias or norm must be f32 or bf16, not %s", what, name,
                           smoe_format_name(t->format));
        else if (t->offset > L->dense_bytes || t->nbytes > L->dense_bytes - t->offset)
            rc = smoe_fail(SMOE_ERR_VAULT, "%s '%s': bytes [%llu, +%llu) run past the dense region (%llu bytes)", what,
                           name, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                           (unsigned long long)L->dense_bytes);
    }
    if (rc == SMOE_OK) {
        /* n_tensors equals the number of names this vault requires, each was seen at most
         * once and every name belongs to a required slot, so every slot is now filled. */
        for (uint32_t l = 0; l < c->num_hidden_layers; l++) {
            smoe_layer_weights *w = &L->layers[l];
            const int32_t *s = slot_of + N_GLOBAL + (size_t)l * LAYER_SLOTS;
#define T(k) (s[k] ? &L->tensors[s[k] - 1] : NULL)
            w->sparse = L->layer_sparse[l];
            w->attn = L->layer_attn[l];
            w->input_norm = T(L_INPUT_NORM);
            w->post_norm = T(L_POST_NORM);
            w->q = T(L_Q);
            w->k = T(L_K);
            w->v = T(L_V);
            w->o = T(L_O);
            w->q_bias = T(L_Q_BIAS);
            w->k_bias = T(L_K_BIAS);
            w->v_bias = T(L_V_BIAS);
            w->o_bias = T(L_O_BIAS);
            w->q_norm = T(L_Q_NORM);
            w->k_norm = T(L_K_NORM);
            w->router = T(L_ROUTER);
            w->router_bias = T(L_ROUTER_BIAS);
            w->mlp_gate = T(L_MLP_GATE);
            w->mlp_up = T(L_MLP_UP);
            w->mlp_down = T(L_MLP_DOWN);
            w->shared_gate = T(L_SHARED_GATE);
            w->shared_up = T(L_SHARED_UP);
            w->shared_down = T(L_SHARED_DOWN);
            w->sinks = T(L_SINKS);
            w->q_gate = T(L_Q_GATE);
            w->shared_expert_gate = T(L_SHARED_XGATE);
            w->lin_qkv = T(L_LIN_QKV);
            w->lin_z = T(L_LIN_Z);
            w->lin_b = T(L_LIN_B);
            w->lin_a = T(L_LIN_A);
            w->lin_conv = T(L_LIN_CONV);
            w->lin_a_log = T(L_LIN_A_LOG);
            w->lin_dt_bias = T(L_LIN_DT_BIAS);
            w->lin_norm = T(L_LIN_NORM);
            w->lin_out = T(L_LIN_OUT);
#undef T
        }
        L->embed = &L->tensors[slot_of[G_EMBED] - 1];
        L->final_norm = &L->tensors[slot_of[G_NORM] - 1];
        L->lm_head = c->tie_word_embeddings ? L->embed : &L->tensors[slot_of[G_LM_HEAD] - 1];
    }
    smoe_free(slot_of);
    return rc;
}

/* ------------------------------------------------------------------ blob table (2.6) */

static smoe_status parse_blob_table(const uint8_t *d, smoe_layout *L) {
    const smoe_config *c = &L->cfg;
    uint64_t data_end = L->dense_offset + L->dense_bytes;
    uint64_t n_sparse = 0;
    for (uint32_t i = 0; i < L->n_blobs; i++) {
        const uint8_t *e = d + (size_t)i * BLOB_ENTRY_BYTES;
        uint32_t layer = i / c->num_experts, expert = i % c->num_experts;
        uint64_t off = rd64(e), bytes = L->layer_blob_bytes[layer];
        L->blob_offset[i] = off;
        L->blob_crc[i] = rd32(e + 8);
        if (rd32(e + 12))
            return smoe_fail(SMOE_ERR_VAULT, "blob (layer %u, expert %u): reserved field not zero", layer, expert);
        if (!L->layer_sparse[layer]) {
            if (off) return smoe_fail(SMOE_ERR_VAULT, "blob (layer %u, expert %u): offset %llu for a dense layer, must be 0",
                                      layer, expert, (unsigned long long)off);
            continue;
        }
        n_sparse++;
        if (off % SMOE_PAGE || off < data_end || off > L->file_size || bytes > L->file_size - off)
            return smoe_fail(SMOE_ERR_VAULT,
                             "blob (layer %u, expert %u): offset %llu must be a multiple of %u with the blob "
                             "(%llu bytes) between the dense region's end %llu and the file's end %llu",
                             layer, expert, (unsigned long long)off, SMOE_PAGE, (unsigned long long)bytes,
                             (unsigned long long)data_end, (unsigned long long)L->file_size);
    }
    if (n_sparse < 2) return SMOE_OK;
    uint64_t (*order)[2] = smoe_alloc(n_sparse * sizeof *order, 64); /* (offset, index) */
    if (!order) return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate %llu blob entries", (unsigned long long)n_sparse);
    size_t k = 0;
    for (uint32_t i = 0; i < L->n_blobs; i++)
        if (L->layer_sparse[i / c->num_experts]) order[k][0] = L->blob_offset[i], order[k][1] = i, k++;
    qsort(order, k, sizeof *order, cmp_u64_pair);
    smoe_status rc = SMOE_OK;
    for (size_t i = 0; i + 1 < k; i++)
        if (order[i + 1][0] - order[i][0] < L->layer_blob_bytes[order[i][1] / c->num_experts]) {
            uint64_t a = order[i][1], b = order[i + 1][1];
            rc = smoe_fail(SMOE_ERR_VAULT, "blobs (layer %llu, expert %llu) and (layer %llu, expert %llu) overlap",
                           (unsigned long long)(a / c->num_experts), (unsigned long long)(a % c->num_experts),
                           (unsigned long long)(b / c->num_experts), (unsigned long long)(b % c->num_experts));
            break;
        }
    smoe_free(order);
    return rc;
}

/* ---------------------------------------------------- the embedding on disk (4.1, 2.7) */

/* Where a paged region may be and what it holds: exactly the untied embedding, the dense
 * region's tail, no other tensor in it; then its page checksums (2.7). */
static smoe_status parse_page_table(const uint8_t *d, smoe_layout *L) {
    if (!L->paged_bytes) return SMOE_OK;
    const uint64_t start = L->dense_bytes - L->paged_bytes;
    const smoe_tensor *E = L->embed;
    if (L->cfg.tie_word_embeddings)
        return smoe_fail(SMOE_ERR_VAULT, "header: paged_bytes %llu, but the embedding is tied to lm_head (a tied "
                         "embedding stays in memory)", (unsigned long long)L->paged_bytes);
    if (E->offset != start || E->nbytes > L->paged_bytes || L->paged_bytes - E->nbytes >= 64)
        return smoe_fail(SMOE_ERR_VAULT, "header: the paged region [%llu, +%llu) of the dense region must hold "
                         "embed_tokens exactly (it is [%llu, +%llu))", (unsigned long long)start,
                         (unsigned long long)L->paged_bytes, (unsigned long long)E->offset,
                         (unsigned long long)E->nbytes);
    for (uint32_t i = 0; i < L->n_tensors; i++) {
        const smoe_tensor *t = &L->tensors[i];
        char pn[40];
        if (t != E && t->offset + t->nbytes > start)
            return smoe_fail(SMOE_ERR_VAULT, "dense tensor '%s' reaches into the paged embedding (past byte %llu)",
                             printable(L->names[i], pn), (unsigned long long)start);
    }
    L->page_crc = smoe_alloc((size_t)L->n_pages * sizeof *L->page_crc, 64);
    if (!L->page_crc) return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate %u page checksums", L->n_pages);
    for (uint32_t k = 0; k < L->n_pages; k++) L->page_crc[k] = rd32(d + 4 * (size_t)k);
    if (!all_zero(d + 4 * (size_t)L->n_pages, (L->n_pages & 1) * 4u))
        return smoe_fail(SMOE_ERR_VAULT, "page checksums: padding not zero");
    return SMOE_OK;
}

/* ------------------------------------------------------------------ the tables in order */

static smoe_status parse_all(const uint8_t *b, size_t len, uint64_t real_size, smoe_layout *L) {
    smoe_status rc = parse_header(b, len, real_size, L);
    if (rc) return rc;
    const uint8_t *t = b + L->table_offset;
    const uint64_t tb = L->table_bytes;
    if ((rc = parse_config(t, &L->cfg))) return rc;
    smoe_config *c = &L->cfg;
    uint32_t nl = c->num_hidden_layers, ne = c->num_experts;
    const bool v3 = L->version >= 3;
    uint64_t pos = CONFIG_BYTES;

    /* 2.2 parameters (version 3) */
    uint32_t n_params = 0;
    if (v3) {
        if (tb - pos < PARAMS_HEAD_BYTES) return smoe_fail(SMOE_ERR_VAULT, "tables: no room for the parameter count");
        n_params = rd32(t + pos);
        if (rd32(t + pos + 4)) return smoe_fail(SMOE_ERR_VAULT, "parameters: reserved field not zero");
        pos += PARAMS_HEAD_BYTES;
        if (n_params > MAX_PARAMS || tb - pos < (uint64_t)n_params * PARAM_BYTES)
            return smoe_fail(SMOE_ERR_VAULT, "parameters: %u entries do not fit the tables (at most %u)", n_params,
                             MAX_PARAMS);
    }
    const uint8_t *params = t + pos;
    pos += (uint64_t)n_params * PARAM_BYTES;

    /* 2.3 layer kinds. Every count is checked against the table size before anything is
     * allocated from it. */
    uint64_t kinds_bytes = smoe_align_up(nl, 8);
    if (tb - pos < kinds_bytes)
        return smoe_fail(SMOE_ERR_VAULT, "tables: table_bytes %llu too small for %u layer kinds", (unsigned long long)tb, nl);
    const uint8_t *kinds = t + pos;
    pos += kinds_bytes;
    uint32_t n_sparse = 0;
    const uint8_t kind_mask = v3 ? 0x7 : 0x1;
    for (uint32_t l = 0; l < nl; l++) {
        if (kinds[l] & ~kind_mask || (kinds[l] >> 1) == 3)
            return smoe_fail(SMOE_ERR_VAULT, "layer kinds: layer %u has kind %u (%s)", l, kinds[l],
                             v3 ? "bit 0 sparse, bits 1-2 attention 0, 1 or 2" : "must be 0 or 1");
        n_sparse += kinds[l] & 1;
    }
    if (!all_zero(kinds + nl, kinds_bytes - nl)) return smoe_fail(SMOE_ERR_VAULT, "layer kinds: padding not zero");
    c->num_sparse_layers = n_sparse;
    if ((n_sparse == 0) != (L->blob_bytes == 0))
        return smoe_fail(SMOE_ERR_VAULT, "header: blob_bytes %llu with %u sparse layers (0 exactly when there are none)",
                         (unsigned long long)L->blob_bytes, n_sparse);
    if ((uint64_t)L->n_blobs != (uint64_t)nl * ne)
        return smoe_fail(SMOE_ERR_VAULT, "header: n_blobs %u, must be num_hidden_layers x num_experts = %llu", L->n_blobs,
                         (unsigned long long)nl * ne);

    L->layer_sparse = smoe_alloc(nl, 64);
    L->layer_attn = smoe_alloc(nl, 64);
    L->xl = smoe_alloc((size_t)nl * sizeof *L->xl, 64);
    L->layer_blob_bytes = smoe_alloc((size_t)nl * sizeof *L->layer_blob_bytes, 64);
    L->layers = smoe_alloc((size_t)nl * sizeof *L->layers, 64);
    if (!L->layer_sparse || !L->layer_attn || !L->xl || !L->layer_blob_bytes || !L->layers)
        return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate the vault's tables");
    memset(L->xl, 0, (size_t)nl * sizeof *L->xl);
    memset(L->layers, 0, (size_t)nl * sizeof *L->layers);
    for (uint32_t l = 0; l < nl; l++) {
        L->layer_sparse[l] = kinds[l] & 1;
        L->layer_attn[l] = kinds[l] >> 1;
    }
    if ((rc = parse_params(params, n_params, L))) return rc;

    /* 2.4 expert blob layouts */
    if (v3) {
        uint64_t used = 0;
        if ((rc = parse_expert_layouts_v3(t + pos, tb - pos, L, &used))) return rc;
        pos += used;
    } else {
        if (tb - pos < 3 * DESC_BYTES) return smoe_fail(SMOE_ERR_VAULT, "tables: no room for the expert layout");
        if ((rc = parse_expert_layout_v2(t + pos, L))) return rc;
        pos += 3 * DESC_BYTES;
    }
    summarise_experts(L);

    /* 2.5 dense tensors, 2.6 blob table */
    uint64_t want_tensors = wanted_tensors(L);
    if (L->n_tensors != want_tensors)
        return smoe_fail(SMOE_ERR_VAULT, "header: n_tensors %u, this %s vault has %llu dense tensors", L->n_tensors,
                         smoe_family_name(L->mp.family), (unsigned long long)want_tensors);
    const uint64_t page_table = smoe_align_up((uint64_t)L->n_pages * 4, 8);
    uint64_t want_table =
        pos + (uint64_t)L->n_tensors * DESC_BYTES + (uint64_t)L->n_blobs * BLOB_ENTRY_BYTES + page_table;
    if (tb != want_table)
        return smoe_fail(SMOE_ERR_VAULT, "header: table_bytes %llu, the tables it describes take %llu",
                         (unsigned long long)tb, (unsigned long long)want_table);

    L->tensors = smoe_alloc((size_t)L->n_tensors * sizeof *L->tensors, 64);
    L->names = smoe_alloc((size_t)L->n_tensors * sizeof *L->names, 64);
    L->blob_offset = smoe_alloc((size_t)L->n_blobs * sizeof *L->blob_offset, 64);
    L->blob_crc = smoe_alloc((size_t)L->n_blobs * sizeof *L->blob_crc, 64);
    if (!L->tensors || !L->names || !L->blob_offset || !L->blob_crc)
        return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate the vault's tables");

    const uint8_t *dense = t + pos;
    const uint8_t *blobs = dense + (size_t)L->n_tensors * DESC_BYTES;
    const uint8_t *pages = blobs + (size_t)L->n_blobs * BLOB_ENTRY_BYTES;
    if ((rc = parse_dense_table(dense, L)) || (rc = parse_blob_table(blobs, L))) return rc;
    return parse_page_table(pages, L);
}

smoe_status smoe_vault_parse(const uint8_t *bytes, size_t len, uint64_t file_size, smoe_layout *out) {
    if (!out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_vault_parse: out is NULL");
    memset(out, 0, sizeof *out);
    if (!bytes) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_vault_parse: bytes is NULL");
    smoe_status rc = parse_all(bytes, len, file_size, out);
    if (rc) smoe_layout_free(out);
    return rc;
}

/* ----------------------------------------------------------------------------------- I/O */

/* Exactly n bytes at off, or an error naming the file. */
static smoe_status read_exact(int fd, const char *path, void *buf, uint64_t n, uint64_t off) {
    int64_t got = smoe_pread_full(fd, buf, n, off);
    if (got < 0)
        return smoe_fail(SMOE_ERR_IO, "%s: read of %llu bytes at %llu failed: %s", path, (unsigned long long)n,
                         (unsigned long long)off, strerror(errno));
    if ((uint64_t)got < n)
        return smoe_fail(SMOE_ERR_IO, "%s: read of %llu bytes at %llu came back short (%lld): the file shrank", path,
                         (unsigned long long)n, (unsigned long long)off, (long long)got);
    return SMOE_OK;
}

static char *dup_str(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = smoe_alloc(na + nb + 1, 8);
    if (s) memcpy(s, a, na), memcpy(s + na, b, nb + 1);
    return s;
}

bool smoe_file_id_of(int fd, smoe_file_id *out) {
    struct stat st;
    if (fstat(fd, &st) != 0) return false;
    memset(out, 0, sizeof *out);
    out->dev = (uint64_t)st.st_dev;
    out->ino = (uint64_t)st.st_ino;
    out->size = (uint64_t)st.st_size;
#if defined(__APPLE__)
    out->mtime_s = (int64_t)st.st_mtimespec.tv_sec;
    out->mtime_ns = (int64_t)st.st_mtimespec.tv_nsec;
#else
    out->mtime_s = (int64_t)st.st_mtim.tv_sec;
    out->mtime_ns = (int64_t)st.st_mtim.tv_nsec;
#endif
    return true;
}

bool smoe_file_id_equal(const smoe_file_id *a, const smoe_file_id *b) {
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime_s == b->mtime_s &&
           a->mtime_ns == b->mtime_ns;
}

smoe_status smoe_vault_check_unchanged(const smoe_vault *v) {
    smoe_file_id now;
    if (!smoe_file_id_of(v->fd, &now)) return smoe_fail(SMOE_ERR_IO, "%s: stat failed: %s", v->path, strerror(errno));
    if (!smoe_file_id_equal(&now, &v->id))
        return smoe_fail(SMOE_ERR_VAULT, "%s: vault.bin changed since it was opened (rewritten in place); open the vault again",
                         v->path);
    return SMOE_OK;
}

/* ------------------------------------------------------------------------ the dense region
 *
 * Loaded and checksummed in one pass, by DENSE_LANES threads: thread i owns lane i of
 * smoe_checksum (util.c: the region in 4 parts, each CRC-32C'd apart) and reads its part in
 * DENSE_CHUNK requests, each CRC'd the moment it lands while the other threads' reads are in
 * flight, so the checksum costs no time of its own and the disk sees 4 large requests at once.
 * The reads use O_DIRECT where the file system takes it (Linux: the open file reopened through
 * /proc/self/fd; a read that fails with EINVAL falls back to the vault's buffered descriptor), so
 * the dense bytes do not also sit in the page cache. Lane i is [b[i], b[i+1]); thread i reads
 * [up(b[i]), up(b[i+1])) (up: to SMOE_PAGE, the last clipped to the buffer, a whole number of
 * pages), so the reads are disjoint and aligned; the start of its lane before up(b[i]) (less than
 * a page, in thread i−1's part) it reads again into a page of its own, for the CRC only. A small
 * region, or a thread that cannot be started, is read and checked serially. */

#define DENSE_LANES 4
#define DENSE_CHUNK (8u << 20)
#define DENSE_PARALLEL_MIN (64u << 10) /* every lane at least a page */

typedef struct {
    int fd_direct, fd_buffered;
    uint8_t *buf;
    uint64_t off, n, lo, hi, lane_lo, lane_hi; /* file offset of buf; region bytes; read range; lane */
    uint8_t *head;                            /* SMOE_PAGE bytes for the lane's start before lo */
    uint32_t crc;
    int err; /* 0, an errno, or −1 for a short read */
} dense_lane;

/* Reads [at, at + len) of the region into buf + at, Direct I/O first; 0, an errno or −1 (short). */
static int dense_read(dense_lane *d, uint8_t *dst, uint64_t at, uint64_t len, uint64_t need) {
    int64_t got = -1;
    if (d->fd_direct >= 0) {
        got = smoe_pread_full(d->fd_direct, dst, len, d->off + at);
        if (got < 0 && errno != EINVAL) return errno;
    }
    if (got < 0) got = smoe_pread_full(d->fd_buffered, dst, len, d->off + at);
    if (got < 0) return errno;
    return (uint64_t)got < need ? -1 : 0;
}

static void *dense_lane_main(void *arg) {
    dense_lane *d = arg;
    uint32_t crc = 0;
    if (d->lane_lo < d->lo) { /* the lane's first bytes, inside the previous lane's last page */
        const uint64_t page = d->lo - SMOE_PAGE;
        if ((d->err = dense_read(d, d->head, page, SMOE_PAGE, (d->lane_hi < d->lo ? d->lane_hi : d->lo) - page)))
            return NULL;
        const uint64_t end = d->lane_hi < d->lo ? d->lane_hi : d->lo;
        crc = smoe_crc32c(crc, d->head + (d->lane_lo - page), (size_t)(end - d->lane_lo));
    }
    for (uint64_t at = d->lo; at < d->hi; at += DENSE_CHUNK) {
        const uint64_t len = d->hi - at < DENSE_CHUNK ? d->hi - at : DENSE_CHUNK;
        const uint64_t need = d->n > at ? (d->n - at < len ? d->n - at : len) : 0;
        if ((d->err = dense_read(d, d->buf + at, at, len, need))) return NULL;
        const uint64_t a = at > d->lane_lo ? at : d->lane_lo, e = at + len < d->lane_hi ? at + len : d->lane_hi;
        if (e > a) crc = smoe_crc32c(crc, d->buf + a, (size_t)(e - a));
    }
    d->crc = crc;
    return NULL;
}

static int dense_open_direct(int fd) {
#if defined(__linux__) && defined(O_DIRECT)
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
    return open(self, O_RDONLY | O_DIRECT | O_CLOEXEC);
#else
    (void)fd;
    return -1;
#endif
}

/* Reads the dense region [off, off + n) into buf (a whole number of SMOE_PAGE pages) and its
 * smoe_checksum into *crc. */
/* The failure of a read of the dense region (n bytes at off): e an errno, or −1 (came back short). */
static smoe_status dense_read_failed(const char *path, uint64_t n, uint64_t off, int e) {
    if (e > 0)
        return smoe_fail(SMOE_ERR_IO, "%s: read of the dense region (%llu bytes at %llu) failed: %s", path,
                         (unsigned long long)n, (unsigned long long)off, strerror(e));
    return smoe_fail(SMOE_ERR_IO, "%s: read of the dense region (%llu bytes at %llu) came back short: the file shrank",
                     path, (unsigned long long)n, (unsigned long long)off);
}

static smoe_status load_dense(int fd, const char *path, uint8_t *buf, uint64_t off, uint64_t n, uint32_t *crc) {
    if (n >= DENSE_PARALLEL_MIN) {
        const uint64_t cap = smoe_align_up(n, SMOE_PAGE);
        uint64_t b[5];
        smoe_checksum_lanes(n, b);
        dense_lane d[DENSE_LANES];
        uint8_t *heads = smoe_alloc_untouched((size_t)DENSE_LANES * SMOE_PAGE, SMOE_PAGE);
        const int fdd = heads ? dense_open_direct(fd) : -1;
        pthread_t th[DENSE_LANES];
        int started = 0;
        for (int i = 0; heads && i < DENSE_LANES; i++) {
            const uint64_t lo = smoe_align_up(b[i], SMOE_PAGE), hi = smoe_align_up(b[i + 1], SMOE_PAGE);
            d[i] = (dense_lane){fdd, fd, buf, off, n, lo, hi < cap ? hi : cap, b[i], b[i + 1],
                                heads + (size_t)i * SMOE_PAGE, 0, 0};
            if (smoe_thread_start(&th[i], "smoe-dense", 0, dense_lane_main, &d[i]) != 0) break;
            started++;
        }
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        if (fdd >= 0) close(fdd);
        smoe_free(heads);
        if (started == DENSE_LANES) {
            uint32_t c[DENSE_LANES];
            for (int i = 0; i < DENSE_LANES; i++) {
                if (d[i].err) return dense_read_failed(path, n, off, d[i].err);
                c[i] = d[i].crc;
            }
            *crc = smoe_checksum_combine(c);
            return SMOE_OK;
        }
        /* a thread could not be started: the serial read below */
    }
    smoe_status rc = read_exact(fd, path, buf, n, off);
    if (rc) return rc;
    *crc = smoe_checksum(buf, n);
    return SMOE_OK;
}

/* ---------------------------------------------------------------- a deferred lm_head
 *
 * lm_head is used by the logits alone, at the end of a pass; for a large vocabulary it is also
 * the largest dense tensor (a3b's: 315 MiB, two thirds of what stays in memory once the embedding
 * is paged). So an untied lm_head of at least DEFER_MIN bytes (SMOE_DENSE_DEFER_MIN in the
 * environment overrides it) is read by a thread of the vault's own once open has read the rest,
 * beside the first pass's work, into its place in the dense region; then dense_crc is checked over
 * the whole loaded region in memory (smoe_checksum: the same value open computes). Every pass
 * waits for that (smoe_vault_dense_ready) before its logits and before it ends, so no result of
 * unchecked weights leaves the library: a mismatch fails that pass (the position where it was)
 * and every later one, as it would have failed the open. */

#define DEFER_MIN (16u << 20)

typedef struct {
    int fd_direct, fd_buffered;
    uint8_t *buf;
    uint64_t off, n;     /* the region's file offset and loaded bytes */
    const uint64_t (*span)[2];
    uint32_t n_span;
    _Atomic uint64_t next; /* the next DENSE_CHUNK over the spans, counted through them */
    int err;
} dense_spans;

/* Reads whole DENSE_CHUNKs of the spans (page-aligned [a, b) of the region) until none is left;
 * several threads may run it on one dense_spans. */
static void *dense_spans_main(void *arg) {
    dense_spans *d = arg;
    for (;;) {
        uint64_t k = atomic_fetch_add(&d->next, 1), at = 0, len = 0;
        for (uint32_t i = 0; i < d->n_span; i++) {
            const uint64_t chunks = (d->span[i][1] - d->span[i][0] + DENSE_CHUNK - 1) / DENSE_CHUNK;
            if (k < chunks) {
                at = d->span[i][0] + k * DENSE_CHUNK;
                len = d->span[i][1] - at < DENSE_CHUNK ? d->span[i][1] - at : DENSE_CHUNK;
                break;
            }
            k -= chunks;
        }
        if (len == 0) return NULL;
        dense_lane r = {d->fd_direct, d->fd_buffered, d->buf, d->off, d->n, 0, 0, 0, 0, NULL, 0, 0};
        const uint64_t need = d->n > at ? (d->n - at < len ? d->n - at : len) : 0;
        const int e = dense_read(&r, d->buf + at, at, len, need);
        if (e) {
            d->err = e;
            return NULL;
        }
    }
}

/* Reads the spans with `threads` threads (1: this one); 0, an errno or −1 (short). */
static int read_spans(int fd, uint8_t *buf, uint64_t off, uint64_t n, const uint64_t (*span)[2], uint32_t n_span,
                      int threads) {
    dense_spans d = {dense_open_direct(fd), fd, buf, off, n, span, n_span, 0, 0};
    pthread_t th[DENSE_LANES];
    int started = 0;
    for (int i = 1; i < threads && i <= DENSE_LANES; i++)
        if (smoe_thread_start(&th[started], "smoe-dense", 0, dense_spans_main, &d) == 0) started++;
    dense_spans_main(&d);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (d.fd_direct >= 0) close(d.fd_direct);
    return d.err;
}

static void dense_settle(smoe_vault *v, smoe_status err, const char *msg) {
    smoe_memory_promised(-(int64_t)(v->defer_hi - v->defer_lo)); /* its pages are in (or never will be) */
    pthread_mutex_lock(&v->dense_mu);
    v->dense_err = err;
    if (err) snprintf(v->dense_msg, sizeof v->dense_msg, "%s", msg);
    atomic_store(&v->dense_state, err ? -1 : 1);
    pthread_cond_broadcast(&v->dense_cv);
    pthread_mutex_unlock(&v->dense_mu);
}

static void *deferred_main(void *arg) {
    smoe_vault *v = arg;
    const smoe_layout *L = &v->lay;
    const uint64_t n = L->dense_bytes - L->paged_bytes, span[1][2] = {{v->defer_lo, v->defer_hi}};
    const int e = read_spans(v->fd, v->dense, L->dense_offset, n, span, 1, 1);
    char msg[512];
    if (e) {
        snprintf(msg, sizeof msg, e > 0 ? "%s: read of lm_head (%llu bytes of the dense region at %llu) failed: %s"
                                        : "%s: read of lm_head (%llu bytes of the dense region at %llu) came back "
                                          "short: the file shrank%s",
                 v->path, (unsigned long long)(v->defer_hi - v->defer_lo), (unsigned long long)v->defer_lo,
                 e > 0 ? strerror(e) : "");
        dense_settle(v, SMOE_ERR_IO, msg);
        return NULL;
    }
    const uint32_t crc = smoe_checksum(v->dense, n);
    if (crc != L->dense_crc) {
        snprintf(msg, sizeof msg, "%s: dense region checksum mismatch (computed %08x, header says %08x)", v->path, crc,
                 L->dense_crc);
        dense_settle(v, SMOE_ERR_VAULT, msg);
        return NULL;
    }
    dense_settle(v, SMOE_OK, NULL);
    return NULL;
}

smoe_status smoe_vault_dense_ready(smoe_vault *v) {
    int state = atomic_load(&v->dense_state);
    if (state == 0 && v->pid != smoe_process_id()) /* forked while dense_th read: it is not here */
        return smoe_fail(SMOE_ERR_INVALID_ARG,
                         "the vault was opened in process %d, which forked this one (%d) while the vault was still "
                         "reading lm_head in a thread the fork did not copy: open the vault again in this process",
                         v->pid, smoe_process_id());
    if (state == 0) {
        pthread_mutex_lock(&v->dense_mu);
        while ((state = atomic_load(&v->dense_state)) == 0) pthread_cond_wait(&v->dense_cv, &v->dense_mu);
        pthread_mutex_unlock(&v->dense_mu);
    }
    return state > 0 ? SMOE_OK : smoe_fail(v->dense_err, "%s", v->dense_msg);
}

/* The bytes of lm_head that open leaves to deferred_main ([lo, hi) of the region, whole pages),
 * or false: tied, small, or a region too small to split. */
static bool defer_span(const smoe_layout *L, uint64_t *lo, uint64_t *hi) {
    const uint64_t n = L->dense_bytes - L->paged_bytes, cap = smoe_align_up(n, SMOE_PAGE);
    const smoe_tensor *H = L->lm_head;
    uint64_t min = DEFER_MIN;
    const char *env = getenv("SMOE_DENSE_DEFER_MIN");
    if (env && *env) min = strtoull(env, NULL, 10);
    if (L->cfg.tie_word_embeddings || H->nbytes < min || n < DENSE_PARALLEL_MIN) return false;
    *lo = H->offset / SMOE_PAGE * SMOE_PAGE;
    *hi = smoe_align_up(H->offset + H->nbytes, SMOE_PAGE);
    if (*hi > cap) *hi = cap;
    return *hi > *lo;
}

/* The whole of open once the file is open: header, tables, dense region. */
static smoe_status load(smoe_vault *v, int fd) {
    const char *path = v->path;
    if (!smoe_file_id_of(fd, &v->id)) return smoe_fail(SMOE_ERR_IO, "%s: stat failed: %s", path, strerror(errno));
    uint64_t size = v->id.size;
    uint8_t head[HEADER_BYTES];
    uint64_t n = size < HEADER_BYTES ? size : HEADER_BYTES;
    smoe_status rc = read_exact(fd, path, head, n, 0);
    if (rc) return rc;
    if (size == 0) return smoe_fail(SMOE_ERR_VAULT, "%s is empty: not a pysmoe vault", path);
    if (memcmp(head, MAGIC, n < 8 ? n : 8))
        return smoe_fail(SMOE_ERR_VAULT, "%s is not a pysmoe vault (bad magic)", path);
    if (size < HEADER_BYTES)
        return smoe_fail(SMOE_ERR_VAULT, "%s is truncated: %llu bytes, the header alone is %u", path,
                         (unsigned long long)size, HEADER_BYTES);
    uint64_t need = smoe_vault_head_bytes(head);
    uint8_t *tables = NULL;
    if (need == 0) {
        rc = smoe_vault_parse(head, HEADER_BYTES, size, &v->lay); /* says what is wrong */
        if (rc == SMOE_OK) rc = smoe_fail(SMOE_ERR_INTERNAL, "header rejected without a reason");
    } else if (need > size) {
        rc = smoe_fail(SMOE_ERR_VAULT, "truncated: the file is %llu bytes, its header and tables need %llu",
                       (unsigned long long)size, (unsigned long long)need);
    } else if (!(tables = smoe_alloc(need, 64))) {
        rc = smoe_fail(SMOE_ERR_NOMEM, "cannot allocate %llu bytes for the tables", (unsigned long long)need);
    } else if ((rc = read_exact(fd, path, tables, need, 0)) == SMOE_OK) {
        rc = smoe_vault_parse(tables, need, size, &v->lay);
    }
    smoe_free(tables);
    if (rc) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", smoe_last_error());
        if (strncmp(msg, path, strlen(path))) return smoe_fail(rc, "%s: %s", path, msg);
        return rc;
    }

    const smoe_layout *L = &v->lay;
    /* untouched: every byte is read over before use (the pages come in as the reads land); a
     * whole number of pages, so the last Direct I/O request ends inside the buffer. Small pages:
     * huge ones here made decode faster but a cold first pass slower on the Xeon's VM (the cache's
     * slots take them: smoe_alloc_huge says why) */
    v->dense = smoe_alloc_untouched(smoe_align_up(L->dense_bytes ? L->dense_bytes : 1, SMOE_PAGE), SMOE_PAGE);
    if (!v->dense)
        return smoe_fail(SMOE_ERR_NOMEM, "%s: cannot allocate %llu bytes for the dense weights", path,
                         (unsigned long long)L->dense_bytes);
    for (uint32_t i = 0; i < L->n_tensors; i++)
        if (!L->paged_bytes || &L->tensors[i] != L->embed) v->lay.tensors[i].data = v->dense + L->tensors[i].offset;
    /* A paged embedding (the region's tail, 4.1) stays on disk: its pages of the buffer are never touched */
    const uint64_t held = L->dense_bytes - L->paged_bytes, cap = smoe_align_up(held, SMOE_PAGE);
    uint64_t lo, hi;
    if (defer_span(L, &lo, &hi)) {
        /* all but lm_head now, in parallel; lm_head and the checksum by deferred_main */
        const uint64_t span[2][2] = {{0, lo}, {hi, cap}};
        const int e = read_spans(fd, v->dense, L->dense_offset, held, span, 2, DENSE_LANES);
        if (e) return dense_read_failed(path, held, L->dense_offset, e);
        v->defer_lo = lo, v->defer_hi = hi;
        smoe_memory_promised((int64_t)(hi - lo)); /* until dense_settle: not free for a cache sized now */
        if (smoe_thread_start(&v->dense_th, "smoe-dense", 0, deferred_main, v) == 0) {
            v->dense_th_live = true;
            return SMOE_OK;
        }
        deferred_main(v); /* no thread: read it here */
        return smoe_vault_dense_ready(v);
    }
    uint32_t crc = 0;
    if ((rc = load_dense(fd, path, v->dense, L->dense_offset, held, &crc))) return rc;
    if (crc != L->dense_crc)
        return smoe_fail(SMOE_ERR_VAULT, "%s: dense region checksum mismatch (computed %08x, header says %08x)", path, crc,
                         L->dense_crc);
    atomic_store(&v->dense_state, 1);
    return SMOE_OK;
}

smoe_status smoe_open_vault(const char *dir, smoe_vault **out) {
    smoe_status isa = smoe_cpu_check(); /* first: before any code that may use AVX2 (cpu.c) */
    if (isa != SMOE_OK) {
        if (out) *out = NULL;
        return isa;
    }
    if (!out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_open_vault: out is NULL");
    *out = NULL;
    if (!dir) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_open_vault: dir is NULL");
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return smoe_fail(SMOE_ERR_VAULT, "no vault at %s: no such directory", dir);
        return smoe_fail(SMOE_ERR_IO, "no vault at %s: %s", dir, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) return smoe_fail(SMOE_ERR_VAULT, "no vault at %s: not a directory", dir);

    smoe_vault *v = smoe_alloc(sizeof *v, 64);
    if (!v) return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate a vault");
    v->fd = -1;
    if (pthread_mutex_init(&v->paged_mu, NULL) != 0) {
        smoe_free(v);
        return smoe_fail(SMOE_ERR_NOMEM, "cannot create a vault's lock");
    }
    if (pthread_mutex_init(&v->dense_mu, NULL) != 0) {
        pthread_mutex_destroy(&v->paged_mu);
        smoe_free(v);
        return smoe_fail(SMOE_ERR_NOMEM, "cannot create a vault's lock");
    }
    if (pthread_cond_init(&v->dense_cv, NULL) != 0) {
        pthread_mutex_destroy(&v->dense_mu);
        pthread_mutex_destroy(&v->paged_mu);
        smoe_free(v);
        return smoe_fail(SMOE_ERR_NOMEM, "cannot create a vault's lock");
    }
    atomic_init(&v->dense_state, 0);
    atomic_init(&v->paged_loaded, false);
    v->pid = smoe_process_id();
    v->dir = dup_str(dir, "");
    v->path = dup_str(dir, "/vault.bin");
    if (!v->dir || !v->path) {
        smoe_close_vault(v);
        return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate a vault");
    }
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. Nothing is read
     * before fstat says the file is a regular one; the flag is then cleared. */
    v->fd = open(v->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (v->fd < 0) {
        int e = errno;
        smoe_status rc = e == ENOENT ? smoe_fail(SMOE_ERR_VAULT, "no vault at %s: it has no vault.bin", dir)
                                     : smoe_fail(SMOE_ERR_IO, "cannot open %s: %s", v->path, strerror(e));
        smoe_close_vault(v);
        return rc;
    }
    struct stat fst;
    smoe_status rc = SMOE_OK;
    if (fstat(v->fd, &fst) != 0) rc = smoe_fail(SMOE_ERR_IO, "%s: stat failed: %s", v->path, strerror(errno));
    else if (!S_ISREG(fst.st_mode))
        rc = smoe_fail(SMOE_ERR_VAULT, "%s is not a regular file (a FIFO, device or socket); not a pysmoe vault",
                       v->path);
    else if (fcntl(v->fd, F_SETFL, fcntl(v->fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = smoe_fail(SMOE_ERR_IO, "%s: fcntl failed: %s", v->path, strerror(errno));
    if (rc == SMOE_OK) rc = load(v, v->fd);
    if (rc) {
        smoe_close_vault(v);
        return rc;
    }
    smoe_log(SMOE_LOG_INFO,
             "opened %s: %u layers (%u sparse), %u experts, %.1f MiB dense (%.1f MiB of embedding on disk), %.1f MiB "
             "per blob", v->path, v->lay.cfg.num_hidden_layers, v->lay.cfg.num_sparse_layers, v->lay.cfg.num_experts,
             (double)(v->lay.dense_bytes - v->lay.paged_bytes) / (1 << 20), (double)v->lay.paged_bytes / (1 << 20),
             (double)v->lay.blob_bytes / (1 << 20));
    *out = v;
    return SMOE_OK;
}

void smoe_close_vault(smoe_vault *v) {
    if (!v) return;
    /* it reads through v->fd into v->dense; in a forked child it is the parent's, not here */
    if (v->dense_th_live && v->pid == smoe_process_id()) pthread_join(v->dense_th, NULL);
    if (v->fd >= 0) close(v->fd);
    pthread_cond_destroy(&v->dense_cv);
    pthread_mutex_destroy(&v->dense_mu);
    pthread_mutex_destroy(&v->paged_mu);
    smoe_free(v->dense);
    smoe_layout_free(&v->lay);
    smoe_free(v->path);
    smoe_free(v->dir);
    smoe_free(v);
}

smoe_status smoe_vault_config(const smoe_vault *v, smoe_config *out) {
    if (!v || !out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_vault_config: NULL argument");
    uint32_t size = out->struct_size;
    if (size < sizeof(uint32_t))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_vault_config: set out->struct_size to sizeof(smoe_config)");
    /* A caller built against an older header gets the prefix it knows; a newer one keeps the
     * fields this library does not know about. */
    smoe_config c = v->lay.cfg;
    c.dense_bytes = v->lay.dense_bytes - v->lay.paged_bytes;
    c.paged_bytes = v->lay.paged_bytes;
    c.blob_bytes = v->lay.blob_bytes;
    c.file_bytes = v->lay.file_size;
    memcpy(out, &c, size < sizeof c ? size : sizeof c);
    out->struct_size = size;
    return SMOE_OK;
}

smoe_status smoe_vault_layer_is_sparse(const smoe_vault *v, uint32_t layer, bool *out) {
    if (!v || !out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_vault_layer_is_sparse: NULL argument");
    if (layer >= v->lay.cfg.num_hidden_layers)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "layer %u out of range (the vault has %u)", layer,
                         v->lay.cfg.num_hidden_layers);
    *out = v->lay.layer_sparse[layer];
    return SMOE_OK;
}

/* ------------------------------------------------------------------- the embedding on disk
 *
 * A paged embedding (4.1) is read a row at a time: each of the row's parts (a q8/q4 row's codes,
 * scales and biases; any other format's one run of bytes) from the pages that hold it, each page
 * read whole and checked against its checksum before a byte of it is used, and the parts copied
 * into an image of a one-row tensor that smoe_dequant_row reads as it reads any tensor. */

typedef struct {
    const smoe_vault *v;
    uint8_t *page; /* page_bytes */
    int64_t held;  /* the page in it, −1: none */
} page_reader;

/* The paged region's file offset. */
static uint64_t paged_start(const smoe_layout *L) { return L->dense_offset + (L->dense_bytes - L->paged_bytes); }

/* Page k of the paged region into dst (page_bytes, the last page shorter), checked. */
static smoe_status read_page(const smoe_vault *v, uint64_t k, uint8_t *dst) {
    const smoe_layout *L = &v->lay;
    const uint64_t at = k * L->page_bytes, len = L->paged_bytes - at < L->page_bytes ? L->paged_bytes - at
                                                                                  : L->page_bytes;
    const uint64_t off = paged_start(L) + at;
    smoe_status rc = read_exact(v->fd, v->path, dst, len, off);
    if (rc == SMOE_OK && smoe_checksum(dst, len) != L->page_crc[k])
        rc = smoe_fail(SMOE_ERR_IO, "%s: the embedding's page %llu (%llu bytes at %llu) fails its checksum: the file "
                       "is damaged (`pysmoe verify` lists what is)", v->path, (unsigned long long)k,
                       (unsigned long long)len, (unsigned long long)off);
    return rc;
}

static smoe_status page_get(page_reader *r, uint64_t k) {
    if (r->held == (int64_t)k) return SMOE_OK;
    r->held = -1;
    smoe_status rc = read_page(r->v, k, r->page);
    if (rc == SMOE_OK) r->held = (int64_t)k;
    return rc;
}

/* Bytes [at, at + n) of the paged region into dst, page by page. */
static smoe_status paged_copy(page_reader *r, uint64_t at, uint64_t n, uint8_t *dst) {
    const uint32_t pb = r->v->lay.page_bytes;
    while (n) {
        const uint64_t k = at / pb, in = at % pb, take = pb - in < n ? pb - in : n;
        smoe_status rc = page_get(r, k);
        if (rc) return rc;
        memcpy(dst, r->page + in, (size_t)take);
        dst += take, at += take, n -= take;
    }
    return SMOE_OK;
}

/* Where rows [r0, r0 + n) of the paged embedding lie in the paged region: the spans of its parts
 * (a q8/q4 tensor's codes, scales and biases; any other format's one run of bytes); how many. */
static uint32_t paged_spans(const smoe_tensor *E, uint32_t r0, uint32_t n, uint64_t at[3], uint64_t len[3]) {
    if (!is_quant(E->format)) { /* rows of whole elements or blocks, back to back */
        const uint64_t rb = E->nbytes / E->rows;
        at[0] = (uint64_t)r0 * rb, len[0] = (uint64_t)n * rb;
        return 1;
    }
    const uint64_t cb = E->format == SMOE_FMT_Q8 ? E->cols : E->cols / 2;
    const uint64_t sb = scale_part_bytes(E->scale_format, E->group, 1, E->cols);
    at[0] = (uint64_t)r0 * cb, len[0] = (uint64_t)n * cb;
    at[1] = E->scales_off + (uint64_t)r0 * sb, len[1] = (uint64_t)n * sb;
    at[2] = E->biases_off + (uint64_t)r0 * sb, len[2] = (uint64_t)n * sb;
    return 3;
}

/* Rows [r0, r0 + n) of the paged embedding as an n-row tensor *slice (same format) at image
 * (slice->nbytes bytes). */
static smoe_status paged_rows(page_reader *r, uint32_t r0, uint32_t n, smoe_tensor *slice, uint8_t *image) {
    const smoe_tensor *E = r->v->lay.embed;
    if (!tensor_init(slice, E->format, E->scale_format, E->group, n, E->cols))
        return smoe_fail(SMOE_ERR_INTERNAL, "a slice of the embedding has no size");
    uint64_t at[3], len[3];
    const uint32_t parts = paged_spans(E, r0, n, at, len);
    uint8_t *dst[3] = {image, image + slice->scales_off, image + slice->biases_off};
    smoe_status rc = SMOE_OK;
    for (uint32_t i = 0; i < parts && rc == SMOE_OK; i++) rc = paged_copy(r, at[i], len[i], dst[i]);
    return rc;
}

void smoe_vault_embed_prefetch(const smoe_vault *v, const int32_t *ids, uint32_t n) {
#ifdef POSIX_FADV_WILLNEED
    const smoe_layout *L = &v->lay;
    if (!L->paged_bytes) return;
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= L->embed->rows) continue; /* smoe_vault_embed_row refuses it */
        uint64_t at[3], len[3];
        const uint32_t parts = paged_spans(L->embed, (uint32_t)ids[i], 1, at, len);
        for (uint32_t j = 0; j < parts; j++)
            (void)posix_fadvise(v->fd, (off_t)(paged_start(L) + at[j]), (off_t)len[j], POSIX_FADV_WILLNEED);
    }
#else
    (void)v, (void)ids, (void)n;
#endif
}

uint64_t smoe_vault_row_scratch_bytes(const smoe_layout *L) {
    if (!L->paged_bytes) return 0;
    const smoe_tensor *E = L->embed;
    return L->page_bytes + smoe_tensor_bytes(E->format, E->scale_format, E->group, 1, E->cols);
}

smoe_status smoe_vault_embed_row(const smoe_vault *v, uint32_t row, uint8_t *scratch, float *out) {
    const smoe_layout *L = &v->lay;
    if (!L->paged_bytes) return smoe_fail(SMOE_ERR_INTERNAL, "smoe_vault_embed_row: the embedding is in memory");
    if (row >= L->embed->rows)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "token id %u out of range (vocabulary %u)", row, L->embed->rows);
    page_reader r = {v, scratch, -1};
    smoe_tensor one;
    uint8_t *image = scratch + L->page_bytes;
    smoe_status rc = paged_rows(&r, row, 1, &one, image);
    if (rc) return rc;
    smoe_dequant_row(&one, image, 0, out);
    return SMOE_OK;
}

smoe_status smoe_vault_load_paged(smoe_vault *v) {
    smoe_layout *L = &v->lay;
    if (!L->paged_bytes) return SMOE_OK;
    smoe_status rc = SMOE_OK;
    pthread_mutex_lock(&v->paged_mu);
    if (!atomic_load(&v->paged_loaded)) {
        uint8_t *base = v->dense + (L->dense_bytes - L->paged_bytes);
        for (uint32_t k = 0; k < L->n_pages && rc == SMOE_OK; k++) /* each page in place, checked */
            rc = read_page(v, k, base + (uint64_t)k * L->page_bytes);
        if (rc == SMOE_OK) {
            L->tensors[L->embed - L->tensors].data = base;
            atomic_store(&v->paged_loaded, true);
        }
    }
    pthread_mutex_unlock(&v->paged_mu);
    return rc;
}

uint64_t smoe_vault_resident_bytes(const smoe_vault *v) {
    return v->lay.dense_bytes - (atomic_load(&v->paged_loaded) ? 0 : v->lay.paged_bytes);
}

/* ---------------------------------------------------------------------------------- verify */

typedef struct {
    smoe_verify_fn fn;
    void *user;
    uint32_t bad;
    const char *path;
} verify_ctx;

static void report(verify_ctx *x, const char *kind, int32_t layer, int32_t expert, const char *why) {
    x->bad++;
    if (layer >= 0) smoe_log(SMOE_LOG_WARN, "%s: %s (layer %d, expert %d): %s", x->path, kind, layer, expert, why);
    else smoe_log(SMOE_LOG_WARN, "%s: %s: %s", x->path, kind, why);
    if (x->fn) x->fn(kind, layer, expert, why, x->user);
}

/* Continues the CRC-32C *crc over the file's bytes [off, off + n), read in VERIFY_CHUNK pieces,
 * with header_crc's 4 bytes read as zero; *short_read set if the file ends early. */
static smoe_status crc_range(int fd, const char *path, uint8_t *buf, uint64_t off, uint64_t n, uint32_t *crc,
                             bool *short_read) {
    *short_read = false;
    for (uint64_t done = 0; done < n;) {
        uint64_t want = n - done < VERIFY_CHUNK ? n - done : VERIFY_CHUNK, at = off + done;
        int64_t got = smoe_pread_full(fd, buf, want, at);
        if (got < 0)
            return smoe_fail(SMOE_ERR_IO, "%s: read at %llu failed: %s", path, (unsigned long long)at, strerror(errno));
        for (uint64_t i = HEADER_CRC_AT; i < HEADER_CRC_AT + 4; i++)
            if (i >= at && i < at + (uint64_t)got) buf[i - at] = 0;
        *crc = smoe_crc32c(*crc, buf, (size_t)got);
        if ((uint64_t)got < want) {
            *short_read = true;
            return SMOE_OK;
        }
        done += want;
    }
    return SMOE_OK;
}

/* smoe_checksum of the file's bytes [off, off + n) (header_crc read as zero), lane by lane. */
static smoe_status checksum_range(int fd, const char *path, uint8_t *buf, uint64_t off, uint64_t n, uint32_t *sum,
                                  bool *short_read) {
    uint64_t lane[5];
    uint32_t c[4];
    smoe_checksum_lanes(n, lane);
    for (int i = 0; i < 4; i++) {
        c[i] = 0;
        smoe_status rc = crc_range(fd, path, buf, off + lane[i], lane[i + 1] - lane[i], &c[i], short_read);
        if (rc || *short_read) return rc;
    }
    *sum = smoe_checksum_combine(c);
    return SMOE_OK;
}

/* Values among count scales or biases of this format that are NaN or infinite (all exponent
 * bits set), and the index of the first. */
static uint64_t count_nonfinite(const uint8_t *p, uint64_t count, uint8_t scale_format, uint64_t *first) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < count; i++) {
        bool inf_nan;
        if (scale_format == SMOE_SCALE_F32) inf_nan = (rd32(p + 4 * i) & 0x7F800000u) == 0x7F800000u;
        else if (scale_format == SMOE_SCALE_F16) inf_nan = (rd16(p + 2 * i) & 0x7C00u) == 0x7C00u;
        else inf_nan = (rd16(p + 2 * i) & 0x7F80u) == 0x7F80u; /* bf16 */
        if (inf_nan && bad++ == 0) *first = i;
    }
    return bad;
}

/* The bits of the f16 scales of a GGML block at blk (d, and dmin where it has one) into h; how
 * many. None for F16 (values, not scales) and MXFP4 (its e8m0 scale is always finite). */
static int ggml_scales(uint8_t format, const uint8_t *blk, uint16_t h[2]) {
    int at[2] = {-1, -1};
    switch (format) {
    case SMOE_FMT_GGML_Q4_0:
    case SMOE_FMT_GGML_Q5_0:
    case SMOE_FMT_GGML_Q8_0:
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_IQ4_XS:
    case SMOE_FMT_GGML_IQ2_XXS:
    case SMOE_FMT_GGML_IQ2_XS:
    case SMOE_FMT_GGML_IQ2_S:
    case SMOE_FMT_GGML_IQ3_XXS:
    case SMOE_FMT_GGML_IQ3_S:
    case SMOE_FMT_GGML_IQ1_S: at[0] = 0; break;
    case SMOE_FMT_GGML_Q4_1:
    case SMOE_FMT_GGML_Q5_1:
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K: at[0] = 0, at[1] = 2; break;
    case SMOE_FMT_GGML_Q2_K: at[0] = 80, at[1] = 82; break;
    case SMOE_FMT_GGML_Q3_K: at[0] = 108; break;
    case SMOE_FMT_GGML_Q6_K: at[0] = 208; break;
    case SMOE_FMT_GGML_IQ1_M: h[0] = smoe_ggml_iq1m_d(blk); return 1; /* spread over four words */
    }
    int n = 0;
    for (int k = 0; k < 2; k++)
        if (at[k] >= 0) h[n++] = rd16(blk + at[k]);
    return n;
}

/* Reports a GGML tensor (t's bytes at base) with an inf or NaN among its blocks' f16 scales. */
static void check_ggml_values(verify_ctx *x, const smoe_tensor *t, const uint8_t *base, const char *name,
                              int32_t layer, int32_t expert, uint64_t row0) {
    uint32_t bs, ts;
    if (!smoe_ggml_block(t->format, &bs, &ts)) return;
    const uint64_t bpr = t->cols / bs, blocks = (uint64_t)t->rows * bpr;
    uint64_t bad = 0, first = 0;
    for (uint64_t b = 0; b < blocks; b++) {
        uint16_t h[2];
        const int n = ggml_scales(t->format, base + b * ts, h);
        for (int k = 0; k < n; k++)
            if ((h[k] & 0x7C00u) == 0x7C00u && bad++ == 0) first = b;
    }
    if (!bad) return;
    char why[160];
    snprintf(why, sizeof why, "%s scales: %llu non-finite value(s) (NaN or inf), the first at row %llu, block %llu",
             name, (unsigned long long)bad, (unsigned long long)(row0 + first / bpr), (unsigned long long)(first % bpr));
    report(x, "values", layer, expert, why);
}

/* Reports a quantised tensor whose scales or biases (t's bytes at base) are not all finite; t
 * may be a slice of rows from row0 on (the report counts rows from there). */
static void check_values_from(verify_ctx *x, const smoe_tensor *t, const uint8_t *base, const char *name,
                              int32_t layer, int32_t expert, uint64_t row0) {
    if (!is_quant(t->format)) {
        check_ggml_values(x, t, base, name, layer, expert, row0);
        return;
    }
    uint64_t gpr = t->cols / t->group, count = (uint64_t)t->rows * gpr;
    static const char *const part_name[2] = {"scales", "biases"};
    const uint64_t part_off[2] = {t->scales_off, t->biases_off};
    for (int k = 0; k < 2; k++) {
        uint64_t first = 0, bad = count_nonfinite(base + part_off[k], count, t->scale_format, &first);
        if (!bad) continue;
        char why[160];
        snprintf(why, sizeof why, "%s %s: %llu non-finite value(s) (NaN or inf), the first at row %llu, group %llu",
                 name, part_name[k], (unsigned long long)bad, (unsigned long long)(row0 + first / gpr),
                 (unsigned long long)(first % gpr));
        report(x, "values", layer, expert, why);
    }
}

static void check_values(verify_ctx *x, const smoe_tensor *t, const uint8_t *base, const char *name, int32_t layer,
                         int32_t expert) {
    check_values_from(x, t, base, name, layer, expert, 0);
}

/* A paged embedding: every page against its checksum, then its values slice by slice (rows read
 * as a session reads them; only when every page is sound). buf: VERIFY_CHUNK bytes at least. */
static smoe_status verify_paged(const smoe_vault *v, uint8_t *buf, uint64_t buf_bytes, verify_ctx *x) {
    const smoe_layout *L = &v->lay;
    if (!L->paged_bytes) return SMOE_OK;
    const uint64_t base = paged_start(L);
    uint32_t bad = 0;
    for (uint32_t k = 0; k < L->n_pages;) {
        /* as many whole pages as buf holds in one read */
        const uint32_t per = (uint32_t)(buf_bytes / L->page_bytes);
        const uint32_t m = L->n_pages - k < per ? L->n_pages - k : per;
        const uint64_t at = (uint64_t)k * L->page_bytes;
        const uint64_t want = L->paged_bytes - at < (uint64_t)m * L->page_bytes ? L->paged_bytes - at
                                                                                : (uint64_t)m * L->page_bytes;
        int64_t got = smoe_pread_full(v->fd, buf, want, base + at);
        if (got < 0)
            return smoe_fail(SMOE_ERR_IO, "%s: read at %llu failed: %s", x->path, (unsigned long long)(base + at),
                             strerror(errno));
        for (uint32_t j = 0; j < m; j++) {
            const uint64_t lo = (uint64_t)j * L->page_bytes;
            const uint64_t len = want - lo < L->page_bytes ? want - lo : L->page_bytes;
            char why[96];
            if ((uint64_t)got < lo + len) snprintf(why, sizeof why, "page %u: cut short by the end of the file", k + j);
            else if (smoe_checksum(buf + lo, len) != L->page_crc[k + j])
                snprintf(why, sizeof why, "page %u: checksum mismatch", k + j);
            else continue;
            bad++;
            report(x, "embedding", -1, -1, why);
        }
        k += m;
    }
    if (bad) return SMOE_OK;
    const smoe_tensor *E = L->embed;
    const uint64_t row_bytes = smoe_tensor_bytes(E->format, E->scale_format, E->group, 1, E->cols);
    uint64_t per = (buf_bytes - L->page_bytes) / (row_bytes + 192); /* a slice's parts each padded to 64 */
    if (per == 0) per = 1;
    page_reader r = {v, buf, -1};
    for (uint32_t r0 = 0; r0 < E->rows;) {
        const uint32_t n = E->rows - r0 < per ? E->rows - r0 : (uint32_t)per;
        smoe_tensor slice;
        smoe_status rc = paged_rows(&r, r0, n, &slice, buf + L->page_bytes);
        if (rc) return rc;
        check_values_from(x, &slice, buf + L->page_bytes, "embed_tokens", -1, -1, r0);
        r0 += n;
    }
    return SMOE_OK;
}

/* Every blob, read a run of whole blobs at a time (buf holds at least one): its checksum and its
 * tensors' scales and biases. */
static smoe_status verify_blobs(int fd, const smoe_vault *v, uint8_t *buf, uint64_t buf_bytes, verify_ctx *x) {
    const smoe_layout *L = &v->lay;
    uint32_t ne = L->cfg.num_experts;
    if (L->blob_bytes == 0) return SMOE_OK; /* no sparse layer, no blobs */
    for (uint32_t i = 0; i < L->n_blobs;) {
        const uint32_t li = i / ne;
        if (!L->layer_sparse[li]) {
            i++;
            continue;
        }
        /* Blobs of one layer that lie back to back (the writer's order) go in one read. */
        const uint64_t bb = L->layer_blob_bytes[li];
        const uint64_t per_read = buf_bytes / bb;
        uint32_t j = i + 1;
        while (j < L->n_blobs && j / ne == li && j - i < per_read && L->blob_offset[j] == L->blob_offset[j - 1] + bb) j++;
        int64_t got = smoe_pread_full(fd, buf, (uint64_t)(j - i) * bb, L->blob_offset[i]);
        if (got < 0)
            return smoe_fail(SMOE_ERR_IO, "%s: read at %llu failed: %s", x->path, (unsigned long long)L->blob_offset[i],
                             strerror(errno));
        const smoe_expert_layout *xl = &L->xl[li];
        for (uint32_t k = i; k < j; k++) {
            int32_t layer = (int32_t)li, expert = (int32_t)(k % ne);
            const uint8_t *b = buf + (uint64_t)(k - i) * bb;
            if ((uint64_t)got < (uint64_t)(k - i + 1) * bb) {
                report(x, "blob", layer, expert, "cut short by the end of the file");
                continue;
            }
            if (smoe_checksum(b, bb) != L->blob_crc[k]) report(x, "blob", layer, expert, "checksum mismatch");
            for (int t = 0; t < SMOE_XT_COUNT; t++)
                if (xl->has[t]) check_values(x, &xl->t[t], b + xl->t[t].offset, EXPERT_NAME[t], layer, expert);
        }
        i = j;
    }
    return SMOE_OK;
}

smoe_status smoe_verify_vault(const smoe_vault *v, smoe_verify_fn fn, void *user) {
    if (!v) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_verify_vault: vault is NULL");
    const smoe_layout *L = &v->lay;
    verify_ctx x = {fn, user, 0, v->path};
    int fd = v->fd; /* the file this vault opened, as it is on disk now */
    (void)smoe_vault_dense_ready((smoe_vault *)v); /* a deferred lm_head in memory (its check is redone below) */
#ifdef POSIX_FADV_SEQUENTIAL
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
    uint64_t buf_bytes = L->blob_bytes > VERIFY_CHUNK ? L->blob_bytes : VERIFY_CHUNK;
    uint8_t *buf = smoe_alloc(buf_bytes, SMOE_PAGE);
    if (!buf) return smoe_fail(SMOE_ERR_NOMEM, "cannot allocate the verify buffer");
    smoe_status rc;
    uint32_t sum = 0;
    bool cut;
    /* Header and tables as they are on disk now, the crc field read as zero. */
    uint8_t stored[4];
    int64_t got = smoe_pread_full(fd, stored, 4, HEADER_CRC_AT);
    if (got < 0) {
        rc = smoe_fail(SMOE_ERR_IO, "%s: read at 0 failed: %s", v->path, strerror(errno));
        goto done;
    }
    cut = got < 4;
    if (!cut && (rc = checksum_range(fd, v->path, buf, 0, L->table_offset + L->table_bytes, &sum, &cut))) goto done;
    if (cut) report(&x, "header", -1, -1, "cut short by the end of the file");
    else if (sum != rd32(stored)) report(&x, "header", -1, -1, "checksum mismatch");

    if ((rc = checksum_range(fd, v->path, buf, L->dense_offset, L->dense_bytes - L->paged_bytes, &sum, &cut)))
        goto done;
    if (cut) report(&x, "dense", -1, -1, "cut short by the end of the file");
    else if (sum != L->dense_crc) report(&x, "dense", -1, -1, "checksum mismatch");
    /* The dense tensors as the engine uses them (they matched dense_crc at open); a paged
     * embedding from the file */
    for (uint32_t i = 0; i < L->n_tensors; i++)
        if (!L->paged_bytes || &L->tensors[i] != L->embed)
            check_values(&x, &L->tensors[i], L->tensors[i].data, L->names[i], -1, -1);
    if ((rc = verify_paged(v, buf, buf_bytes, &x))) goto done;

    if ((rc = verify_blobs(fd, v, buf, buf_bytes, &x))) goto done;
    rc = x.bad ? smoe_fail(SMOE_ERR_VAULT, "%s: %u problem(s) found", v->path, x.bad) : SMOE_OK;
done:
    smoe_free(buf);
    return rc;
}

/* ------------------------------------------------------------------------------ dequantize */

smoe_status smoe_dequantize(smoe_format format, smoe_scale_format scale_format, uint32_t group_size, uint32_t rows,
                            uint32_t cols, const void *data, size_t nbytes, float *out) {
    if (!data || !out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_dequantize: NULL argument");
    smoe_tensor t;
    if ((unsigned)format > 255 || (unsigned)scale_format > 255 ||
        !tensor_init(&t, (uint8_t)format, (uint8_t)scale_format, group_size, rows, cols))
        return smoe_fail(SMOE_ERR_INVALID_ARG,
                         "smoe_dequantize: invalid format %d / scale format %d / group size %u for %ux%u", (int)format,
                         (int)scale_format, group_size, rows, cols);
    if (nbytes != t.nbytes)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_dequantize: %ux%u %s takes %llu bytes, got %zu", rows, cols,
                         smoe_format_name(t.format), (unsigned long long)t.nbytes, nbytes);
    t.data = data;
    for (uint32_t r = 0; r < rows; r++) smoe_dequant_row(&t, data, r, out + (size_t)r * cols);
    return SMOE_OK;
}
