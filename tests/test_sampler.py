"""The one sampler (csrc/engine/sample.c, smoe.h "sampler"): its presence and frequency penalties and
log-probabilities against numpy, and the same ids whichever call draws them — Session.generate, a
prefill_next/decode_next loop, or a batch of sessions."""
from __future__ import annotations

import numpy as np
import pytest

import pysmoe
from pysmoe import InvalidArgument


def _penalised_greedy(logits_seq, presence, frequency):
    """Greedy ids under OpenAI's presence/frequency penalties over the ids drawn so far, in numpy."""
    counts, out = {}, []
    for logits in logits_seq:
        v = np.array(logits, dtype=np.float32)
        for i, c in counts.items():
            v[i] = np.float32(np.float64(v[i]) - (np.float64(np.float32(frequency)) * c + np.float64(np.float32(presence))))
        t = int(np.argmax(v))
        out.append(t)
        counts[t] = counts.get(t, 0) + 1
    return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (1.5, 0.0), (0.0, 0.7), (0.5, 1.25), (-1.0, 0.5)])
def test_presence_and_frequency_penalties_are_openais(tiny_vault, presence, frequency):
    """Greedy decoding with the penalties picks, at every step, numpy's argmax of the logits minus
    frequency · count + presence over the ids drawn since set_sampler."""
    prompt = [5, 17, 99, 3]
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        s.set_sampler(presence_penalty=presence, frequency_penalty=frequency)
        logits, nxt = s.prefill_next(prompt)
        seq, ids = [logits], [nxt]
        for _ in range(30):
            logits, nxt = s.decode_next(ids[-1])
            seq.append(logits)
            ids.append(nxt)
    assert ids == _penalised_greedy(seq, presence, frequency)
    if presence or frequency:  # the penalties changed something over 31 draws of a tiny model
        assert ids != [int(np.argmax(x)) for x in seq]


def test_penalties_are_checked(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        for kw in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(presence_penalty=float("nan"))):
            with pytest.raises(InvalidArgument):
                s.set_sampler(**kw)


def test_logprobs_are_the_log_softmax(tiny_vault):
    rng = np.random.default_rng(0)
    x = rng.normal(size=5000).astype(np.float32) * 4
    x[7] = np.nan
    x[9] = -np.inf
    ref = x.astype(np.float64)
    ref[np.isnan(ref)] = -np.inf
    lse = np.log(np.sum(np.exp(ref - ref.max()))) + ref.max()
    lp, top = pysmoe.logprobs(x, 42, 20)
    assert abs(lp - (ref[42] - lse)) < 1e-9
    order = np.lexsort((np.arange(x.size), -ref))[:20]
    assert [i for i, _ in top] == order.tolist()
    assert np.allclose([p for _, p in top], ref[order] - lse, atol=1e-9)
    assert pysmoe.logprobs(x, 7)[0] == -np.inf
    ties = np.zeros(10, dtype=np.float32)
    assert [i for i, _ in pysmoe.logprobs(ties, 0, 4)[1]] == [0, 1, 2, 3]
    with pytest.raises(InvalidArgument):
        pysmoe.logprobs(x, 5000)
    with pytest.raises(InvalidArgument):
        pysmoe.logprobs(x, 0, pysmoe.engine.MAX_TOP_LOGPROBS + 1)


SETTINGS = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=11),
            dict(temperature=1.2, min_p=0.05, seed=3, presence_penalty=0.6, frequency_penalty=0.3)]


@pytest.mark.parametrize("params", SETTINGS)
def test_the_same_seed_gives_the_same_ids_from_every_call(tiny_vault, params):
    """Session.generate, a prefill_next/decode_next loop, and decode_batch of sessions sharing a cache
    all draw with the session's one sampler: the same ids for the same settings and seed."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 6]
    n = 16
    with pysmoe.open_vault(tiny_vault) as v:
        gen = []
        with v.session() as s:
            for p in prompts:
                s.reset()
                gen.append(list(s.generate(p, max_tokens=n, **params)))
        loop = []
        with v.session() as s:
            for p in prompts:
                s.reset()
                s.set_sampler(**params)
                _, t = s.prefill_next(p, want_logits=False)
                ids = [t]
                while len(ids) < n:
                    ids.append(s.decode_next(ids[-1], want_logits=False)[1])
                loop.append(ids)
        with v.session(chunk=8) as lead:
            ss = [lead] + [v.session(share_cache=lead, chunk=8) for _ in prompts[1:]]
            ids = []
            for s, p in zip(ss, prompts):
                s.set_sampler(**params)
                ids.append([s.prefill_next(p, want_logits=False)[1]])
            for _ in range(n - 1):
                _, nxt = pysmoe.decode_batch(ss, [x[-1] for x in ids], sample=True)
                for x, t in zip(ids, nxt):
                    x.append(t)
            for s in ss[1:]:
                s.close()
    assert gen == loop == ids
