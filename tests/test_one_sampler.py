"""One sampler: the engine's (csrc/engine/sample.c) draws every id, whichever front end asks. Seeded,
non-greedy sampling gives the same token ids from Session.generate, pysmoe.stream_generate,
`python -m pysmoe run` and the server's /v1/completions for the same arguments: alone, with a
prompt fed in several chunks or reused from the prefix cache, and batched with other requests
(each with its own seed), with and without logprobs. (On the GPU: tests/test_server.py,
test_served_from_the_gpu.)"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe.demo import ensure_demo_vault
from pysmoe.generate import stream_generate

# The settings, and one with OpenAI's presence and frequency penalties (and min-p).
SETTINGS = {
    "top-k-top-p-repetition": dict(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=11),
    "presence-frequency": dict(temperature=1.0, top_p=0.95, min_p=0.02, presence_penalty=0.6, frequency_penalty=0.9,
                               seed=5),
}
N = 24
CHUNK = 8
PROMPT = ("The function returns a new list of the values found in the dictionary, in the order in which "
          "their keys were inserted")


@pytest.fixture(scope="module")
def demo():
    return ensure_demo_vault()


def _alone(vault, prompt, n=N, **kw):
    """Session.generate's ids on a fresh session (stopping at the tokenizer's end ids, as the others do)."""
    with vault.session() as s:
        return list(s.generate(prompt, max_tokens=n, stop=vault.tokenizer.eos_ids, **kw))


# ------------------------------------------------------------------------------- the server
class Served:
    """The server of the demo vault on threads of this process (pysmoe.cli.serve.Background), with
    the ids each request generated: every RequestText the routes make is recorded."""

    def __init__(self, vault_path, **over):
        pytest.importorskip("uvicorn")
        pytest.importorskip("starlette")
        from pysmoe.cli.serve import Background
        args = dict(vault=str(vault_path), host="127.0.0.1", port=0, api_key=None, model_name="demo", max_batch=8,
                    batching=True, cache_mb=64, kv_mb=None, threads=1, chunk=CHUNK, context=512,
                    max_tokens_limit=256, max_request_kb=64, buffered=False, device="cpu", gpu_cache_mb=None)
        args.update(over)
        self.bg = Background(argparse.Namespace(**args))
        self.texts = []

    def post(self, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.bg.port, timeout=120)
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = json.loads(r.read())
        conn.close()
        assert r.status == 200, payload
        return payload

    def metrics(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.bg.port, timeout=30)
        conn.request("GET", "/metrics")
        payload = json.loads(conn.getresponse().read())
        conn.close()
        return payload

    def complete(self, prompt, n=N, logprobs=None, **kw):
        """(the ids the server generated, the response) of one /v1/completions request. kw: sampling
        arguments with the library's names (top_k, min_p and repetition_penalty go as the extensions
        they are)."""
        body = {"prompt": list(prompt), "max_tokens": n, **kw}
        if logprobs is not None:
            body["logprobs"] = logprobs
        r = self.post("/v1/completions", body)
        mine = [t for t in self.texts if t.prompt == list(prompt) and t.req.sampling.seed == kw.get("seed")
                and t.gen.done]
        assert len(mine) == 1, "one recorded request per (prompt, seed) in a test"
        self.texts.remove(mine[0])
        return list(mine[0].gen.tokens), r

    def close(self):
        self.bg.close()


@pytest.fixture
def served(demo, monkeypatch, request):
    import pysmoe.server.app as app
    s = Served(demo, **getattr(request, "param", {}))

    class Recording(app.RequestText):
        def __init__(self, req, tokenizer, prompt_ids, **kw):
            super().__init__(req, tokenizer, prompt_ids, **kw)
            self.prompt = list(prompt_ids)
            s.texts.append(self)

    monkeypatch.setattr(app, "RequestText", Recording)
    yield s
    s.close()


def _text(tok, ids):
    return tok.decode([t for t in ids if t not in tok.eos_ids])


@pytest.mark.parametrize("name", SETTINGS)
def test_seeded_ids_are_the_same_from_every_front_end(demo, served, name):
    kw = SETTINGS[name]
    with pysmoe.open_vault(demo) as v:
        tok = v.tokenizer
        prompt = tok.encode(PROMPT)
        assert len(prompt) > 2 * CHUNK  # the server feeds it in three pieces, the last with prefill_next
        want = _alone(v, prompt, **kw)
        assert len(want) == N and want != _alone(v, prompt), "these settings sample: not the greedy ids"

        with v.session() as s:
            streamed = [r.token for r in stream_generate(s, prompt, N, **kw)]

    cmd = [sys.executable, "-m", "pysmoe", "run", "--vault", str(demo), "--ids", ",".join(map(str, prompt)),
           "--max-tokens", str(N), "--json"]
    for k, x in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(x)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["ids"]

    server, r = served.complete(prompt, **kw)
    assert r["choices"][0]["text"] == _text(served.bg.vault.tokenizer, want)
    assert r["usage"]["completion_tokens"] == len(want)
    # again: the prompt's KV now comes from the prefix cache, the sampler is set anew
    again, r2 = served.complete(prompt, **kw)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    assert streamed == run == server == again == want


def test_negative_seeds_are_their_twos_complement(demo, served):
    """The server takes OpenAI's int64 seeds: seed −s samples as Session.generate's seed 2**64 − s."""
    kw = dict(SETTINGS["top-k-top-p-repetition"], seed=-7)
    with pysmoe.open_vault(demo) as v:
        prompt = v.tokenizer.encode("Return the number of items")
        want = _alone(v, prompt, **dict(kw, seed=2 ** 64 - 7))
        assert want != _alone(v, prompt, **dict(kw, seed=7))
    assert served.complete(prompt, **kw)[0] == want


WORDS = ["cats", "the sea", "mountains", "bread", "rain", "engines", "music", "stars"]


@pytest.mark.parametrize("served", [{}, {"batching": False}], ids=["batched", "interleaved"], indirect=True)
def test_concurrent_seeded_requests_each_get_their_alone_ids(demo, served):
    """Eight requests at once, each with its own seed, one with logprobs: every one gets the ids its
    own Session.generate gives (batched decode steps draw each session's id with its own sampler), and
    the logprobs are the model's log-softmax of the logits those ids were drawn from."""
    base = SETTINGS["top-k-top-p-repetition"]
    with pysmoe.open_vault(demo) as v:
        tok = v.tokenizer
        prompts = [tok.encode(f"Request {i} asks about {w}") for i, w in enumerate(WORDS)]
        seeds = [100 + i for i in range(len(prompts))]
        wants = [_alone(v, p, **dict(base, seed=s)) for p, s in zip(prompts, seeds)]
        # the logits each id of request 0 was drawn from, by the session API
        with v.session() as s:
            s.set_sampler(**dict(base, seed=seeds[0]))
            logits, t = s.prefill_next(prompts[0])
            ids, rows = [t], [logits]
            while len(ids) < len(wants[0]) and ids[-1] not in tok.eos_ids:
                logits, t = s.decode_next(ids[-1])
                ids.append(t)
                rows.append(logits)
        assert ids == wants[0]
    before = served.metrics()["batch_sizes"]

    def ask(i):
        return served.complete(prompts[i], logprobs=3 if i == 0 else None, **dict(base, seed=seeds[i]))

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(ask, range(len(prompts))))
    assert [g for g, _ in got] == wants
    for want, (_, r) in zip(wants, got):
        assert r["choices"][0]["text"] == _text(tok, want)

    lp = got[0][1]["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(wants[0])
    for t, x, top, row in zip(wants[0], lp["token_logprobs"], lp["top_logprobs"], rows):
        mine, best = pysmoe.logprobs(row, t, 3)
        assert x == mine
        v64 = row.astype(np.float64)
        m = v64.max()
        assert math.isclose(x, v64[t] - m - math.log(np.exp(v64 - m).sum()), abs_tol=1e-9)
        assert sorted(top.values(), reverse=True) == [p for _, p in best]
    assert all(r["choices"][0]["logprobs"] is None for _, r in got[1:])

    if served.bg.sched.batching:
        after = served.metrics()["batch_sizes"]
        assert any(int(k) > 1 and after[k] > before.get(k, 0) for k in after), "no decode step ran several requests"


# ------------------------------------------------------------------------------- the library alone
@settings(deadline=None, max_examples=12)
@given(ids=st.lists(st.integers(1, 500), min_size=1, max_size=40),
       temperature=st.sampled_from([0.0, 0.7, 1.3]), top_p=st.sampled_from([1.0, 0.9]),
       top_k=st.sampled_from([0, 1, 40]), min_p=st.sampled_from([0.0, 0.05]),
       repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]), presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
       frequency_penalty=st.sampled_from([0.0, 1.2]), seed=st.integers(0, 2 ** 64 - 1))
def test_stream_generate_draws_what_session_generate_draws(tiny_vault, ids, temperature, top_p, top_k, min_p,
                                                            repetition_penalty, presence_penalty, frequency_penalty,
                                                            seed):
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
    with pysmoe.open_vault(tiny_vault) as v, v.session(cache_bytes=1 << 22) as s:
        want = list(s.generate(ids, max_tokens=12, stop=(), **kw))
        s.reset()
        got = [r.token for r in stream_generate(s, ids, 12, stop=(), **kw)]
    assert got == want
