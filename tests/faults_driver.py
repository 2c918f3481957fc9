"""Read faults against the engine, in a process with tests/c/fault_shim.c preloaded.

    LD_PRELOAD=fault_shim.so python tests/faults_driver.py rewind VAULT SHIM
    LD_PRELOAD=fault_shim.so python tests/faults_driver.py soak VAULT SHIM [OPS [SEED]]

tests/test_faults.py builds the shim and runs both (and `make asan` with the sanitizer runtimes
preloaded before it). Each mode prints "<mode>: ok ..." last, or fails with a traceback.

rewind  one failed read at a chosen point in a prefill (several chunks) and in generate: the
        method raises and the position is where it was before it; the session then gives what a
        session that never failed gives, bit for bit.
soak    OPS random operations (prefill of random lengths, decode, generate, reset, rewind,
        cancel from another thread, clear_cache, a new session of random shape) on a session
        whose blob reads fail at random (EIO, short read, a flipped bit), each mirrored on a
        fault-free reference session: after each, either the results and positions agree bit
        for bit, or a SmoeError was raised and the position is unchanged (the reference then
        skips the operation). Blobs are verified on read, so a flipped bit is an error.
"""
from __future__ import annotations

import random
import sys
import threading
import time

import cffi
import numpy as np

import pysmoe
from pysmoe import Cancelled, ReadError, SmoeError, VaultError

FAULT_EIO, FAULT_SHORT, FAULT_FLIP = 1, 2, 4
KINDS = {"eio": FAULT_EIO, "short": FAULT_SHORT, "flip": FAULT_FLIP}
# What a failed read may raise: ReadError, or VaultError for a checksum mismatch.
READ_FAILURES = (ReadError, VaultError)


def load_shim(path: str):
    ffi = cffi.FFI()
    ffi.cdef("void smoe_fault_config(uint64_t, uint32_t, uint32_t, uint64_t);"
             "void smoe_fault_fail_nth(int64_t, uint32_t); uint64_t smoe_fault_injected(uint32_t);")
    return ffi.dlopen(path)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def rewind(vault_dir: str, shim) -> None:
    vault = pysmoe.open_vault(vault_dir)
    vocab = vault.config["vocab_size"]
    rng = np.random.default_rng(0)
    head, body = rng.integers(0, vocab, 10), rng.integers(0, vocab, 40)
    kw = dict(cache_bytes=0, chunk=4, threads=1, verify_blobs=True)
    with vault.session(**kw) as ref:
        ref.prefill(head)
        ref.reset_stats()
        want = ref.prefill(body)
        prompt_reads = ref.stats()["blob_reads"]
        ref.rewind(len(head))
        want_ids = list(ref.generate(body, max_tokens=12, temperature=0.8, seed=3))
    with vault.session(**kw) as s:
        s.prefill(head)
        shim.smoe_fault_config(vault.blob_bytes, 0, 0, 0)
        for kind in KINDS.values():
            # Past the first chunk's reads, well before the prompt's last: a failure part way.
            shim.smoe_fault_fail_nth(60, kind)
            try:
                s.prefill(body)
            except READ_FAILURES:
                pass
            else:
                raise AssertionError(f"kind {kind}: the injected read failure did not surface")
            assert s.position == len(head), (kind, s.position)
            assert shim.smoe_fault_injected(kind) >= 1
        # generate: a failure while it decodes (the prompt's reads come first)
        fed = 0
        shim.smoe_fault_fail_nth(prompt_reads + 20, FAULT_EIO)
        try:
            for _ in s.generate(body, max_tokens=12, temperature=0.8, seed=3):
                fed += 1
        except READ_FAILURES:
            pass
        else:
            raise AssertionError("the injected failure in generate did not surface")
        assert s.position == len(head), s.position
        shim.smoe_fault_fail_nth(0, 0)
        assert same(s.prefill(body), want)
        s.rewind(len(head))
        assert list(s.generate(body, max_tokens=12, temperature=0.8, seed=3)) == want_ids
    print(f"rewind: ok (generate failed after {fed} tokens)")


