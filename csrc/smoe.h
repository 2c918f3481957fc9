/*
 * smoe.h — the whole public ABI of libsmoe, the pysmoe engine.
 *
 * libsmoe runs Qwen3-MoE models whose expert weights live on disk in a vault (docs/vault.md):
 * dense weights stay in memory, expert blobs are streamed with Direct I/O into a bounded
 * retention cache. Two ways to feed a prompt give bit-identical results:
 *
 *   smoe_prefill_chunk  layer-major: per layer, the whole chunk routes, each needed expert is
 *                       read once and applied to every token routed to it;
 *   smoe_decode_step    token-serial: one token through every layer; returns logits and/or a
 *                       sampled next id.
 *
 * Conventions
 *   - Every call that can fail returns smoe_status (0 ok, negative error). smoe_last_error()
 *     gives the message of the last failure on the calling thread.
 *   - The library never prints, exits or aborts. Messages go to the log callback, if set.
 *   - Handles are opaque; objects are returned through out-parameters; *_free / *_close accept
 *     NULL.
 *   - Option and stats structs start with struct_size so the ABI can grow: set it to
 *     sizeof(the struct) (the *_default_* functions do).
 *   - A vault may be shared by several sessions, each used from any thread (see Threading).
 *   - Prefill and decode calls run kernels on the calling thread too; it needs about 1 MiB of
 *     stack (the library gives its own worker threads at least that).
 *
 * Threading
 *   - A session runs one call at a time. Every call that reads or changes a session
 *     (smoe_prefill_chunk, smoe_decode_step, smoe_session_reset, smoe_session_rewind,
 *     smoe_session_set_sampler, smoe_session_set_mask, smoe_session_read_kv, smoe_stats*,
 *     smoe_cache_clear) claims it with an atomic compare-exchange as it starts and releases it
 *     as it returns. A call that finds the session claimed by another thread returns
 *     SMOE_ERR_BUSY at once and touches nothing: the running call is unaffected. So concurrent
 *     use is refused, never undefined; a caller that wants to share a session across threads
 *     serialises the calls itself.
 *   - Two calls free of that rule: smoe_session_position (an atomic load of the position the
 *     last finished call left) and smoe_session_cancel (an atomic store), safe from any thread
 *     at any time, and smoe_session_cancel from a signal handler too.
 *   - smoe_session_cancel stops the prefill or decode call that is running on the session: it
 *     checks between layers, and between the experts of a layer while it waits for blobs, and
 *     returns SMOE_ERR_CANCELLED, which leaves the session as any other failure does (position
 *     unchanged, session usable). Every call clears the request as it claims the session, so a
 *     cancel that arrives while no call runs — or before a call has claimed the session — is
 *     ignored; one that arrives while a call runs is never lost (the call returns CANCELLED or,
 *     if it was past its last check, completes normally).
 *   - smoe_session_free and smoe_close_vault must not run while a call runs on the session (or a
 *     session of the vault): that is undefined behaviour. Cancel, let the call return, then free.
 *     The Python binding enforces this (Session.close() cancels and waits).
 *   - Different sessions, of one vault or of several, may run calls at the same time; sessions
 *     sharing one cache (smoe_session_new_shared) take turns for the calls that use it.
 *   - The library's own threads (a session's workers and I/O threads, a vault's loaders) block
 *     every signal, so process-directed signals reach the host's threads; on Linux they are
 *     named smoe-pool, smoe-io and smoe-dense.
 *
 * Processes (fork)
 *   - A session belongs to the process that made it: after fork() its threads are not in the
 *     child. There every call on an inherited session returns SMOE_ERR_INVALID_ARG saying so,
 *     as does smoe_session_new_shared with it as the sibling; smoe_session_free of it frees
 *     nothing in the child and returns at once (the child's copy of its memory goes with the
 *     child).
 *   - A vault opened before the fork serves the child: smoe_session_new on it there makes a
 *     session of the child's own (the dense weights stay shared with the parent, copy-on-write),
 *     unless the fork came while the vault was still reading lm_head in its own thread (a large
 *     lm_head read beside the first pass), which that call then reports (SMOE_ERR_INVALID_ARG);
 *     smoe_close_vault in the child frees the child's copy without waiting for that thread.
 */
#ifndef SMOE_H
#define SMOE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* SMOE_API marks the library's exported calls. The library's own build defines SMOE_BUILD (the
 * Makefile does): its symbols are exported (the rest is hidden, -fvisibility=hidden); a program
 * that includes this header to use the library leaves it undefined (and, on Windows, imports). */
