"""Structured output: a request's grammar, and the token mask it gives the sampler at each step.

What a request may ask for (OpenAI's fields; the Anthropic route maps its own onto them):

    response_format {"type": "json_object"}                      the reply is a JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": S, "strict": ...}}
                                                                 the reply is JSON valid under S
    tool_choice "required"                                       the reply is one or more tool calls
                                                                 (exactly one with parallel_tool_calls false)
    tool_choice {"type": "function", "function": {"name": N}}    the reply is one call of N

Each becomes an llguidance grammar (bench/RESULTS.md, "Structured output": llguidance measured
cheapest per token on a Qwen3-sized vocabulary, compiles a schema in milliseconds, and needs
neither torch nor a GPU). At every step the request's Constraint computes the bitmask of the ids
the grammar allows next, and the scheduler hands it to the session (Session.set_mask →
smoe_session_set_mask): the engine's one sampler gives every other id −inf before it draws, so a
greedy or a seeded reply is the model's own choice among what the grammar allows, and the end of
sequence is allowed only where the grammar accepts. A reply that ends by its end-of-sequence id
is therefore valid; one cut by max_tokens (finish_reason "length") may not be, as with OpenAI.

The model may reason first: a prompt that leaves it inside <think> (or a vocabulary that has a
<think> token) lets the grammar take a reasoning block, which ends at </think>, before the
constrained part; the reasoning is sent apart as usual (reasoning_content, thinking blocks).
A tool call is written the way the vault's template teaches (and its output format's parser,
pysmoe.textgen.formats, reads): Qwen3's <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>,
its arguments valid under the tool's `parameters`; or GLM-4.5's and Qwen3-Coder's XML, each
parameter in its tags, the required ones always, in the schema's order, a "string" parameter as
text without "<" and any other as JSON valid under its schema.

JSON is written with fixed separators (", " and ": ") and no free whitespace, so a model cannot
pad a reply with blank lines until max_tokens. An object schema that lists its properties and says
nothing of others gets no others (as XGrammar's strict mode does): the reply still validates
against the client's schema, and a model cannot add keys until max_tokens either.
"""
from __future__ import annotations

import json
import threading

import numpy as np

from .schemas import APIError

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _closed(node):
    """node with additionalProperties false wherever an object lists properties and is silent on
    others (a subset of what the schema allows)."""
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node \
            and "patternProperties" not in node and "unevaluatedProperties" not in node:
        out["additionalProperties"] = False
    return out


