"""python -m pysmoe serve, driven over loopback by the official openai client (and raw HTTP for
what the client will not send): a real uvicorn on a free port, the tiny vault."""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from pysmoe.cli.serve import Background  # noqa: E402

MAX_BATCH = 8
CONTEXT = 512


def _args(vault, **over):
    base = dict(vault=str(vault), host="127.0.0.1", port=0, api_key=None, model_name="tiny", max_batch=MAX_BATCH,
                batching=True, cache_mb=16, kv_mb=None, threads=1, chunk=16, context=CONTEXT,
                max_tokens_limit=256, max_request_kb=64, buffered=False, device="cpu", gpu_cache_mb=None)
    base.update(over)
    return argparse.Namespace(**base)


class Running(Background):
    """A served vault plus an openai client and raw HTTP."""

    def __init__(self, vault, **over):
        super().__init__(_args(vault, **over))
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)

    def raw(self, method: str, path: str, body=None, headers=None):
        """(status, parsed JSON) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        payload = r.read()
        conn.close()
        return r.status, json.loads(payload) if payload else None

    def wait_idle(self):
        """Until no job runs or waits (a guard against a hang, not a timing: a minute)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            load = self.raw("GET", "/health")[1]
            if load["running"] == 0 and load["queued"] == 0:
                return load
            time.sleep(0.02)
        raise AssertionError(f"the server still has jobs: {load}")


@pytest.fixture(scope="module")
def served(tiny_vault):
    s = Running(tiny_vault)
    yield s
    s.close()


def _ids(served, text):
    return served.vault.tokenizer.encode(text)


def _alone(served, prompt_ids, n):
    """Greedy ids of prompt_ids from a fresh session of the vault, no server involved."""
    tok = served.vault.tokenizer
    with served.vault.session(cache_bytes=1 << 24, threads=1) as s:
        return list(s.generate(prompt_ids, max_tokens=n, temperature=0.0, stop=tok.eos_ids))


def test_served_from_the_gpu(tiny_vault):
    """--device cuda: the pool's sessions share the GPU's cache and the scheduler batches their decode
    steps (smoe_decode_batch on the GPU); each completion is the engine's own, greedy or seeded (the
    GPU's selection, the session's sampler), alone or with three others at once. Skipped without a
    CUDA build and a GPU."""
    import concurrent.futures
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v:
        try:
            v.session(device="cuda").close()
        except pysmoe.Unsupported:
            pytest.skip("no CUDA here")
        prompts = [v.tokenizer.encode(f"the GPU answers {i}") for i in range(4)]
        seeded = dict(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, presence_penalty=0.5)
        wants, sampled = [], []
        for i, prompt in enumerate(prompts):
            with v.session(device="cuda", gpu_cache_bytes=v.expert_bytes + v.blob_bytes, context=CONTEXT) as s:
                wants.append(list(s.generate(prompt, max_tokens=12, temperature=0.0, stop=v.tokenizer.eos_ids)))
                s.reset()
                sampled.append(list(s.generate(prompt, max_tokens=12, seed=11 + i, stop=v.tokenizer.eos_ids,
                                               **seeded)))
        assert sampled != wants
    served = Running(tiny_vault, device="cuda", max_batch=4)
    try:
        status, body = served.raw("GET", "/health")
        assert status == 200 and body["max_batch"] == 4
        tok = served.vault.tokenizer
        texts = [tok.decode([t for t in want if t not in tok.eos_ids]) for want in wants]

        def ask(prompt):
            r = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0)
            return r.choices[0].text

        assert ask(prompts[0]) == texts[0]
        for _ in range(2):  # four at once: batched decode steps, each its own bits
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                assert list(ex.map(ask, prompts)) == texts

        def ask_seeded(i):
            r = served.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, seed=11 + i,
                                                 temperature=seeded["temperature"], top_p=seeded["top_p"],
                                                 presence_penalty=seeded["presence_penalty"],
                                                 extra_body={"top_k": seeded["top_k"],
                                                             "repetition_penalty": seeded["repetition_penalty"]})
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as ex:  # each its own seed, batched
            assert list(ex.map(ask_seeded, range(4))) == [tok.decode([t for t in w if t not in tok.eos_ids])
                                                          for w in sampled]
        status, m = served.raw("GET", "/metrics")
        assert status == 200 and m["engine"]["batch_steps"] > 0
        assert max(int(k) for k in m["batch_sizes"]) > 1
    finally:
        served.close()