#if defined(_WIN32)
#if defined(SMOE_BUILD)
#define SMOE_API __declspec(dllexport)
#else
#define SMOE_API __declspec(dllimport)
#endif
#elif defined(SMOE_BUILD)
#define SMOE_API __attribute__((visibility("default")))
#else
#define SMOE_API
#endif

/* What may change between releases. SMOE_ABI_VERSION is the library's binary contract: bindings
 * refuse a library whose smoe_abi_version() differs from what they were built for, and it is the
 * first number of the shared object's version and its soname (libsmoe.so.ABI, libsmoe.ABI.dylib;
 * the Makefile reads it from here), so a program linked against one ABI never loads another.
 *   Bump it when a function is removed or its signature changes, when a struct's layout changes in
 *   any way (a field added, removed, retyped or moved; this includes appending to the structs that
 *   smoe_session_default_params and smoe_sampler_default_params return by value, whose size the
 *   caller's stack frame fixes), or when an enum value's number or meaning changes.
 *   No bump for: a new function; a new enum value (a new smoe_status code); or, for a struct that
 *   starts with struct_size and is only passed by pointer, the growth that struct_size makes
 *   compatible: a caller built against an older header passes its smaller struct_size, the
 *   library reads (params) or fills (config, counters) that prefix and keeps its defaults for the
 *   rest. Such growth still bumps SMOE_VERSION_STRING's MINOR.
 * SMOE_VERSION_STRING is the release, MAJOR.MINOR.PATCH; its MINOR.PATCH end the shared object's
 * version (libsmoe.so.ABI.MINOR.PATCH). */
#define SMOE_ABI_VERSION 6
#define SMOE_VERSION_STRING "0.1.0"

typedef enum {
    SMOE_OK = 0,
    SMOE_ERR_INVALID_ARG = -1,    /* a NULL handle, a bad size, an out-of-range value */
    SMOE_ERR_BAD_TOKEN = -2,      /* a token id outside [0, vocab_size) */
    SMOE_ERR_CONTEXT_FULL = -3,   /* the call would pass the session's context length */
    SMOE_ERR_VAULT = -4,          /* missing, truncated, corrupted or unsupported vault */
    SMOE_ERR_IO = -5,             /* a read failed, came back short or did not match its checksum */
    SMOE_ERR_NOMEM = -6,          /* an allocation failed */
    SMOE_ERR_SESSION_BROKEN = -7, /* an earlier failure left the session unusable */
    SMOE_ERR_UNSUPPORTED = -8,    /* this build or CPU cannot do it */
    SMOE_ERR_INTERNAL = -9,
    SMOE_ERR_BUSY = -10,          /* another call is running on this session (nothing was done) */
    SMOE_ERR_CANCELLED = -11,     /* smoe_session_cancel stopped the call (position unchanged) */
} smoe_status;

SMOE_API const char *smoe_status_str(smoe_status status);
/* Message of the last failure on this thread; "" if none. Valid until the next failing call. */
SMOE_API const char *smoe_last_error(void);
SMOE_API const char *smoe_version(void);
/* The kernels this build runs on this CPU: "avx2+avx512vnni", "avx2+avx512", "avx2+avx-vnni",
 * "avx2", "neon" or "portable" (the part after "+": the 8-bit-activation products' instance,
 * picked at run time; SMOE_NO_AVX512=1 and SMOE_NO_VNNI=1 in the environment take it away),
 * with "+amx" after it where batched q4/q8 products run on AMX tiles (SMOE_NO_AMX=1: not),
 * followed by ", cuda" in a library built with the CUDA backend (`make CUDA=1`; whether a GPU is
 * there shows when a session asks for one). A session on another device
 * (smoe_session_params.device) says what it runs on with smoe_session_backend. */
SMOE_API const char *smoe_kernels(void);
SMOE_API int smoe_abi_version(void);

/* Bytes this process can still take without swapping or meeting a memory cgroup's limit (a
 * container's, a systemd unit's MemoryMax): the least of Linux's MemAvailable and, for the
 * process's memory cgroup (v2, or v1's memory controller) and each parent with a limit, that
 * limit (v2: memory.max and memory.high) less the group's usage plus its inactive file pages.
 * Where there is no /proc/meminfo, half the physical memory. `where` (cap bytes, may be NULL)
 * gets what set the figure: "MemAvailable", "half the RAM" or "cgroup v2 limit of /sys/fs/...".
 * SMOE_ERR_UNSUPPORTED (and 0) where nothing says. What pysmoe sizes its default cache from, and
 * what decides whether the cache's slots are put on huge pages. */
