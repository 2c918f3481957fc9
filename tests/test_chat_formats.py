"""The chat formats of the families after Qwen3-MoE: their templates rendered as transformers'
apply_chat_template renders them, and their replies (reasoning, tool calls) parsed, alone and
through the server (OpenAI and Anthropic routes, streamed and not).

The templates (tests/data/):
  glm4_moe_chat_template.jinja     GLM-4.5 / Air: the chat_template that zai-org's GLM-4.5-Air
                                   tokenizer_config carries, as llama-server printed it from a GGUF
                                   converted from that release (two independent logs, same text)
  glm4_6_chat_template.jinja       GLM-4.6: llama.cpp's copy (models/templates/GLM-4.6.jinja),
                                   rebuilt here from GLM-4.5's by its two differences (the user
                                   turn, `tc.arguments or {}`); the length matches the copy's
  qwen3_5_moe_chat_template.jinja  Qwen3.5-35B-A3B: mlx-community's copy of the published
                                   chat_template.jinja, byte for byte (sha256 a4aee8af…f715)
  qwen3_6_moe_chat_template.jinja  Qwen3.6-35B-A3B: from a secondary copy (a llama-server /props
                                   fixture); its differences from 3.5 (preserve_thinking, how a
                                   string argument renders) are the ones other sources quote
  mixtral_chat_template.jinja      Mixtral-8x7B-Instruct-v0.1's current template (the optional
                                   system message folded into the first [INST]): from secondary
                                   copies (a vLLM log printing it, a project hard-coding it)
  MIXTRAL_V1, OLMOE below          reconstructions, not the files: Mixtral's first [INST] template,
                                   and the Tulu-style template of OLMoE's instruct models (as
                                   another project quotes it); neither has tool or reasoning syntax
"""
from __future__ import annotations

import json
import pathlib

import pytest

from pysmoe.textgen import render_chat
from pysmoe.textgen.formats import FORMATS, format_of, make_parser
from pysmoe.tokenizer import Tokenizer, build_synthetic_tokenizer

DATA = pathlib.Path(__file__).parent / "data"
GLM = (DATA / "glm4_moe_chat_template.jinja").read_text(encoding="utf-8")
GLM46 = (DATA / "glm4_6_chat_template.jinja").read_text(encoding="utf-8")
QWEN35 = (DATA / "qwen3_5_moe_chat_template.jinja").read_text(encoding="utf-8")
QWEN36 = (DATA / "qwen3_6_moe_chat_template.jinja").read_text(encoding="utf-8")
QWEN3 = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
MIXTRAL = (DATA / "mixtral_chat_template.jinja").read_text(encoding="utf-8")
# Mixtral-8x7B-Instruct-v0.1's first template (before the one above, which added the system message)
MIXTRAL_V1 = ("{{ bos_token }}{% for message in messages %}"
              "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
              "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
              "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
              "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
OLMOE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
         "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
         "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
         "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
         "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
         "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "object"}}, "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time", "description": "the time",
                                                    "parameters": {"type": "object", "properties": {}}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich for 2 days?"},
    {"role": "assistant", "content": "", "reasoning_content": "  Use the tool.  ",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {
         "city": "Zürich", "days": 2, "units": {"t": "C"}}}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"c\": 3}"},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    {"role": "assistant", "content": "3 °C at noon.", "reasoning_content": "Report it."},
    {"role": "user", "content": "Thanks <b>&</b>"},
]
SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


@pytest.fixture(scope="module")
def tok_json():
    return build_synthetic_tokenizer(400)


