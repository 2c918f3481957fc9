"""The engine thread: continuous batching of requests over a SessionPool.

One thread owns every session (a session is single-threaded, design.md); HTTP handlers hand it
Jobs and receive events through a callback. Each turn of its loop:

  1. admits queued jobs while fewer than max_batch run: pool.acquire(prompt) gives a session whose
     KV already holds the longest cached prefix of the prompt (prefix reuse), and the session's
     sampler is set from the request's SamplingParams (Session.set_sampler: reseeded, the
     penalties' counts forgotten);
  2. prefills ONE chunk (at most `chunk` tokens) of the oldest job still prefilling, so a long
     new prompt costs the running streams one chunk's time per token, not the whole prompt's;
     its last chunk (Session.prefill_next) hands back the first id, drawn by the session's sampler;
  3. advances every decoding job by one token: with batching, one pysmoe.decode_batch call (one
     layer-major pass, each layer's union of experts read once, bit-identical to each session
     decoding alone, each session drawing its next id with its own sampler); without
     (batching=False, the benchmark's baseline), one Session.decode_next per job in turn, i.e.
     interleaved token by token;
  4. finishes jobs (stop, length, cancelled, error): pool.release(session, ids in its KV) keeps
     the KV for a later request with the same prefix.

Echo with logprobs (lm-evaluation-harness's log-likelihoods): such a job's prompt is fed from
position 0 (no prefix reuse: every prompt position's logits are wanted) in pieces whose logits
take at most ECHO_ROWS_BYTES, each by Session.prefill_logits (the logits after every id of the
piece from the layer-major pass itself, no token-serial pass); the last piece also draws the first
id, unless max_tokens is 0 (the prompt only: the job ends after its prefill, "length").

Several choices of one prompt (n > 1) are a chain of jobs (Job.then): the first is queued, the
others run one after another on its session, each starting from the prompt's KV (rewound to the
prompt less its last id, which is fed again so the choice draws its own first id): the prompt is
prefilled once, not n times. A chain that fails or is cancelled ends every job of it.

A cancelled job (its client went away) leaves at the next turn; one that is prefilling is
stopped inside libsmoe by Session.cancel (within a layer) and its KV rewinds to the last whole
chunk. The ids come from the engine's one sampler, as Session.generate's do: a seeded request
gives the ids Session.generate gives for the same arguments, batched or not, on the CPU or the
GPU. Logits are copied out of the engine only for requests that want logprobs. The text side of
a job (stop strings, detokenisation, the output parser, logprobs) is its `text` object, which
runs here too so a stop decision takes effect before the next step.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Callable

from ..errors import Cancelled, SmoeError

log = logging.getLogger("pysmoe.server")

ECHO_ROWS_BYTES = 64 << 20  # the most logits (float32) one echo prefill piece hands back


class Job:
    """One request inside the scheduler. text: its server.text.RequestText (the sampler's
    settings, stop strings, the parser; it decides when the job ends). emit(kind, payload) is
    called from the engine thread: ("token", textgen Step) per generated token with something to show, then ("done", (finish_reason, usage)) or
    ("error", exception) exactly once (a cancelled job's reason is "cancelled")."""

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], text, emit: Callable):
        self.id = next(self._ids)
        self.prompt_ids = list(prompt_ids)
        self.text = text
        self.emit = emit
        self.cancelled = False
        self.session = None
        self.reused = 0           # prompt tokens whose KV came from the pool
        self.fed: list[int] = []  # ids in the session's KV
        self.pending: list[int] = []
        self.next_token: int | None = None
        self.generated = 0
        self.finished = False
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.then: Job | None = None  # the next choice of the same prompt, run on this job's session after it

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.generated,
                "total_tokens": len(self.prompt_ids) + self.generated,
                "prompt_tokens_details": {"cached_tokens": self.reused}}


class Metrics:
    """Counters of the scheduler; read through Scheduler.metrics()."""

    def __init__(self):
        self.started = time.time()
        self.requests = collections.Counter()      # by outcome: admitted, stop, length, cancelled, error
        self.prompt_tokens = 0
        self.prompt_tokens_reused = 0
        self.completion_tokens = 0
        self.decode_steps = 0
        self.decode_s = 0.0
        self.decode_blob_reads = 0                 # blobs read by decode steps (the shared cache's counter)
        self.prefill_blob_reads = 0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.batch_sizes = collections.Counter()   # decode step size → steps
        self.ttft_s = collections.deque(maxlen=1000)
        self.tps = collections.deque(maxlen=1000)  # per finished request: tokens/s after the first