class Soak:
    def __init__(self, vault_dir: str, shim, seed: int):
        self.vault = pysmoe.open_vault(vault_dir)
        self.shim = shim
        self.rng = random.Random(seed)
        self.vocab = self.vault.config["vocab_size"]
        self.context = 256
        self.blobs = self.vault.num_sparse_layers * self.vault.config["num_experts"]
        self.ref = self.vault.session(cache_bytes=0, chunk=7, threads=1, context=self.context, verify_blobs=True)
        self.s = None
        self.new_session()
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0}

    def faults(self, on: bool) -> None:
        self.shim.smoe_fault_config(self.vault.blob_bytes, 20000 if on else 0, 7, self.rng.getrandbits(64))

    def new_session(self) -> None:
        if self.s is not None:
            self.s.close()
        r = self.rng
        self.s = self.vault.session(cache_bytes=r.randint(0, self.blobs) * self.vault.blob_bytes,
                                    chunk=r.randint(1, 32), threads=r.randint(1, 2), io_threads=r.randint(1, 4),
                                    context=self.context, verify_blobs=True,
                                    prefill=r.choice(pysmoe.engine.PREFILL_PATHS))
        self.ref.reset()

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def both(self, name: str, op, cancel: bool = False) -> None:
        """op(session) on the faulty session, then, if that worked, on the reference; compare."""
        before = self.s.position
        assert before == self.ref.position
        self.faults(True)
        canceller = None
        if cancel:
            delay = self.rng.random() * 0.003
            canceller = threading.Thread(target=lambda: (time.sleep(delay), self.s.cancel()))
            canceller.start()
        try:
            got = op(self.s)
        except (Cancelled, *READ_FAILURES) as e:
            self.counts["cancelled" if isinstance(e, Cancelled) else "failed"] += 1
            assert self.s.position == before, (name, type(e).__name__, self.s.position, before)
            return
        finally:
            if canceller is not None:
                canceller.join()
            self.faults(False)
        want = op(self.ref)
        self.counts["ok"] += 1
        assert self.s.position == self.ref.position, (name, self.s.position, self.ref.position)
        if isinstance(want, np.ndarray):
            assert same(got, want), name
        else:
            assert got == want, (name, got, want)

    def step(self) -> None:
        r, s = self.rng, self.s
        if s.position > self.context - 40:
            s.reset()
            self.ref.reset()
        op = r.choices(["prefill", "decode", "generate", "cancel", "reset", "rewind", "clear", "new"],
                       weights=[30, 25, 10, 10, 5, 10, 5, 5])[0]
        if op == "prefill":
            ids = self.ids(r.randint(1, 24))
            self.both(op, lambda x: x.prefill(ids))
        elif op == "decode":
            tok = r.randrange(self.vocab)
            self.both(op, lambda x: x.decode(tok))
        elif op == "generate":
            ids, n, seed = self.ids(r.randint(1, 8)), r.randint(1, 4), r.getrandbits(32)
            self.both(op, lambda x: list(x.generate(ids, max_tokens=n, temperature=0.9, seed=seed)))
        elif op == "cancel":
            ids = self.ids(r.randint(8, 32))
            self.both(op, lambda x: x.prefill(ids), cancel=True)
        elif op == "reset":
            s.reset()
            self.ref.reset()
        elif op == "rewind":
            p = r.randint(0, s.position)
            s.rewind(p)
            self.ref.rewind(p)
        elif op == "clear":
            s.clear_cache()
        else:
            self.new_session()
        assert self.s.position == self.ref.position


def soak(vault_dir: str, shim, ops: int, seed: int) -> None:
    run = Soak(vault_dir, shim, seed)
    for _ in range(ops):
        run.step()
    injected = {k: int(shim.smoe_fault_injected(v)) for k, v in KINDS.items()}
    c = run.counts
    # The run must have exercised both outcomes and every kind of fault.
    assert c["ok"] > 0 and c["failed"] > 0, c
    assert all(injected.values()), injected
    run.s.close()
    run.ref.close()
    print(f"soak: ok ({ops} operations, {c['ok']} compared, {c['failed']} failed reads, {c['cancelled']} cancelled; "
          f"faults {injected})")


if __name__ == "__main__":
    mode, vault_dir, shim_path = sys.argv[1:4]
    shim = load_shim(shim_path)
    if mode == "rewind":
        rewind(vault_dir, shim)
    elif mode == "soak":
        soak(vault_dir, shim, int(sys.argv[4]) if len(sys.argv) > 4 else 1000,
             int(sys.argv[5]) if len(sys.argv) > 5 else 0)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