# ---------------------------------------------------------------------------- basics
def test_models_and_health(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = served.raw("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["max_batch"] == MAX_BATCH


def test_completion_matches_the_engine_alone(served):
    prompt = _ids(served, "The quick brown fox")
    want = _alone(served, prompt, 12)
    r = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    tok = served.vault.tokenizer
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(want)
    assert r.choices[0].text == tok.decode([t for t in want if t not in tok.eos_ids])
    assert r.choices[0].finish_reason == ("stop" if want[-1] in tok.eos_ids else "length")


def test_chat_streamed_equals_not_streamed(served):
    msgs = [{"role": "user", "content": "Say something about rivers."}]
    full = served.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    chunks = list(served.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_streamed(served):
    prompt = "Once upon a time"
    full = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    parts = list(served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                  stream=True))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_logprobs(served):
    r = served.client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert all(len(t) == 2 and max(t.values()) >= v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text
    c = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})
    entries = c.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.logprob == e.top_logprobs[0].logprob for e in entries)  # greedy: the likeliest


def test_sampling_parameters_reach_the_sampler(served):
    # Over HTTP, every sampling field means what it means in the library: the same request gives the
    # text that pysmoe.generate gives with the same arguments (the engine's one sampler draws both).
    from pysmoe.generate import stream_generate
    prompt = _ids(served, "Once upon a time")
    greedy = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    # a cut that keeps only the likeliest token is greedy whatever the temperature
    for cut in ({"top_p": 1e-9}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        r = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.5, seed=3, **cut)
        assert r.choices[0].text == greedy, cut
    kw = dict(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.7, frequency_penalty=1.3)
    extra = {"top_k": 40, "min_p": 0.01}
    texts = [served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body=extra,
                                              **kw).choices[0].text for _ in range(2)]
    with served.vault.session(cache_bytes=1 << 24, threads=1) as s:
        want = "".join(r.text for r in stream_generate(s, prompt, 10, **kw, **extra))
    assert texts == [want, want]
    # a different seed samples differently (the seed reaches the sampler, not only the cache key)
    others = {served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body=extra,
                                               **dict(kw, seed=k)).choices[0].text for k in range(12, 16)}
    assert others - {want}
    # max_completion_tokens (the chat API's newer spelling) caps a chat reply
    c = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3 and c.choices[0].finish_reason == "length"


def test_stop_string(served):
    prompt = "In the beginning"
    text = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    stop = text[5:9]
    assert len(stop) == 4 and stop not in text[:8]
    r = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(served.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                                      stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in streamed) == r.choices[0].text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}}}}}]
SCRIPT = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def served_qwen3(tiny_qwen3_vault):
    """The tiny vault under Qwen3's chat template (tools, thinking)."""
    s = Running(tiny_qwen3_vault, max_batch=2)
    yield s
    s.close()


def _scripted(monkeypatch, served, text):
    """The model 'says' text then an end-of-sequence id: the id each engine step drew is replaced
    by the next id of text (the engine still runs every step; only the choice is forced)."""
    from pysmoe.server.text import RequestText
    tok = served.vault.tokenizer
    ids = tok.encode(text) + [tok.eos_ids[0]]

    def step(self, token, logits=None):
        return self.gen.push(ids[min(len(self.gen.tokens), len(ids) - 1)], logits)

    monkeypatch.setattr(RequestText, "step", step)


