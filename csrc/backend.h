/* backend.h — the seam between the engine's loops and the device that runs a layer's math.
 *
 * prefill.c, decode.c and batch.c walk tokens and layers; everything they ask of a device goes
 * through a session's backend: embed the ids, run a layer's attention block and FFN block over
 * rows [0, n), make the logits. A backend is a set of kernels, a device allocator and an upload
 * path, with its own state per session (session->backend_state):
 *
 *   cpu   (backend_cpu.c) the kernels of kernels.h on the worker pool, planes in host memory;
 *         the expert tiers are the streamer's (host retention cache, then the disk).
 *   cuda  (cuda/backend_cuda.c, built by `make CUDA=1`) dense weights, KV cache and planes in
 *         VRAM; experts in a VRAM retention cache (gpu_cache_bytes), then the streamer's host
 *         cache (pinned), then the disk.
 *
 * A backend keeps layer-major and token-serial bit-identical on its own device (each output
 * element reduced in one order that does not depend on n); two backends need not agree bit for
 * bit with each other. Adding one (metal/) means one more table like these and one more case in
 * smoe_backend_for: nothing above this header changes. */
#ifndef SMOE_BACKEND_H
#define SMOE_BACKEND_H

#include "internal.h"

typedef struct smoe_session smoe_session;

typedef struct smoe_backend {
    const char *name; /* "cpu", "cuda" */
    /* After the session's host planes, streamer and pool exist: the device's own allocations and
     * the upload of what stays resident. On failure the session is freed (free runs). */
    smoe_status (*init)(smoe_session *s);
    void (*free)(smoe_session *s); /* of what init made; safe after a failed init */
    /* x rows [0, n) ← embedding rows of ids (host array): a pass's start, at position s->pos. */
    smoe_status (*embed)(smoe_session *s, const int32_t *ids, uint32_t n);
    /* session.h's blocks (smoe_attention_block, smoe_ffn_block), on this device. */
    smoe_status (*attention)(smoe_session *s, uint32_t l, uint32_t pos0, uint32_t n);
    smoe_status (*ffn)(smoe_session *s, uint32_t l, uint32_t n, uint32_t *union_size);
    /* s->logits (host, vocab floats) ← lm_head(final_norm(x row 0)). */
    smoe_status (*logits)(smoe_session *s);
    /* The end of a pass (a prefill chunk; a decode step after its logits): waits for the device and
     * reports what the pass's layers left for later — their expert counts, and their union sizes
     * into union_sizes (layers entries) when not NULL. NULL: nothing is ever deferred. */
    smoe_status (*settle)(smoe_session *s, uint32_t *union_sizes);
    /* A whole decode step of id at s->pos, embedding to s->logits, when the backend runs it in one
     * go (*ran true; settle still follows); *ran false: it did nothing, the caller walks the layers.
     * NULL: always the walk. */
    smoe_status (*decode_step)(smoe_session *s, int32_t id, bool *ran);
    /* The next id for the step's logits (after settle), drawn with s->sampler over s->history as
     * smoe_sample would draw it (*done true), when the backend does the work on its device; *done
     * false: the caller samples s->logits. NULL: the caller always does. */
    smoe_status (*sample)(smoe_session *s, int32_t *next_id, bool *done);
    /* KV rows of layer [start, start + n) widened to f32 into k, v (either may be NULL). */
    smoe_status (*read_kv)(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v);
    /* Drops the device's own retained experts (the streamer's are dropped by the caller). */
    void (*cache_clear)(smoe_session *s);
    /* One line on the device and its kernels, for smoe_session_backend. */
    const char *(*describe)(const smoe_session *s);
    /* The device's counters (smoe_device_stats); NULL: none (all zero). */
    void (*device_stats)(const smoe_session *s, smoe_device_counters *out);
} smoe_backend;

extern const smoe_backend smoe_backend_cpu;

/* The backend for smoe_session_params.device (smoe_device) into *out; SMOE_ERR_UNSUPPORTED (this
 * build has none) or SMOE_ERR_INVALID_ARG (no such device), with a message, and *out NULL. */
smoe_status smoe_backend_for(uint32_t device, const smoe_backend **out);

#endif
