"""gpt-oss's chat format (harmony): its published chat template rendered as transformers renders
it, the output parser (analysis/final channels, tool calls), and both through the server."""
from __future__ import annotations

import argparse
import json
import pathlib
import random

import pytest

from pysmoe.textgen import Generation, HarmonyParser, SamplingParams, render_chat
from pysmoe.tokenizer import Tokenizer

TEMPLATE = (pathlib.Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "integer"}, "hourly": {"type": "array", "items": {"type": "number"}}},
        "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "thinking": "Use the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"c\": 3}"},
    {"role": "assistant", "content": "3 °C."},
    {"role": "user", "content": "And tomorrow?"},
]


def harmony_tokenizer_json(vocab: int = 512) -> str:
    """A byte-level BPE with gpt-oss's harmony tags as special tokens, all ids < vocab."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    corpus = (pathlib.Path(__file__).resolve().parent.parent / "pysmoe" / "data" / "corpus.txt")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", *HARMONY_SPECIALS]
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(specials), show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab
    return tok.to_str()


@pytest.fixture(scope="module")
def tok_json():
    return harmony_tokenizer_json()


# ------------------------------------------------------------------------------ the template
def _both(tok_json, messages, **kw):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTok

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(tok_json), eos_token="<|return|>")
    kw.setdefault("add_generation_prompt", True)
    theirs = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kw)
    ours = Tokenizer(tok_json, {"eos_token": "<|return|>"}, TEMPLATE).apply_chat_template(messages, tokenize=False,
                                                                                          **kw)
    return ours, theirs


@pytest.mark.parametrize("messages, kw", [
    (CONVERSATION[1:2], {}),
    (CONVERSATION[:2], {"reasoning_effort": "low"}),
    (CONVERSATION, {"tools": TOOLS}),
    (CONVERSATION, {"tools": TOOLS, "reasoning_effort": "high", "model_identity": "You are a test."}),
    (CONVERSATION[:5], {"tools": TOOLS}),  # the tool call's analysis is kept: no final answer after it
    (CONVERSATION[:2] + [{"role": "assistant", "content": "Hi.", "thinking": "Greet."}],
     {"add_generation_prompt": False}),
    (CONVERSATION[1:2], {"builtin_tools": ["browser", "python"]}),
])
def test_template_renders_as_transformers(tok_json, messages, kw):
    ours, theirs = _both(tok_json, messages, **kw)
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>")
    assert ("Reasoning: " + kw.get("reasoning_effort", "medium")) in ours


def test_render_chat_takes_openai_messages(tok_json):
    """OpenAI's shapes (reasoning_content, arguments as a JSON string) render as transformers
    renders the template's own shapes; the prompt is marked harmony."""
    tok = Tokenizer(tok_json, {"eos_token": "<|return|>"}, TEMPLATE)
    openai_msgs = [dict(m) for m in CONVERSATION]
    openai_msgs[2] = {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]}
    p = render_chat(tok, openai_msgs[:4], tools=TOOLS, chat_template_kwargs={"reasoning_effort": "low"})
    ours, theirs = _both(tok_json, CONVERSATION[:4], tools=TOOLS, reasoning_effort="low")
    assert p.text == theirs == ours
    assert p.format == "harmony" and not p.starts_in_reasoning
    assert p.text.endswith("<|start|>assistant")
    # the tags are single tokens of this tokenizer
    assert tok.encode("<|start|>assistant")[0] == tok._tok.token_to_id("<|start|>")


# ------------------------------------------------------------------------------ the parser
ANSWER = "<|channel|>analysis<|message|>The user asks <b>.<|end|><|start|>assistant<|channel|>final<|message|>It is 3 °C <|x|>."
CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        "{\"city\": \"Paris\"}")


def _parse(text: str, pieces: list[int], **kw) -> tuple[dict, dict]:
    """(message, what the deltas add up to) of text fed in pieces of the given sizes."""
    p = HarmonyParser(call_id=lambda: "call_x", **kw)
    got = {"content": "", "reasoning": "", "calls": []}
    i = 0
    deltas = []
    for n in pieces:
        deltas.append(p.feed(text[i:i + n]))
        i += n
    deltas.append(p.feed(text[i:]))
    deltas.append(p.finish())
    for d in deltas:
        got["content"] += d.content
        got["reasoning"] += d.reasoning
        got["calls"] += [t.to_openai() for t in d.tool_calls]
    return p.message(), got


def _random_pieces(text: str, seed: int) -> list[int]:
    r = random.Random(seed)
    out, left = [], len(text)
    while left > 0:
        out.append(r.randint(1, 7))
        left -= out[-1]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_parser_channels_in_any_pieces(seed):
    msg, got = _parse(ANSWER, _random_pieces(ANSWER, seed))
    assert msg == {"role": "assistant", "content": "It is 3 °C <|x|>.", "reasoning_content": "The user asks <b>."}
    assert got["content"] == msg["content"] and got["reasoning"] == msg["reasoning_content"]


