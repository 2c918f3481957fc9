"""Layers 2 and 3 of the binding: Vault and Session, the Pythonic face of libsmoe.

    vault = pysmoe.open_vault(path)
    with vault.session(cache_bytes=1 << 30, threads=2) as s:
        logits = s.prefill(ids)            # layer-major by default
        for tok in s.generate(ids, max_tokens=16):
            ...

A Session holds a strong reference to its Vault, so the vault stays open while any session of
it lives. close() is explicit and idempotent; ffi.gc is only a safety net.
"""
from __future__ import annotations

import json
import os
import pathlib
import weakref
from typing import Iterator, Sequence

import numpy as np

from ._ffi import check, ffi, lib
from .errors import BadToken, ContextFull, InvalidArgument, VaultError

PREFILL_PATHS = ("layer-major", "token-serial")
ACTIVATIONS = ("q8", "f32")


def open_vault(path) -> "Vault":
    """Open a vault directory (docs/vault.md). Raises VaultError if it is missing or corrupt, or
    is the leftover of an interrupted write (pysmoe.vaultdir)."""
    from .vaultdir import check_complete
    check_complete(pathlib.Path(path).expanduser())
    return Vault(path)


def _config_dict(c) -> dict:
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size, "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": float(c.rms_norm_eps), "rope_theta": float(c.rope_theta),
        "norm_topk_prob": bool(c.norm_topk_prob), "tie_word_embeddings": bool(c.tie_word_embeddings),
    }


