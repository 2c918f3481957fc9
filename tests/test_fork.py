"""A vault or session after fork(): the child refuses what it cannot run and can start afresh.

A session's worker and I/O threads stay in the process that made it; in a forked child (Python's
multiprocessing on Linux, a pre-forking server) using it would wait forever for them. The library
records each handle's process: an inherited session refuses every call with InvalidArgument saying
so (closing it frees nothing in the child and never waits), and a new session made in the child
from an inherited vault runs, giving the parent's bits.
"""
import os
import signal
import sys

import numpy as np
import pytest

import pysmoe

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                                reason="fork() with threads: Linux")


def in_child(fn) -> str:
    """Runs fn() in a forked child (20 s alarm: a hang fails the test, never blocks it); its
    returned text, or the child's exception, comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        signal.alarm(20)
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"raised {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child did not exit (status {status}: 14 = the alarm, a hang)"
    return b"".join(chunks).decode()


def test_inherited_session_refuses_and_a_new_one_runs(tiny_vault):
    ids = [1, 5, 9, 2, 7, 3]
    with pysmoe.open_vault(tiny_vault) as vault:
        s = vault.session(threads=2)
        want = s.prefill(ids).copy()

        def child():
            try:
                s.reset()
                return "the inherited session ran"
            except pysmoe.errors.InvalidArgument as e:
                refused = str(e)
            s.close()  # frees nothing here, waits for nothing
            with vault.session(threads=2) as s2:
                same = np.array_equal(s2.prefill(ids), want)
            return f"refused: {refused}\nnew session same: {same}"

        out = in_child(child)
        assert "refused: " in out and "a fork of it" in out and "make a new session" in out, out
        assert "new session same: True" in out, out
        s.reset()  # the parent's session is untouched
        assert np.array_equal(s.prefill(ids), want)
        s.close()


def test_inherited_shared_session_cannot_be_a_sibling(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as vault, vault.session(threads=2) as s:
        def child():
            try:
                vault.session(share_cache=s)
                return "a sibling of the parent's session was made"
            except pysmoe.errors.InvalidArgument as e:
                return f"refused: {e}"

        out = in_child(child)
        assert out.startswith("refused: ") and "a fork of it" in out, out
