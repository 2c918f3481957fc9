"""Layers 2 and 3 of the binding: Vault and Session, the Pythonic face of libsmoe.

    vault = pysmoe.open_vault(path)
    with vault.session(cache_bytes=1 << 30, threads=2) as s:
        logits = s.prefill(ids)            # layer-major by default
        for tok in s.generate(ids, max_tokens=16):
            ...

A Session holds a strong reference to its Vault, so the vault stays open while any session of
it lives. close() is explicit and idempotent; ffi.gc is only a safety net.

Threads: a Session runs one method at a time. A method called while another thread is inside
one raises Busy at once (libsmoe refuses concurrent calls the same way, SMOE_ERR_BUSY);
position and cancel() may be called at any time, from any thread or a signal handler; close()
from another thread cancels the running method and waits for it to return. A method that fails
(for any exception, Cancelled and KeyboardInterrupt included) leaves the position where it
found it: the methods that make several C calls rewind (smoe_session_rewind) before raising.
"""
from __future__ import annotations

import contextlib
import json
import numbers
import os
import pathlib
import threading
import weakref
from typing import Iterator, Sequence

import numpy as np

from ._ffi import check, ffi, lib
from .errors import BadToken, Busy, Cancelled, ContextFull, InvalidArgument, SmoeError, VaultError
from .kvdtype import KV_DTYPES
from .staging import check_complete

PREFILL_PATHS = ("layer-major", "token-serial")
ACTIVATIONS = ("q8", "f32")
DEVICES = ("cpu", "cuda")  # smoe_device's values, in order


U32, U64 = 2**32 - 1, 2**64 - 1


def open_vault(path) -> "Vault":
    """Open a vault directory (docs/vault.md; `~` is expanded). Raises VaultError if it is
    missing or corrupt, or is the leftover of an interrupted write (pysmoe.staging)."""
    try:
        p = pathlib.Path(os.path.expanduser(path))
    except TypeError:
        raise InvalidArgument(f"a vault path must be a str or os.PathLike, not {path!r}") from None
    check_complete(p)
    return Vault(p)