def _with_style(schema: dict) -> dict:
    return {**_closed(schema), "x-guidance": {**_JSON_STYLE, **schema.get("x-guidance", {})}}


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _xml_calls(tools: list[dict], call_format: str) -> str:
    """The rules `call` of the XML call formats (pysmoe/textgen/xmlcalls.py): the tool's name,
    then its parameters in the schema's order, the required ones always, the others optionally;
    a parameter typed "string" is text without "<" (at most maxLength characters), any other is
    JSON valid under its schema."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or ())
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            schema = schema if isinstance(schema, dict) else {}
            if schema.get("type") == "string":
                n = schema.get("maxLength")
                bound = f"{{0,{n}}}" if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else "*"
                rules.append(f"v{i}_{j}: /[^<]{bound}/")
            else:
                rules.append(f"v{i}_{j}: %json {json.dumps(_with_style(schema))}")
            if call_format == "glm45":
                arg = f'"<arg_key>" {json.dumps(key)} "</arg_key>\\n<arg_value>" v{i}_{j} "</arg_value>\\n"'
            else:
                arg = f'"<parameter=" {json.dumps(key)} ">\\n" v{i}_{j} "\\n</parameter>\\n"'
            parts.append(arg if key in required else f"({arg})?")
        body = " ".join(parts) or '""'
        if call_format == "glm45":
            rules.append(f'call{i}: "<tool_call>" {json.dumps(fn["name"])} "\\n" {body} "</tool_call>"')
        else:
            rules.append(f'call{i}: "<tool_call>\\n<function=" {json.dumps(fn["name"])} ">\\n" {body} '
                         f'"</function>\\n</tool_call>"')
        calls.append(f"call{i}")
    return f"call: {' | '.join(calls)}\n" + "\n".join(rules) + "\n"


CALL_FORMATS = ("qwen3", "glm45", "qwen3_coder")  # the output formats whose calls a grammar can force


def grammar_text(response_format: dict | None, tools: list[dict] | None, tool_choice, *,
                 reasoning: str, parallel: bool = True, call_format: str = "qwen3") -> str | None:
    """The Lark grammar (llguidance's dialect) of a request, or None when it is unconstrained.
    reasoning: "open" (the prompt left the model inside <think>), "optional" (it may open one),
    or "none". call_format: how the model writes a tool call (one of CALL_FORMATS: Qwen3's JSON,
    or the XML of GLM-4.5 or Qwen3-Coder)."""
    if isinstance(tool_choice, dict) or tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            chosen = [t for t in tools if t["function"]["name"] == name]
            if not chosen:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                               param="tool_choice", code="invalid_value")
            tools = chosen[:1]
        body = "body: call" + (" (\"\\n\" call)*" if tool_choice == "required" and parallel else "") + "\n"
        if call_format == "qwen3":
            schemas = [_call_schema(t) for t in tools]
            schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
            body += "call: \"<tool_call>\\n\" call_json \"\\n</tool_call>\"\n" \
                    f"call_json: %json {json.dumps(_with_style(schema))}\n"
        else:
            body += _xml_calls(tools, call_format)
    elif response_format is not None and response_format.get("type") in ("json_object", "json_schema"):
        if response_format["type"] == "json_object":
            schema = {"type": "object"}
        else:
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                schema = {}
            if not isinstance(schema, dict):
                raise APIError(422, "'response_format.json_schema.schema' must be an object",
                               param="response_format", code="invalid_type")
        body = f"body: %json {json.dumps(_with_style(schema))}\n"
    else:
        return None
    think = ('think_text[stop="</think>"]: /(?s:.*)/\n'
             'think_end: /[ \\t\\n]*/\n')
    if reasoning == "open":
        return "start: think_text think_end body\n" + think + body
    if reasoning == "optional":
        return 'start: think? body\nthink: "<think>" think_text think_end\n' + think + body
    return "start: body\n" + body


class Grammars:
    """The server's grammar machinery: llguidance's view of the vault's tokenizer (built at the
    first constrained request: about a second for a Qwen3-sized vocabulary) and the requests'
    Constraints."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lt = None
        self._lock = threading.Lock()

    def _ll(self):
        import llguidance
        with self._lock:
            if self._lt is None:
                self._lt = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=list(self.tokenizer.eos_ids) or None)
            return self._lt

    @property
    def has_think_token(self) -> bool:
        return self.tokenizer.token_to_id("<think>") is not None

    def constraint(self, response_format, tools, tool_choice, *, starts_in_reasoning: bool,
                   parallel: bool = True, call_format: str = "qwen3") -> "Constraint | None":
        """The request's Constraint, or None. APIError 400 for a schema llguidance cannot
        compile, or where llguidance is not installed (the message says what to install)."""
        reasoning = "open" if starts_in_reasoning else "optional" if self.has_think_token else "none"
        text = grammar_text(response_format, tools, tool_choice, reasoning=reasoning, parallel=parallel,
                            call_format=call_format)
        if text is None:
            return None
        try:
            import llguidance
        except ImportError:
            raise APIError(400, "structured output needs llguidance (pip install 'pysmoe[serve]')",
                           param="response_format", code="unsupported_value") from None
        lt = self._ll()
        grammar = llguidance.grammar_from("lark", text)
        error = llguidance.LLMatcher.validate_grammar(grammar, lt)
        if error:
            raise APIError(400, f"the schema cannot be enforced: {error.strip().splitlines()[0]}",
                           param="response_format" if tool_choice in (None, "auto") else "tools",
                           code="invalid_value")
        return Constraint(llguidance.LLMatcher(lt, grammar, log_level=0), self.vocab_size, self.tokenizer.eos_ids)


class Constraint:
    """One request's grammar state: mask() before each draw, consume(id) after it. Once the
    grammar can go no further, only the end-of-sequence ids are allowed."""

    def __init__(self, matcher, vocab_size: int, eos_ids):
        self.matcher = matcher
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.eos = np.zeros_like(self.words)
        self.eos_ids = [i for i in eos_ids if 0 <= i < vocab_size]
        for i in self.eos_ids:
            self.eos[i // 32] |= np.int32(np.uint32(1 << (i % 32)).view(np.int32))
        self.ended = False  # an end-of-sequence id was drawn

    def mask(self) -> np.ndarray:
        """The ids allowed next (the array is reused: set it before the next consume)."""
        if self.matcher.is_stopped():
            return self.eos
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar: {self.matcher.get_error()}")
        return self.words

    def consume(self, token: int) -> None:
        if self.matcher.is_stopped():
            ok = token in self.eos_ids
        else:
            ok = self.matcher.consume_token(int(token))
        if not ok:
            raise RuntimeError(f"grammar: the sampler drew id {token}, which the mask forbade: "
                               f"{self.matcher.get_error()}")
        self.ended = token in self.eos_ids

    @property
    def done(self) -> bool:
        """An end-of-sequence id was drawn: nothing more is allowed."""
        return self.ended
