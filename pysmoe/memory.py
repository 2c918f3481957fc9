"""The default retention cache budget: what `run` and `chat` use when --cache-mb is not given.

A budget of 0 keeps only the slots one step needs, so every decode step re-reads most of its
experts (about 2x slower decode than with a cache). The default is

    min(every expert blob of the vault,
        max(one token's experts, FRACTION x (available memory - KV cache - planes)))

rounded down to whole blobs. "Available" is measured after the vault is open, so the dense
weights are already out of it (an lm_head still being read beside the first pass too: the library
holds its bytes back until they land): Linux's MemAvailable (free memory plus what the kernel can
reclaim), or less where the process's memory cgroup (a container's limit, a systemd unit's
MemoryMax) leaves less; elsewhere half the physical memory. Direct I/O bypasses the page cache,
so blobs do not also sit there. FRACTION leaves the rest to the user's other programs.
"""
from __future__ import annotations

import dataclasses

from .kvdtype import KV_ELEM_BYTES, default_kv_dtype

FRACTION = 0.5


def available_memory() -> int | None:
    """Bytes of memory a new allocation can get without swapping or meeting its cgroup's limit,
    or None if unknown."""
    return memory_headroom()[0]


def memory_headroom(meminfo: str | None = None, proc_cgroup: str | None = None,
                    cgroup_root: str | None = None) -> tuple[int | None, str]:
    """(bytes available, what set them) from the library's smoe_memory_available: the least of
    MemAvailable and the room below the limits of this process's memory cgroup and its parents
    (limit - usage + inactive file pages; v2 or v1), half the RAM where there is no MemAvailable;
    (None, "memory unknown") where nothing says. The paths stand in for /proc/meminfo,
    /proc/self/cgroup and /sys/fs/cgroup (tests)."""
    from ._ffi import ffi, lib
    out = ffi.new("uint64_t *")
    where = ffi.new("char[]", 1280)
    if meminfo is None and proc_cgroup is None and cgroup_root is None:
        rc = lib.smoe_memory_available(out, where, len(where))
    else:
        rc = lib.smoe_memory_available_at((meminfo or "/proc/meminfo").encode(),
                                          (proc_cgroup or "/proc/self/cgroup").encode(),
                                          (cgroup_root or "/sys/fs/cgroup").encode(), out, where, len(where))
    if rc != 0:
        return None, "memory unknown"
    return int(out[0]), ffi.string(where).decode(errors="replace")


def kv_bytes(config: dict, context: int, kv_dtype: str | None = None) -> int:
    """The session's K and V caches (every layer, the whole context, in kv_dtype: None for the
    library's default), as smoe_session_new allocates them (stats()["kv_bytes"])."""
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    kv = 2 * config["num_hidden_layers"] * context * kv_dim * KV_ELEM_BYTES[kv_dtype or default_kv_dtype()]
    return kv + recurrent_state_bytes(config)


def recurrent_state_bytes(config: dict) -> int:
    """A hybrid model's (Qwen3-Next, Qwen3.5-MoE) recurrent and convolution states of its linear
    layers and their one snapshot, f32, counted with the KV cache (docs/hybrid.md); 0 otherwise."""
    linear = sum(t == "linear_attention" for t in config.get("layer_types") or [])
    if not linear or config.get("model_type") not in ("qwen3_next", "qwen3_5_moe"):
        return 0
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv = linear * (config["linear_conv_kernel_dim"] - 1) * (2 * nk * dk + nv * dv)
    return 2 * (4 * linear * nv * dk * dv + max(4 * conv, 64))  # (an empty plane is allocated as 64 bytes)


# The layer-major chunk a CPU session gets when none is given (default_chunk). Every expert in
# the cache: prefill is compute-bound and 256 is the fastest chunk (larger ones cost 6-11 % more
# compute). A smaller cache: each chunk reads its layer's union again, so a 1,024-token prompt in
# one chunk of 1,024 reads a quarter of what four chunks of 256 read (full a3b, 10 % cache: 24.9
# against 32.6 s). bench/RESULTS.md, "The default chunk on a quiet machine".
RESIDENT_CHUNK = 256
BUDGET_CHUNK = 1024