SMOE_API smoe_status smoe_memory_available(uint64_t *bytes, char *where, size_t cap);

/* Log levels passed to the callback. */
enum { SMOE_LOG_DEBUG = 0, SMOE_LOG_INFO = 1, SMOE_LOG_WARN = 2, SMOE_LOG_ERROR = 3 };
typedef void (*smoe_log_fn)(int level, const char *message, void *user);
/* Process-wide. NULL silences the library (the default). The callback may be called from I/O
 * threads; it must not call back into libsmoe. */
SMOE_API void smoe_set_log_callback(smoe_log_fn fn, void *user);

/* ---------------------------------------------------------------------------------- vault */

typedef struct smoe_vault smoe_vault;

typedef struct {
    uint32_t struct_size;
    uint32_t vocab_size;
    uint32_t hidden_size;
    uint32_t num_hidden_layers;
    uint32_t num_attention_heads;
    uint32_t num_key_value_heads;
    uint32_t head_dim;
    uint32_t intermediate_size;     /* dense MLP layers */
    uint32_t moe_intermediate_size; /* one expert */
    uint32_t num_experts;
    uint32_t num_experts_per_tok;
    uint32_t max_position_embeddings;
    uint32_t num_sparse_layers;
    float rms_norm_eps;
    double rope_theta;
    uint64_t blob_bytes;  /* one expert blob on disk */
    uint64_t dense_bytes; /* kept in memory while the vault is open */
    uint64_t file_bytes;
    bool norm_topk_prob;
    bool tie_word_embeddings;
    uint64_t paged_bytes; /* the embedding, left on disk and read a row at a time (0: it is in dense_bytes) */
} smoe_config;

/* Opens DIR/vault.bin, validates header and tables, loads and checks the dense region.
 * An embedding left on disk (docs/vault.md 4.1) is not read; a large untied lm_head (16 MiB or
 * more) is read by a thread of the vault's after this returns, beside the first pass's work, and
 * the dense region's checksum checked then: every pass waits for it before its logits, and a
 * mismatch found then fails that pass (SMOE_ERR_VAULT, the position where it was) and every later
 * one, as it fails this open for the rest of the region.
 * A vault.bin that is not a regular file (a FIFO, a device) is refused without blocking.
 * The vault keeps the file open: its sessions read blobs from that very file (the same inode)
 * even if DIR/vault.bin is later renamed over, never mixing another file's blobs with the loaded
 * tables; a file rewritten in place since (other size or mtime), or another file at the path
 * where the open one cannot be reopened, makes smoe_session_new fail with SMOE_ERR_VAULT
 * ("changed since it was opened").
 * A vault of format version 1 is refused: re-create it (`pysmoe convert` / `pysmoe synth`).
 * On failure *out is NULL and nothing stays open. */
SMOE_API smoe_status smoe_open_vault(const char *dir, smoe_vault **out);
SMOE_API void smoe_close_vault(smoe_vault *vault); /* after every session of it is freed */
SMOE_API smoe_status smoe_vault_config(const smoe_vault *vault, smoe_config *out);
/* Kind of layer l: 1 sparse (experts), 0 dense MLP. */
SMOE_API smoe_status smoe_vault_layer_is_sparse(const smoe_vault *vault, uint32_t layer, bool *out);

/* Called by smoe_verify_vault for each problem: kind is "header", "dense" or "blob" for a region
 * whose checksum fails or that the file cuts short, "values" for a quantised tensor whose scales
 * or biases hold NaN or infinity; layer/expert are -1 except for blobs (and "values" of a blob's
 * tensor). what says it in words, e.g. "checksum mismatch", "layers.3.q_proj scales: 2 non-finite
 * values" or "down biases: 1 non-finite values". */
typedef void (*smoe_verify_fn)(const char *kind, int32_t layer, int32_t expert, const char *what, void *user);
/* Re-reads the file and checks every checksum (header, dense region, every blob) and that every
 * quantised tensor's scales and biases are finite. SMOE_ERR_VAULT if anything is bad (each
 * reported to fn, which may be NULL), SMOE_ERR_IO if a read fails. */
