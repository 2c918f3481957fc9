"""pysmoe.workers.fork_map: every item once, results as fn gives them, errors raised as themselves."""
from __future__ import annotations

import os

import pytest

from pysmoe.workers import can_fork, fork_map


@pytest.mark.parametrize("procs", [1, 2, 3, 8])
def test_every_item_once_with_its_result(procs):
    items = list(range(7))
    got = dict(fork_map(lambda x: x * x, items, procs))
    assert got == {i: i * i for i in items}


@pytest.mark.skipif(not can_fork(), reason="runs in-process without fork")
def test_the_work_runs_in_other_processes():
    pids = {pid for _, pid in fork_map(lambda _: os.getpid(), range(6), 3)}
    assert os.getpid() not in pids and len(pids) == 3


@pytest.mark.parametrize("procs", [1, 3])
def test_an_exception_is_raised_as_itself(procs):
    def fn(x):
        if x == 4:
            raise KeyError("four")
        return x

    with pytest.raises(KeyError, match="four"):
        list(fork_map(fn, range(6), procs))


@pytest.mark.skipif(not can_fork(), reason="runs in-process without fork")
def test_an_exception_that_does_not_pickle_becomes_worker_error():
    from pysmoe.workers import WorkerError

    class Local(Exception):  # a local class: pickle cannot find it by name
        pass

    def fn(x):
        if x == 2:
            raise Local("not picklable")
        return x

    with pytest.raises(WorkerError, match="item 2: Local: not picklable"):
        list(fork_map(fn, range(4), 2))


def test_stopping_early_leaves_no_worker():
    import multiprocessing as mp
    it = fork_map(lambda x: x, range(100), 3)
    next(it)
    it.close()
    assert mp.active_children() == []


def test_default_procs_counts_the_cores_this_process_may_use():
    from pysmoe.workers import default_procs
    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_procs() == want >= 1


_ORPHAN_SCRIPT = """
import os, pathlib, sys, time
import pysmoe.workers as w
out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
if mode == "send":  # without the kernel's signal: only the closed pipe ends can stop them
    w._die_with_parent = lambda parent: None

def fn(x):
    (out / str(os.getpid())).touch()
    if mode == "busy":
        time.sleep(600)
    return b"x" * (1 << 20)  # more than a pipe holds: the send waits for the parent to read

it = w.fork_map(fn, range(6), 3)
next(it)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not can_fork() or not os.path.isdir("/proc/self"), reason="forks only on Linux")
@pytest.mark.parametrize("mode", ["busy", "send"])
def test_workers_die_with_a_killed_parent(tmp_path, mode):
    """kill -9 of the process running fork_map: its workers end too (within a bound), whether
    they are inside fn ("busy": the kernel's parent-death signal) or blocked sending a result
    ("send", the signal disabled: the pipe's read ends they no longer hold)."""
    import signal
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tmp_path), mode])
    pids = []
    try:
        deadline = time.monotonic() + 60  # guards against a hang, not a timing
        while len(pids) < 3 and time.monotonic() < deadline:
            pids = [int(f.name) for f in tmp_path.iterdir()]
            time.sleep(0.05)
        assert len(pids) == 3 and p.poll() is None
        time.sleep(0.5)  # let the senders fill their pipes
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