@pytest.mark.parametrize("seed", range(4))
def test_parser_tool_call(seed):
    # <|call|> is an end-of-sequence id: the text ends with the call's body
    for text in (CALL, CALL + "<|call|>"):
        msg, got = _parse(text, _random_pieces(text, seed), tools=True)
        assert msg["reasoning_content"] == "Need the tool."
        assert msg["content"] is None
        assert msg["tool_calls"] == [{"id": "call_x", "type": "function",
                                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
        assert got["calls"] == [{"index": 0, "id": "call_x", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}},
                                {"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}}]


def test_parser_fallbacks():
    # tools not offered, or a body that is not JSON: the body is content
    assert _parse(CALL, [], tools=False)[0]["content"] == "{\"city\": \"Paris\"}"
    bad = CALL.replace("{\"city\": \"Paris\"}", "{city: Paris")
    msg = _parse(bad, [3, 3], tools=True)[0]
    assert msg["content"] == "{city: Paris" and "tool_calls" not in msg
    # text that ignores the format is content, as it came
    assert _parse("Hello <|end|> there", [1, 1])[0] == {"role": "assistant", "content": "Hello <|end|> there"}
    # a preamble (commentary to nobody) is content; a built-in tool's message is reasoning
    pre = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=browser.search<|channel|>analysis" \
          "<|message|>{\"query\": \"x\"}<|call|>"
    assert _parse(pre, [5])[0] == {"role": "assistant", "content": "Checking.", "reasoning_content": "{\"query\": \"x\"}"}
    # an unfinished header shows nothing
    assert _parse("<|channel|>analy", [2])[0] == {"role": "assistant", "content": ""}


def test_generation_picks_the_harmony_parser(tok_json):
    tok = Tokenizer(tok_json, {"eos_token": "<|return|>"}, TEMPLATE)
    ids = tok.encode(ANSWER) + [tok._tok.token_to_id("<|return|>")]
    gen = Generation(tok, SamplingParams(max_tokens=200), [1, 2], chat=True, chat_format="harmony")
    steps = [gen.push(i) for i in ids]
    assert steps[-1].finish_reason == "stop"
    assert gen.message() == {"role": "assistant", "content": "It is 3 °C <|x|>.",
                             "reasoning_content": "The user asks <b>."}


# ------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def served_harmony(tiny_vault, tmp_path_factory, tok_json):
    """The tiny vault with a harmony tokenizer (tags as special tokens) and gpt-oss's template."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from pysmoe.cli.serve import Background

    d = tmp_path_factory.mktemp("harmony_tiny")
    for f in pathlib.Path(tiny_vault).iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            (d / f.name).symlink_to(f)
    (d / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    tok = Tokenizer(tok_json)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok._tok.token_to_id("<|return|>"), tok._tok.token_to_id("<|call|>")]}))
    args = argparse.Namespace(vault=str(d), host="127.0.0.1", port=0, api_key=None, model_name="tiny", max_batch=2,
                              batching=True, cache_mb=16, kv_mb=None, threads=1, chunk=16, context=512,
                              max_tokens_limit=256, max_request_kb=64, buffered=False, device="cpu",
                              gpu_cache_mb=None)
    s = Background(args)
    s.client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    yield s
    s.close()


def _scripted(monkeypatch, served, text, end):
    """The model 'says' text then the end tag's id (each engine step still runs; the id is forced)."""
    from pysmoe.server.text import RequestText
    tok = served.vault.tokenizer
    ids = tok.encode(text) + [tok._tok.token_to_id(end)]

    def step(self, token, logits=None):
        return self.gen.push(ids[min(len(self.gen.tokens), len(ids) - 1)], logits)

    monkeypatch.setattr(RequestText, "step", step)


def test_server_reasoning_and_content(served_harmony, monkeypatch):
    _scripted(monkeypatch, served_harmony, ANSWER, "<|return|>")
    msgs = [{"role": "user", "content": "weather?"}]
    c = served_harmony.client
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=200, temperature=0)
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"]) == ("It is 3 °C <|x|>.", "The user asks <b>.")
    assert r.choices[0].finish_reason == "stop"
    content, reasoning = "", ""
    for ch in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=200, temperature=0, stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
    assert (content, reasoning) == (m.content, "The user asks <b>.")


def test_server_tool_calls(served_harmony, monkeypatch):
    _scripted(monkeypatch, served_harmony, CALL, "<|call|>")
    c = served_harmony.client
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}],
                                  tools=TOOLS, max_tokens=200, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert m.model_extra["reasoning_content"] == "Need the tool."


def test_server_reasoning_effort(served_harmony):
    """reasoning_effort (OpenAI's field, or the template kwarg) reaches the template; a bad one is a 400."""
    c = served_harmony.client
    msgs = [{"role": "user", "content": "hi"}]
    low = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0, reasoning_effort="low")
    high = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0,
                                     extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    medium = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    tok = served_harmony.vault.tokenizer
    want = {e: render_chat(tok, msgs, chat_template_kwargs={"reasoning_effort": e}).ids for e in ("low", "medium", "high")}
    assert len(set(map(tuple, want.values()))) == 3
    assert (low.usage.prompt_tokens, medium.usage.prompt_tokens, high.usage.prompt_tokens) == \
        (len(want["low"]), len(want["medium"]), len(want["high"]))
    import openai
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, reasoning_effort="extreme")