SMOE_API smoe_status smoe_verify_vault(const smoe_vault *vault, smoe_verify_fn fn, void *user);

/* The vault format's checksum (docs/vault.md, "Checksums"): CRC-32C over 4 lanes of the n bytes,
 * combined by a CRC-32C of the four lane CRCs. Hardware CRC32C (SSE4.2 on x86-64, chosen at run
 * time; ARMv8 CRC on arm64) or a portable table, all giving the same value. */
SMOE_API uint32_t smoe_checksum(const void *data, size_t n);

/* Tensor formats (docs/vault.md section 3). The GGML block formats are numbered 32 + ggml's own
 * enum ggml_type: rows of cols/block_size blocks laid out exactly as ggml lays them out (block
 * size 32, or 256 for the K-quants and the IQ formats but IQ4_NL; F16 a block of one), scale_format none and group 0;
 * they dequantise exactly as gguf-py's gguf.quants.dequantize does. */
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
/* (smoe_dequantize, for tests and tools, is in smoe_testing.h.) */

/* -------------------------------------------------------------------------------- session */

typedef struct smoe_session smoe_session;

/* Element type of the KV cache (smoe_session_params.kv_dtype). K and V are computed in f32 and
 * rounded to nearest-even when they are stored; attention reads them widened back to f32
 * (exactly), so both prefill paths agree bit for bit for each type. */
typedef enum { SMOE_KV_F32 = 0, SMOE_KV_BF16 = 1, SMOE_KV_F16 = 2 } smoe_kv_dtype;

/* Where a session runs its layers (smoe_session_params.device).
 *   SMOE_DEVICE_CPU   the kernels of smoe_kernels() on the session's threads.
 *   SMOE_DEVICE_CUDA  an NVIDIA GPU (the first one), in a library built with `make CUDA=1`; other
 *                     builds answer SMOE_ERR_UNSUPPORTED. Dense weights (once per share), KV cache
 *                     and activations live in VRAM; experts are retained in VRAM (gpu_cache_bytes),
 *                     behind it in the host retention cache (cache_bytes, pinned) and behind that on
 *                     disk. Its q4/q8 products (f16/bf16 scales) run on the tensor cores (weights to f16,
 *                     activations rounded to f16 after a power-of-two scale per row, f32 sums in the
 *                     GPU's own order; float_activations is ignored), so its logits agree with the
 *                     CPU's within a tolerance, not bit for bit; its layer-major, token-serial and
 *                     batched paths agree bit for bit with each other, for each kv_dtype
 *                     (attention for head sizes 32, 64 and 128 takes K and V as f16, so there an f16
 *                     cache gives the same logits as an f32 one at half the VRAM). */
typedef enum { SMOE_DEVICE_CPU = 0, SMOE_DEVICE_CUDA = 1 } smoe_device;

typedef struct {
    uint32_t struct_size;
    uint32_t context;      /* KV cache length in tokens (default 4096, capped by the model's); the
                              cache for all of it is reserved by smoe_session_new (2 · layers ·
                              context · kv_heads · head_dim elements of kv_dtype, kv_bytes in
                              smoe_counters) but not written, so on Linux and macOS its pages
                              become resident as positions fill */
    uint32_t chunk;        /* largest n for smoe_prefill_chunk, and the most sessions one
                              smoe_decode_batch takes with this one as its largest (default 256; with
                              a cache smaller than the experts a larger chunk reads less: pysmoe
                              picks 1024 then) */
    uint32_t threads;      /* compute threads including the caller (default: online cores) */
    uint32_t io_threads;   /* blob reads in flight (default 4) */
    smoe_kv_dtype kv_dtype; /* of the KV cache (default SMOE_KV_F32; bench/RESULTS.md "KV cache in
                               bf16 and f16" has its cost and speed) */
    smoe_device device;    /* that runs the layers (default SMOE_DEVICE_CPU) */
    uint64_t cache_bytes;  /* retention cache budget; 0 = only the slots one step needs */
    uint64_t coalesce_bytes; /* largest read request (default 16 MiB): blobs of a layer's union that
                                lie next to each other in vault.bin are read as one request of up to
                                this many bytes (docs/streamer.md); below two blobs, one read each */
    uint64_t gpu_cache_bytes; /* SMOE_DEVICE_CUDA: budget of the experts retained in VRAM (default 0:
                                 a few blobs, enough to stream); the dense weights, the KV cache and
                                 the planes come on top. Ignored on the CPU. */
    bool direct_io;        /* O_DIRECT / F_NOCACHE; falls back to buffered reads, logged (default true) */
    bool verify_blobs;     /* check each blob's checksum every time it is read from disk (default
                              true); a mismatch is SMOE_ERR_IO naming layer, expert and offset */
    bool float_activations; /* false (default): the inputs of q8/q4 matrices are quantised to 8 bits
                               per 32 values, as llama.cpp does; true: they stay f32 and the
                               dequantised weights multiply them exactly (slower). Either way both
                               prefill paths agree bit for bit. */
    uint32_t part_rows;    /* rows per part of a layer-major pass: a sparse layer's attention and
                              routing run a part at a time, each part's expert reads fired as it
                              routes, so the disk reads while the next part computes (docs/streamer.md
                              "Parts"); the experts still run once over all the rows. 0 (default): the
                              engine's choice, up to 8 parts of at least 8 rows; ≥ chunk: one part.
                              The bits are the same for every value. */
} smoe_session_params;