def _both(tok_json, template, messages, special=SPECIAL, **kw):
    """(ours, transformers') text of messages under template."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTok
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(tok_json), **special)
    kw.setdefault("add_generation_prompt", True)  # transformers' default is False, ours True
    theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    ours = Tokenizer(tok_json, {"chat_template": template, **special}).apply_chat_template(messages, tokenize=False,
                                                                                           **kw)
    return ours, theirs


# ---------------------------------------------------------------------------------- rendering

RENDER_KW = [dict(), dict(add_generation_prompt=False), dict(tools=TOOLS), dict(tools=TOOLS, enable_thinking=False),
             dict(enable_thinking=True)]


@pytest.mark.parametrize("kw", RENDER_KW)
@pytest.mark.parametrize("name, template", [("glm45", GLM), ("glm45", GLM46), ("qwen3.5", QWEN35),
                                            ("qwen3.6", QWEN36)], ids=["glm4.5", "glm4.6", "qwen3.5", "qwen3.6"])
def test_thinking_templates_render_as_transformers(tok_json, name, template, kw):
    ours, theirs = _both(tok_json, template, CONVERSATION, **kw)
    assert ours == theirs
    if "tools" in kw:
        assert "get_weather" in ours and "<tool_response>" in ours
    assert ("<arg_key>days</arg_key>\n<arg_value>2</arg_value>" in ours) == (name == "glm45")
    assert ("<parameter=days>\n2\n</parameter>" in ours) == (name != "glm45")


def test_preserve_thinking_reaches_the_qwen36_template(tok_json):
    ours, theirs = _both(tok_json, QWEN36, CONVERSATION, preserve_thinking=True)
    assert ours == theirs and "Use the tool." in ours
    assert "Use the tool." not in _both(tok_json, QWEN36, CONVERSATION)[0]


@pytest.mark.parametrize("kw", [dict(), dict(add_generation_prompt=False)])
def test_mixtral_and_olmoe_render_as_transformers(tok_json, kw):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    mixtral = {"bos_token": "<s>", "eos_token": "</s>"}
    ours, theirs = _both(tok_json, MIXTRAL_V1, chat, special=mixtral, **kw)
    assert ours == theirs == "<s>[INST] Hi [/INST]Hello!</s>[INST] Bye [/INST]"
    ours, theirs = _both(tok_json, MIXTRAL, [{"role": "system", "content": "Be kind."}, *chat], special=mixtral, **kw)
    assert ours == theirs == "<s> [INST] Be kind.\n\nHi [/INST] Hello!</s> [INST] Bye [/INST]"
    ours, theirs = _both(tok_json, OLMOE, [{"role": "system", "content": "Be kind."}, *chat], **kw)
    assert ours == theirs and ours.endswith("<|user|>\nBye\n" + ("<|assistant|>\n" if kw == {} else ""))


def test_render_chat_takes_openai_arguments_for_each_template(tok_json):
    """The API sends arguments as a JSON string: render_chat gives the templates the object they
    iterate (GLM's `.items()`, Qwen3.5's `|items`), as transformers' own callers must."""
    def as_string(c):
        return dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
    as_api = [dict(m, tool_calls=[as_string(c) for c in m["tool_calls"]]) if m.get("tool_calls") else m
              for m in CONVERSATION]
    for template in (GLM, GLM46, QWEN35, QWEN36):
        tok = Tokenizer(tok_json, {"chat_template": template, **SPECIAL})
        ours = render_chat(tok, as_api, tools=TOOLS).text
        assert ours == _both(tok_json, template, CONVERSATION, tools=TOOLS)[0]


