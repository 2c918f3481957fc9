"""SessionPool: sessions of one vault that share one retention cache, with prefix reuse.

    pool = SessionPool(vault, max_sessions=8, cache_bytes=4 << 30, kv_budget_bytes=8 << 30)
    session, reused = pool.acquire(prompt_ids)     # KV already holds prompt_ids[:reused]
    session.set_sampler(**params.sampler_kwargs())  # the request's own sampler (reseeded)
    logits, t = session.prefill_next(prompt_ids[reused:])  # exact: as if the whole prompt were fed
    ...                                              # decode_next, or pysmoe.decode_batch with others
    pool.release(session, prompt_ids + generated)   # the ids its KV now holds

Prefix reuse. Every idle session remembers the ids its KV cache holds. acquire() hands out the
idle session whose ids share the longest exact prefix with the prompt (at most all but its last
id, so the caller always feeds one id and gets logits), rewound to that prefix
(Session.rewind: the KV rows before it are kept, exact). When no idle session shares a prefix,
acquire() makes a new session while the pool has room, and otherwise takes the least recently
released idle session and forgets its ids (an eviction). Reused or not, the logits that follow
are bit-identical: the KV rows of a prefix do not depend on how they were computed (layer-major
prefill, token-serial steps, or decode_batch all give the same rows).

Memory. The sessions share one cache (Vault.session(share_cache=...)), so it is counted once:
the pool's memory is dense weights + cache_bytes + sessions × (KV + planes). kv_budget_bytes,
when given, bounds the number of sessions to what fits at the KV bytes one session holds
(smoe_stats' kv_bytes of the first session, which the pool makes at once).

Threads. acquire and release may be called from any thread. A session handed out belongs to
the caller until released; the pool never touches it meanwhile.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

from ..engine import Session, Vault, check_int
from ..errors import Busy, InvalidArgument


class _Entry:
    __slots__ = ("session", "ids", "busy", "used")

    def __init__(self, session: Session):
        self.session = session
        self.ids: tuple[int, ...] = ()  # what its KV cache holds, when idle
        self.busy = False
        self.used = 0                   # the pool's clock at its last release (LRU)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionPool:
    """Up to max_sessions sessions of vault sharing one cache of cache_bytes (see the module's
    docstring). session_kwargs go to Vault.session for each (context, chunk, activations, ...)."""

    def __init__(self, vault: Vault, *, max_sessions: int, cache_bytes: int, threads: int | None = None,
                 kv_budget_bytes: int | None = None, **session_kwargs):
        max_sessions = check_int("max_sessions", max_sessions, 1)
        if "share_cache" in session_kwargs:
            raise InvalidArgument("SessionPool makes its sessions share its own cache; share_cache is not an option")
        self.vault = vault
        self._kwargs = session_kwargs
        first = vault.session(cache_bytes=cache_bytes, threads=threads, **session_kwargs)
        self.kv_bytes_per_session = first.stats()["kv_bytes"]
        if kv_budget_bytes is not None:
            kv_budget_bytes = check_int("kv_budget_bytes", kv_budget_bytes, 0)
            fit = kv_budget_bytes // self.kv_bytes_per_session
            if fit < 1:
                first.close()
                raise InvalidArgument(f"kv_budget_bytes {kv_budget_bytes} holds no session "
                                      f"(one session's KV cache takes {self.kv_bytes_per_session} bytes)")
            max_sessions = min(max_sessions, fit)
        self.max_sessions = max_sessions
        self.kv_budget_bytes = kv_budget_bytes
        self._entries = [_Entry(first)]
        self._by_session = {id(first): self._entries[0]}
        self._cond = threading.Condition(threading.Lock())
        self._clock = 0
        self._closed = False
        self._acquires = self._prefix_hits = self._reused_tokens = self._evictions = 0

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, prompt_ids: Sequence[int], timeout: float | None = None) -> tuple[Session, int]:
        """A session for prompt_ids and the number of its first ids whose KV the session holds
        already (its position): feed prompt_ids[reused:] next. Waits for a session to be
        released while all max_sessions are handed out (timeout: seconds, None = no limit; on
        expiry, Busy)."""
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidArgument("prompt_ids must hold at least one id")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise InvalidArgument("the session pool is closed")
                entry, reused = self._choose(prompt)
                if entry is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise Busy(f"all {self.max_sessions} sessions of the pool are in use")
                self._cond.wait(left)
            entry.busy = True
            evicted = reused == 0 and len(entry.ids) > 0
            entry.ids = ()
            self._acquires += 1
            self._prefix_hits += reused > 0
            self._reused_tokens += reused
            self._evictions += evicted
        try:
            s = entry.session
            if reused == 0:
                s.reset()  # also makes a session that broke under its last user usable again
            elif s.position != reused:
                s.rewind(reused)
        except BaseException:
            self._give_back(entry, ())
            raise
        return entry.session, reused

    def _choose(self, prompt: tuple[int, ...]) -> tuple[_Entry | None, int]:
        """Under the lock: the idle entry with the longest reusable prefix; else a new one if
        there is room; else the least recently used idle one; else (None, 0)."""
        best, best_len = None, 0
        for e in self._entries:
            if e.busy:
                continue
            n = min(_common_prefix(e.ids, prompt), len(prompt) - 1)
            if n > best_len or (n == best_len and n > 0 and e.used < best.used):
                best, best_len = e, n
        if best is not None:
            return best, best_len
        idle = [e for e in self._entries if not e.busy]
        fresh = [e for e in idle if not e.ids]
        if fresh:
            return fresh[0], 0
        if len(self._entries) < self.max_sessions:
            s = self.vault.session(share_cache=self._entries[0].session, **self._kwargs)
            e = _Entry(s)
            self._entries.append(e)
            self._by_session[id(s)] = e
            return e, 0
        if idle:
            return min(idle, key=lambda e: e.used), 0
        return None, 0

    def release(self, session: Session, ids: Sequence[int] | None) -> None:
        """Give session back. ids: the whole token history its KV cache holds (the prompt and
        the generated ids fed), for later prompts to reuse; None forgets it (after a failure,
        say). Only the first session.position ids are kept (what the KV cache holds)."""
        entry = self._by_session.get(id(session))
        if entry is None or entry.session is not session:
            raise InvalidArgument("release: not a session of this pool")
        with self._cond:
            if not entry.busy:
                raise InvalidArgument("release: the session is not handed out")
        held = ()
        if ids is not None and not session.closed:
            held = tuple(int(t) for t in ids)[:session.position]
            if session.position > len(held):
                session.rewind(len(held))
        self._give_back(entry, held)

    def _give_back(self, entry: _Entry, ids: tuple[int, ...]) -> None:
        with self._cond:
            entry.ids = ids
            entry.busy = False
            self._clock += 1
            entry.used = self._clock
            self._cond.notify()

    # ------------------------------------------------------------------ introspection, closing
    def stats(self) -> dict:
        with self._cond:
            busy = sum(e.busy for e in self._entries)
            return {
                "sessions": len(self._entries), "max_sessions": self.max_sessions, "busy": busy,
                "acquires": self._acquires, "prefix_hits": self._prefix_hits,
                "reused_tokens": self._reused_tokens, "evictions": self._evictions,
                "kv_bytes_per_session": self.kv_bytes_per_session,
                "kv_bytes": self.kv_bytes_per_session * len(self._entries),
                "kv_budget_bytes": self.kv_budget_bytes,
                "cached_tokens": sum(len(e.ids) for e in self._entries if not e.busy),
            }

    @property
    def sessions(self) -> list[Session]:
        with self._cond:
            return [e.session for e in self._entries]

    def close(self) -> None:
        """Close every session (one still in use is cancelled and waited for); safe twice."""
        with self._cond:
            self._closed = True
            entries, self._entries = self._entries, []
            self._cond.notify_all()
        for e in reversed(entries):
            e.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        s = self.stats()
        return f"SessionPool(sessions={s['sessions']}/{s['max_sessions']}, busy={s['busy']})"


__all__ = ["SessionPool"]