SMOE_API smoe_session_params smoe_session_default_params(void);

/* Allocates everything the session will ever use: KV cache, activation planes, cache slots,
 * threads. On failure *out is NULL. The vault must outlive the session. */
SMOE_API smoe_status smoe_session_new(smoe_vault *vault, const smoe_session_params *params,
                                      smoe_session **out);
SMOE_API void smoe_session_free(smoe_session *session);

/* Forgets the tokens seen so far (position back to 0); the retention cache stays warm. Also
 * makes a broken session usable again. */
SMOE_API smoe_status smoe_session_reset(smoe_session *session);
/* Number of tokens in the KV cache, as the last finished call left it (an atomic load: safe
 * while another thread runs a call on the session). */
SMOE_API uint32_t smoe_session_position(const smoe_session *session);
/* Moves the position back to position (≤ the current one), forgetting the tokens after it. The
 * KV rows before it are those the earlier calls wrote, so this is exact: what follows is what
 * would have followed position the first time. The sampler's random state is not rewound.
 * SMOE_ERR_INVALID_ARG, changing nothing, if position is past the current one. */
SMOE_API smoe_status smoe_session_rewind(smoe_session *session, uint32_t position);
/* Asks the prefill or decode call running on session to stop (Threading, above); returns at
 * once. Only an atomic store: thread- and async-signal-safe. SMOE_ERR_INVALID_ARG (with no
 * message, for signal safety) for NULL. */
SMOE_API smoe_status smoe_session_cancel(smoe_session *session);

/* ------------------------------------------------------------ sessions that share a cache */

/* A new session of sibling's vault, on sibling's device, that reads experts through sibling's
 * retention caches (the host's, and the device's on a GPU) and runs on its worker pool or GPU
 * streams, with its dense weights: params.threads, io_threads, cache_bytes, coalesce_bytes,
 * direct_io, verify_blobs, device and gpu_cache_bytes are ignored (sibling's hold); context,
 * chunk, kv_dtype and float_activations are the new session's own, as are its KV cache, planes
 * and sampler. Sharing is transitive (a share is the set of sessions made from one another) and
 * counted: sessions of a share may be freed in any order, the caches going with the last one. The
 * vault must outlive them all. Sessions of one share run the calls that use the device or the
 * caches (prefill, decode, batch, smoe_stats*, smoe_cache_clear) one at a time: such a call waits
 * until a sibling's returns. Each session still refuses concurrent calls on itself with
 * SMOE_ERR_BUSY. On failure *out is NULL and sibling is unchanged. */
SMOE_API smoe_status smoe_session_new_shared(smoe_session *sibling, const smoe_session_params *params,
                                             smoe_session **out);

/* One decode step of n sessions in one layer-major pass: appends ids[i] to sessions[i] at its
 * own position and writes its next-token logits to logits + i·vocab_size and/or a sampled id
 * (its own sampler) to next_ids[i] (either array may be NULL). Per layer, each session's
 * attention runs on its own KV cache; the layer's union of their experts is read once and
 * applied to every session routed to it. Each session's logits, sampled id, KV rows and
 * position are bit-identical to those of smoe_decode_step(sessions[i], ids[i], ...) alone, for
 * any batch composition and order, on either device.
 * Requires: 1 ≤ n ≤ the largest chunk among the sessions; distinct sessions of one share
 * (smoe_session_new_shared) with the same float_activations. Claims every session as any call
 * does (Threading): smoe_session_cancel on any of them stops the whole step (SMOE_ERR_CANCELLED).
 * On failure no session advanced (positions, histories, samplers, counters unchanged; KV rows
 * past each position are garbage, rewritten next time), and *failed (if not NULL) is the index
 * of the session at fault — the one that was BUSY, cancelled, given a bad id, full
 * (CONTEXT_FULL), broken, NULL, a duplicate, outside the share — or −1 when the failure is the
 * batch's (a read that failed, n out of range). *failed is −1 on success. */
