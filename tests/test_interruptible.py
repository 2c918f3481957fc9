"""generate.interruptible: Ctrl-C reaches a call in libsmoe through Session.cancel(), and the
worker stays in lockstep with the consumer (stopping early leaves what a plain loop leaves)."""
import os
import signal
import threading

import numpy as np
import pytest

import pysmoe
from pysmoe.generate import interruptible


def test_stopping_early_leaves_the_position_of_a_plain_loop(tiny_vault):
    ids = list(range(1, 40))
    with pysmoe.open_vault(tiny_vault) as v, v.session() as a, v.session() as b:
        plain = []
        for t in a.generate(ids, max_tokens=20):
            plain.append(t)
            if len(plain) == 3:
                break
        ours = []
        for t in interruptible(b, b.generate(ids, max_tokens=20)):
            ours.append(t)
            if len(ours) == 3:
                break
        assert ours == plain and b.position == a.position


def test_errors_of_the_worker_are_raised_here(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        with pytest.raises(pysmoe.errors.ContextFull):
            list(interruptible(s, s.generate(list(range(1, 10)) * 1000, max_tokens=2)))


def test_ctrl_c_cancels_the_call_in_flight_and_rewinds(tiny_vault):
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 3000)]
    with pysmoe.open_vault(tiny_vault) as v, v.session(context=4096, prefill="token-serial") as s, v.session() as ref:
        s.prefill([5, 6, 7])
        start = s.position
        # a real SIGINT, as Ctrl-C sends: it wakes the main thread's wait (interrupt_main would not)
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in interruptible(s, s.generate(ids, max_tokens=1000)):
                pass
        timer.join()
        assert s.position == start  # cancelled in its prompt, generate rewound to where it began
        # and the session goes on exactly as one that never saw the interrupted call
        ref.prefill([5, 6, 7])
        assert np.array_equal(s.decode(9), ref.decode(9))