def default_chunk(vault, cache_bytes: int, context: int) -> int:
    """The chunk for a session whose cache budget is cache_bytes over this vault: RESIDENT_CHUNK
    when the cache holds every expert; else BUDGET_CHUNK (at most the context) when the larger
    chunk's extra activation planes take at most a quarter of the cache budget (on a3b 160 MiB,
    against 1.5 GiB at 10 %), so that a small budget is not spent on planes instead of experts;
    else RESIDENT_CHUNK."""
    big = min(BUDGET_CHUNK, context)
    if cache_bytes >= vault.expert_bytes or big <= RESIDENT_CHUNK:
        return RESIDENT_CHUNK
    extra = plane_bytes(vault.config, context, big) - plane_bytes(vault.config, context, RESIDENT_CHUNK)
    return big if 4 * extra <= cache_bytes else RESIDENT_CHUNK


def plane_bytes(config: dict, context: int, chunk: int = 256) -> int:
    """An upper estimate of the session's activation planes and RoPE tables (with the f32 rows
    that bf16/f16 K and V are computed in before they are rounded into the cache)."""
    width = (4 * config["hidden_size"] + config["num_attention_heads"] * config["head_dim"]
             + 2 * max(config["intermediate_size"], config["moe_intermediate_size"]) + config["num_experts"]
             + config["num_key_value_heads"] * config["head_dim"])
    return 4 * (2 * chunk * width + context * config["head_dim"])


@dataclasses.dataclass(frozen=True)
class CacheChoice:
    bytes: int               # the budget
    available: int | None    # memory available when it was chosen
    all_experts: int         # bytes of every blob: more than this is never needed
    one_token: int           # bytes of one token's experts: the floor
    source: str = "given"    # what set `available` (memory_headroom: MemAvailable, a cgroup's limit...)

    def describe(self) -> str:
        mib, gib = 1 << 20, 1 << 30
        if self.available is None:
            avail = "memory unknown"
        else:
            size = (f"{self.available / gib:.1f} GiB" if self.available >= 10 * gib
                    else f"{self.available / mib:,.0f} MiB")
            avail = f"{size} available ({self.source})"
        return (f"cache budget {self.bytes / mib:,.0f} MiB (auto: {avail}, all experts "
                f"{self.all_experts / mib:,.0f} MiB; --cache-mb to change)")


def choose_cache(vault, context: int, chunk: int = 256, available: int | None = None,
                 kv_dtype: str | None = None) -> CacheChoice:
    """The default cache budget for a session of `context` tokens over an open vault (see the
    module's docstring). available: bytes of free memory (default: measured now); kv_dtype: the
    session's KV element type (None: the library's default)."""
    cfg = vault.config
    context = min(context, cfg["max_position_embeddings"])
    blob = vault.blob_bytes
    all_experts = vault.expert_bytes
    one_token = min(all_experts, cfg["num_experts_per_tok"] * vault.num_sparse_layers * blob)
    source = "given"
    if available is None:
        available, source = memory_headroom()
    if available is None:
        want = one_token
    else:
        spare = available - kv_bytes(cfg, context, kv_dtype) - plane_bytes(cfg, context, chunk)
        want = max(one_token, int(FRACTION * spare))
    want = min(want, all_experts)
    if blob:
        want -= want % blob
    return CacheChoice(bytes=max(want, 0), available=available, all_experts=all_experts, one_token=one_token,
                       source=source)


def default_cache_bytes(vault, context: int, chunk: int = 256, kv_dtype: str | None = None) -> int:
    """The default retention cache budget in bytes (choose_cache(...).bytes)."""
    return choose_cache(vault, context, chunk, kv_dtype=kv_dtype).bytes