SMOE_API smoe_status smoe_decode_batch(smoe_session *const *sessions, const int32_t *ids, uint32_t n, float *logits,
                                       int32_t *next_ids, int32_t *failed);

/* ------------------------------------------------------------------------ prefill and decode */

/* Layer-major prefill of n tokens (1 ≤ n ≤ params.chunk) at the current position: per layer the
 * whole chunk routes, each expert of its union is read once and applied to every token routed to
 * it. logits (vocab_size floats, may be NULL) gets the next-token logits after the chunk's last
 * token, and next_id (may be NULL) an id sampled from them with the session's sampler — the same
 * values, bit for bit, that feeding the n tokens one at a time through smoe_decode_step gives.
 * With both NULL no logits are computed: a prompt fed in pieces asks for them on its last piece
 * only and reads no more blobs than one call over the same chunks.
 * On failure the position is where it was before the call (KV rows past it are garbage and will
 * be overwritten); the session stays usable unless SMOE_ERR_SESSION_BROKEN is returned. */
SMOE_API smoe_status smoe_prefill_chunk(smoe_session *session, const int32_t *ids, uint32_t n, float *logits,
                                        int32_t *next_id);
/* smoe_prefill_chunk that also hands back the logits after chosen tokens of the chunk (an
 * echo's log-probabilities): rows[0..n_rows) are indices into ids, strictly increasing, and
 * logits (n_rows × vocab_size floats) gets, for each, the logits that follow that token. next_id
 * (may be NULL) is sampled after the last token, whether or not n − 1 is among rows. */
SMOE_API smoe_status smoe_prefill_rows(smoe_session *session, const int32_t *ids, uint32_t n, const uint32_t *rows,
                                       uint32_t n_rows, float *logits, int32_t *next_id);

/* Token-serial step: appends id at the current position, runs every layer, and writes the
 * next-token logits (vocab_size floats) to logits and/or a sampled id to next_id (either may
 * be NULL). On failure the position is unchanged, as for smoe_prefill_chunk. Logits with no
 * finite value (NaN or infinite weights) are SMOE_ERR_VAULT, not a sampled id 0. */
SMOE_API smoe_status smoe_decode_step(smoe_session *session, int32_t id, float *logits, int32_t *next_id);

/* ---------------------------------------------------------------------------------- sampler */

/* The one sampler: what smoe_decode_step, smoe_prefill_chunk and smoe_decode_batch draw with,
 * and what pysmoe's generate, run, chat and server use. In Hugging Face's order: the repetition
 * penalty (over the last repetition_window ids of the session's history, each distinct id once:
 * a logit > 0 divided by it, any other multiplied), the presence and frequency penalties
 * (OpenAI's: logit −= frequency_penalty · count + presence_penalty · (count > 0), count = times
 * the id was drawn since smoe_session_set_sampler), temperature 0 → argmax (lowest id on ties),
 * then logits / temperature, top-k, softmax in double, top-p, min-p, and one draw from
 * xoroshiro128+ seeded by splitmix64(seed). The same seed, settings and logits give the same ids. */
typedef struct {
    uint32_t struct_size;
    float temperature;        /* 0 = greedy (default 0) */
    uint32_t top_k;           /* 0 = off */
    float top_p;              /* 1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off; applied over the last repetition_window tokens (default 64) */
    uint32_t repetition_window;
    float presence_penalty;   /* 0 = off; −2 to 2 */
    float frequency_penalty;  /* 0 = off; −2 to 2 */
    uint64_t seed;
} smoe_sampler_params;

SMOE_API smoe_sampler_params smoe_sampler_default_params(void);
/* Sets the sampler, reseeds its generator and forgets the counts of the presence and frequency
 * penalties: the same seed gives the same ids. */
