"""/v1/completions as lm-evaluation-harness and the OpenAI SDK use it, over loopback: echo with the
prompt's logprobs (equal to the engine's own, token-serial), max_tokens 0 with echo, several
prompts per request, n choices sharing the prompt's KV, /tokenize and /detokenize, and the model
name checked against the served name and its aliases."""
from __future__ import annotations

import argparse
import http.client
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import pysmoe  # noqa: E402
from pysmoe.cli.serve import Background  # noqa: E402

CHUNK = 16


def _args(vault, **over):
    base = dict(vault=str(vault), host="127.0.0.1", port=0, api_key=None, model_name="tiny", alias=["tiny-alias"],
                max_batch=4, batching=True, cache_mb=16, kv_mb=None, threads=1, chunk=CHUNK, context=512,
                max_tokens_limit=256, max_request_kb=64, buffered=False, device="cpu", gpu_cache_mb=None)
    base.update(over)
    return argparse.Namespace(**base)


class Served(Background):
    def __init__(self, vault):
        super().__init__(_args(vault))
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)

    def post(self, path: str, body: dict, method: str = "POST"):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        return r.status, raw

    def json(self, path: str, body: dict | None, method: str = "POST"):
        status, raw = self.post(path, body, method)
        return status, json.loads(raw)


@pytest.fixture(scope="module")
def served(tiny_vault):
    s = Served(tiny_vault)
    yield s
    s.close()


def engine_logprobs(vault, ids, top: int):
    """(logprob, {id: logprob} of the top ids) of ids[1:], each from the logits after the id
    before it, fed token-serially: the engine's own path, no prefill involved."""
    out = []
    with vault.session(cache_bytes=1 << 24, threads=1, prefill="token-serial") as s:
        for i, t in enumerate(ids[:-1]):
            lp, best = pysmoe.logprobs(s.decode(t), ids[i + 1], top)
            out.append((lp, dict(best)))
    return out


def test_echo_logprobs_are_the_engines_own(served):
    """Two token-id prompts in one request, echo, logprobs 2, max_tokens 0: each choice is its
    prompt, its first token's logprob null, every other's equal (as floats, exactly) to the
    engine's token-serial log-softmax. The 40-token prompt spans three prefill pieces."""
    v = served.vault
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(40)], [5, 17, 300, 42, 7, 99, 1]]
    status, r = served.json("/v1/completions", {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 2,
                                                "max_tokens": 0, "temperature": 0})
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 47
    for ids, choice in zip(prompts, r["choices"]):
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert choice["text"] == v.tokenizer.decode(ids, skip_special_tokens=False)
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = engine_logprobs(v, ids, 2)
        assert lp["token_logprobs"][1:] == [w[0] for w in want]
        for top, (_, best) in zip(lp["top_logprobs"][1:], want):  # keyed by token text (two ids may share one)
            assert set(top.values()) <= set(best.values()) and max(top.values()) == max(best.values())


def test_echo_with_one_generated_token_as_lm_eval_sends_it(served):
    """lm-eval's log-likelihood request (echo, logprobs 1, max_tokens 1, temperature 0), through
    the openai SDK: the prompt's logprobs, then the greedy id's, all the engine's."""
    v = served.vault
    ids = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199]
    r = served.client.completions.create(model="tiny-alias", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                         temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    with v.session(cache_bytes=1 << 24, threads=1, prefill="token-serial") as s:
        for t in ids[:-1]:
            s.decode(t)
        last = s.decode(ids[-1])
    nxt = int(last.argmax())
    assert lp.token_logprobs == [None] + [w[0] for w in engine_logprobs(v, ids, 1)] + \
        [pysmoe.logprobs(last, nxt)[0]]
    assert r.choices[0].text.startswith(v.tokenizer.decode(ids, skip_special_tokens=False))
    assert r.usage.completion_tokens == 1


def test_several_prompts_in_one_request_are_each_alone(served):
    prompts = ["Once upon a time", "The weather today", "In a hole in the ground"]
    together = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    alone = [served.client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == alone
    assert together.usage.completion_tokens == 3 * 8


def test_n_choices_reuse_the_prompt_and_are_seeded_choices(served):
    """n = 3 with seed s: choice k is the request with seed s + k alone; the prompt is counted once
    and prefilled once (the other two choices reuse all of it but its last id)."""
    prompt = "A long prompt whose KV the three choices share, word after word after word"
    n_ids = len(served.vault.tokenizer.encode(prompt))
    before = served.json("/metrics", None, "GET")[1]
    r = served.client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=10, temperature=1.0, seed=7)
    after = served.json("/metrics", None, "GET")[1]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == n_ids
    assert after["prompt_tokens"] - before["prompt_tokens"] == n_ids  # one prefill of the prompt
    assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= 2 * (n_ids - 1)
    alone = [served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0,
                                              seed=7 + k).choices[0].text for k in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1


def test_chat_n_choices(served):
    msgs = [{"role": "user", "content": "Say something"}]
    r = served.client.chat.completions.create(model="tiny", messages=msgs, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same


def test_streamed_echo_and_choices_match_the_whole_answer(served):
    body = {"model": "tiny", "prompt": ["one two three", "four five"], "n": 2, "echo": True, "max_tokens": 5,
            "temperature": 0.9, "seed": 3, "logprobs": 1}
    status, whole = served.json("/v1/completions", body)
    assert status == 200
    status, raw = served.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    texts, lps = ["", "", "", ""], [[], [], [], []]
    usage = None
    for line in raw.decode().split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
            if c["logprobs"]:
                lps[c["index"]] += c["logprobs"]["token_logprobs"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert lps == [c["logprobs"]["token_logprobs"] for c in whole["choices"]]
    assert usage == whole["usage"]


def test_tokenize_and_detokenize_in_both_spellings(served):
    tok = served.vault.tokenizer
    text = "Hello tokenizer world"
    status, a = served.json("/tokenize", {"content": text})  # llama-server
    status2, b = served.json("/tokenize", {"prompt": text, "add_special_tokens": False})  # vLLM, lm-eval
    assert status == status2 == 200
    assert a["tokens"] == b["tokens"] == tok.encode(text) and a["count"] == len(a["tokens"])
    status, pieces = served.json("/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == a["tokens"]
    status, d = served.json("/detokenize", {"tokens": a["tokens"]})
    assert status == 200 and d["content"] == d["prompt"] == tok.decode(a["tokens"], skip_special_tokens=False)
    assert served.json("/detokenize", {"tokens": [10 ** 7]})[0] == 400
    assert served.json("/tokenize", {"content": 5})[0] == 422
    status, info = served.json("/tokenizer_info", None, "GET")
    assert status == 200 and "eos_token" in info and info["model_max_length"] == 512


def test_model_names(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny", "tiny-alias"]
    with pytest.raises(openai.NotFoundError) as e:
        served.client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
    status, r = served.json("/v1/completions", {"prompt": "x", "max_tokens": 1})  # no model: the served one
    assert status == 200 and r["model"] == "tiny"
