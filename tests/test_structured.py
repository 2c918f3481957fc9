"""Structured output: the sampler's token mask (smoe_session_set_mask) and the server's
response_format / tool_choice enforced by an llguidance grammar, checked with jsonschema."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pysmoe
from pysmoe import InvalidArgument


def _mask(vocab, allowed):
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for i in allowed:
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words


# ------------------------------------------------------------------------------ the sampler


def test_the_mask_picks_among_the_allowed_ids(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        vocab = v.config["vocab_size"]
        prompt = v.tokenizer.encode("the mask")
        logits = s.prefill(prompt)
        s.reset()
        ranked = [int(i) for i in np.argsort(-logits, kind="stable")]
        allowed = ranked[5:9] + [vocab - 1]  # not the model's favourites
        s.set_mask(_mask(vocab, allowed))
        _, greedy = s.prefill_next(prompt, want_logits=False)
        assert greedy == max(allowed, key=lambda i: (logits[i], -i))
        drawn = set()
        for seed in range(20):  # seeded draws at temperature 1 stay inside the mask
            s.reset()
            s.set_sampler(temperature=1.0, seed=seed)
            s.set_mask(_mask(vocab, allowed))
            _, t = s.prefill_next(prompt, want_logits=False)
            drawn.add(t)
        assert drawn <= set(allowed) and len(drawn) > 1
        s.reset()
        s.set_sampler(temperature=0.0)  # lifts the mask
        assert s.prefill_next(prompt, want_logits=False)[1] == ranked[0]
        s.reset()
        s.set_mask(_mask(vocab, allowed))
        s.set_mask(None)
        assert s.prefill_next(prompt, want_logits=False)[1] == ranked[0]


def test_the_mask_holds_in_a_batched_decode(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v:
        vocab = v.config["vocab_size"]
        a = v.session(cache_bytes=1 << 24)
        b = v.session(share_cache=a)
        try:
            for s, text in ((a, "one"), (b, "two")):
                s.prefill(v.tokenizer.encode(text))
            allowed = [7, 300, 301]
            a.set_mask(_mask(vocab, allowed))
            logits, ids = pysmoe.decode_batch([a, b], [11, 12], sample=True, want_logits=True)
            assert ids[0] == max(allowed, key=lambda i: (logits[0][i], -i))
            assert ids[1] == int(np.argmax(logits[1]))
        finally:
            b.close()
            a.close()


def test_the_mask_on_the_gpu(tiny_vault):
    """A masked session on the GPU skips the device's candidate selection: the host draws from the
    GPU's logits, greedy taking the best allowed id, seeded draws staying inside the mask.
    Skipped without a CUDA build and a GPU."""
    with pysmoe.open_vault(tiny_vault) as v:
        try:
            v.session(device="cuda").close()
        except pysmoe.Unsupported:
            pytest.skip("no CUDA here")
        vocab = v.config["vocab_size"]
        prompt = v.tokenizer.encode("the mask on the GPU")
        allowed = list(range(3, vocab, 7))
        with v.session(device="cuda") as s:
            logits = s.prefill(prompt)
            s.reset()
            s.set_mask(_mask(vocab, allowed))
            assert s.prefill_next(prompt, want_logits=False)[1] == max(allowed, key=lambda i: (logits[i], -i))
            s.reset()
            s.set_sampler(temperature=0.9, top_k=40, seed=5)
            s.set_mask(_mask(vocab, allowed))
            _, t = s.prefill_next(prompt, want_logits=False)
            for _ in range(8):
                assert t in allowed
                _, t = s.decode_next(t, want_logits=False)


def test_bad_masks_are_refused(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        vocab = v.config["vocab_size"]
        with pytest.raises(InvalidArgument, match="words"):
            s.set_mask(np.ones(3, dtype=np.uint32))
        with pytest.raises(InvalidArgument, match="allows no id"):
            s.set_mask(np.zeros((vocab + 31) // 32, dtype=np.uint32))
        with pytest.raises(InvalidArgument):
            s.set_mask(np.ones((vocab + 31) // 32, dtype=np.float32))


# ------------------------------------------------------------------------------ the server

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_server import Running  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pet": {"enum": ["cat", "dog", None]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "Tell me about Ada as JSON."}]


@pytest.fixture(scope="module")
def served(tiny_vault):
    s = Running(tiny_vault, max_batch=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served_tools(tiny_qwen3_vault):
    """The tiny vault under Qwen3's chat template, which shows the model its tools (a template that
    ignores them is refused: tests/test_server_limits.py)."""
    s = Running(tiny_qwen3_vault, max_batch=4, context=1024)  # room for the tools' descriptions and a reply
    yield s
    s.close()


def _streamed(client, **kw):
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"name": "", "arguments": ""})
            e["name"] += t.function.name or ""
            e["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], finish


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_replies_validate_streamed_or_not(served, seed):
    kw = dict(model="tiny", messages=MSGS, max_tokens=200, seed=seed, temperature=1.0,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                       "strict": True}})
    r = served.client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    content, _, finish = _streamed(served.client, **kw)
    assert (content, finish) == (r.choices[0].message.content, "stop")  # the same seed: the same ids
    if seed == 0:  # n choices: each its own grammar state
        both = served.client.chat.completions.create(n=2, **kw)
        assert [c.finish_reason for c in both.choices] == ["stop", "stop"]
        for c in both.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_replies_are_objects(served):
    """The demo's model, trained on text, under json_object: every reply that ends by itself is a
    JSON object (a reply cut by max_tokens may not be, as with OpenAI)."""
    from pysmoe.demo import ensure_demo_vault
    demo = Running(ensure_demo_vault(), max_batch=2)
    try:
        ended = 0
        for seed in range(8):
            r = demo.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=60, seed=seed,
                                                    temperature=0.7, response_format={"type": "json_object"})
            if r.choices[0].finish_reason == "stop":
                ended += 1
                assert isinstance(json.loads(r.choices[0].message.content), dict)
            else:
                assert r.choices[0].message.content.startswith("{")
        assert ended >= 2
    finally:
        demo.close()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(served_tools, stream):
    served = served_tools
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, names in (("required", set(params)), ({"type": "function", "function": {"name": "add"}}, {"add"})):
        for seed in range(3):
            # one call each (a random model, free to add calls, may go on until max_tokens)
            kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=120, seed=seed,
                      parallel_tool_calls=False)
            if stream:
                _, calls, finish = _streamed(served.client, **kw)
            else:
                r = served.client.chat.completions.create(**kw)
                finish = r.choices[0].finish_reason
                calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
            assert finish == "tool_calls" and len(calls) == 1
            for name, arguments in calls:
                assert name in names
                jsonschema.validate(json.loads(arguments), params[name])


@pytest.mark.parametrize("reasoning, text, ok", [
    ("none", '{"ok": true}', True),
    ("none", '<think>x</think>{"ok": true}', False),
    ("optional", '<think>\nfirst {"ok": 1}\n</think>\n\n{"ok": false}', True),
    ("optional", '{"ok": false}', True),
    ("optional", '<think>x</think> and more</think>{"ok": true}', False),  # reasoning ends at its first </think>
    ("open", 'I think.\n</think>\n\n{"ok": true}', True),
    ("open", '{"ok": true}', False),
])
def test_reasoning_before_the_constrained_part(tiny_vault, reasoning, text, ok):
    """A model that reasons first (Qwen3) writes its <think> block, then the constrained reply."""
    import llguidance
    from pysmoe.server.grammar import grammar_text
    with pysmoe.open_vault(tiny_vault) as v:
        tok = v.tokenizer
        lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=v.config["vocab_size"], eos_token=tok.eos_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    g = grammar_text({"type": "json_schema", "json_schema": {"schema": schema}}, None, None, reasoning=reasoning)
    m = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", g), log_level=0)
    assert (m.consume_tokens(tok.encode(text)) and m.is_accepting()) == ok


def test_objects_get_no_keys_their_schema_does_not_list(tiny_vault):
    """A schema silent on additionalProperties (pydantic's, LangChain's) gets none: the reply still
    validates against it, and a model cannot add keys until max_tokens."""
    import llguidance
    from pysmoe.server.grammar import grammar_text
    with pysmoe.open_vault(tiny_vault) as v:
        tok = v.tokenizer
        lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=v.config["vocab_size"], eos_token=tok.eos_ids)
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    g = llguidance.grammar_from("lark", grammar_text({"type": "json_schema", "json_schema": {"schema": schema}},
                                                     None, None, reasoning="none"))
    for text, ok in (('{"a": {"b": 1}}', True), ('{"a": {"b": 1, "c": 2}}', False), ('{"a": {}, "z": 1}', False)):
        m = llguidance.LLMatcher(lt, g, log_level=0)
        assert (m.consume_tokens(tok.encode(text)) and m.is_accepting()) == ok, text


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"response_format": {"type": "xml"}}, "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "cannot be enforced"),
])
def test_bad_constraints_are_400(served, served_tools, body, message):
    served = served_tools if "tools" in body else served
    status, r = served.raw("POST", "/v1/chat/completions", {"model": "tiny", "messages": MSGS, **body})
    assert status == 400 and message in r["error"]["message"], r
