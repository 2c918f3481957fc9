/* smoe_testing.h — calls for tests and tools: exported by libsmoe and covered by
 * SMOE_ABI_VERSION like smoe.h's, but nothing a program needs to run a model. */
#ifndef SMOE_TESTING_H
#define SMOE_TESTING_H

#include "smoe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Dequantises a rows × cols tensor laid out as the vault stores it (data points at the
 * tensor's first byte, nbytes long) into out (rows × cols floats). group_size: for q8/q4 the
 * group along cols (32, 64 or 128; cols a multiple of it), 0 for f32/bf16. Pure. */
SMOE_API smoe_status smoe_dequantize(smoe_format format, smoe_scale_format scale_format, uint32_t group_size,
                                     uint32_t rows, uint32_t cols, const void *data, size_t nbytes, float *out);

/* Copies the K and V rows of layer for positions [start, start + n) (each n × kv_heads·head_dim
 * floats, post-RoPE K) into k and v (either may be NULL), widened exactly to f32 from the
 * session's kv_dtype (from the device, on a GPU). A linear-attention layer (Qwen3-Next,
 * Qwen3.5-MoE) has no KV rows: zeros. */
SMOE_API smoe_status smoe_session_read_kv(const smoe_session *session, uint32_t layer, uint32_t start,
                                          uint32_t n, float *k, float *v);

/* smoe_memory_available over other files: meminfo for /proc/meminfo, proc_cgroup for
 * /proc/self/cgroup, cgroup_root for /sys/fs/cgroup (tests give it a tree of their own). */
SMOE_API smoe_status smoe_memory_available_at(const char *meminfo, const char *proc_cgroup, const char *cgroup_root,
                                              uint64_t *bytes, char *where, size_t cap);

/* Adds delta to the bytes smoe_memory_available holds back as promised but not yet in use (a
 * vault's lm_head still being read beside the first pass: its pages are not yet counted by
 * MemAvailable or the cgroup) and returns the new total. The library adds and removes its own;
 * tests add theirs to see smoe_memory_available move. */
SMOE_API uint64_t smoe_memory_promised(int64_t delta);

#ifdef __cplusplus
}
#endif
#endif
