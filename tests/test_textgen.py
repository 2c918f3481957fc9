"""pysmoe.textgen: sampling settings, incremental detokenizing, stop strings, chat prompts, Qwen3 parsing.
(The ids are the engine's sampler's: tests/test_sampler.py tests it, tests/test_one_sampler.py that
every front end draws with it.)"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pysmoe.textgen import (Detokenizer, Generation, InvalidParam, MessageDelta, Qwen3Parser, SamplingParams,
                            StopMatcher, completion_logprobs, first_stop, render_chat, token_bytes)
from pysmoe.tokenizer import Tokenizer, build_synthetic_tokenizer

QWEN3_TEMPLATE = (pathlib.Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(build_synthetic_tokenizer(1000), {"eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def qwen_tok():
    return Tokenizer(build_synthetic_tokenizer(1000), {"eos_token": "<|im_end|>"}, QWEN3_TEMPLATE)


def splits(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------------------- params

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("seed", -2 ** 63 - 1), ("seed", 2 ** 64),
    ("min_p", 2.0), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("max_tokens", -1), ("max_tokens", 1.5), ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop", ["x"] * 17),
    ("stop_token_ids", [-1]), ("logprobs", 1), ("top_logprobs", 21), ("seed", "1"), ("temperature", True),
])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value, **({"logprobs": True} if field == "top_logprobs" else {})})
    assert isinstance(e.value, InvalidParam) and e.value.param == field and field in str(e.value)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidParam, match="logprobs"):
        SamplingParams(top_logprobs=2)


def test_params_normalise():
    p = SamplingParams(stop="END", seed=None, top_k=-1)
    assert p.stop == ("END",) and isinstance(p.seed, int) and p.seed >= 0 and p.top_k == 0


def test_sampler_kwargs_are_what_set_sampler_takes():
    """SamplingParams meets the engine's sampler in sampler_kwargs(): every setting, by name, and the
    seed as a uint64 (OpenAI's negative seeds as their two's complement)."""
    from pysmoe import Session
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=-1, presence_penalty=0.5,
                       frequency_penalty=-0.25, repetition_penalty=1.1, repetition_window=7, max_tokens=3,
                       stop=["x"], logprobs=True, top_logprobs=2)
    kw = p.sampler_kwargs()
    assert kw == dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=2 ** 64 - 1, presence_penalty=0.5,
                      frequency_penalty=-0.25, repetition_penalty=1.1, repetition_window=7)
    Session.check_sampler(**kw)
    assert SamplingParams(seed=-2 ** 63).sampler_kwargs()["seed"] == 2 ** 63
    assert SamplingParams(seed=2 ** 64 - 1).sampler_kwargs()["seed"] == 2 ** 64 - 1
    assert SamplingParams(top_k=-1).sampler_kwargs()["top_k"] == 0
    drawn = SamplingParams(seed=None)
    assert drawn.sampler_kwargs()["seed"] == drawn.seed  # drawn once, kept: the request can be replayed


# ---------------------------------------------------------------------------------- detokenizer

@settings(deadline=None, max_examples=200)
@given(st.data())
def test_detokenizer_equals_whole_decode(tok, data):
    # byte tokens (0..255 are single bytes: split UTF-8 everywhere), merges, special tokens
    ids = data.draw(st.lists(st.one_of(st.integers(0, 255), st.integers(0, tok.vocab_size + 5)), max_size=40))
    text = "".join(data.draw(st.lists(st.sampled_from(["é", "語", "🙂", "a", " b", "\n", "ü", "<|im_end|>"]),
                                      max_size=10)))
    ids = ids + tok.encode(text)
    ids = data.draw(st.permutations(ids))
    d = Detokenizer(tok)
    out = [d.push(i) for i in ids]
    assert "".join(out) + d.flush() == tok.decode(ids)
    # nothing shown ever ends in half a character, unless the whole text does
    assert all(not piece.endswith("\ufffd") for piece in out)


def test_detokenizer_holds_a_split_character(tok):
    ids = tok.encode("語")
    assert len(ids) >= 2
    d = Detokenizer(tok)
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1]) == "語"


def test_parser_tags_survive_even_when_marked_special():
    from tokenizers import AddedToken
    t = Tokenizer(build_synthetic_tokenizer(1000))
    t._tok.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    t.vocab_size = t._tok.get_vocab_size(with_added_tokens=True)
    ids = t.encode("<think>hm</think>ok<|im_end|>")
    assert t.decode(ids) == "hmok"    # what plain skip_special_tokens would show
    d = Detokenizer(t)
    assert "".join(d.push(i) for i in ids) + d.flush() == "<think>hm</think>ok"


def test_token_bytes(tok):
    ids = tok.encode("héllo 語")
    assert b"".join(token_bytes(tok, i) for i in ids) == "héllo 語".encode()
    assert token_bytes(tok, tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


# ---------------------------------------------------------------------------------- stop strings

@settings(deadline=None, max_examples=400)
@given(text=st.text(alphabet="abc\n", max_size=40), stops=st.lists(st.text(alphabet="abc\n", min_size=1,
                                                                               max_size=5), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 60), max_size=12))
def test_stop_matcher_equals_brute_force(text, stops, cuts):
    m = StopMatcher(stops)
    shown, stopped = [], False
    for piece in splits(text, cuts):
        s, stopped = m.push(piece)
        shown.append(s)
        if stopped:
            break
    if not stopped:
        s, stopped = m.flush()
        shown.append(s)
    i = first_stop(text, stops)
    assert "".join(shown) == (text if i is None else text[:i])
    assert stopped == (i is not None)


def test_stop_string_across_tokens(tok):
    ids = tok.encode("one two three four five")
    g = Generation(tok, SamplingParams(stop=["three"], max_tokens=50), [1], eos_ids=())
    shown = []
    for i in ids:
        step = g.push(i)
        shown.append(step.text)
        if step.finish_reason:
            break
    assert "".join(shown) == "one two " and g.finish_reason == "stop" and g.text == "one two "
    assert g.usage["completion_tokens"] == len(g.tokens) <= len(ids)


def test_finish_reasons(tok):
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hello world")
    g = Generation(tok, SamplingParams(max_tokens=2), [1])
    steps = [g.push(i) for i in ids[:2]]
    assert steps[-1].finish_reason == "length" and g.usage == {"prompt_tokens": 1, "completion_tokens": 2,
                                                               "total_tokens": 3}
    g = Generation(tok, SamplingParams(max_tokens=9), [1, 2])
    steps = [g.push(i) for i in [*ids, eos]]
    assert steps[-1].finish_reason == "stop" and g.text == "hello world" and steps[-1].text == ""
    g = Generation(tok, SamplingParams(max_tokens=None), [1], room=1)
    assert g.push(ids[0]).finish_reason == "length"
    with pytest.raises(RuntimeError):
        g.push(ids[1])


# ---------------------------------------------------------------------------------- chat prompts

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_render_chat_with_the_real_qwen3_template(qwen_tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    p = render_chat(qwen_tok, msgs, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert p.text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n") and json.dumps(TOOLS[0]) in p.text
    assert p.text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert p.ids == qwen_tok.encode(p.text) and not p.starts_in_reasoning
    # a tool call round trip: arguments as the API sends them (a JSON string) render as the model wrote them
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    p = render_chat(qwen_tok, msgs, tools=TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n') in p.text
    assert p.text.endswith("<|im_start|>assistant\n")


def test_render_chat_matches_transformers(qwen_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=qwen_tok._tok, eos_token="<|im_end|>")
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nmm\n</think>\n\nhello"},
            {"role": "user", "content": "weather in Paris?"}]
    for kw in ({}, {"enable_thinking": False}):
        want = hf.apply_chat_template(msgs, tools=TOOLS, chat_template=QWEN3_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True, **kw)
        assert render_chat(qwen_tok, msgs, tools=TOOLS, chat_template_kwargs=kw).text == want


def test_render_chat_refusals(qwen_tok):
    with pytest.raises(ValueError, match="role"):
        render_chat(qwen_tok, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        render_chat(qwen_tok, [])
    with pytest.raises(ValueError, match="image"):
        render_chat(qwen_tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


# ---------------------------------------------------------------------------------- Qwen3 parser

def parse(pieces, **kw):
    p = Qwen3Parser(call_id=iter(f"call_{i}" for i in range(100)).__next__, **kw)
    out = MessageDelta()
    deltas = []
    for x in pieces:
        d = p.feed(x)
        deltas.append(d)
        out.extend(d)
    d = p.finish()
    deltas.append(d)
    out.extend(d)
    return out, p.message(), deltas


def test_parser_reasoning_content_and_tool_calls():
    text = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            '</tool_call>')
    out, msg, _ = parse([text], tools=True)
    assert msg == {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants weather.",
                   "tool_calls": [
                       {"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                       {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    assert [t.to_openai() for t in out.tool_calls][:2] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]


def test_parser_fallbacks():
    _, msg, _ = parse(['Sure <tool_call>{"name": oops}</tool_call> done'], tools=True)
    assert msg == {"role": "assistant", "content": 'Sure <tool_call>{"name": oops}</tool_call> done'}
    _, msg, _ = parse(['x <tool_call>{"name": "f", "argu'], tools=True)
    assert msg["content"] == 'x <tool_call>{"name": "f", "argu' and "tool_calls" not in msg
    _, msg, _ = parse(['<tool_call>{"name": "f"}</tool_call>'], tools=False)   # no tools offered: text
    assert msg["content"] == '<tool_call>{"name": "f"}</tool_call>'
    _, msg, _ = parse(["<think>\nstill thinking when cut"])
    assert msg == {"role": "assistant", "content": "", "reasoning_content": "still thinking when cut"}
    _, msg, _ = parse(["plain answer <think> not a tag here"])
    assert msg == {"role": "assistant", "content": "plain answer <think> not a tag here"}
    _, msg, _ = parse(["only the end</think>\n\nanswer"], starts_in_reasoning=True)
    assert msg == {"role": "assistant", "content": "answer", "reasoning_content": "only the end"}


PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "\n\n", "hello", "<", "</", "<th",
          "</tool", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "arguments": "{\\"b\\": 2}"}',
          '{"name": 3}', "{", "}", "x", "é"]


@settings(deadline=None, max_examples=400)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(0, 200), max_size=10),
       tools=st.booleans(), starts=st.booleans())
def test_parser_streamed_equals_whole(parts, cuts, tools, starts):
    text = "".join(parts)
    whole, wmsg, _ = parse([text], tools=tools, starts_in_reasoning=starts)
    streamed, smsg, deltas = parse(splits(text, cuts), tools=tools, starts_in_reasoning=starts)
    assert smsg == wmsg
    assert (streamed.content, streamed.reasoning) == (whole.content, whole.reasoning)
    # the deltas, concatenated as a client does, give the message
    assert streamed.content == (wmsg["content"] or "") and streamed.reasoning == wmsg.get("reasoning_content", "")
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            c = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id:
                assert c["id"] is None
                c["id"], c["name"] = t.id, t.name
            c["arguments"] += t.arguments
    assert [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())] == wmsg.get("tool_calls", [])


def test_logprobs_entries(tok):
    import pysmoe
    ids = tok.encode("héllo wörld")
    g = Generation(tok, SamplingParams(temperature=0, max_tokens=50, logprobs=True, top_logprobs=2), [1], eos_ids=())
    assert g.wants_logits
    entries = []
    for i in ids:
        logits = np.full(tok.vocab_size, -5.0, dtype=np.float32)
        logits[i], logits[7] = 3.0, 2.0
        step = g.push(i, logits)
        assert [(e.token, e.logprob, list(e.top)) for e in step.logprobs] == [(i, *pysmoe.logprobs(logits, i, 2))]
        entries += step.logprobs
    assert g.push(5).logprobs == []       # a forced id, no logits: no logprobs to give
    assert not Generation(tok, SamplingParams(max_tokens=5), [1]).wants_logits
    chat = [e.to_openai(tok) for e in entries]
    assert [c["top_logprobs"][0]["token"] for c in chat] == [c["token"] for c in chat]
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] > c["top_logprobs"][1]["logprob"] for c in chat)
    assert b"".join(bytes(c["bytes"]) for c in chat) == "héllo wörld".encode()
    legacy = completion_logprobs(tok, entries)
    assert legacy["tokens"] == [c["token"] for c in chat] and legacy["text_offset"][0] == 0
    assert legacy["token_logprobs"] == [c["logprob"] for c in chat]


def test_generation_chat_streams_reasoning_and_tool_calls(tok):
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"q": "é"}}\n</tool_call>'
    g = Generation(tok, SamplingParams(max_tokens=500, logprobs=True), [1], chat=True, tools=True)
    chunks = []
    for i in tok.encode(text) + [tok.token_to_id("<|im_end|>")]:
        step = g.push(i)
        chunks.append(step.chat_delta())
    assert step.finish_reason == "tool_calls"
    msg = g.message()
    assert msg["reasoning_content"] == "hm" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "é"}
    assert "".join(c.get("reasoning_content", "") for c in chunks) == "hm"
    assert sum(len(c.get("tool_calls", [])) for c in chunks) == 2


# ---------------------------------------------------------------------------------- on the engine

@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5),
                                dict(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.3, seed=11)])
def test_chat_turns_penalise_what_the_c_sampler_would(tiny_vault, kw):
    """A second chat turn, fed on top of the first one's KV, draws the ids Session.generate draws
    over the whole conversation: the repetition penalty sees the earlier turns (the session's history)."""
    import pysmoe
    from pysmoe.cli.chat import Conversation
    with pysmoe.open_vault(tiny_vault) as v, v.session(cache_bytes=1 << 22) as s:
        conv = Conversation(s, v.tokenizer, max_tokens=1, **kw)
        list(conv.reply("hello"))
        conv.max_tokens = 8
        got = [r.token for r in conv.reply("and then?")]
        assert conv.kept > 0
        ids = render_chat(v.tokenizer, conv.turns[:-1]).ids
        s.reset()
        assert got == list(s.generate(ids, max_tokens=8, stop=v.tokenizer.eos_ids, **kw))


def test_stop_strings_and_seeds_through_stream_generate(tiny_vault):
    import pysmoe
    from pysmoe.errors import Cancelled
    from pysmoe.generate import stream_generate
    with pysmoe.open_vault(tiny_vault) as v, v.session(cache_bytes=1 << 22) as s:
        ids = v.tokenizer.encode("once upon a time")
        recs = list(stream_generate(s, ids, 40, stop=()))
        text = "".join(r.text for r in recs)
        pieces = [v.tokenizer.decode([r.token]) for r in recs]
        # a stop string across a token boundary: the end of one token's text and the start of the next
        j = next(j for j in range(1, len(pieces)) if pieces[j - 1] and pieces[j])
        before = "".join(pieces[:j - 1])
        stop = pieces[j - 1][-1] + pieces[j][0]
        s.reset()
        got = list(stream_generate(s, ids, 40, stop=(), stop_strings=[stop]))
        assert "".join(r.text for r in got) == text[:text.find(stop)] and got[-1].finish_reason == "stop"
        assert text.find(stop) <= len(before) + len(pieces[j - 1]) - 1
        # sampling: the same seed gives the same ids
        runs = []
        for seed in (5, 5, 6):
            s.reset()
            runs.append([r.token for r in stream_generate(s, ids, 16, temperature=1.0, top_p=0.95, seed=seed,
                                                          presence_penalty=0.5, stop=())])
        assert runs[0] == runs[1] != runs[2]
        # a failure while generating rewinds to before the prompt, as Session.generate does
        s.reset()
        s.prefill([3, 4])
        it = stream_generate(s, ids, 16, stop=())
        next(it), next(it)
        with pytest.raises(Cancelled):
            it.throw(Cancelled("test"))
        assert s.position == 2


def test_cli_stop_and_penalties(tiny_vault):
    import subprocess
    import sys
    base = [sys.executable, "-m", "pysmoe", "run", "--vault", str(tiny_vault), "--prompt", "the cat", "--max-tokens",
            "30", "--json", "--cache-mb", "1"]
    full = json.loads(subprocess.run(base, capture_output=True, text=True, timeout=300, check=True).stdout)
    stop = full["text"][5:8]
    out = subprocess.run([*base, "--stop", stop, "--stop", "NEVER IN THIS TEXT", "--presence-penalty", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["text"] == full["text"][:full["text"].find(stop)] and rec["finish_reason"] == "stop"
    out = subprocess.run([*base, "--frequency-penalty", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--frequency-penalty" in out.stderr


def test_ctrl_c_in_stream_generate_rewinds_to_before_the_prompt(tiny_vault):
    import os
    import signal
    import threading

    import pysmoe
    from pysmoe.generate import interruptible, stream_generate
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 3000)]
    with pysmoe.open_vault(tiny_vault) as v, v.session(context=4096, prefill="token-serial") as s, v.session() as ref:
        s.prefill([5, 6, 7])
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in interruptible(s, stream_generate(s, ids, 1000, stop=())):
                pass
        timer.join()
        assert s.position == 3
        ref.prefill([5, 6, 7])
        assert np.array_equal(s.decode(9), ref.decode(9))
