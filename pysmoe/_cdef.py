"""The C declarations the binding uses: generated from csrc/smoe.h and csrc/smoe_testing.h by scripts/gen_cdef.py."""

CDEF = """
#define SMOE_ABI_VERSION 6
typedef enum {
SMOE_OK = 0,
SMOE_ERR_INVALID_ARG = -1,
SMOE_ERR_BAD_TOKEN = -2,
SMOE_ERR_CONTEXT_FULL = -3,
SMOE_ERR_VAULT = -4,
SMOE_ERR_IO = -5,
SMOE_ERR_NOMEM = -6,
SMOE_ERR_SESSION_BROKEN = -7,
SMOE_ERR_UNSUPPORTED = -8,
SMOE_ERR_INTERNAL = -9,
SMOE_ERR_BUSY = -10,
SMOE_ERR_CANCELLED = -11,
} smoe_status;
const char *smoe_status_str(smoe_status status);
const char *smoe_last_error(void);
const char *smoe_version(void);
const char *smoe_kernels(void);
int smoe_abi_version(void);
smoe_status smoe_memory_available(uint64_t *bytes, char *where, size_t cap);
enum { SMOE_LOG_DEBUG = 0, SMOE_LOG_INFO = 1, SMOE_LOG_WARN = 2, SMOE_LOG_ERROR = 3 };
typedef void (*smoe_log_fn)(int level, const char *message, void *user);
void smoe_set_log_callback(smoe_log_fn fn, void *user);
typedef struct smoe_vault smoe_vault;
typedef struct {
uint32_t struct_size;
uint32_t vocab_size;
uint32_t hidden_size;
uint32_t num_hidden_layers;
uint32_t num_attention_heads;
uint32_t num_key_value_heads;
uint32_t head_dim;
uint32_t intermediate_size;
uint32_t moe_intermediate_size;
uint32_t num_experts;
uint32_t num_experts_per_tok;
uint32_t max_position_embeddings;
uint32_t num_sparse_layers;
float rms_norm_eps;
double rope_theta;
uint64_t blob_bytes;
uint64_t dense_bytes;
uint64_t file_bytes;
bool norm_topk_prob;
bool tie_word_embeddings;
uint64_t paged_bytes;
} smoe_config;
smoe_status smoe_open_vault(const char *dir, smoe_vault **out);
void smoe_close_vault(smoe_vault *vault);
smoe_status smoe_vault_config(const smoe_vault *vault, smoe_config *out);
smoe_status smoe_vault_layer_is_sparse(const smoe_vault *vault, uint32_t layer, bool *out);
typedef void (*smoe_verify_fn)(const char *kind, int32_t layer, int32_t expert, const char *what, void *user);
smoe_status smoe_verify_vault(const smoe_vault *vault, smoe_verify_fn fn, void *user);
uint32_t smoe_checksum(const void *data, size_t n);
typedef enum {
SMOE_FMT_F32 = 0,
SMOE_FMT_BF16 = 1,
SMOE_FMT_Q8 = 2,
SMOE_FMT_Q4 = 3,
SMOE_FMT_GGML_F16 = 33,
SMOE_FMT_GGML_Q4_0 = 34,
SMOE_FMT_GGML_Q4_1 = 35,
SMOE_FMT_GGML_Q5_0 = 38,
SMOE_FMT_GGML_Q5_1 = 39,
SMOE_FMT_GGML_Q8_0 = 40,
SMOE_FMT_GGML_Q2_K = 42,
SMOE_FMT_GGML_Q3_K = 43,
SMOE_FMT_GGML_Q4_K = 44,
SMOE_FMT_GGML_Q5_K = 45,
SMOE_FMT_GGML_Q6_K = 46,
SMOE_FMT_GGML_IQ2_XXS = 48,
SMOE_FMT_GGML_IQ2_XS = 49,
SMOE_FMT_GGML_IQ3_XXS = 50,
SMOE_FMT_GGML_IQ1_S = 51,
SMOE_FMT_GGML_IQ4_NL = 52,
SMOE_FMT_GGML_IQ3_S = 53,
SMOE_FMT_GGML_IQ2_S = 54,
SMOE_FMT_GGML_IQ4_XS = 55,
SMOE_FMT_GGML_IQ1_M = 61,
SMOE_FMT_GGML_MXFP4 = 71
} smoe_format;
typedef enum { SMOE_SCALE_NONE = 0, SMOE_SCALE_F16 = 1, SMOE_SCALE_BF16 = 2, SMOE_SCALE_F32 = 3 } smoe_scale_format;
typedef struct smoe_session smoe_session;
typedef enum { SMOE_KV_F32 = 0, SMOE_KV_BF16 = 1, SMOE_KV_F16 = 2 } smoe_kv_dtype;
typedef enum { SMOE_DEVICE_CPU = 0, SMOE_DEVICE_CUDA = 1 } smoe_device;
typedef struct {
uint32_t struct_size;
uint32_t context;
uint32_t chunk;
uint32_t threads;
uint32_t io_threads;
smoe_kv_dtype kv_dtype;
smoe_device device;
uint64_t cache_bytes;
uint64_t coalesce_bytes;
uint64_t gpu_cache_bytes;
bool direct_io;
bool verify_blobs;
bool float_activations;
uint32_t part_rows;
} smoe_session_params;
smoe_session_params smoe_session_default_params(void);
smoe_status smoe_session_new(smoe_vault *vault, const smoe_session_params *params,
smoe_session **out);
void smoe_session_free(smoe_session *session);
smoe_status smoe_session_reset(smoe_session *session);
uint32_t smoe_session_position(const smoe_session *session);
smoe_status smoe_session_rewind(smoe_session *session, uint32_t position);
smoe_status smoe_session_cancel(smoe_session *session);
smoe_status smoe_session_new_shared(smoe_session *sibling, const smoe_session_params *params,
smoe_session **out);
smoe_status smoe_decode_batch(smoe_session *const *sessions, const int32_t *ids, uint32_t n, float *logits,
int32_t *next_ids, int32_t *failed);
smoe_status smoe_prefill_chunk(smoe_session *session, const int32_t *ids, uint32_t n, float *logits,
int32_t *next_id);
smoe_status smoe_prefill_rows(smoe_session *session, const int32_t *ids, uint32_t n, const uint32_t *rows,
uint32_t n_rows, float *logits, int32_t *next_id);
smoe_status smoe_decode_step(smoe_session *session, int32_t id, float *logits, int32_t *next_id);
typedef struct {
uint32_t struct_size;
float temperature;
uint32_t top_k;
float top_p;
float min_p;
float repetition_penalty;
uint32_t repetition_window;
float presence_penalty;
float frequency_penalty;
uint64_t seed;
} smoe_sampler_params;
smoe_sampler_params smoe_sampler_default_params(void);
smoe_status smoe_session_set_sampler(smoe_session *session, const smoe_sampler_params *params);
smoe_status smoe_session_set_mask(smoe_session *session, const uint32_t *bitmask, uint32_t n_words);
#define SMOE_TOP_LOGPROBS 64
smoe_status smoe_logprobs(const float *logits, uint32_t vocab, int32_t token, uint32_t top_n,
double *token_lp, int32_t *top_ids, double *top_lps);
typedef struct {
uint32_t struct_size;
uint32_t position;
uint32_t num_layers;
uint64_t tokens_prefilled;
uint64_t tokens_decoded;
double prefill_s;
double decode_s;
uint64_t resident_bytes;
uint64_t dense_bytes;
uint64_t cache_bytes;
uint64_t kv_bytes;
uint64_t plane_bytes;
uint32_t cache_slots;
uint32_t cache_sharers;
uint64_t blob_reads;
uint64_t bytes_read;
uint64_t read_requests;
uint64_t cache_hits;
uint64_t cache_misses;
double io_wait_s;
uint64_t batch_steps;
uint64_t batch_tokens;
uint64_t batch_blob_reads;
bool direct_io;
} smoe_counters;
smoe_status smoe_stats(const smoe_session *session, smoe_counters *out);
typedef struct {
uint32_t struct_size;
smoe_device device;
uint32_t vram_slots;
uint64_t uploads;
uint64_t upload_bytes;
uint64_t vram_hits;
uint64_t vram_misses;
uint64_t vram_cache_bytes;
uint64_t vram_other_bytes;
} smoe_device_counters;
smoe_status smoe_device_stats(const smoe_session *session, smoe_device_counters *out);
const char *smoe_session_backend(const smoe_session *session);
smoe_status smoe_stats_union_sizes(const smoe_session *session, uint32_t *out, uint32_t cap);
smoe_status smoe_stats_expert_counts(const smoe_session *session, uint32_t layer, uint64_t *counts,
uint32_t cap);
smoe_status smoe_stats_reset(smoe_session *session);
smoe_status smoe_cache_clear(smoe_session *session);
smoe_status smoe_dequantize(smoe_format format, smoe_scale_format scale_format, uint32_t group_size,
uint32_t rows, uint32_t cols, const void *data, size_t nbytes, float *out);
smoe_status smoe_session_read_kv(const smoe_session *session, uint32_t layer, uint32_t start,
uint32_t n, float *k, float *v);
smoe_status smoe_memory_available_at(const char *meminfo, const char *proc_cgroup, const char *cgroup_root,
uint64_t *bytes, char *where, size_t cap);
uint64_t smoe_memory_promised(int64_t delta);
"""
