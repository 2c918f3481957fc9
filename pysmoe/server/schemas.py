"""OpenAI request bodies → GenerationRequest, checked field by field; OpenAI-style errors.

Status codes: 400 for a body that is not JSON, a value out of range, an unsupported option
(best_of > 1, suffix, logit_bias, an unknown response_format type), a prompt over the context or a
token id outside the vocabulary; 422 for a field of the wrong type or a missing required field;
413 for a body over the size limit; 401 without the API key; 404 for a model this server does not
serve (app.py checks it against the model's name and its aliases). Every error body is OpenAI's:
{"error": {"message", "type", "param", "code"}}. Fields this server does not know are ignored
(clients send vendor extras); known fields are checked for type and range.

/v1/completions takes OpenAI's prompt forms: a string, a list of token ids, or a list of either
(several prompts, answered as choices prompt_index × n + k); `echo` (the prompt's text, and with
`logprobs` its tokens' log-probabilities, before the completion) and max_tokens 0 with echo (the
prompt only: what lm-evaluation-harness scores log-likelihoods with). `n` choices per prompt."""
from __future__ import annotations

import dataclasses
import math

from ..textgen import InvalidParam, SamplingParams


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class GenerationRequest:
    kind: str                       # "chat" or "completion"
    model: str
    sampling: SamplingParams        # textgen's: max_tokens (None: up to the context), stop strings, logprobs
    stream: bool
    include_usage: bool
    ignore_eos: bool = False            # vLLM's extension: generate through end-of-sequence ids
    messages: list[dict] | None = None  # chat
    tools: list[dict] | None = None     # chat, rendered through the template
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    prompt: str | list[int] | None = None  # completion: text or token ids (the first of prompts)
    prompts: list | None = None         # completion: every prompt of the request
    echo: bool = False                  # completion: the prompt (and its logprobs) before the completion
    n: int = 1                          # choices per prompt (each drawn with seed + k)
    response_format: dict | None = None    # chat: json_object / json_schema (server.grammar enforces it)
    tool_choice: str | dict | None = None  # chat: "required" or {"type": "function", ...} are enforced too
    parallel_tool_calls: bool = True       # with tool_choice "required": more than one call allowed


_MISSING = object()
MAX_CHOICES = 128  # prompts × n in one request (OpenAI's limit on n)


def _type_error(name: str, want: str, value) -> APIError:
    return APIError(422, f"'{name}' must be {want}, not {type(value).__name__} ({_short(value)})", param=name,
                    code="invalid_type")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _range_error(name: str, rule: str, value) -> APIError:
    return APIError(400, f"'{name}' must be {rule}, got {_short(value)}", param=name, code="invalid_value")


def _number(body: dict, name: str, default, low=-math.inf, high=math.inf, *, integer=False, low_open=False):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        if integer and isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _type_error(name, "an integer" if integer else "a number", value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        lo = "(" if low_open else "["
        raise _range_error(name, f"in {lo}{low}, {high}]" if high < math.inf else f"{'>' if low_open else '≥'} {low}",
                           value)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or a list of strings", value)
    if len(value) > 16:
        raise _range_error("stop", "at most 16 strings", value)
    return [s for s in value if s]


def _common(body: dict, kind: str, max_tokens_limit: int) -> dict:
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_type")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    max_tokens = None
    for name in names:  # completions take 0 (with echo: parse_completion checks)
        max_tokens = _number(body, name, None, 1 if kind == "chat" else 0, max_tokens_limit, integer=True)
        if max_tokens is not None:
            break
    if max_tokens is None:  # OpenAI's default for completions; for chat, the server's limit (and the context)
        max_tokens = min(16, max_tokens_limit) if kind == "completion" else max_tokens_limit
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
    stream = _bool(body, "stream", False)
    options = _object(body, "stream_options") or {}
    if options and not stream:
        raise APIError(400, "stream_options is only allowed with stream = true", param="stream_options")
    include_usage = _bool(options, "include_usage", False)
    fields = dict(
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
        top_k=_number(body, "top_k", 0, -1, integer=True),  # -1 (vLLM's "off") and 0 both mean off
        min_p=float(_number(body, "min_p", 0.0, 0.0, 1.0)),
        seed=_number(body, "seed", None, -2 ** 63, 2 ** 64 - 1, integer=True),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0.0, low_open=True)),
        max_tokens=max_tokens, stop=_stop(body))
    return dict(model=model, sampling=fields, stream=stream, include_usage=include_usage,
                ignore_eos=_bool(body, "ignore_eos", False), n=n)


