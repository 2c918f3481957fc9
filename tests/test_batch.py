"""decode_batch (smoe_decode_batch) and sessions sharing one cache (smoe_session_new_shared).

The property: advancing several sessions together in one layer-major pass gives every one of
them, bit for bit, the logits, KV rows and position that decoding it alone gives, whatever the
batch's members, their order, their prompt lengths and the cache budget."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe import decode_batch

CTX = 48


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def same_kv(a: pysmoe.Session, b: pysmoe.Session, layers: int) -> bool:
    if a.position != b.position:
        return False
    for layer in range(layers):
        ka, va = a.kv(layer)
        kb, vb = b.kv(layer)
        if not (np.array_equal(bits(ka), bits(kb)) and np.array_equal(bits(va), bits(vb))):
            return False
    return True


@pytest.fixture(scope="module")
def vaults(tiny_vault, tiny_vault_f32):
    with pysmoe.open_vault(tiny_vault) as q, pysmoe.open_vault(tiny_vault_f32) as f:
        yield {"q": q, "f32": f}


def shared_set(vault, n, cache_bytes, chunks, activations="q8"):
    first = vault.session(cache_bytes=cache_bytes, threads=2, context=CTX, chunk=chunks[0], activations=activations)
    rest = [vault.session(share_cache=first, context=CTX, chunk=c, activations=activations) for c in chunks[1:n]]
    return [first, *rest]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batch_is_bit_identical_to_one_at_a_time(vaults, data):
    which = data.draw(st.sampled_from(["q", "f32"]), label="vault")
    vault = vaults[which]
    activations = "f32" if which == "f32" else data.draw(st.sampled_from(["q8", "f32"]), label="activations")
    vocab = vault.config["vocab_size"]
    n = data.draw(st.integers(1, 5), label="sessions")
    chunks = data.draw(st.lists(st.integers(n if n > 1 else 1, 8), min_size=n, max_size=n), label="chunks")
    chunks[0] = max(chunks[0], n)  # some session's chunk must hold the batch
    blob = vault.expert_bytes
    cache_bytes = data.draw(st.sampled_from([0, 12 * blob, 1 << 30]), label="cache_bytes")
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12), label=f"prompt{i}")
               for i in range(n)]
    steps = data.draw(st.integers(1, 4), label="steps")

    batch = shared_set(vault, n, cache_bytes, chunks, activations)
    alone = [vault.session(threads=1, context=CTX, chunk=chunks[i], activations=activations) for i in range(n)]
    try:
        for b, a, p in zip(batch, alone, prompts):
            assert np.array_equal(bits(b.prefill(p)), bits(a.prefill(p)))
        for _ in range(steps):
            order = data.draw(st.permutations(range(n)), label="order")
            members = order[:data.draw(st.integers(1, n), label="members")]
            toks = [data.draw(st.integers(0, vocab - 1)) for _ in members]
            got = decode_batch([batch[i] for i in members], toks)
            for i, t, g in zip(members, toks, got):
                want = alone[i].decode(t)
                assert np.array_equal(bits(g), bits(want)), f"session {i}"
        for b, a in zip(batch, alone):
            assert same_kv(b, a, vault.config["num_hidden_layers"])
    finally:
        for s in batch + alone:
            s.close()


def test_one_union_read_for_sessions_routed_alike(vaults):
    """Sessions with the same history route alike: a cold batch step reads each blob once, as
    many blobs as one of them decoding alone (not n times as many)."""
    vault = vaults["q"]
    sessions = shared_set(vault, 4, 1 << 30, [4, 4, 4, 4])
    alone = vault.session(cache_bytes=1 << 30, threads=2, context=CTX)
    try:
        for s in sessions + [alone]:
            s.prefill([3, 1, 4, 1, 5])
        alone.clear_cache()
        r0 = alone.stats()["blob_reads"]
        alone.decode(9)
        one = alone.stats()["blob_reads"] - r0
        sessions[0].clear_cache()
        sessions[0].reset_stats()
        decode_batch(sessions, [9, 9, 9, 9])
        st_ = sessions[2].stats()
        assert one > 0
        assert st_["blob_reads"] == one
        assert (st_["batch_steps"], st_["batch_tokens"], st_["batch_blob_reads"]) == (1, 4, one)
        assert st_["cache_sharers"] == 4
    finally:
        for s in sessions + [alone]:
            s.close()


def test_errors_leave_every_session_where_it_was(vaults):
    vault = vaults["q"]
    vocab = vault.config["vocab_size"]
    a, b, c = shared_set(vault, 3, 1 << 20, [4, 4, 4])
    other = vault.session(threads=1, context=CTX)
    ref = vault.session(threads=1, context=CTX)
    try:
        for s in (a, b, c, ref):
            s.prefill([7, 8])
        c.prefill(list(range(CTX - 2 - 1)) + [5])  # c is now full
        assert c.position == CTX

        cases = [
            (pysmoe.InvalidArgument, [a, b, a], [1, 2, 3], 2),      # a duplicate
            (pysmoe.InvalidArgument, [a, other], [1, 2], 1),        # not sharing a's cache
            (pysmoe.BadToken, [a, b], [1, vocab], 1),               # a bad id
            (pysmoe.BadToken, [a, b], [-1, 2], 0),
            (pysmoe.ContextFull, [a, b, c], [1, 2, 3], 2),          # c has no room
            (pysmoe.InvalidArgument, [], [], None),
            (pysmoe.InvalidArgument, [a, b], [1], None),
        ]
        for exc, sess, toks, index in cases:
            with pytest.raises(exc) as info:
                decode_batch(sess, toks)
            assert getattr(info.value, "session_index", None) == index, (exc, index)
            assert (a.position, b.position) == (2, 2)

        a._lock.acquire()  # a method of a running in another thread, as Session sees it
        try:
            with pytest.raises(pysmoe.Busy) as info:
                decode_batch([b, a], [1, 2])
            assert info.value.session_index == 1
        finally:
            a._lock.release()
        assert (a.position, b.position) == (2, 2)

        # and the sessions still decode exactly
        got = decode_batch([b, a], [11, 11])
        want = ref.decode(11)
        assert np.array_equal(bits(got[0]), bits(want)) and np.array_equal(bits(got[1]), bits(want))

        c.close()
        with pytest.raises(pysmoe.InvalidArgument) as info:
            decode_batch([a, c], [1, 2])
        assert info.value.session_index == 1
    finally:
        for s in (a, b, c, other, ref):
            s.close()


def test_shared_sessions_close_in_any_order(vaults):
    vault = vaults["q"]
    a, b, c = shared_set(vault, 3, 1 << 20, [4, 4, 4])
    ref = vault.session(threads=1, context=CTX)
    try:
        a.close()  # the session that made the cache goes first
        assert b.stats()["cache_sharers"] == 2
        b.prefill([1, 2, 3])
        c.prefill([1, 2, 3])
        want = ref.prefill([1, 2, 3])
        b.close()
        assert c.stats()["cache_sharers"] == 1
        assert np.array_equal(bits(c.decode(4)), bits(ref.decode(4)))
        assert want.shape == (vault.config["vocab_size"],)
    finally:
        for s in (a, b, c, ref):
            s.close()


def test_share_cache_arguments(vaults, tiny_vault):
    vault = vaults["q"]
    a = vault.session(cache_bytes=1 << 20, threads=2, context=CTX)
    try:
        with pytest.raises(pysmoe.InvalidArgument):
            vault.session(share_cache=a, cache_bytes=1 << 20)
        with pytest.raises(pysmoe.InvalidArgument):
            vault.session(share_cache=a, threads=1)
        with pysmoe.open_vault(tiny_vault) as again:  # another Vault object of the same files
            with pytest.raises(pysmoe.InvalidArgument):
                again.session(share_cache=a)
        with pytest.raises(pysmoe.InvalidArgument):
            vault.session(share_cache="a")
        b = vault.session(share_cache=a, context=CTX)
        assert b.threads == a.threads and b.stats()["cache_bytes"] == a.stats()["cache_bytes"]
        b.close()
    finally:
        a.close()


def test_sharers_in_threads_take_turns(vaults):
    """Calls of sessions that share a cache, from several threads at once, wait for each other
    instead of racing on the shared pool and streamer: each thread's results are exact."""
    vault = vaults["q"]
    sessions = shared_set(vault, 3, 0, [4, 4, 4])
    refs = [vault.session(threads=1, context=CTX) for _ in sessions]
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [100, 200, 300, 400]]
    want = [[bits(r.prefill(p))] + [bits(r.decode(t)) for t in range(20, 30)] for r, p in zip(refs, prompts)]
    got = [None] * 3

    def work(i):
        s = sessions[i]
        got[i] = [bits(s.prefill(prompts[i]))] + [bits(s.decode(t)) for t in range(20, 30)]

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g, w in zip(got, want):
            assert g is not None and all(np.array_equal(x, y) for x, y in zip(g, w))
    finally:
        for s in sessions + refs:
            s.close()