def test_tools_are_rendered_into_the_prompt(served_qwen3):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    c = served_qwen3.client
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    with_tools = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=1, temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_calls_and_reasoning(served_qwen3, monkeypatch):
    _scripted(monkeypatch, served_qwen3, SCRIPT)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    c = served_qwen3.client
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=100, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.model_extra["reasoning_content"] == "The user wants weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert not m.content

    calls, reasoning, finish = {}, "", None
    for ch in c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=100, temperature=0,
                                        stream=True):
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            entry["name"] += t.function.name or ""
            entry["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert reasoning == "The user wants weather."
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"


def test_enable_thinking_kwarg_reaches_the_template(served_qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    c = served_qwen3.client
    on = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    off = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty <think></think> block


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"model": "tiny"}, 422),
    ("/v1/chat/completions", {"messages": "hi"}, 422),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 422),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, 422),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 422),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 6]}, 400),
    ("/v1/completions", {"prompt": [1, -2]}, 400),
    ("/v1/completions", {"prompt": list(range(1, 200)) * 3}, 400),  # over the context of 512
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),  # 0 only with echo
    ("/v1/completions", {"prompt": ["x"] * 65, "n": 2}, 400),  # over 128 choices
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, 400),
    ("/v1/completions", {"prompt": ["a", ""]}, 400),
    ("/v1/completions", {"prompt": [[1, "a"]]}, 422),
    ("/v1/completions", {"prompt": 5}, 422),
    ("/v1/completions", {"prompt": "x" * 70000}, 413),
    ("/v1/nothing", {"prompt": "x"}, 404),
])
def test_errors_are_openai_shaped_and_the_server_goes_on(served, path, body, status):
    got, payload = served.raw("POST", path, body)
    assert got == status
    assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
    ok = served.client.completions.create(model="tiny", prompt="still there?", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_context_error_through_the_client(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model="tiny", prompt=[5] * CONTEXT, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"


def test_api_key(served):
    served.server.api_key = "sekrit"
    try:
        with pytest.raises(openai.AuthenticationError):
            served.client.models.list()
        status, body = served.raw("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert served.raw("GET", "/metrics")[0] == 401
        assert served.raw("GET", "/health")[0] == 200
        keyed = openai.OpenAI(base_url=served.client.base_url, api_key="sekrit", max_retries=0)
        assert keyed.completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1
    finally:
        served.server.api_key = None


# ---------------------------------------------------------------------------- concurrency
def test_eight_concurrent_greedy_requests_get_their_alone_tokens(served):
    prompts = [_ids(served, f"Request number {i} asks about {word}") for i, word in
               enumerate(["cats", "the sea", "mountains", "bread", "rain", "engines", "music", "stars"])]
    want = [_alone(served, p, 16) for p in prompts]
    tok = served.vault.tokenizer
    before = served.raw("GET", "/metrics")[1]["batch_sizes"]

    def ask(p):
        return served.client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(ask, prompts))
    for w, r in zip(want, got):
        assert r.usage.completion_tokens == len(w)
        assert r.choices[0].text == tok.decode([t for t in w if t not in tok.eos_ids])
    after = served.raw("GET", "/metrics")[1]["batch_sizes"]
    batched = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert any(int(k) > 1 and v > 0 for k, v in batched.items()), "no decode step ran more than one request"


def test_disconnect_mid_stream_frees_the_slot(served):
    # The tiny vault decodes thousands of tokens a second, and the server does not wait for a slow
    # reader: a stream can be generated to its end before the client has read two chunks. Such an
    # attempt proves nothing and is retried; one that is still running must end cancelled.
    for attempt in range(8):
        served.wait_idle()
        before = served.raw("GET", "/metrics")[1]["requests"]
        cancelled, length = before.get("cancelled", 0), before.get("length", 0)
        stream = served.client.completions.create(model="tiny", prompt="Tell a long story", max_tokens=250,
                                                  temperature=0.8, seed=1 + attempt, stream=True,
                                                  extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)
        stream.close()
        served.wait_idle()
        requests = served.raw("GET", "/metrics")[1]["requests"]
        if requests.get("length", 0) == length + 1:
            continue  # it ran to max_tokens before the disconnect reached the server
        assert requests.get("cancelled", 0) == cancelled + 1, requests
        assert served.raw("GET", "/health")[1]["running"] == 0
        return
    pytest.fail("every attempt's generation ended before the client could disconnect")


def test_second_turn_reuses_the_first_turns_kv(served):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour and a fruit and an animal, please."}]
    first = served.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    reused_before = served.raw("GET", "/metrics")[1]["prompt_tokens_reused"]
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    second = served.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert served.raw("GET", "/metrics")[1]["prompt_tokens_reused"] - reused_before == cached


def test_a_disconnect_during_prefill_frees_the_slot(served):
    served.wait_idle()
    cancelled = served.raw("GET", "/metrics")[1]["requests"].get("cancelled", 0)
    long = [{"role": "user", "content": "word " * 200}]
    stream = served.client.chat.completions.create(model="tiny", messages=long, max_tokens=5, stream=True)
    next(iter(stream))  # the role chunk comes before the prompt is prefilled
    stream.close()
    served.wait_idle()
    assert served.raw("GET", "/metrics")[1]["requests"].get("cancelled", 0) == cancelled + 1


def test_a_disconnect_without_streaming_frees_the_slot(served):
    import socket
    served.wait_idle()
    cancelled = served.raw("GET", "/metrics")[1]["requests"].get("cancelled", 0)
    body = json.dumps({"prompt": "Tell a long story", "max_tokens": 250, "temperature": 0.8, "seed": 2,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while served.raw("GET", "/health")[1]["running"] == 0:  # until it runs
            assert time.monotonic() < deadline
            time.sleep(0.005)
    served.wait_idle()
    assert served.raw("GET", "/metrics")[1]["requests"].get("cancelled", 0) == cancelled + 1


# ---------------------------------------------------------------------------- the scheduler alone
def _job(tok, ids, max_tokens, events, context=CONTEXT):
    from pysmoe.server.scheduler import Job
    from pysmoe.server.schemas import parse_completion
    from pysmoe.server.text import RequestText
    req = parse_completion({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}, 256)
    return Job(ids, RequestText(req, tok, ids, context=context), lambda kind, payload: events.append((kind, payload)))


def _until(cond):
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, "the scheduler did not get there"
        time.sleep(0.005)


def test_long_prompt_is_prefilled_between_decode_steps(tiny_vault):
    """While a long prompt is prefilled chunk by chunk, the running request keeps decoding: a
    decode step after each of the newcomer's chunks."""
    from pysmoe import open_vault
    from pysmoe.server.scheduler import Scheduler
    from pysmoe.server.pool import SessionPool
    with open_vault(tiny_vault) as v, SessionPool(v, max_sessions=2, cache_bytes=1 << 24, threads=1, chunk=16) as pool:
        sched = Scheduler(pool, max_batch=2, context=CONTEXT, chunk=16)
        first, second = [], []
        a = _job(v.tokenizer, [5, 6, 7], 200, first)
        b = _job(v.tokenizer, list(range(10, 310)), 3, second)
        seen = []
        real_decode = sched._decode

        def record(jobs):
            seen.append((len(jobs), len(b.pending)))
            real_decode(jobs)

        sched._decode = record
        sched.start()
        try:
            sched.submit(a)
            _until(lambda: len(first) >= 2)  # a is decoding
            sched.submit(b)
            _until(lambda: b.finished and a.finished)
        finally:
            sched.stop()
    assert second[-1][0] == "done" and first[-1] == ("done", ("length", a.usage()))
    during = [p for n, p in seen if 0 < p < 300]
    assert during == [300 - 16 * k for k in range(1, 19)]  # one decode step after each chunk
    assert any(n == 2 for n, p in seen)  # then both decode together


def test_cancel_during_prefill_stops_at_the_next_chunk(tiny_vault):
    from pysmoe import open_vault
    from pysmoe.server.scheduler import Scheduler
    from pysmoe.server.pool import SessionPool
    with open_vault(tiny_vault) as v, SessionPool(v, max_sessions=1, cache_bytes=1 << 24, threads=1, chunk=16) as pool:
        sched = Scheduler(pool, max_batch=1, context=CONTEXT, chunk=16)
        events = []
        job = _job(v.tokenizer, list(range(10, 410)), 5, events)
        real = pool.acquire

        def acquire(ids):
            session, reused = real(ids)
            prefill = session.prefill

            def one_chunk_then_cancel(part, **kw):
                out = prefill(part, **kw)
                sched.cancel(job)  # as the HTTP side does when the client goes away
                return out
            session.prefill = one_chunk_then_cancel
            return session, reused

        pool.acquire = acquire
        sched.start()
        try:
            sched.submit(job)
            _until(lambda: job.finished and job.session is None)
        finally:
            sched.stop()
        assert [(k, p[0]) for k, p in events] == [("done", "cancelled")]  # no token
        assert len(job.fed) == 16 and job.generated == 0
        st = pool.stats()
        assert st["busy"] == 0 and st["cached_tokens"] == 16  # released with what its KV holds


def test_the_serve_command(tiny_vault):
    """python -m pysmoe serve in its own process: says where it listens, answers, stops on SIGINT."""
    import re
    import signal
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "pysmoe", "serve", "--vault", str(tiny_vault), "--port", "0",
                          "--cache-mb", "8", "--max-batch", "2", "--api-key", "k", "--alias", "x"],
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{m.group(1)}/v1", api_key="k", max_retries=0)
        r = client.completions.create(model="x", prompt="hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(60) in (0, 130)