SMOE_API smoe_status smoe_session_set_sampler(smoe_session *session, const smoe_sampler_params *params);
/* Constrains the ids the session's sampler may draw (structured output: the tokens a grammar
 * allows next). bitmask: n_words = ceil(vocab_size / 32) words, id allowed when bit id % 32 of
 * word id / 32 is set (the layout of llguidance's and XGrammar's token bitmasks); it is copied.
 * NULL lifts the mask. A mask stays in force for every id the session draws until it is set
 * again, lifted, or smoe_session_set_sampler runs. The ids it forbids become −inf after the
 * penalties, before the temperature: greedy takes the best allowed id, a draw renormalises over
 * the allowed ones (if every allowed logit is −inf, the lowest allowed id). While a mask is in
 * force the draw runs on the host, whatever the device. A mask of the wrong size or allowing no
 * id below vocab_size is SMOE_ERR_INVALID_ARG and leaves the mask as it was. */
SMOE_API smoe_status smoe_session_set_mask(smoe_session *session, const uint32_t *bitmask, uint32_t n_words);

/* The model's log-probabilities: log-softmax of logits (vocab floats; NaN counts as −inf) in
 * double, whatever the sampler's settings. *token_lp (may be NULL) ← token's, and top_ids /
 * top_lps (top_n entries each, may be NULL when top_n is 0) ← the top_n likeliest ids and theirs,
 * best first, ties by lower id. top_n ≤ SMOE_TOP_LOGPROBS. Pure; never allocates. */
#define SMOE_TOP_LOGPROBS 64
SMOE_API smoe_status smoe_logprobs(const float *logits, uint32_t vocab, int32_t token, uint32_t top_n,
                                   double *token_lp, int32_t *top_ids, double *top_lps);

/* ------------------------------------------------------------------------------- counters */

typedef struct {
    uint32_t struct_size;
    /* the session */
    uint32_t position;
    uint32_t num_layers;        /* entries smoe_stats_union_sizes fills */
    uint64_t tokens_prefilled;
    uint64_t tokens_decoded;
    double prefill_s;           /* seconds inside smoe_prefill_chunk / smoe_prefill_rows */
    double decode_s;            /* seconds inside smoe_decode_step (and smoe_decode_batch: each member
                                   counts the whole step, as it does the token in tokens_decoded) */
    /* memory: resident_bytes = dense + cache + kv + planes */
    uint64_t resident_bytes;
    uint64_t dense_bytes;
    uint64_t cache_bytes;       /* bytes of the host cache's expert slots */
    uint64_t kv_bytes;          /* the K and V cache for the whole context, in kv_dtype */
    uint64_t plane_bytes;
    /* The host retention cache and its reads belong to the share of sessions made with
     * smoe_session_new_shared: every sharer reports the same values, and resident_bytes counts the
     * cache (like the dense weights) in full. The memory of a share is dense_bytes + cache_bytes +
     * Σ over its sessions of (kv_bytes + plane_bytes). */
    uint32_t cache_slots;
    uint32_t cache_sharers;     /* sessions holding this cache now (1: not shared) */
    uint64_t blob_reads;        /* blobs read from disk */
    uint64_t bytes_read;
    uint64_t read_requests;     /* read requests issued: a coalesced run of blobs counts once */
    uint64_t cache_hits;        /* expert uses served by the retention cache */
    uint64_t cache_misses;      /* expert uses that needed a read */
    double io_wait_s;           /* seconds compute waited for blobs */
    /* batches on the share */
    uint64_t batch_steps;       /* smoe_decode_batch calls that succeeded */
    uint64_t batch_tokens;      /* tokens they decoded (Σ n) */
    uint64_t batch_blob_reads;  /* blobs they read: batch_blob_reads / batch_tokens = reads per token */
    bool direct_io;             /* reads bypass the page cache */
} smoe_counters;

SMOE_API smoe_status smoe_stats(const smoe_session *session, smoe_counters *out);

/* What the session's device did (zeros on the CPU, whose tiers smoe_counters describes). On a
 * GPU the expert cache is the share's, like the host's. */
typedef struct {
    uint32_t struct_size;
    smoe_device device;
    uint32_t vram_slots;
    uint64_t uploads;           /* expert blobs copied host → device */
    uint64_t upload_bytes;
    uint64_t vram_hits;         /* expert uses served by the VRAM cache */
    uint64_t vram_misses;       /* expert uses that needed an upload */
    uint64_t vram_cache_bytes;  /* the VRAM expert cache (whole blobs of gpu_cache_bytes) */
    uint64_t vram_other_bytes;  /* dense weights, KV cache, planes in VRAM */
} smoe_device_counters;

