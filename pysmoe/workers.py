"""Numpy work spread over forked processes, for the converters.

Quantising in numpy holds the GIL for much of its time, so threads gain little (14 threads of
scripts/export_gguf.py requantised 41 M weights/s on a 16-core machine, about one core's rate);
processes do not share that lock. `fork_map` forks its workers, so `fn` and what it reads (an open checkpoint, a vault's
memory map, a writer's layout) are inherited as they are: nothing but the items' results is
pickled. Off Linux (see can_fork) or when one worker is asked for, it runs in this process.

A worker dies with the process that forked it, however that one ends (kill -9 included): it
asks the kernel for SIGKILL when its parent goes (prctl PR_SET_PDEATHSIG), and, should that be
refused, it still stops at its next item or result, since it holds no read end of any pipe but
the parent's (its own and its elder siblings' were inherited by the fork and are closed first),
so a result sent to a dead parent fails at once instead of blocking for ever, and it checks its
parent before each item.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class WorkerError(RuntimeError):
    """A worker died, or fn raised an exception that could not be sent back (the message names
    the item and the exception); one that can is raised as it is."""


def default_procs() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset narrows;
    os.cpu_count() counts the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Linux only: macOS has fork, but its system libraries (Accelerate, which numpy may use) are
    not safe in a forked child, which is why Python spawns there by default."""
    return sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends (Linux); exit now if it has already ended."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the pipe and the parent checks still stop it
        pass
    if os.getppid() != parent:  # the parent went before the request above: nobody to signal it
        os._exit(1)


def _work(fn, items, share, conn, inherited, parent) -> None:
    _die_with_parent(parent)
    for c in inherited:  # read ends this fork copied: with them open, a send to a dead parent blocks
        c.close()
    i = None
    try:
        for i in share:
            if os.getppid() != parent:
                os._exit(1)
            conn.send((i, fn(items[i])))
        conn.send(None)
    except BrokenPipeError:  # the parent is gone
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent, which raises
        try:  # the exception itself, so that the caller sees the type it would see in-process
            conn.send(("error", exc))
        except BrokenPipeError:
            os._exit(1)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            conn.send(("error", f"item {i}: {type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def fork_map(fn: Callable[[Any], Any], items: Sequence, procs: int) -> Iterator[tuple[int, Any]]:
    """(i, fn(items[i])) for every item, in the order they are done: by `procs` forked workers
    (worker k takes items k, k + procs, ... in turn), or in this process, in order, when procs <= 1
    or the platform cannot fork. A worker's exception ends the whole map, raised here; the workers
    left are stopped when the map ends, early or not."""
    n = len(items)
    if procs <= 1 or n <= 1 or not can_fork():
        for i in range(n):
            yield i, fn(items[i])
        return
    ctx = mp.get_context("fork")
    workers, conns = [], []
    try:
        for k in range(min(procs, n)):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_work, args=(fn, items, range(k, n, procs), send, [*conns, recv], os.getpid()),
                            daemon=True)
            p.start()
            send.close()
            workers.append(p)
            conns.append(recv)
        live = list(conns)
        while live:
            for c in mpc.wait(live):
                try:
                    msg = c.recv()
                except EOFError:
                    raise WorkerError("a worker process died") from None
                if msg is None:
                    live.remove(c)
                elif msg[0] == "error":
                    if isinstance(msg[1], BaseException):
                        raise msg[1]
                    raise WorkerError(msg[1])
                else:
                    yield msg
    finally:
        for p in workers:
            if p.is_alive():
                p.terminate()
            p.join()
        for c in conns:
            c.close()