def _sampling(fields: dict, **more) -> SamplingParams:
    try:
        return SamplingParams(**fields, **more)
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content, where: str) -> str | None:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _type_error(where, "a string or a list of content parts", content)
            if part["type"] != "text":
                raise APIError(400, f"content parts of type {part['type']!r} are not supported (text only)",
                               param=where, code="unsupported_value")
            if not isinstance(part.get("text"), str):
                raise _type_error(f"{where}.text", "a string", part.get("text"))
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(where, "a string or a list of content parts", content)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING:
        raise APIError(422, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list", messages)
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in _ROLES:
            raise _range_error(f"{where}.role", f"one of {', '.join(_ROLES)}", role)
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(m.get("content"), f"{where}.content")
        if msg["content"] is None and role != "assistant":
            raise APIError(422, f"'{where}.content' is required", param=f"{where}.content",
                           code="missing_required_parameter")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise _type_error(f"{where}.tool_calls", "a list of objects", calls)
            # Qwen3's template reads tool_call.function.arguments as a mapping or a JSON string.
        out.append(msg)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _type_error("tools", "a list", tools)
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise _type_error(f"tools[{i}]", "an object with a 'function' object", t)
        if t.get("type", "function") != "function":
            raise _range_error(f"tools[{i}].type", "'function'", t.get("type"))
        if not isinstance(t["function"].get("name"), str):
            raise _type_error(f"tools[{i}].function.name", "a string", t["function"].get("name"))
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    if choice not in (None, "auto", "required") and not isinstance(choice, dict):
        raise _range_error("tool_choice", "'none', 'auto', 'required' or an object", choice)
    return tools or None


def _tool_choice(body: dict, tools: list[dict] | None) -> str | dict | None:
    """"required" or a named function (both enforced by a grammar), else None."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _type_error("tool_choice", "{'type': 'function', 'function': {'name': ...}}", choice)
    elif choice != "required":
        return None
    if not tools:
        raise APIError(400, f"tool_choice {_short(choice)} needs tools", param="tool_choice")
    return choice


def _response_format(body: dict) -> dict | None:
    fmt = _object(body, "response_format")
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _type_error("response_format.json_schema", "an object", spec)
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _type_error("response_format.json_schema.schema", "an object", schema)
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": schema,
                                                       "strict": bool(spec.get("strict"))}}
    raise APIError(400, f"response_format {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                   param="response_format", code="unsupported_value")


REASONING_EFFORTS = ("low", "medium", "high")


def parse_chat(body, max_tokens_limit: int) -> GenerationRequest:
    common = _common(body, "chat", max_tokens_limit)
    messages = _messages(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    response_format = _response_format(body)
    logprobs = _bool(body, "logprobs", False)
    top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
    if top and not logprobs:
        raise APIError(400, "top_logprobs needs logprobs = true", param="top_logprobs")
    common["sampling"] = _sampling(common["sampling"], logprobs=logprobs, top_logprobs=top)
    kwargs = dict(_object(body, "chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        # OpenAI's field; gpt-oss's template reads it as a variable (chat_template_kwargs wins)
        if effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r:.40}",
                           param="reasoning_effort", code="invalid_value")
        kwargs.setdefault("reasoning_effort", effort)
    return GenerationRequest(kind="chat", messages=messages, tools=tools, template_kwargs=kwargs,
                             response_format=response_format, tool_choice=choice,
                             parallel_tool_calls=_bool(body, "parallel_tool_calls", True), **common)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _prompts(body: dict) -> list:
    """The prompts of a completions request: a string, a list of token ids, a list of strings or a
    list of lists of token ids (OpenAI's four forms) → a list of strings and id lists."""
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING:
        raise APIError(422, "'prompt' is required", param="prompt", code="missing_required_parameter")
    want = "a string, a list of token ids, or a list of strings or of token-id lists"
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and _is_ids(p))
                                                      for p in prompt):
        prompts = prompt
    elif prompt == []:
        raise APIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    else:
        raise _type_error("prompt", want, prompt)
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(400, f"'{where}' must not be empty", param="prompt", code="invalid_value")
    return prompts


def parse_completion(body, max_tokens_limit: int) -> GenerationRequest:
    common = _common(body, "completion", max_tokens_limit)
    prompts = _prompts(body)
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise _range_error("n", f"such that prompts × n ≤ {MAX_CHOICES} ({len(prompts)} prompts)", common["n"])
    echo = _bool(body, "echo", False)
    if common["sampling"]["max_tokens"] == 0 and not echo:
        raise _range_error("max_tokens", "≥ 1 (0 only with echo = true: the prompt's logprobs)", 0)
    if _number(body, "best_of", 1, 1, integer=True) != 1:
        raise APIError(400, "only best_of = 1 is supported", param="best_of", code="unsupported_value")
    if body.get("suffix") is not None:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    top = _number(body, "logprobs", None, 0, 20, integer=True)
    common["sampling"] = _sampling(common["sampling"], logprobs=top is not None, top_logprobs=top or 0)
    return GenerationRequest(kind="completion", prompt=prompts[0], prompts=prompts, echo=echo, **common)
