"""SessionPool: sessions sharing one cache, handed out with the longest reusable KV prefix."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe import SessionPool, decode_batch

CTX = 64


def bits(x):
    return np.ascontiguousarray(x).view(np.uint32)


@pytest.fixture(scope="module")
def vault(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v:
        yield v


def fresh_logits(vault, ids):
    with vault.session(threads=1, context=CTX) as s:
        return s.prefill(ids)


def test_second_turn_reuses_the_first_turns_kv(vault):
    with SessionPool(vault, max_sessions=2, cache_bytes=1 << 20, threads=2, context=CTX) as pool:
        turn1 = [5, 6, 7, 8, 9]
        s, reused = pool.acquire(turn1)
        assert reused == 0
        s.prefill(turn1)
        gen = list(s.generate([11], max_tokens=4))  # decode steps feed 11 and the ids it yields but the last
        fed = turn1 + [11] + gen[:-1]
        assert s.position == len(fed)
        pool.release(s, fed)

        turn2 = fed + [gen[-1], 40, 41]
        s2, reused = pool.acquire(turn2)
        assert s2 is s and reused == len(fed) and s2.position == reused
        got = s2.prefill(turn2[reused:])
        assert np.array_equal(bits(got), bits(fresh_logits(vault, turn2)))
        pool.release(s2, turn2)
        st_ = pool.stats()
        assert (st_["prefix_hits"], st_["reused_tokens"], st_["evictions"]) == (1, len(fed), 0)

        # the same prompt again: all but its last id are reused (the caller feeds one id)
        s3, reused = pool.acquire(turn2)
        assert reused == len(turn2) - 1
        assert np.array_equal(bits(s3.prefill(turn2[reused:])), bits(fresh_logits(vault, turn2)))
        pool.release(s3, turn2)


def test_lru_eviction_and_fresh_sessions(vault):
    with SessionPool(vault, max_sessions=2, cache_bytes=0, threads=1, context=CTX) as pool:
        a, _ = pool.acquire([1, 2, 3])
        a.prefill([1, 2, 3])
        b, reused = pool.acquire([1, 2, 9])  # a is in use: a second session
        assert b is not a and reused == 0
        b.prefill([1, 2, 9])
        with pytest.raises(pysmoe.Busy):
            pool.acquire([4], timeout=0)
        pool.release(a, [1, 2, 3])
        pool.release(b, [1, 2, 9])
        c, reused = pool.acquire([50, 51])  # no prefix: the least recently released (a) is evicted
        assert c is a and reused == 0 and c.position == 0
        pool.release(c, None)
        d, reused = pool.acquire([1, 2, 9, 10])
        assert d is b and reused == 3
        pool.release(d, [1, 2, 9])
        st_ = pool.stats()
        assert st_["evictions"] == 1 and st_["sessions"] == 2 and st_["busy"] == 0
        assert a.stats()["cache_sharers"] == 2


def test_kv_budget_bounds_the_sessions(vault):
    one = None
    with SessionPool(vault, max_sessions=8, cache_bytes=0, threads=1, context=CTX) as pool:
        one = pool.kv_bytes_per_session
        assert pool.max_sessions == 8
    with SessionPool(vault, max_sessions=8, cache_bytes=0, threads=1, context=CTX,
                     kv_budget_bytes=3 * one + one // 2) as pool:
        assert pool.max_sessions == 3
        held = [pool.acquire([i + 1])[0] for i in range(3)]
        with pytest.raises(pysmoe.Busy):
            pool.acquire([9], timeout=0.01)
        for s in held:
            pool.release(s, None)
    with pytest.raises(pysmoe.InvalidArgument):
        SessionPool(vault, max_sessions=2, cache_bytes=0, threads=1, context=CTX, kv_budget_bytes=one - 1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reused_prefix_is_exact(vault, data):
    """Whatever a pool's sessions went through (prefills, steps, batch steps), a prompt served
    from a reused prefix gets the logits a fresh session gets."""
    vocab = vault.config["vocab_size"]
    tok = st.integers(0, vocab - 1)
    base = data.draw(st.lists(tok, min_size=1, max_size=10), label="base")
    with SessionPool(vault, max_sessions=3, cache_bytes=1 << 20, threads=2, context=CTX, chunk=4) as pool:
        for _ in range(data.draw(st.integers(1, 4), label="requests")):
            n = data.draw(st.integers(1, 3), label="batch")
            prompts = [base[:data.draw(st.integers(1, len(base)))] + data.draw(st.lists(tok, max_size=5))
                       for _ in range(n)]
            held = []
            for p in prompts:
                s, reused = pool.acquire(p)
                assert s.position == reused < len(p)
                got = s.prefill(p[reused:])
                assert np.array_equal(bits(got), bits(fresh_logits(vault, p)))
                held.append((s, list(p)))
            for _ in range(data.draw(st.integers(0, 3), label="steps")):
                toks = [data.draw(tok) for _ in held]
                decode_batch([s for s, _ in held], toks)
                for (s, ids), t in zip(held, toks):
                    ids.append(t)
            for s, ids in held:
                pool.release(s, ids)


def test_acquire_and_release_from_threads(vault):
    with SessionPool(vault, max_sessions=3, cache_bytes=1 << 20, threads=1, context=CTX) as pool:
        prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 7], [1, 2], [9, 8, 7, 6]]
        want = {tuple(p): bits(fresh_logits(vault, p)) for p in prompts}
        errors = []

        def worker(k):
            try:
                for r in range(6):
                    p = prompts[(k + r) % len(prompts)]
                    s, reused = pool.acquire(p)
                    try:
                        got = s.prefill(p[reused:])
                        assert np.array_equal(bits(got), want[tuple(p)])
                    finally:
                        pool.release(s, p)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        st_ = pool.stats()
        assert st_["acquires"] == 30 and st_["busy"] == 0 and st_["sessions"] <= 3