def test_chat_cli_keeps_the_final_channel_as_the_turn(tok_json):
    """`pysmoe chat` records a gpt-oss reply as its final channel: the template refuses channel tags
    in a message's content, and the next turn renders."""
    from pysmoe.cli.chat import Conversation

    conv = Conversation.__new__(Conversation)
    conv.tok = Tokenizer(tok_json, {"eos_token": "<|return|>"}, TEMPLATE)
    turn = conv._assistant(ANSWER)
    assert turn == {"role": "assistant", "content": "It is 3 °C <|x|>."}
    p = render_chat(conv.tok, [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "and?"}])
    assert "<|channel|>final<|message|>It is 3 °C <|x|>.<|end|>" in p.text
    with pytest.raises(Exception, match="channel"):
        render_chat(conv.tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER}])


# ------------------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def harmony_vault(tiny_vault, tmp_path_factory, tok_json):
    """The tiny vault with a harmony tokenizer and gpt-oss's template (no server)."""
    d = tmp_path_factory.mktemp("harmony_cli")
    for f in pathlib.Path(tiny_vault).iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            (d / f.name).symlink_to(f)
    (d / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    return d


def _script_cli(monkeypatch, text: str, prompts: list):
    """stream_generate 'says' text, three characters at a time; prompts collects what it was given."""
    import pysmoe.generate
    from pysmoe.generate import GenerationResponse

    def fake(session, prompt, max_tokens=64, **kw):
        prompts.append(prompt)
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for k, piece in enumerate(pieces, 1):
            yield GenerationResponse(k, piece, len(prompt), k, 1.0, 1.0, 0.1,
                                     "stop" if k == len(pieces) else None)

    monkeypatch.setattr(pysmoe.generate, "stream_generate", fake)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_cli_shows_the_final_channel_and_the_reasoning_apart(harmony_vault, monkeypatch, capsys, command):
    """`run --chat` and `chat` read a gpt-oss reply with the server's parser: the final channel on
    stdout, the analysis on stderr, no harmony tag printed; chat keeps the final channel as the turn."""
    import io
    import sys

    from pysmoe.cli import main

    prompts: list = []
    _script_cli(monkeypatch, ANSWER, prompts)
    argv = [command, "--vault", str(harmony_vault), "--cache-mb", "1"]
    if command == "run":
        argv += ["--chat", "--prompt", "weather?"]
    else:
        monkeypatch.setattr(sys, "stdin", io.StringIO("weather?\nand tomorrow?\n"))
    assert main(argv) == 0
    out, err = capsys.readouterr()
    tok = Tokenizer(harmony_vault.joinpath("tokenizer.json").read_text(encoding="utf-8"),
                    {"eos_token": "<|return|>"}, TEMPLATE)
    first = render_chat(tok, [{"role": "user", "content": "weather?"}]).ids
    assert prompts[0] == first  # the template was applied
    assert "It is 3 °C <|x|>." in out and "The user asks <b>." in err
    assert "The user asks" not in out
    for tag in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "analysis", "final"):
        assert tag not in out and tag not in err
    if command == "chat":
        assert out.count("It is 3 °C <|x|>.") == 2
        # the second turn was rendered with the first reply's final channel as its content
        second = render_chat(tok, [{"role": "user", "content": "weather?"},
                                   {"role": "assistant", "content": "It is 3 °C <|x|>."},
                                   {"role": "user", "content": "and tomorrow?"}]).ids
        assert prompts[1] == second[len(first):] or prompts[1] == second


def test_run_json_gives_the_parsed_message(harmony_vault, monkeypatch, capsys):
    from pysmoe.cli import main

    _script_cli(monkeypatch, CALL, [])
    assert main(["run", "--vault", str(harmony_vault), "--cache-mb", "1", "--chat", "--prompt", "hi", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["text"] == CALL
    assert rec["reasoning"] == "Need the tool."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in rec["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