def test_a_template_that_refuses_is_a_clear_error(tok_json):
    from pysmoe.errors import InvalidArgument
    tok = Tokenizer(tok_json, {"chat_template": MIXTRAL, "bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(InvalidArgument, match="alternate"):
        render_chat(tok, [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}])
    with pytest.raises(InvalidArgument, match="roles are supported"):
        render_chat(tok, [{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}])


def test_the_prompt_leaves_qwen35_inside_think_and_glm_not(tok_json):
    msgs = [{"role": "user", "content": "hi"}]
    for template, inside in ((QWEN35, True), (QWEN36, True), (GLM, False)):
        tok = Tokenizer(tok_json, {"chat_template": template, **SPECIAL})
        assert render_chat(tok, msgs).starts_in_reasoning is inside
        assert render_chat(tok, msgs, chat_template_kwargs={"enable_thinking": False}).starts_in_reasoning is False


# ---------------------------------------------------------------------------------- choosing

def test_the_template_picks_the_format_then_the_family():
    assert format_of("qwen3_moe", GLM) == "glm45"
    assert format_of("glm4_moe", GLM) == format_of("glm4_moe", GLM46) == "glm45"
    assert format_of("qwen3_5_moe", QWEN35) == format_of(None, QWEN36) == "qwen3_coder"
    assert format_of("qwen3_next", QWEN3) == "qwen3"
    assert format_of("mixtral", MIXTRAL) == format_of("mixtral", MIXTRAL_V1) == format_of("olmoe", OLMOE) == "plain"
    assert format_of("glm4_moe", None) == "glm45" and format_of("qwen3_5_moe", "") == "qwen3_coder"
    assert format_of("something_new", MIXTRAL) == "qwen3" and set(FORMATS) >= {"qwen3", "qwen3_coder", "glm45", "plain"}
    with pytest.raises(KeyError, match="glm45"):
        make_parser("nope")


# ---------------------------------------------------------------------------------- parsing

GLM_REPLY = ("\n<think>The user wants weather.</think>\nLet me look.\n<tool_call>get_weather\n"
             "<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
             "<arg_key>units</arg_key>\n<arg_value>{\"t\": \"C\"}</arg_value>\n</tool_call>"
             "<tool_call>get_time</tool_call>")
CODER_REPLY = ("The user wants weather.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n"
               "<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=units>\n"
               "{\"t\": \"C\"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
               "</function>\n</tool_call>")
EXPECTED_CALLS = [("get_weather", {"city": "123", "days": 3, "units": {"t": "C"}}), ("get_time", {})]


def _run(fmt, pieces, **kw):
    """(message, deltas joined as a client joins them) of pieces through a fresh parser."""
    n = iter(range(100))
    p = make_parser(fmt, **kw)
    p.call_id = lambda: f"call_{next(n)}"
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    joined = {"content": "".join(d.content for d in deltas), "reasoning": "".join(d.reasoning for d in deltas),
              "calls": {}}
    for d in deltas:
        for t in d.tool_calls:
            c = joined["calls"].setdefault(t.index, {"name": "", "arguments": ""})
            c["name"] += t.name or ""
            c["arguments"] += t.arguments
    return p.message(), joined


@pytest.mark.parametrize("fmt, reply, starts", [("glm45", GLM_REPLY, False), ("qwen3_coder", CODER_REPLY, True)])
def test_replies_parse_the_same_in_any_pieces(fmt, reply, starts):
    whole, _ = _run(fmt, [reply], tools=TOOLS, starts_in_reasoning=starts)
    assert whole["reasoning_content"] == "The user wants weather." and whole["content"] == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == \
        EXPECTED_CALLS
    cuts = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)] + [list(reply)]
    for pieces in cuts:  # every tag split at every place, and one character at a time
        msg, joined = _run(fmt, pieces, tools=TOOLS, starts_in_reasoning=starts)
        assert msg == whole, pieces[0][-12:]
        assert joined["content"] == whole["content"] and joined["reasoning"] == whole["reasoning_content"]
        assert [(c["name"], c["arguments"]) for c in joined["calls"].values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


XML_PIECES = {
    "glm45": ["<think>", "</think>", "<tool_call>", "</tool_call>", "get_weather", "get_time", "<arg_key>",
              "</arg_key>", "<arg_value>", "</arg_value>", "city", "3", '{"t": 1}', "\n", " ", "<", "</", "<tool", "x",
              "é"],
    "qwen3_coder": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=",
                    "</function>", "<parameter=city>", "<parameter=days>", "</parameter>", "3", "Paris", "\n", " ",
                    "<", "</", "<tool", "x", "é"],
}