class Vault:
    """An open vault: dense weights in memory, expert blobs on disk."""

    def __init__(self, path):
        self.path = pathlib.Path(path).expanduser()
        out = ffi.new("smoe_vault **")
        check(lib.smoe_open_vault(os.fsencode(self.path), out))
        self._h = ffi.gc(out[0], lib.smoe_close_vault)
        c = ffi.new("smoe_config *")
        c.struct_size = ffi.sizeof("smoe_config")
        check(lib.smoe_vault_config(self._h, c))
        self.blob_bytes = int(c.blob_bytes)
        self.dense_bytes = int(c.dense_bytes)
        self.file_bytes = int(c.file_bytes)
        self.num_sparse_layers = int(c.num_sparse_layers)
        # The checkpoint's own config.json names, with the engine's values authoritative.
        cfg = {}
        cfg_path = self.path / "config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except ValueError as e:
                raise VaultError(f"{cfg_path}: not valid JSON ({e})") from None
        cfg.update(_config_dict(c))
        self.config = cfg
        self._tokenizer = None
        self._closing = False
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # open sessions; they hold us strongly

    @property
    def handle(self):
        if self._h is None or self._closing:
            raise InvalidArgument("the vault is closed")
        return self._h

    def layer_is_sparse(self, layer: int) -> bool:
        out = ffi.new("bool *")
        check(lib.smoe_vault_layer_is_sparse(self.handle, layer, out))
        return bool(out[0])

    @property
    def expert_bytes(self) -> int:
        """Bytes of all expert blobs on disk."""
        return self.blob_bytes * self.num_sparse_layers * self.config["num_experts"]

    @property
    def tokenizer(self):
        """The vault's tokenizer (pysmoe.tokenizer.Tokenizer), or None if it has none."""
        if self._tokenizer is None and (self.path / "tokenizer.json").exists():
            from .tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def verify(self) -> list[tuple[str, int, int]]:
        """Check every checksum. Returns the bad regions as (kind, layer, expert); [] if sound."""
        bad = []

        @ffi.callback("void(const char *, int32_t, int32_t, void *)")
        def on_bad(kind, layer, expert, _user):
            bad.append((ffi.string(kind).decode(), layer, expert))

        rc = lib.smoe_verify_vault(self.handle, on_bad, ffi.NULL)
        if rc != 0 and not (rc == VaultError.code and bad):
            check(rc)
        return bad

    def session(self, cache_bytes: int = 0, threads: int | None = None, chunk: int | None = None,
                prefill: str = "layer-major", context: int = 4096, io_threads: int = 4,
                direct_io: bool = True, verify_blobs: bool = False, activations: str = "q8") -> "Session":
        return Session(self, cache_bytes=cache_bytes, threads=threads, chunk=chunk, prefill=prefill,
                       context=context, io_threads=io_threads, direct_io=direct_io, verify_blobs=verify_blobs,
                       activations=activations)

    def close(self) -> None:
        """Close the vault; safe twice. Sessions still open keep it alive until they close."""
        self._closing = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self._closing and self._h is not None and not self._sessions:
            ffi.release(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        c = self.config
        return (f"Vault({str(self.path)!r}, layers={c['num_hidden_layers']}, experts={c['num_experts']}, "
                f"top_k={c['num_experts_per_tok']}, hidden={c['hidden_size']})")


class Session:
    """A KV cache, activation planes and a retention cache over one vault.

    activations: "q8" (default) quantises the inputs of q8/q4 matrices to 8 bits per 32 values, as
    llama.cpp does, and multiplies integer codes; "f32" keeps them in float and multiplies the
    dequantised weights exactly (slower; what the numpy reference computes). Both prefill paths
    agree bit for bit either way."""

    def __init__(self, vault: Vault, *, cache_bytes=0, threads=None, chunk=None, prefill="layer-major",
                 context=4096, io_threads=4, direct_io=True, verify_blobs=False, activations="q8"):
        if prefill not in PREFILL_PATHS:
            raise InvalidArgument(f"prefill must be one of {PREFILL_PATHS}, not {prefill!r}")
        if activations not in ACTIVATIONS:
            raise InvalidArgument(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        for name, value, low in (("cache_bytes", cache_bytes, 0), ("chunk", 1 if chunk is None else chunk, 1),
                                 ("context", context, 1),
                                 ("io_threads", io_threads, 1), ("threads", 1 if threads is None else threads, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidArgument(f"{name} must be an integer ≥ {low}, not {value!r}")
        self.vault = vault  # strong reference: the vault outlives the session
        p = lib.smoe_session_default_params()
        p.cache_bytes = int(cache_bytes)
        if threads is not None:
            p.threads = int(threads)
        if chunk is not None:  # None: the library's default (smoe_session_default_params)
            p.chunk = int(chunk)
        p.context = int(context)
        p.io_threads = int(io_threads)
        p.direct_io = bool(direct_io)
        p.verify_blobs = bool(verify_blobs)
        p.float_activations = int(activations == "f32")
        params = ffi.new("smoe_session_params *", p)
        out = ffi.new("smoe_session **")
        check(lib.smoe_session_new(vault.handle, params, out))
        self._h = ffi.gc(out[0], lib.smoe_session_free)
        vault._sessions.add(self)
        self.prefill_path = prefill
        self.activations = activations
        self.chunk = int(p.chunk)
        self.context = min(int(context), vault.config["max_position_embeddings"])
        self.threads = int(p.threads)
        self._vocab = vault.config["vocab_size"]
        self._union = [0] * vault.config["num_hidden_layers"]
        self._sampler = None

    # ------------------------------------------------------------------ plumbing
    @property
    def handle(self):
        if self._h is None:
            raise InvalidArgument("the session is closed")
        return self._h

    def close(self) -> None:
        if self._h is not None:
            ffi.release(self._h)
            self._h = None
            self.vault._sessions.discard(self)
            self.vault._release_if_idle()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def position(self) -> int:
        return int(lib.smoe_session_position(self.handle))

    def reset(self) -> None:
        """Forget the tokens so far (the retention cache stays warm)."""
        check(lib.smoe_session_reset(self.handle))

    def clear_cache(self) -> None:
        """Drop every retained expert blob, so the next step starts cold."""
        check(lib.smoe_cache_clear(self.handle))

    def reset_stats(self) -> None:
        check(lib.smoe_stats_reset(self.handle))

    def _ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise InvalidArgument("ids must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgument(f"ids must be integers, not {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self._vocab:
            bad = int(arr[(arr < 0) | (arr >= self._vocab)][0])
            raise BadToken(f"token id {bad} is outside the vocabulary [0, {self._vocab})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    # ------------------------------------------------------------------ the two calls
    def set_sampler(self, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    repetition_window=64, seed=0) -> None:
        sp = lib.smoe_sampler_default_params()
        sp.temperature, sp.top_k, sp.top_p, sp.min_p = temperature, top_k, top_p, min_p
        sp.repetition_penalty, sp.repetition_window, sp.seed = repetition_penalty, repetition_window, seed
        check(lib.smoe_session_set_sampler(self.handle, ffi.new("smoe_sampler_params *", sp)))

    def _step(self, token: int, want_logits=True):
        logits = np.empty(self._vocab, dtype=np.float32) if want_logits else None
        nxt = ffi.new("int32_t *")
        lp = ffi.cast("float *", ffi.from_buffer(logits)) if want_logits else ffi.NULL
        check(lib.smoe_decode_step(self.handle, int(token), lp, nxt))
        return logits, int(nxt[0])

    def _feed(self, ids: np.ndarray) -> None:
        """Everything but the last id, by the session's prefill path."""
        n_layers = len(self._union)
        union = [0] * n_layers
        if self.prefill_path == "token-serial":
            for t in ids:
                check(lib.smoe_decode_step(self.handle, int(t), ffi.NULL, ffi.NULL))
        else:
            sizes = ffi.new("uint32_t[]", n_layers)
            for start in range(0, len(ids), self.chunk):
                part = ids[start:start + self.chunk]
                check(lib.smoe_prefill_chunk(self.handle, ffi.cast("int32_t *", ffi.from_buffer(part)), len(part)))
                check(lib.smoe_stats_union_sizes(self.handle, sizes, n_layers))
                union = [u + int(sizes[i]) for i, u in enumerate(union)]
        self._union = union

    def _check_room(self, n: int) -> None:
        if self.position + n > self.context:
            raise ContextFull(f"{n} more tokens would pass the context of {self.context} (position {self.position})")

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed a prompt; returns the logits (float32, vocab) that follow its last id.

        All ids but the last go through the session's prefill path (layer-major chunks by
        default); the last through the token-serial step."""
        arr = self._ids(ids)
        self._check_room(len(arr))
        self._feed(arr[:-1])
        logits, _ = self._step(arr[-1])
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one id; returns the logits that follow it."""
        self._ids([token])
        return self._step(token)[0]

    def generate(self, ids: Sequence[int], max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 stop: Sequence[int] = ()) -> Iterator[int]:
        """Prefill ids, then yield up to max_tokens sampled ids (stops early at an id in stop or
        when the context is full)."""
        arr = self._ids(ids)
        if max_tokens < 0:
            raise InvalidArgument("max_tokens must be ≥ 0")
        self._check_room(len(arr))
        self.set_sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repetition_penalty=repetition_penalty, seed=seed)
        if max_tokens == 0:
            return
        self._feed(arr[:-1])
        _, nxt = self._step(arr[-1], want_logits=False)
        stop = set(int(s) for s in stop)
        for i in range(max_tokens):
            yield nxt
            if nxt in stop or i + 1 == max_tokens or self.position >= self.context:
                return
            _, nxt = self._step(nxt, want_logits=False)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        c = ffi.new("smoe_counters *")
        c.struct_size = ffi.sizeof("smoe_counters")
        check(lib.smoe_stats(self.handle, c))
        return {
            "position": int(c.position), "blob_reads": int(c.blob_reads), "bytes_read": int(c.bytes_read),
            "cache_hits": int(c.cache_hits), "cache_misses": int(c.cache_misses), "io_wait_s": float(c.io_wait_s),
            "prefill_s": float(c.prefill_s), "decode_s": float(c.decode_s),
            "tokens_prefilled": int(c.tokens_prefilled), "tokens_decoded": int(c.tokens_decoded),
            "resident_bytes": int(c.resident_bytes), "dense_bytes": int(c.dense_bytes),
            "cache_bytes": int(c.cache_bytes), "kv_bytes": int(c.kv_bytes), "plane_bytes": int(c.plane_bytes),
            "cache_slots": int(c.cache_slots), "direct_io": bool(c.direct_io),
            "union_sizes": list(self._union),
        }

    def kv(self, layer: int, start: int = 0, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K (after norm and RoPE) and V rows of a layer for positions [start, start + n)."""
        if n is None:
            n = self.position - start
        kv_dim = self.vault.config["num_key_value_heads"] * self.vault.config["head_dim"]
        k = np.empty((n, kv_dim), dtype=np.float32)
        v = np.empty((n, kv_dim), dtype=np.float32)
        check(lib.smoe_session_read_kv(self.handle, layer, start, n, ffi.cast("float *", ffi.from_buffer(k)),
                                       ffi.cast("float *", ffi.from_buffer(v))))
        return k, v

    def __repr__(self):
        return f"Session(position={self.position if self._h is not None else 'closed'}, prefill={self.prefill_path!r})"


__all__ = ["open_vault", "Vault", "Session", "PREFILL_PATHS"]