SMOE_API smoe_status smoe_device_stats(const smoe_session *session, smoe_device_counters *out);
/* One line naming the session's device and kernels, e.g. "cpu: avx2" or
 * "cuda: NVIDIA H200 (sm_90), 10 GiB expert cache". Valid while the session lives. */
SMOE_API const char *smoe_session_backend(const smoe_session *session);
/* (smoe_stats_reset and smoe_cache_clear act on the share's caches and counters: on every sharer.) */
/* Per layer, the number of distinct experts the last prefill call used (0 for dense layers). out
 * has room for cap entries; fills min(cap, num_layers). */
SMOE_API smoe_status smoe_stats_union_sizes(const smoe_session *session, uint32_t *out, uint32_t cap);
/* Per expert of layer, how many tokens had it among their top-k since the session was made or
 * smoe_stats_reset last ran (prefill chunks and decode steps alike). Fills
 * min(cap, num_experts) entries; zeros for a dense layer. */
SMOE_API smoe_status smoe_stats_expert_counts(const smoe_session *session, uint32_t layer, uint64_t *counts,
                                              uint32_t cap);
/* Zeroes the counters (not the cache). */
SMOE_API smoe_status smoe_stats_reset(smoe_session *session);
/* Drops every retained blob (host and device), so the next step starts cold. */
SMOE_API smoe_status smoe_cache_clear(smoe_session *session);

/* ---------------------------------------------------------------------------- environment
 *
 * What the library reads from the environment: each only takes away or narrows, for measuring
 * and testing; none is needed to run a model.
 *   SMOE_DENSE_DEFER_MIN=BYTES an untied lm_head this large or larger is read after the open
 *                              returns (default 16 MiB; 1 defers any, a huge value none)
 *   SMOE_NO_AVX512=1           the CPU kernels do not use AVX-512 (smoe_kernels says which run)
 *   SMOE_NO_VNNI=1             nor AVX-VNNI / AVX512-VNNI
 *   SMOE_NO_AMX=1              nor AMX tiles (batched q4/q8 products on Sapphire Rapids and later)
 *   SMOE_AMX_MIN_N=N           the batch (tokens) from which q4/q8 products take AMX (default 8;
 *                              the same bits either way)
 *   SMOE_MATVEC=avx2|avx512    one token's products (decode) on the AVX2 or the AVX-512 kernels
 *                              (default: by CPU, csrc/cpu/kernels.c; the same bits either way)
 *   SMOE_NO_DOTPROD=1          arm64: the 8-bit-activation products do not use SDOT (the same bits)
 *   SMOE_RETENTION=lru|lrfu|lrfu:H  the host cache's victim order within a layer (default lrfu,
 *                              H its half-life in visits of a layer; docs/streamer.md)
 *   SMOE_CUDA_DEVICE_UNION=0   a GPU never forms a layer's union itself (every layer's routed
 *                              ids come to the host)
 *   SMOE_CUDA_GRAPH=0          a GPU never records a decode step
 *   SMOE_CUDA_SAMPLE=0         a GPU leaves sampling's selection to the host
 *   SMOE_CUDA_PIN=0            a GPU does not pin the host cache's slots
 *   SMOE_CUDA_ATT_STREAMS=N    a GPU batch's per-session attention on N streams side by side
 *                              (default 4, at most 8; 0: one after another)
 *   SMOE_CUDA_TC=0             a GPU's q4/q8 products do not use the tensor cores
 *   SMOE_CUDA_FLASH=0          a GPU's attention does not use them (flash attention off)
 *   SMOE_CUDA_TILE=0|1|2       the many-token tensor-core products' tile (a tuning experiment)
 *   SMOE_CUDA_TC_PER=N         a GPU's few-token products take N row tiles a block (default: about
 *                              one wave of blocks; 1 is a tile a block)
 *   SMOE_CUDA_PDL=0            a GPU's one-token products do not start before their predecessor ends
 *   SMOE_CUDA_FA_SPLIT=N       a GPU's flash attention takes positions in splits of N·64 (default 2:
 *                              128; the bits beyond the first split follow N)
 *   SMOE_CUDA_VRAM_FREE=BYTES  a GPU sees at most this much free VRAM (to test OutOfMemory) */

#ifdef __cplusplus
}
#endif
#endif /* SMOE_H */