@pytest.mark.parametrize("fmt", sorted(XML_PIECES))
def test_any_text_parses_the_same_streamed(fmt):
    """Whatever the model writes, in whatever pieces: the same message, and the deltas add up to it."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(deadline=None, max_examples=150)
    @given(parts=st.lists(st.sampled_from(XML_PIECES[fmt]), max_size=16),
           cuts=st.lists(st.integers(0, 200), max_size=8), starts=st.booleans())
    def check(parts, cuts, starts):
        text = "".join(parts)
        bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
        whole, _ = _run(fmt, [text], tools=TOOLS, starts_in_reasoning=starts)
        msg, joined = _run(fmt, [text[a:b] for a, b in zip(bounds, bounds[1:])], tools=TOOLS,
                           starts_in_reasoning=starts)
        assert msg == whole
        assert joined["content"] == (whole["content"] or "")
        assert joined["reasoning"] == whole.get("reasoning_content", "")
        assert [(c["name"], c["arguments"]) for c in joined["calls"].values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]

    check()


def test_values_follow_the_schema():
    """GLM: a string-typed parameter stays text, others are JSON where they parse. Qwen3-Coder:
    text unless the schema types it otherwise; a value that will not parse stays text."""
    msg, _ = _run("glm45", ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>null</arg_value>"
                            "<arg_key>days</arg_key><arg_value>three</arg_value><arg_key>extra</arg_key>"
                            "<arg_value>[1, 2]</arg_value></tool_call>"], tools=TOOLS)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "null", "days": "three",
                                                                        "extra": [1, 2]}
    msg, _ = _run("qwen3_coder", ["<tool_call>\n<function=get_weather>\n<parameter=city>\n  7  \n</parameter>\n"
                                  "<parameter=days>\nthree\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n"
                                  "</function>\n</tool_call>"], tools=TOOLS)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "  7  ", "days": "three",
                                                                        "extra": "[1]"}


@pytest.mark.parametrize("fmt, body", [
    ("glm45", "<tool_call>\n<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"),       # no name
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key>junk<arg_value>x</arg_value></tool_call>"),
    ("glm45", "<tool_call>two words\nhere<arg_key>a</arg_key><arg_value>b</arg_value></tool_call>"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"),                   # Qwen3's JSON
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray <parameter=a>\nb\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=a>\nb\n</function>\n</tool_call>"),
])
def test_a_body_that_is_not_a_call_is_content(fmt, body):
    msg, _ = _run(fmt, ["Sure. ", body, " done"], tools=TOOLS)
    assert msg == {"role": "assistant", "content": "Sure. " + body + " done"}


def test_without_tools_the_tags_are_text_and_plain_reads_everything_as_content():
    msg, _ = _run("glm45", ["<tool_call>get_time</tool_call>"])
    assert msg == {"role": "assistant", "content": "<tool_call>get_time</tool_call>"}
    msg, _ = _run("plain", ["<think>not reasoning</think> ", "<tool_call>get_time</tool_call>"], tools=TOOLS,
                  starts_in_reasoning=True)
    assert msg == {"role": "assistant", "content": "<think>not reasoning</think> <tool_call>get_time</tool_call>"}


def test_glm_tags_that_are_special_tokens_still_reach_the_parser(tok_json):
    """GLM's tokenizer has its tags as added tokens; the detokenizer keeps them (text.KEEP_TAGS)
    while it hides the other special tokens, so a Generation reads the call from the ids."""
    from tokenizers import Tokenizer as HFTok

    from pysmoe.textgen import Generation, SamplingParams
    hf = HFTok.from_str(tok_json)
    hf.add_special_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                           "<arg_value>", "</arg_value>", "<|observation|>"])
    tok = Tokenizer(hf.to_str(), {"chat_template": GLM, **SPECIAL})
    ids = tok.encode(GLM_REPLY + "<|observation|>")
    assert tok.token_to_id("<arg_key>") in ids
    gen = Generation(tok, SamplingParams(max_tokens=len(ids) + 1), [1], chat=True, tools=TOOLS, chat_format="glm45",
                     eos_ids=[tok.token_to_id("<|observation|>")])  # GLM's generation_config lists it
    for i in ids:
        step = gen.push(i)
    assert step.finish_reason == "tool_calls"
    msg = gen.message()
    assert (msg["reasoning_content"], msg["content"]) == ("The user wants weather.", "Let me look.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        EXPECTED_CALLS


# ---------------------------------------------------------------------------------- the server

MAX = 300  # the scripted reply (about 200 tokens of the tiny vault's small vocabulary) and its end


def _served(tiny_vault, tmp_path_factory, template):
    from test_server import Running
    d = tmp_path_factory.mktemp("fmt")
    for f in pathlib.Path(tiny_vault).iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    return Running(d, max_batch=2, context=2048, max_tokens_limit=MAX)


@pytest.fixture(scope="module", params=[("glm45", GLM, GLM_REPLY), ("qwen3_coder", QWEN35, CODER_REPLY)],
                ids=["glm45", "qwen3.5"])
def served_format(request, tiny_vault, tmp_path_factory):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    s = _served(tiny_vault, tmp_path_factory, request.param[1])
    yield request.param[0], request.param[2], s
    s.close()


def test_the_server_reads_its_format(served_format, monkeypatch):
    from test_server import _scripted
    fmt, reply, served = served_format
    assert served.server.chat_format == fmt
    _scripted(monkeypatch, served, reply)
    assert len(served.vault.tokenizer.encode(reply)) < MAX
    c = served.client
    msgs = [{"role": "user", "content": "weather in Zürich?"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=MAX, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.model_extra["reasoning_content"] == "The user wants weather." and m.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == EXPECTED_CALLS

    calls, reasoning, content = {}, "", ""
    for ch in c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=MAX, temperature=0,
                                        stream=True):
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"name": "", "arguments": ""})
            e["name"] += t.function.name or ""
            e["arguments"] += t.function.arguments or ""
    assert (reasoning, content) == ("The user wants weather.", "Let me look.")
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == EXPECTED_CALLS

    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=served.base_url.rsplit("/v1", 1)[0], api_key="unused", max_retries=0)
    kw = dict(model="tiny", max_tokens=MAX, messages=msgs, tools=[
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]} for t in TOOLS])
    with a.messages.stream(**kw) as st:
        streamed = st.get_final_message()
    for final in (a.messages.create(**kw), streamed):
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert final.content[0].thinking == "The user wants weather." and final.content[1].text == "Let me look."
        assert [(b.name, b.input) for b in final.content[2:]] == EXPECTED_CALLS and final.stop_reason == "tool_use"


def test_a_forced_tool_call_is_written_in_the_format(served_format):
    """tool_choice "required" / a named function: the grammar makes the model (random weights,
    left to itself) write calls in the vault's format, which parse into valid arguments."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    fmt, _, served = served_format
    tools = [{"type": "function", "function": dict(
        WEATHER["function"], parameters={"type": "object", "required": ["city", "days"], "properties": {
            "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "metric": {"type": "boolean"}}})}, TOOLS[1]]
    msgs = [{"role": "user", "content": "weather?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for seed in range(2):
            r = served.client.chat.completions.create(  # no thinking: straight to the call
                model="tiny", messages=msgs, tools=tools, tool_choice=choice, max_tokens=MAX, temperature=1.0,
                seed=seed, parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
            call = c.message.tool_calls[0].function
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
            if isinstance(choice, dict):
                assert call.name == "get_weather"


def test_forced_tool_choice_is_refused_where_the_format_has_no_calls(tiny_vault, tmp_path_factory):
    pytest.importorskip("uvicorn")
    served = _served(tiny_vault, tmp_path_factory, MIXTRAL)
    try:
        served.server.chat_format = format_of("mixtral", MIXTRAL)  # the tiny vault's own model_type is Qwen3's
        status, body = served.raw("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"})
        # refused either for the format (no call syntax) or, first, for the template (it ignores tools)
        assert status == 400 and body["error"]["param"] in ("tool_choice", "messages")
        assert "tool" in body["error"]["message"]
    finally:
        served.close()
