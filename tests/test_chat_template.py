"""The checkpoint's chat template, rendered as transformers' apply_chat_template renders it."""
from __future__ import annotations

import json

import pytest

from pysmoe.tokenizer import Tokenizer, build_synthetic_tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

# A template in the style of Qwen3's: a tools preamble with tojson, thinking blocks kept only
# after the last user turn, tool calls and tool responses, enable_thinking.
THINKING_TOOLS = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content and loop.index0 > ns.last_user %}
{{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# Plain block syntax, so trim_blocks/lstrip_blocks matter; loop controls; raise_exception;
# bos_token; tojson with indent and sort_keys.
BLOCKS = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
[{{ message['role'] }}] {{ message['content'] }}
    {% if meta is defined %}{{ meta | tojson(indent=2, sort_keys=True) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[assistant] {% endif %}"""

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city, «now»",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "  Use the tool.  ",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"c\": 3}"},
    {"role": "assistant", "content": "3 °C.", "reasoning_content": "Report it."},
    {"role": "user", "content": "Thanks <b>&</b>"},
]


@pytest.fixture(scope="module")
def tok_json():
    return build_synthetic_tokenizer(400)


def _both(tok_json, template, messages, **kw):
    from tokenizers import Tokenizer as HFTok
    from transformers import PreTrainedTokenizerFast

    config = {"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    hf = PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(tok_json), bos_token="<|endoftext|>",
                                 eos_token="<|im_end|>")
    kw.setdefault("add_generation_prompt", True)  # transformers' default is False, ours True
    theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    ours = Tokenizer(tok_json, config).apply_chat_template(messages, tokenize=False, **kw)
    return ours, theirs


@pytest.mark.parametrize("kw", [dict(), dict(add_generation_prompt=False), dict(tools=TOOLS),
                                dict(tools=TOOLS, enable_thinking=False), dict(enable_thinking=True)])
def test_thinking_and_tools_template(tok_json, kw):
    ours, theirs = _both(tok_json, THINKING_TOOLS, CONVERSATION, **kw)
    assert ours == theirs
    assert "<tool_call>" in ours and "Report it." not in ours or "<think>" in ours


@pytest.mark.parametrize("kw", [dict(), dict(meta={"b": [1, 2], "a": "ü"}), dict(add_generation_prompt=False)])
def test_block_template(tok_json, kw):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "STOP"},
            {"role": "user", "content": "never"}]
    ours, theirs = _both(tok_json, BLOCKS, msgs, **kw)
    assert ours == theirs and "never" not in ours


def test_chatml_template(tok_json):
    ours, theirs = _both(tok_json, CHATML, CONVERSATION[:2])
    assert ours == theirs


def test_raise_exception(tok_json):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        Tokenizer(tok_json, {"chat_template": BLOCKS}).apply_chat_template([{"role": "robot", "content": "x"}])


def test_vault_files_template_and_eos(tmp_path, tok_json):
    """chat_template.jinja wins over ChatML; generation_config.json's eos ids come first."""
    (tmp_path / "tokenizer.json").write_text(tok_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(BLOCKS)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    t = load_tokenizer(tmp_path)
    assert t.chat_template == BLOCKS
    assert t.eos_ids[:2] == [7, 9] and t.token_to_id("<|im_end|>") in t.eos_ids
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).endswith("[assistant] ")