def _int_arg(name: str, value, low: int, high: int | None = None) -> int:
    """value as an int in [low, high], else InvalidArgument (never cffi's OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
            high is not None and value > high):
        bound = f"≥ {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgument(f"{name} must be an integer {bound}, not {value!r}")
    return int(value)


def _real_arg(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number, not {value!r}")
    return float(value)


def _stop_ids(stop) -> frozenset:
    """The stop ids of generate: an iterable of integers (None: none)."""
    if stop is None:
        return frozenset()
    try:
        items = list(stop)
    except TypeError:
        raise InvalidArgument(f"stop must be a sequence of token ids, not {stop!r}") from None
    return frozenset(_int_arg("a stop id", s, -(2**31), 2**31 - 1) for s in items)


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """value as an int in [low, high] (no upper bound when high is None), else InvalidArgument
    naming it: the binding's check of its integer arguments (a bool or a float is refused, and a
    value too large for the C field is an InvalidArgument, never cffi's OverflowError), for
    front ends that check theirs the same way."""
    return _int_arg(name, value, low, high)


def check_stop_ids(stop) -> frozenset:
    """The stop ids of Session.generate as a frozenset: an iterable of token ids (None: none),
    else InvalidArgument."""
    return _stop_ids(stop)


def _read_vault_file(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise VaultError(f"{path}: cannot read ({e.strerror or e})") from e
    except ValueError as e:  # not UTF-8
        raise VaultError(f"{path}: not valid text ({e})") from None


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
        try:
            self.path = pathlib.Path(os.path.expanduser(path))
        except TypeError:
            raise InvalidArgument(f"a vault path must be a str or os.PathLike, not {path!r}") from None
        out = ffi.new("smoe_vault **")
        check(lib.smoe_open_vault(os.fsencode(self.path), out))
        self._h = ffi.gc(out[0], lib.smoe_close_vault)
        c = ffi.new("smoe_config *")
        c.struct_size = ffi.sizeof("smoe_config")
        check(lib.smoe_vault_config(self._h, c))
        self.blob_bytes = int(c.blob_bytes)
        self.dense_bytes = int(c.dense_bytes)  # in memory; a paged embedding is not (paged_bytes)
        self.paged_bytes = int(c.paged_bytes)  # the embedding left on disk, read a row at a time
        self.file_bytes = int(c.file_bytes)
        self.num_sparse_layers = int(c.num_sparse_layers)
        # The checkpoint's own config.json names, with the engine's values authoritative.
        cfg = {}
        cfg_path = self.path / "config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(_read_vault_file(cfg_path))
            except ValueError as e:
                raise VaultError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise VaultError(f"{cfg_path}: not a JSON object")
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
            try:
                self._tokenizer = load_tokenizer(self.path)
            except OSError as e:
                raise VaultError(f"{e.filename or self.path / 'tokenizer.json'}: cannot read "
                                 f"({e.strerror or e})") from e
            except Exception as e:  # bad JSON or a tokenizer the tokenizers library refuses
                raise VaultError(f"{self.path / 'tokenizer.json'}: not a usable tokenizer ({e})") from e
        return self._tokenizer

    def verify(self) -> list[tuple[str, int, int, str]]:
        """Check every checksum and that every quantised tensor's scales and biases are finite.
        Returns the problems as (kind, layer, expert, what) — kind "header", "dense", "embedding"
        (a page of a paged embedding), "blob" or "values", layer and expert -1 outside blobs, what in words; [] if sound."""
        bad = []

        @ffi.callback("smoe_verify_fn")
        def on_bad(kind, layer, expert, what, _user):
            bad.append((ffi.string(kind).decode(), layer, expert, ffi.string(what).decode("utf-8", "replace")))

        rc = lib.smoe_verify_vault(self.handle, on_bad, ffi.NULL)
        if rc != 0 and not (rc == VaultError.code and bad):
            check(rc)
        return bad

    def session(self, cache_bytes: int = 0, threads: int | None = None, chunk: int | None = None,
                prefill: str = "layer-major", context: int = 4096, io_threads: int = 4,
                direct_io: bool = True, verify_blobs: bool = True, activations: str = "q8",
                share_cache: "Session | None" = None, coalesce_bytes: int | None = None,
                kv_dtype: str | None = None, device: str | None = None, gpu_cache_bytes: int = 0,
                part_rows: int = 0) -> "Session":
        return Session(self, cache_bytes=cache_bytes, threads=threads, chunk=chunk, prefill=prefill,
                       context=context, io_threads=io_threads, direct_io=direct_io, verify_blobs=verify_blobs,
                       activations=activations, share_cache=share_cache, coalesce_bytes=coalesce_bytes,
                       kv_dtype=kv_dtype, device=device, gpu_cache_bytes=gpu_cache_bytes, part_rows=part_rows)

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
    agree bit for bit either way.

    share_cache: an open Session of the same vault whose retention cache (streamer) and worker
    pool this one reads experts through (smoe_session_new_shared), so that decode_batch can
    advance them together. cache_bytes must then be 0 and threads None or the other's: the cache,
    threads, io_threads, direct_io and verify_blobs are the shared ones. Sessions sharing a cache
    may be closed in any order (the library counts its holders); they take turns for the calls
    that use it (a call waits while a sibling's runs, in whatever thread), and stats() shows the
    shared cache's counters on each (with `cache_sharers`; the memory of the set is dense_bytes +
    cache_bytes + the sum of each one's kv_bytes + plane_bytes).

    chunk: the most prompt tokens one layer-major pass takes. None: 256 when cache_bytes holds every
    expert (the fastest then), else 1,024 (at most the context) when its larger activation planes
    cost at most a quarter of cache_bytes: with a smaller cache each chunk reads its layer's union
    again, so fewer, larger chunks read less (memory.default_chunk; on a GPU the library's
    default, 256). Results are the same bits for any chunk.

    coalesce_bytes: the largest read request; blobs of a layer's union that lie next to each other
    in vault.bin are read as one request up to this size (None: the library's default, 16 MiB;
    0: one read per blob). Changes only how reads are issued, never what is read.

    kv_dtype: the KV cache's element type, "f32", "bf16" or "f16" (None: the library's default,
    smoe_session_default_params). K and V are rounded to it as they are stored and read back
    widened, so both prefill paths still agree bit for bit; bf16/f16 halve the KV memory
    (stats()["kv_bytes"]). bench/RESULTS.md "KV cache in bf16 and f16" has the cost and speed.

    device: "cpu" (default) or "cuda": the layers run on the first NVIDIA GPU (a libsmoe built with
    `make CUDA=1`; otherwise pysmoe.Unsupported). gpu_cache_bytes is then the budget of experts
    kept in VRAM, with cache_bytes the host cache behind it. The GPU multiplies f32 activations by
    the dequantised weights whatever `activations` says; its logits agree with the CPU's within a
    tolerance (docs/gpu.md), its two prefill paths bit for bit. `backend` names the device.

    part_rows: rows per part of a layer-major pass (0: the engine's choice). A sparse layer's
    attention and routing run a part of the rows at a time, each part's expert reads fired as it
    routes, so that the disk reads while the next part computes; the experts still run once over
    all the rows, and the bits are the same for every value (docs/streamer.md "Parts").

    One method runs at a time (the module's docstring says what happens otherwise)."""

    def __init__(self, vault: Vault, *, cache_bytes=0, threads=None, chunk=None, prefill="layer-major",
                 context=4096, io_threads=4, direct_io=True, verify_blobs=True, activations="q8",
                 share_cache: "Session | None" = None, coalesce_bytes=None, kv_dtype=None, device=None,
                 gpu_cache_bytes=0, part_rows=0):
        if prefill not in PREFILL_PATHS:
            raise InvalidArgument(f"prefill must be one of {PREFILL_PATHS}, not {prefill!r}")
        if activations not in ACTIVATIONS:
            raise InvalidArgument(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
        if device is None:  # a share's sessions run on its device
            device = share_cache.device if isinstance(share_cache, Session) else "cpu"
        if device not in DEVICES:
            raise InvalidArgument(f"device must be one of {DEVICES}, not {device!r}")
        if isinstance(share_cache, Session) and device != share_cache.device:
            raise InvalidArgument(f"device must be the shared session's ({share_cache.device!r}) with share_cache, "
                                  f"not {device!r}")
        gpu_cache_bytes = _int_arg("gpu_cache_bytes", gpu_cache_bytes, 0, U64)
        cache_bytes = _int_arg("cache_bytes", cache_bytes, 0, U64)
        chunk = None if chunk is None else _int_arg("chunk", chunk, 1, U32)
        context = _int_arg("context", context, 1, U32)
        io_threads = _int_arg("io_threads", io_threads, 1, U32)
        threads = None if threads is None else _int_arg("threads", threads, 1, U32)
        coalesce_bytes = None if coalesce_bytes is None else _int_arg("coalesce_bytes", coalesce_bytes, 0, U64)
        part_rows = _int_arg("part_rows", part_rows, 0, U32)
        self.vault = vault  # strong reference: the vault outlives the session
        p = lib.smoe_session_default_params()
        p.cache_bytes = cache_bytes
        if threads is not None:
            p.threads = threads
        if chunk is None and device == "cpu":  # memory.default_chunk: 256 if every expert fits, else 1024
            from .memory import default_chunk
            budget = share_cache.cache_bytes if isinstance(share_cache, Session) else cache_bytes
            chunk = default_chunk(vault, budget, min(context, vault.config["max_position_embeddings"]))
        if chunk is not None:  # None (on a GPU): the library's default (smoe_session_default_params)
            p.chunk = chunk
        p.context = context
        p.io_threads = io_threads
        p.direct_io = bool(direct_io)
        p.verify_blobs = bool(verify_blobs)
        p.float_activations = activations == "f32"
        if coalesce_bytes is not None:
            p.coalesce_bytes = coalesce_bytes
        if kv_dtype is not None:
            p.kv_dtype = KV_DTYPES.index(kv_dtype)
        p.device = DEVICES.index(device)
        p.gpu_cache_bytes = gpu_cache_bytes
        p.part_rows = part_rows
        params = ffi.new("smoe_session_params *", p)
        out = ffi.new("smoe_session **")
        if share_cache is None:
            check(lib.smoe_session_new(vault.handle, params, out))
        else:
            if not isinstance(share_cache, Session) or share_cache.vault is not vault:
                raise InvalidArgument("share_cache must be a Session of the same Vault object, "
                                      f"not {share_cache!r}")
            if cache_bytes != 0:
                raise InvalidArgument("cache_bytes must be 0 with share_cache: the cache is the shared session's "
                                      f"({share_cache.cache_bytes} bytes asked there)")
            if threads is not None and threads != share_cache.threads:
                raise InvalidArgument(f"threads must be None with share_cache (the shared pool has "
                                      f"{share_cache.threads}), not {threads}")
            with share_cache._hlock:  # not closed under us
                check(lib.smoe_session_new_shared(share_cache.handle, params, out))
            p.threads = share_cache.threads
            cache_bytes = share_cache.cache_bytes
        self._h = ffi.gc(out[0], lib.smoe_session_free)
        self._lock = threading.Lock()    # held by the thread inside a method (others get Busy)
        self._owner = None               # that thread's id
        self._hlock = threading.RLock()  # guards the handle for position and cancel, which skip _lock
        self._cancelled = False          # cancel() since the running method began
        self._close_pending = False      # close() came from inside a method (a signal handler)
        vault._sessions.add(self)
        self.prefill_path = prefill
        self.activations = activations
        self.kv_dtype = KV_DTYPES[p.kv_dtype]
        self.device = device
        self.gpu_cache_bytes = gpu_cache_bytes
        self.backend = ffi.string(lib.smoe_session_backend(self._h)).decode()
        self.chunk = int(p.chunk)
        self.context = min(context, vault.config["max_position_embeddings"])
        self.threads = int(p.threads)
        self.cache_bytes = cache_bytes  # the budget asked (of the shared session, with share_cache)
        self._vocab = vault.config["vocab_size"]
        self._union = [0] * vault.config["num_hidden_layers"]
        self._sampler = None

    # ------------------------------------------------------------------ plumbing
    @property
    def handle(self):
        if self._h is None:
            raise InvalidArgument("the session is closed")
        return self._h

    @contextlib.contextmanager
    def _claim(self, fresh: bool = True, rewind_to: int | None = None):
        """Holds the session for one method; Busy if another thread holds it. fresh: a new
        method, so an earlier cancel() is forgotten (as libsmoe forgets it). rewind_to: on any
        exception the position goes back there (None: where this claim found it)."""
        if not self._lock.acquire(blocking=False):
            raise Busy("another call is running on this session (in another thread)")
        try:
            self._owner = threading.get_ident()
            if fresh:
                self._cancelled = False
            h = self.handle
            start = int(lib.smoe_session_position(h)) if rewind_to is None else rewind_to
            try:
                yield start
            except BaseException:
                if self._h is not None:
                    lib.smoe_session_rewind(self._h, start)  # ≤ the position now: cannot fail
                raise
        finally:
            self._owner = None
            self._lock.release()
            if self._close_pending:
                self.close()

    def _call(self, fn, *args) -> None:
        """One C call of a method, unless cancel() came since the method began."""
        if self._cancelled:
            raise Cancelled("cancelled (Session.cancel)")
        check(fn(self.handle, *args))

    def cancel(self) -> None:
        """Ask the method running on this session to stop: it raises Cancelled within a layer's
        time (libsmoe checks between layers), the position where it was before the method.
        Safe from any thread and from a signal handler (it takes no lock a method holds). A
        cancel while no method runs is ignored, as is one that comes as a method finishes."""
        self._cancelled = True
        with self._hlock:
            if self._h is not None:
                lib.smoe_session_cancel(self._h)

    def close(self) -> None:
        """Free the session; safe twice. A method running in another thread is cancelled and
        waited for; called from inside a method (a signal handler), the session closes as that
        method returns."""
        if self._h is None:
            return
        self.cancel()
        if self._owner == threading.get_ident():
            self._close_pending = True
            return
        with self._lock:
            with self._hlock:
                h, self._h = self._h, None
            if h is None:
                return
            ffi.release(h)
        self._close_pending = False
        self.vault._sessions.discard(self)
        self.vault._release_if_idle()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def position(self) -> int:
        """Tokens in the KV cache (as the last finished call left them: safe at any time)."""
        with self._hlock:
            return int(lib.smoe_session_position(self.handle))

    def reset(self) -> None:
        """Forget the tokens so far (the retention cache stays warm)."""
        with self._claim():
            self._call(lib.smoe_session_reset)

    def rewind(self, position: int) -> None:
        """Forget the tokens after position (≤ the current one); exact: the KV rows before it are
        kept."""
        position = _int_arg("position", position, 0, U32)
        with self._claim():
            self._call(lib.smoe_session_rewind, position)

    def clear_cache(self) -> None:
        """Drop every retained expert blob, so the next step starts cold."""
        with self._claim():
            self._call(lib.smoe_cache_clear)

    def reset_stats(self) -> None:
        with self._claim():
            self._call(lib.smoe_stats_reset)

    # ------------------------------------------------------------------ checks for front ends
    # What prefill and generate check before anything is fed, for a caller that drives the
    # session itself (pysmoe.generate, the server) and refuses the same arguments first.
    @property
    def closed(self) -> bool:
        """True once close() has freed the session."""
        return self._h is None

    def check_ids(self, ids) -> np.ndarray:
        """ids as the contiguous int32 array that prefill feeds: InvalidArgument unless a
        non-empty 1-D sequence of integers, BadToken for an id outside the vocabulary."""
        return self._ids(ids)

    def check_room(self, n: int) -> None:
        """ContextFull unless n more tokens fit the context after the current position."""
        self._check_room(n)

    @staticmethod
    def check_sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                      repetition_window=64, seed=0, presence_penalty=0.0, frequency_penalty=0.0) -> None:
        """InvalidArgument unless set_sampler (and generate) take these values: types and ranges."""
        Session._sampler_params(temperature, top_k, top_p, min_p, repetition_penalty, repetition_window, seed,
                                presence_penalty, frequency_penalty)

    def _ids(self, ids) -> np.ndarray:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"ids must be a 1-D sequence of token ids ({e})") from None
        if arr.ndim != 1 or arr.size == 0:
            raise InvalidArgument("ids must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgument(f"ids must be integers, not {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self._vocab:
            bad = int(arr[(arr < 0) | (arr >= self._vocab)][0])
            raise BadToken(f"token id {bad} is outside the vocabulary [0, {self._vocab})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    # ------------------------------------------------------------------ the two calls
    @staticmethod
    def _sampler_params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                        repetition_window=64, seed=0, presence_penalty=0.0, frequency_penalty=0.0):
        """The smoe_sampler_params of these values, each checked for type and range (libsmoe
        checks the real-valued ones again)."""
        sp = ffi.new("smoe_sampler_params *", lib.smoe_sampler_default_params())
        sp.temperature = _real_arg("temperature", temperature)
        sp.top_p = _real_arg("top_p", top_p)
        sp.min_p = _real_arg("min_p", min_p)
        sp.repetition_penalty = _real_arg("repetition_penalty", repetition_penalty)
        sp.presence_penalty = _real_arg("presence_penalty", presence_penalty)
        sp.frequency_penalty = _real_arg("frequency_penalty", frequency_penalty)
        sp.top_k = _int_arg("top_k", top_k, 0, U32)
        sp.repetition_window = _int_arg("repetition_window", repetition_window, 0, U32)
        sp.seed = _int_arg("seed", seed, 0, U64)
        if not (sp.temperature >= 0 and 0 < sp.top_p <= 1 and 0 <= sp.min_p <= 1 and sp.repetition_penalty > 0
                and -2 <= sp.presence_penalty <= 2 and -2 <= sp.frequency_penalty <= 2):
            raise InvalidArgument("sampler: temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1, repetition_penalty > 0, "
                                  "presence_penalty and frequency_penalty in [-2, 2] "
                                  f"(got {temperature!r}, {top_p!r}, {min_p!r}, {repetition_penalty!r}, "
                                  f"{presence_penalty!r}, {frequency_penalty!r})")
        return sp

    def set_sampler(self, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    repetition_window=64, seed=0, presence_penalty=0.0, frequency_penalty=0.0) -> None:
        """The session's sampler (the one sampler, libsmoe's: smoe.h, "sampler"), which draws the
        ids of generate, prefill_next, decode_next and decode_batch(..., sample=True): every front
        end's (stream_generate, run, chat, the server). Reseeds it (seed: a uint64) and forgets the
        counts of the presence and frequency penalties."""
        sp = self._sampler_params(temperature, top_k, top_p, min_p, repetition_penalty, repetition_window, seed,
                                  presence_penalty, frequency_penalty)
        with self._claim():
            self._call(lib.smoe_session_set_sampler, sp)

    def set_mask(self, bitmask) -> None:
        """Constrain the ids the sampler may draw (structured output): bitmask is
        ceil(vocab_size / 32) uint32 words (or int32, as llguidance fills them), id allowed when
        bit id % 32 of word id // 32 is set; None lifts it. In force for every id the session
        draws until set again, lifted, or set_sampler runs (smoe.h, smoe_session_set_mask).
        InvalidArgument for a wrong size or a mask that allows no id."""
        if bitmask is None:
            ptr, n = ffi.NULL, 0
        else:
            words = np.ascontiguousarray(bitmask)
            if words.ndim != 1 or words.dtype not in (np.uint32, np.int32):
                raise InvalidArgument(f"a token mask is a 1-D array of 32-bit words, not {words.dtype} "
                                      f"of shape {words.shape}")
            ptr, n = ffi.cast("const uint32_t *", ffi.from_buffer(words)), words.size
        with self._claim():
            self._call(lib.smoe_session_set_mask, ptr, n)

    def _step(self, token: int, want_logits=True, want_id=True):
        logits = np.empty(self._vocab, dtype=np.float32) if want_logits else None
        nxt = ffi.new("int32_t *") if want_id else ffi.NULL
        lp = ffi.cast("float *", ffi.from_buffer(logits)) if want_logits else ffi.NULL
        self._call(lib.smoe_decode_step, int(token), lp, nxt)
        return logits, int(nxt[0]) if want_id else None

    def _feed(self, ids: np.ndarray, want_logits=True, want_id=False, rows=None):
        """All of ids by the session's prefill path; returns (logits after the last id or None, an id
        sampled after it or None, the logits after ids[rows] when rows is given: rows then end at the
        last id if want_logits). Layer-major chunks hand back the last position's logits themselves:
        no token-serial pass."""
        n_layers = len(self._union)
        union = [0] * n_layers
        echo = None if rows is None else np.empty((len(rows), self._vocab), dtype=np.float32)
        logits = np.empty(self._vocab, dtype=np.float32) if want_logits else None
        nxt = ffi.new("int32_t *") if want_id else ffi.NULL
        if self.prefill_path == "token-serial":
            want = set() if rows is None else {int(r): i for i, r in enumerate(rows)}
            for j, t in enumerate(ids):
                last = j + 1 == len(ids)
                if last or j in want:
                    row = np.empty(self._vocab, dtype=np.float32)
                    self._call(lib.smoe_decode_step, int(t), ffi.cast("float *", ffi.from_buffer(row)),
                               nxt if last else ffi.NULL)
                    if j in want:
                        echo[want[j]] = row
                    if last and want_logits:
                        logits[:] = row
                else:
                    self._call(lib.smoe_decode_step, int(t), ffi.NULL, ffi.NULL)
        else:
            sizes = ffi.new("uint32_t[]", n_layers)
            rows = np.asarray([] if rows is None else rows, dtype=np.uint32)
            for start in range(0, len(ids), self.chunk):
                part = ids[start:start + self.chunk]
                last = start + self.chunk >= len(ids)
                mine = np.flatnonzero((rows >= start) & (rows < start + len(part)))
                lp = ffi.cast("float *", ffi.from_buffer(logits)) if last and want_logits else ffi.NULL
                nid = nxt if last else ffi.NULL
                if len(mine):
                    local = np.ascontiguousarray(rows[mine] - start, dtype=np.uint32)
                    out = np.empty((len(mine), self._vocab), dtype=np.float32)
                    self._call(lib.smoe_prefill_rows, ffi.cast("int32_t *", ffi.from_buffer(part)), len(part),
                               ffi.cast("uint32_t *", ffi.from_buffer(local)), len(local),
                               ffi.cast("float *", ffi.from_buffer(out)), nid)
                    echo[mine] = out
                    if lp != ffi.NULL:  # rows end at the last id when its logits are wanted (prefill_logits)
                        logits[:] = out[-1]
                else:
                    self._call(lib.smoe_prefill_chunk, ffi.cast("int32_t *", ffi.from_buffer(part)), len(part), lp,
                               nid)
                self._call(lib.smoe_stats_union_sizes, sizes, n_layers)
                union = [u + int(sizes[i]) for i, u in enumerate(union)]
            self._union = union
        return logits, (int(nxt[0]) if want_id else None), echo

    def _check_room(self, n: int) -> None:
        if self.position + n > self.context:
            raise ContextFull(f"{n} more tokens would pass the context of {self.context} (position {self.position})")

    def prefill(self, ids: Sequence[int], want_logits: bool = True) -> np.ndarray | None:
        """Feed a prompt; returns the logits (float32, vocab) that follow its last id.

        The ids go through the session's prefill path: layer-major chunks by default, the last of
        which hands back the logits (bit for bit those of feeding every id token-serially).
        want_logits=False feeds the ids and computes no logits: a prompt fed in pieces asks for
        them with its last piece only. On any exception the position is where it was before."""
        arr = self._ids(ids)
        with self._claim():
            self._check_room(len(arr))
            logits, _, _ = self._feed(arr, want_logits=want_logits)
        return logits

    def prefill_logits(self, ids: Sequence[int], rows: Sequence[int], sample: bool = False):
        """Feed ids as prefill() does and return the logits (len(rows), vocab) that follow each id
        ids[r], r in rows (strictly increasing indices into ids): an echo's log-probabilities
        without a token-serial pass. sample: also draw the next id after the last of ids with the
        session's sampler, as prefill_next does, and return (logits, id)."""
        arr = self._ids(ids)
        try:
            r = np.asarray(rows, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"rows must be a sequence of indices into ids ({e})") from None
        if r.size and (r[0] < 0 or r[-1] >= len(arr) or np.any(np.diff(r) <= 0)):
            raise InvalidArgument(f"rows must increase strictly and lie in [0, {len(arr)}), not {list(r[:8])}...")
        if r.size and r[-1] != len(arr) - 1:
            rr = np.append(r, len(arr) - 1)
        else:
            rr = r
        with self._claim():
            self._check_room(len(arr))
            _, nxt, echo = self._feed(arr, want_logits=False, want_id=sample, rows=rr)
        return (echo[:len(r)], nxt) if sample else echo[:len(r)]

    def decode(self, token: int) -> np.ndarray:
        """Feed one id; returns the logits that follow it."""
        self._ids([token])
        with self._claim():
            return self._step(token, want_id=False)[0]

    def prefill_next(self, ids: Sequence[int], want_logits: bool = True) -> tuple[np.ndarray | None, int]:
        """prefill(ids), and the next id drawn after it by the session's sampler (set_sampler):
        (logits or None, id). The one sampler every front end uses (smoe.h, "sampler")."""
        arr = self._ids(ids)
        with self._claim():
            self._check_room(len(arr))
            logits, nxt, _ = self._feed(arr, want_logits=want_logits, want_id=True)
        return logits, nxt

    def decode_next(self, token: int, want_logits: bool = True) -> tuple[np.ndarray | None, int]:
        """decode(token), and the next id the session's sampler draws after it: (logits or None, id)."""
        self._ids([token])
        with self._claim():
            return self._step(token, want_logits=want_logits)

    def generate(self, ids: Sequence[int], max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 stop: Sequence[int] = (), presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0) -> Iterator[int]:
        """Prefill ids, then yield up to max_tokens sampled ids (stops early at an id in stop or
        when the context is full). Every argument is checked here, before anything is fed; the
        work happens as the iterator is consumed. If it raises (Cancelled included), the
        position is where it was before the prompt; closing the iterator early keeps what was fed."""
        arr = self._ids(ids)
        max_tokens = _int_arg("max_tokens", max_tokens, 0)
        sp = self._sampler_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=repetition_penalty, seed=seed,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        stop = _stop_ids(stop)
        self._check_room(len(arr))
        return self._generate(arr, max_tokens, sp, stop)

    def _generate(self, arr: np.ndarray, max_tokens: int, sp, stop: frozenset) -> Iterator[int]:
        with self._claim() as start:
            self._call(lib.smoe_session_set_sampler, sp)
            if max_tokens == 0:
                return
            self._check_room(len(arr))
            _, nxt, _ = self._feed(arr, want_logits=False, want_id=True)
        for i in range(max_tokens):
            yield nxt
            if nxt in stop or i + 1 == max_tokens or self.position >= self.context:
                return
            # Not held across the yield: the consumer may use other sessions, or this one's
            # position, meanwhile. A cancel() since the prompt still counts.
            with self._claim(fresh=False, rewind_to=start):
                _, nxt = self._step(nxt, want_logits=False)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        c = ffi.new("smoe_counters *")
        c.struct_size = ffi.sizeof("smoe_counters")
        with self._claim():
            self._call(lib.smoe_stats, c)
        return {
            "position": int(c.position), "blob_reads": int(c.blob_reads), "bytes_read": int(c.bytes_read),
            "cache_hits": int(c.cache_hits), "cache_misses": int(c.cache_misses), "io_wait_s": float(c.io_wait_s),
            "prefill_s": float(c.prefill_s), "decode_s": float(c.decode_s),
            "tokens_prefilled": int(c.tokens_prefilled), "tokens_decoded": int(c.tokens_decoded),
            "resident_bytes": int(c.resident_bytes), "dense_bytes": int(c.dense_bytes),
            "cache_bytes": int(c.cache_bytes), "kv_bytes": int(c.kv_bytes), "plane_bytes": int(c.plane_bytes),
            "cache_slots": int(c.cache_slots), "direct_io": bool(c.direct_io), "kv_dtype": self.kv_dtype,
            "read_requests": int(c.read_requests), "union_sizes": list(self._union),
            "cache_sharers": int(c.cache_sharers), "batch_steps": int(c.batch_steps),
            "batch_tokens": int(c.batch_tokens), "batch_blob_reads": int(c.batch_blob_reads),
        }

    def device_stats(self) -> dict:
        """The device's counters (smoe_device_stats): expert uploads host → VRAM, VRAM cache hits and
        misses, VRAM in use. All zero for device="cpu"."""
        c = ffi.new("smoe_device_counters *")
        c.struct_size = ffi.sizeof("smoe_device_counters")
        with self._claim():
            self._call(lib.smoe_device_stats, c)
        return {"device": DEVICES[c.device], "uploads": int(c.uploads), "upload_bytes": int(c.upload_bytes),
                "vram_hits": int(c.vram_hits), "vram_misses": int(c.vram_misses),
                "vram_cache_bytes": int(c.vram_cache_bytes), "vram_other_bytes": int(c.vram_other_bytes),
                "vram_slots": int(c.vram_slots)}

    def kv(self, layer: int, start: int = 0, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K (after norm and RoPE) and V rows of a layer for positions [start, start + n), as
        float32 arrays holding exactly the stored values (bf16/f16 widened)."""
        layer = _int_arg("layer", layer, 0, U32)
        start = _int_arg("start", start, 0, U32)
        with self._claim():
            if n is None:
                n = self.position - start
            n = _int_arg("n", n, 0, U32)
            kv_dim = self.vault.config["num_key_value_heads"] * self.vault.config["head_dim"]
            k = np.empty((n, kv_dim), dtype=np.float32)
            v = np.empty((n, kv_dim), dtype=np.float32)
            self._call(lib.smoe_session_read_kv, layer, start, n, ffi.cast("float *", ffi.from_buffer(k)),
                       ffi.cast("float *", ffi.from_buffer(v)))
        return k, v

    def __repr__(self):
        return f"Session(position={self.position if self._h is not None else 'closed'}, prefill={self.prefill_path!r})"


def decode_batch(sessions: Sequence[Session], tokens: Sequence[int], sample: bool = False, want_logits: bool = True):
    """Advance sessions[i] by tokens[i], all in one layer-major pass (smoe_decode_batch): per
    layer the union of their experts is read once and applied to every session routed to it.
    Returns each session's float32 logits, bit-identical to sessions[i].decode(tokens[i]) alone
    (logits, KV and position), whatever the batch and its order; with sample, (logits, ids): each
    session's next id too, drawn by its own sampler as decode_next would draw it. want_logits=False
    (with sample) copies no logits out: (None, ids).

    The sessions must be distinct, open, idle and share one cache (Vault.session(share_cache=...)).
    On any error nothing advanced, and the exception (InvalidArgument, BadToken, ContextFull,
    Busy, Cancelled, ...) carries `session_index`: the position in `sessions` of the session at
    fault, or None when the failure is the whole batch's (a failed read, say)."""
    sessions = list(sessions)
    try:
        tokens = [int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else None for t in tokens]
    except TypeError:
        raise InvalidArgument(f"tokens must be a sequence of token ids, not {tokens!r}") from None
    if not sessions or len(sessions) != len(tokens):
        raise InvalidArgument(f"decode_batch needs one token per session and at least one session "
                              f"({len(sessions)} sessions, {len(tokens)} tokens)")

    def fail(cls, i, message):
        e = cls(message)
        e.session_index = i
        return e

    seen = {}
    for i, (s, t) in enumerate(zip(sessions, tokens)):
        if not isinstance(s, Session):
            raise fail(InvalidArgument, i, f"sessions[{i}] is not a Session: {s!r}")
        if id(s) in seen:
            raise fail(InvalidArgument, i, f"sessions[{i}] is sessions[{seen[id(s)]}] again")
        seen[id(s)] = i
        if s._h is None:
            raise fail(InvalidArgument, i, f"sessions[{i}] is closed")
        if t is None or not (0 <= t < s._vocab):
            raise fail(BadToken, i, f"tokens[{i}] = {tokens[i]!r} is not a token id in [0, {s._vocab})")
    vocab = sessions[0]._vocab
    if not want_logits and not sample:
        raise InvalidArgument("decode_batch with want_logits=False returns only the sampled ids: pass sample=True")
    logits = np.empty((len(sessions) if want_logits else 1, vocab), dtype=np.float32)
    ids = np.asarray(tokens, dtype=np.int32)
    nxt = np.full(len(sessions), -1, dtype=np.int32)
    failed = ffi.new("int32_t *", -1)
    with contextlib.ExitStack() as stack:
        for i, s in enumerate(sessions):
            try:
                stack.enter_context(s._claim())
            except SmoeError as e:
                e.session_index = i
                raise
        for i, s in enumerate(sessions):
            if s._cancelled:
                raise fail(Cancelled, i, f"sessions[{i}] was cancelled (Session.cancel)")
        handles = ffi.new("smoe_session *[]", [s._h for s in sessions])
        rc = lib.smoe_decode_batch(handles, ffi.cast("int32_t *", ffi.from_buffer(ids)), len(sessions),
                                   ffi.cast("float *", ffi.from_buffer(logits)) if want_logits else ffi.NULL,
                                   ffi.cast("int32_t *", ffi.from_buffer(nxt)) if sample else ffi.NULL, failed)
        try:
            check(rc)
        except SmoeError as e:
            e.session_index = None if failed[0] < 0 else int(failed[0])
            raise
    out = list(logits) if want_logits else None
    return (out, [int(i) for i in nxt]) if sample else out


MAX_TOP_LOGPROBS = int(lib.SMOE_TOP_LOGPROBS)


def logprobs(logits, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probabilities from logits (log-softmax in double; NaN counts as −inf; libsmoe's
    smoe_logprobs): token's, and the top_n likeliest ids with theirs, best first (ties: lower id)."""
    v = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    top_n = _int_arg("top_n", top_n, 0, min(MAX_TOP_LOGPROBS, v.size))
    token = _int_arg("token", token, 0, v.size - 1)
    lp = ffi.new("double *")
    ids = np.empty(max(top_n, 1), dtype=np.int32)
    lps = np.empty(max(top_n, 1), dtype=np.float64)
    check(lib.smoe_logprobs(ffi.cast("float *", ffi.from_buffer(v)), v.size, token, top_n, lp,
                            ffi.cast("int32_t *", ffi.from_buffer(ids)), ffi.cast("double *", ffi.from_buffer(lps))))
    return float(lp[0]), [(int(i), float(x)) for i, x in zip(ids[:top_n], lps[:top_n])]


__all__ = ["open_vault", "Vault", "Session", "PREFILL_PATHS", "KV_DTYPES", "decode_batch", "logprobs",
           "MAX_TOP_LOGPROBS", "check_int", "check_stop_ids"]
