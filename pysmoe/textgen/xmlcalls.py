"""The XML tool-call formats that share Qwen3's tags: GLM-4.5's and Qwen3-Coder's (Qwen3.5/3.6).

Both write reasoning as `<think>…</think>` and wrap each call in `<tool_call>…</tool_call>`, as
Qwen3 does (pysmoe/textgen/qwen3.py: the streaming rules, whitespace, what is held back); only the
call's body differs, so each parser here is Qwen3Parser with its own parse_call.

GLM-4.5 / 4.6 / Air (zai-org's chat template teaches it):

    <tool_call>NAME
    <arg_key>K1</arg_key>
    <arg_value>V1</arg_value>
    ...
    </tool_call>

  (GLM-4.7 drops the newlines: `NAME<arg_key>K</arg_key><arg_value>V</arg_value>`; both read.)
  Keys and values are stripped of surrounding whitespace. A value of a parameter whose schema
  says "type": "string" stays the text it is; any other value is JSON where it parses (numbers,
  booleans, null, objects, arrays) and the text otherwise — the rule vLLM's and SGLang's glm45
  parsers apply (they also try Python literals; pysmoe does not).

Qwen3-Coder, Qwen3.5-MoE and Qwen3.6-MoE (their templates teach it):

    <tool_call>
    <function=NAME>
    <parameter=K1>
    V1
    </parameter>
    ...
    </function>
    </tool_call>

  A value is the text between its tags less one newline after the opening and one before the
  closing. It stays text unless the tool's schema types the parameter otherwise (integer,
  number, boolean, object, array, null): then it is JSON where it parses, the text where it does
  not (vLLM's qwen3_coder parser converts by the schema the same way).

A body that is not such a call (no name, text outside the tags, a tag left open) is content,
verbatim, as for Qwen3's JSON calls.
"""
from __future__ import annotations

import json
import re

from .qwen3 import Qwen3Parser

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_CODER_FN = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _param_types(tools: list, name: str) -> dict[str, object]:
    """{parameter: its schema's "type"} of the tool called name (empty when unknown)."""
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
            if isinstance(props, dict):
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _only_whitespace_between(matches, text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether the matches cover text[start:end] but for whitespace."""
    at = start
    for m in matches:
        if text[at:m.start()].strip():
            return False
        at = m.end()
    return not text[at:end].strip()


class Glm45Parser(Qwen3Parser):
    """GLM-4.5's `<tool_call>NAME<arg_key>…` calls (module docstring)."""

    def parse_call(self, body: str) -> tuple[str, str] | None:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not name or any(c in name for c in "<>\n"):
            return None
        args = list(_GLM_ARG.finditer(body))
        if first >= 0 and not _only_whitespace_between(args, body, first):
            return None
        types = _param_types(self.tools, name)
        out = {}
        for m in args:
            key, value = m.group(1).strip(), m.group(2).strip()
            if not key:
                return None
            out[key] = value if types.get(key) == "string" else _json_or_text(value)
        return name, json.dumps(out, ensure_ascii=False)


class Qwen3CoderParser(Qwen3Parser):
    """Qwen3-Coder's `<function=NAME><parameter=K>` calls (module docstring)."""

    def parse_call(self, body: str) -> tuple[str, str] | None:
        m = _CODER_FN.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        params = list(_CODER_PARAM.finditer(inner))
        if not name or not _only_whitespace_between(params, inner):
            return None
        types = _param_types(self.tools, name)
        out = {}
        for p in params:
            key, value = p.group(1).strip(), p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            kind = types.get(key)
            out[key] = value if kind in (None, "string") else _json_or_text(value)
        return name, json.dumps(out, ensure_ascii=False)