def _quantile(values, q: float) -> float | None:
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, int(q * len(v)))]


class Scheduler:
    def __init__(self, pool, *, max_batch: int, context: int, chunk: int = 256, batching: bool = True,
                 decode_batch=None):
        self.pool = pool
        # Never more jobs than the pool has sessions (its KV budget may allow fewer): acquire()
        # would wait for a release that only this thread can make.
        self.max_batch = min(max_batch, getattr(pool, "max_sessions", max_batch))
        self.context = context
        self.chunk = chunk
        self.batching = batching
        if decode_batch is None:
            from .. import decode_batch
        self._decode_batch = decode_batch
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._calls: collections.deque = collections.deque()
        self._active: list[Job] = []
        self._prefilling: Job | None = None
        self._stopping = False
        self.metrics_data = Metrics()
        self._thread = threading.Thread(target=self._loop, name="pysmoe-scheduler", daemon=True)

    # ------------------------------------------------------------------ other threads
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._prefilling is not None:
            self._prefilling.session.cancel()
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client went away): it leaves at the next turn, a running prefill
        within a layer. Safe from any thread, any number of times."""
        with self._cv:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                self._finish(job, "cancelled")
            self._cv.notify()
        running = self._prefilling
        if running is job and job.session is not None:
            job.session.cancel()

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() on the engine thread between two steps (sessions are single-threaded)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    @property
    def load(self) -> dict:
        with self._cv:
            return {"running": len(self._active), "queued": len(self._queue), "max_batch": self.max_batch}

    def metrics(self) -> dict:
        """A snapshot of the counters plus the pool's and the engine's I/O figures (computed on
        the engine thread)."""
        return self.call(self._metrics).result()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._queue or self._active or self._calls):
                    self._cv.wait()
                if self._stopping:
                    break
                calls, self._calls = list(self._calls), collections.deque()
                admit = []
                while self._queue and len(self._active) + len(admit) < self.max_batch:
                    admit.append(self._queue.popleft())
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
            for job in admit:
                self._admit(job)
            self._reap()
            pre = next((j for j in self._active if j.pending), None)
            if pre is not None:
                self._prefill_chunk(pre)
            ready = [j for j in self._active if not j.pending and not j.finished and not j.cancelled]
            if ready:
                self._decode(ready)
            self._reap()
        for job in list(self._active) + list(self._queue):
            self._finish(job, "cancelled")

    def _admit(self, job: Job) -> None:
        m = self.metrics_data
        m.requests["admitted"] += 1
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        try:
            session, reused = self.pool.acquire(job.prompt_ids)
        except SmoeError as e:
            self._fail(job, e)
            return
        # At least the last prompt id is fed again: its logits start the generation. An echo with
        # logprobs wants the logits after every prompt id: nothing is reused.
        reused = 0 if job.text.needs_prompt_rows else min(reused, len(job.prompt_ids) - 1)
        m.prompt_tokens += len(job.prompt_ids)
        self._start(job, session, reused)

    def _start(self, job: Job, session, reused: int) -> None:
        """Run job on session, whose KV holds job.prompt_ids[:reused] (at least)."""
        self.metrics_data.prompt_tokens_reused += reused
        job.session, job.reused = session, reused
        job.fed = job.prompt_ids[:reused]
        job.pending = job.prompt_ids[reused:]
        self._active.append(job)  # from here _reap gives the session back, whatever happens
        try:
            if session.position > reused:
                session.rewind(reused)
            session.set_sampler(**job.text.sampler_kwargs())
            self._set_mask(job)
        except Exception as e:  # SmoeError, or the request's grammar
            self._fail(job, e)

    @staticmethod
    def _set_mask(job: Job) -> None:
        """A request with a grammar (server.grammar): the ids it allows for the session's next draw."""
        mask = job.text.next_mask()
        if mask is not None:
            job.session.set_mask(mask)

    def _prefill_chunk(self, job: Job) -> None:
        echo = job.text.needs_prompt_rows
        size = self.chunk
        if echo:
            size = max(1, min(size, ECHO_ROWS_BYTES // (4 * self.pool.vault.config["vocab_size"])))
        part = job.pending[:size]
        last = len(part) == len(job.pending)
        draw = last and job.text.draws
        logits = token = None
        reads = self._blob_reads()
        t = time.perf_counter()
        self._prefilling = job
        try:
            if job.cancelled:
                raise Cancelled("cancelled before the chunk")
            s = job.session
            if echo:  # the logits after every id of the piece, from the layer-major pass
                rows = range(len(part))
                if draw:
                    out, token = s.prefill_logits(part, rows, sample=True)
                    logits = out[-1]
                else:
                    out = s.prefill_logits(part, rows)
                job.text.add_prompt_rows(len(job.fed), out)
                del out
            elif draw:  # the prompt's last piece: the first id, drawn by the session's sampler
                logits, token = s.prefill_next(part, want_logits=job.text.wants_logits)
            else:
                s.prefill(part, want_logits=False)
        except Cancelled:
            job.cancelled = True
            return
        except SmoeError as e:
            self._fail(job, e)
            return
        finally:
            self._prefilling = None
            self.metrics_data.prefill_blob_reads += self._blob_reads() - reads
        m = self.metrics_data
        m.prefill_tokens += len(part)
        m.prefill_s += time.perf_counter() - t
        job.fed.extend(part)
        del job.pending[:len(part)]
        if not job.pending:
            job.t_first = time.perf_counter()
            m.ttft_s.append(job.t_first - job.t_submit)
            if job.text.echo:
                job.emit("echo", None)
            if draw:
                self._emit_token(job, token, logits)
            else:  # max_tokens 0: the prompt only
                step = job.text.finish("length")
                if job.text.shows(step):
                    job.emit("token", step)
                self._finish(job, "length")

    def _blob_reads(self) -> int:
        """The shared cache's blob reads so far (every session of the pool reports the same)."""
        sessions = self.pool.sessions
        return sessions[0].stats()["blob_reads"] if sessions else 0

    def _decode(self, jobs: list[Job]) -> None:
        reads = self._blob_reads()
        t = time.perf_counter()
        tokens = [j.next_token for j in jobs]
        results = []  # (job, the id its session drew, the logits it was drawn from or None)
        if self.batching and len(jobs) > 1:
            want = [j.text.wants_logits for j in jobs]
            try:
                all_logits, ids = self._decode_batch([j.session for j in jobs], tokens, sample=True,
                                                     want_logits=any(want))
            except SmoeError as e:
                # Nothing advanced: fail the job at fault (the others go again next turn), or
                # every job when the fault is the batch's (a failed read).
                at = getattr(e, "session_index", None)
                for j in (jobs if at is None else [jobs[at]]):
                    self._fail(j, e)
                return
            for i, (j, tok) in enumerate(zip(jobs, ids)):
                results.append((j, tok, all_logits[i] if want[i] else None))
        else:
            for j, tok in zip(jobs, tokens):
                try:
                    logits, nxt = j.session.decode_next(tok, want_logits=j.text.wants_logits)
                except SmoeError as e:
                    self._fail(j, e)
                    continue
                results.append((j, nxt, logits))
        m = self.metrics_data
        m.decode_steps += 1
        m.decode_s += time.perf_counter() - t
        m.decode_blob_reads += self._blob_reads() - reads
        m.batch_sizes[len(jobs)] += 1
        for j, tok, logits in results:
            j.fed.append(j.next_token)
            self._emit_token(j, tok, logits)

    def _emit_token(self, job: Job, token: int, logits) -> None:
        try:
            self._next_token(job, token, logits)
        except Exception as e:  # a bug in one request's text side must not stop the engine thread
            log.exception("request %d: generating its next token failed", job.id)
            self._fail(job, e)

    def _next_token(self, job: Job, token: int, logits) -> None:
        """Take the id the job's session drew (logits: those it came from, when the job wants
        logprobs), hand its text to the client, decide whether the job ends."""
        step = job.text.step(token, logits)
        job.generated += 1
        self.metrics_data.completion_tokens += 1
        finish = step.finish_reason
        if job.text.shows(step):
            job.emit("token", step)
        if finish is None and len(job.fed) + 1 > self.context:  # no room to feed the id just drawn
            last = job.text.finish("length")
            if job.text.shows(last):
                job.emit("token", last)
            finish = last.finish_reason
        if finish is None:
            job.next_token = step.token
            self._set_mask(job)
        else:
            self._finish(job, finish)

    def _finish(self, job: Job, reason: str) -> None:
        if job.finished:
            return
        if reason == "cancelled" and job.then is not None:  # the rest of the chain with it
            self._finish(job.then, "cancelled")
        job.finished = True
        m = self.metrics_data
        m.requests[reason] += 1
        if reason != "cancelled" and job.t_first is not None and job.generated > 1:
            m.tps.append((job.generated - 1) / max(time.perf_counter() - job.t_first, 1e-9))
        job.emit("done", (reason, job.usage()))  # cancelled too: a handler may still be waiting

    def _fail(self, job: Job, error: Exception) -> None:
        if job.finished:
            return
        log.warning("request %d failed: %s: %s", job.id, type(error).__name__, error)
        if job.then is not None:  # the rest of the chain with it
            self._fail(job.then, error)
        job.finished = True
        self.metrics_data.requests["error"] += 1
        job.emit("error", error)

    def _reap(self) -> None:
        keep, chained = [], []
        for job in self._active:
            if job.cancelled and not job.finished:
                self._finish(job, "cancelled")
            if job.finished:
                nxt = job.then
                if nxt is not None and nxt.cancelled:
                    self._finish(nxt, "cancelled")
                if job.session is not None and nxt is not None and not nxt.finished:
                    chained.append((job, nxt))  # the next choice takes the session, prompt KV and all
                elif job.session is not None:
                    self.pool.release(job.session, job.fed)
                    job.session = None
            else:
                keep.append(job)
        self._active = keep
        for job, nxt in chained:
            session, job.session = job.session, None
            if job.text.echo:
                nxt.text.copy_prompt_logprobs(job.text)
            self._start(nxt, session, len(nxt.prompt_ids) - 1)

    def _metrics(self) -> dict:
        m = self.metrics_data
        steps = sum(m.batch_sizes.values())
        return {
            "uptime_s": time.time() - m.started,
            "requests": dict(m.requests),
            "running": len(self._active), "queued": len(self._queue), "max_batch": self.max_batch,
            "batching": self.batching,
            "prompt_tokens": m.prompt_tokens, "prompt_tokens_reused": m.prompt_tokens_reused,
            "completion_tokens": m.completion_tokens,
            "prefill_tokens_per_s": m.prefill_tokens / m.prefill_s if m.prefill_s else None,
            "decode_tokens_per_s": (sum(k * v for k, v in m.batch_sizes.items()) / m.decode_s
                                    if m.decode_s else None),
            "decode_steps": m.decode_steps,
            "decode_tokens": sum(k * v for k, v in m.batch_sizes.items()),
            "decode_blob_reads": m.decode_blob_reads, "prefill_blob_reads": m.prefill_blob_reads,
            "blob_reads_per_decode_token": (m.decode_blob_reads / sum(k * v for k, v in m.batch_sizes.items())
                                            if m.batch_sizes else None),
            "batch_sizes": {str(k): v for k, v in sorted(m.batch_sizes.items())},
            "mean_batch_size": (sum(k * v for k, v in m.batch_sizes.items()) / steps) if steps else None,
            "ttft_s": {"median": _quantile(m.ttft_s, 0.5), "p95": _quantile(m.ttft_s, 0.95)},
            "request_tokens_per_s": {"median": _quantile(m.tps, 0.5), "p95": _quantile(m.tps, 0.95)},
            "pool": self.pool.stats(),
            "engine": self._engine_stats(),
        }

    def _engine_stats(self) -> dict:
        """The shared retention cache's counters (every session of the pool reports the same)."""
        sessions = self.pool.sessions
        if not sessions:
            return {}
        st = sessions[0].stats()
        uses = st["cache_hits"] + st["cache_misses"]
        keys = ("blob_reads", "bytes_read", "cache_hits", "cache_misses", "io_wait_s", "cache_bytes", "direct_io",
                "batch_steps", "batch_tokens", "batch_blob_reads")
        return {**{k: st[k] for k in keys if k in st}, "cache_hit_rate": st["cache_hits"] / uses if uses else None,
                "blob_reads_per_completion_token": (st["blob_reads"] / self.metrics_data.completion_tokens
                                                    if self.metrics_data.completion_tokens else None)}
