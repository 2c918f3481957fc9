"""One session, several threads: refused (Busy) or correct, never a crash, a hang or a mix.

libsmoe claims a session per call with an atomic flag (SMOE_ERR_BUSY for a second caller); the
binding does the same per method (Busy) and makes close() cancel and wait for a running method.
cancel() stops a running prefill between layers (Cancelled), the position where it was.
"""
import pathlib
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

import pysmoe
from pysmoe._ffi import ffi, lib

THREADS = 4


def same(a, b) -> bool:
    return a.tobytes() == b.tobytes()


def run_threads(target, n=THREADS):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            errors.append(e)

    ts = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def repeated_prompt_logits(vault, prompt, times, **kw):
    """Logits after the prompt fed once, twice, ... times: what the k-th successful prefill of
    the prompt on one session must return, whichever thread made it."""
    with vault.session(**kw) as ref:
        return [ref.prefill(prompt) for _ in range(times)]


def test_threads_hammering_one_session_get_busy_or_correct_results(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    prompt = np.arange(3, 10)
    rounds = 24
    kw = dict(cache_bytes=vault.blob_bytes * 8, chunk=3, threads=1)
    want = repeated_prompt_logits(vault, prompt, rounds + THREADS, **kw)  # each thread may pass `rounds` once
    s = vault.session(**kw)
    got, busy = [], [0] * THREADS
    lock = threading.Lock()

    def hammer(i):
        rng = np.random.default_rng(i)
        while True:
            with lock:
                if len(got) >= rounds:
                    return
            op = rng.integers(0, 4)
            try:
                if op == 0:
                    logits = s.prefill(prompt)  # appends: the k-th success starts at (k-1)·len(prompt)
                    with lock:
                        got.append(logits)
                elif op == 1:
                    s.stats()
                elif op == 2:
                    s.kv(0)
                else:
                    s.clear_cache()
            except pysmoe.Busy:
                busy[i] += 1
            except pysmoe.ContextFull:
                return

    run_threads(hammer)
    assert s.position == len(prompt) * len(got)
    # Every success is one of the expected results, each once: no call saw another's state.
    matched = sorted(next(k for k, w in enumerate(want) if same(g, w)) for g in got)
    assert matched == list(range(len(got)))
    assert sum(busy) > 0  # the threads did meet
    s.close()


def test_concurrent_c_calls_on_one_session_are_refused(tiny_vault):
    """The C busy flag itself, under the binding's lock: raw calls from threads (cffi releases the
    GIL), every one SMOE_OK or SMOE_ERR_BUSY, and the successes chain exactly."""
    vault = pysmoe.open_vault(tiny_vault)
    s = vault.session(chunk=6, threads=1)
    ids = np.arange(1, 7, dtype=np.int32)
    h = s.handle
    codes = []
    lock = threading.Lock()

    def hammer(i):
        p = ffi.cast("int32_t *", ffi.from_buffer(ids))
        for _ in range(60):
            rc = lib.smoe_prefill_chunk(h, p, len(ids), ffi.NULL, ffi.NULL) if i % 2 == 0 else lib.smoe_cache_clear(h)
            with lock:
                codes.append((i % 2, rc))
            if rc == lib.SMOE_ERR_CONTEXT_FULL:
                return

    run_threads(hammer)
    assert {rc for _, rc in codes} <= {0, lib.SMOE_ERR_BUSY, lib.SMOE_ERR_CONTEXT_FULL}
    assert any(rc == lib.SMOE_ERR_BUSY for _, rc in codes)
    ok = sum(1 for kind, rc in codes if kind == 0 and rc == 0)
    assert s.position == ok * len(ids)
    with vault.session(chunk=6, threads=1) as ref:
        for _ in range(ok):
            ref.prefill(np.concatenate([ids, [1]]))
            ref.rewind(ref.position - 1)
        assert all(same(a, b) for a, b in zip(s.kv(1), ref.kv(1)))
    s.close()


def long_prefill_in_thread(s, ids):
    outcome = {}
    started = threading.Event()

    def work():
        started.set()
        try:
            outcome["logits"] = s.prefill(ids)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while t.is_alive() and not s._lock.locked():  # until prefill holds the session (or is over)
        time.sleep(0.0005)
    return t, outcome


def test_cancel_from_another_thread_keeps_the_position(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    rng = np.random.default_rng(1)
    head, body = rng.integers(0, 512, 5), rng.integers(0, 512, 400)
    with vault.session(chunk=8, threads=1) as ref:
        ref.prefill(head)
        want = ref.prefill(body)
    s = vault.session(chunk=8, threads=1)
    s.prefill(head)
    cancelled = 0
    for _ in range(5):
        t, outcome = long_prefill_in_thread(s, body)
        while t.is_alive() and s.position == len(head):
            pass  # until the prefill is under way (its first chunk has landed)
        s.cancel()
        t.join()
        if "error" in outcome:
            assert isinstance(outcome["error"], pysmoe.Cancelled), outcome
            assert s.position == len(head)
            cancelled += 1
        else:  # it finished first
            s.rewind(len(head))
    assert cancelled > 0
    assert same(s.prefill(body), want)  # the session is as good as one never cancelled
    s.close()


def test_cancel_between_chunks_from_the_same_thread(tiny_vault):
    """What a signal handler on the calling thread does: cancel() between two C calls of one
    method. The method raises Cancelled and rewinds."""
    vault = pysmoe.open_vault(tiny_vault)
    s = vault.session(chunk=4, threads=1)
    s.prefill([1, 2, 3])
    calls = 0
    real_call = s._call

    def call_then_cancel(fn, *args):
        nonlocal calls
        real_call(fn, *args)
        calls += 1
        if calls == 3:
            s.cancel()

    s._call = call_then_cancel
    with pytest.raises(pysmoe.Cancelled):
        s.prefill(np.arange(40))
    assert s.position == 3
    del s._call
    s.prefill([4])  # a cancel does not outlive the method it stopped
    s.close()


def test_close_during_prefill_waits_and_is_safe(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    body = np.arange(400) % 512
    for _ in range(3):
        s = vault.session(chunk=8, threads=1)
        t, outcome = long_prefill_in_thread(s, body)
        s.close()  # cancels, then waits for the prefill to return
        assert s._h is None
        t.join()
        assert "logits" in outcome or isinstance(outcome["error"], pysmoe.Cancelled), outcome
        with pytest.raises(pysmoe.InvalidArgument, match="closed"):
            s.prefill([1])
        s.cancel()  # harmless once closed
        s.close()
    # the vault is intact: a new session works
    with vault.session() as s2:
        s2.prefill([1, 2])


def test_busy_is_a_runtime_error_and_leaves_the_running_call_alone(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    with vault.session(chunk=8, threads=1) as s:
        s._lock.acquire()  # as if another thread were inside a method
        try:
            with pytest.raises(pysmoe.Busy):
                s.decode(1)
            with pytest.raises(RuntimeError):
                s.stats()
            assert s.position == 0  # position never waits
        finally:
            s._lock.release()
        s.decode(1)
        assert s.position == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_library_threads_are_named_and_block_every_signal(tiny_vault):
    """The library's own threads (pool workers, I/O threads) carry a name (top -H, gdb) and block
    every signal, so that a process-directed signal (Ctrl-C, a server's SIGTERM) reaches the
    host's threads, never theirs."""
    want = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE)
    with pysmoe.open_vault(tiny_vault) as vault, vault.session(threads=3) as s:
        s.prefill([1, 2, 3, 4, 5, 6, 7, 8])
        masks = {}
        for task in pathlib.Path("/proc/self/task").iterdir():
            try:
                comm, status = (task / "comm").read_text().strip(), (task / "status").read_text()
            except OSError:  # a thread that ended meanwhile
                continue
            if comm.startswith("smoe-"):
                masks.setdefault(comm, []).append(int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16))
        main_mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/status")
                                  .read_text(), re.M).group(1), 16)
    assert len(masks.get("smoe-pool", [])) == 2 and masks.get("smoe-io"), masks
    for comm, ms in masks.items():
        for m in ms:
            assert all(m >> (int(sig) - 1) & 1 for sig in want), f"{comm}: SigBlk {m:016x}"
    assert not main_mask >> (int(signal.SIGINT) - 1) & 1  # the caller's own mask left as it was
