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
