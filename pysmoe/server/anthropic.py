"""Anthropic's Messages API over the same scheduler: POST /v1/messages (and
POST /v1/messages/count_tokens), for clients and agents that speak it.

A request becomes the same GenerationRequest the OpenAI chat route builds, so it is rendered
through the vault's chat template, batched, sampled and parsed (<think> reasoning and tool calls,
in the vault's chat format: pysmoe.textgen.formats) exactly as /v1/chat/completions does. What maps onto what:

    system (string or text blocks)          a system message
    messages[].content: text blocks         the message's text
      tool_use {id, name, input}            an assistant tool call
      tool_result {tool_use_id, content}    a tool message (before the user's own text)
      thinking {thinking}                   the assistant message's reasoning
    tools [{name, description, input_schema}]   function tools
    tool_choice auto | any | tool {name} | none   "any" and "tool" are enforced by a grammar
                                            (server.grammar), as OpenAI's "required" and named
                                            function are; disable_parallel_tool_use → one call
    thinking {"type": "enabled"|"disabled"} the template's enable_thinking (absent: the template's
                                            default); the model's reasoning comes back as a
                                            thinking block (its signature "", nothing is signed)
    output_config.format {"type": "json_schema", "schema": S}
                                            the text is JSON valid under S (a grammar, as
                                            OpenAI's response_format json_schema)
    stop_sequences, temperature, top_p, top_k, max_tokens (required)

The reply: content blocks in the order the model wrote them (thinking, text, tool_use), stop_reason
end_turn / max_tokens / stop_sequence (with stop_sequence) / tool_use, usage {input_tokens,
output_tokens}. Streaming sends Anthropic's events: message_start, ping, then per block
content_block_start, content_block_delta (thinking_delta, text_delta, input_json_delta; a thinking
block ends with a signature_delta), content_block_stop, then message_delta (stop_reason, usage) and
message_stop; a failure after the stream began is an `error` event. Errors are Anthropic's shape,
{"type": "error", "error": {"type", "message"}}. The API key is read from `x-api-key` or
`Authorization: Bearer`. Images and documents are refused (400): the models here read text.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..textgen import InvalidParam, SamplingParams
from .schemas import APIError, GenerationRequest

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def _bad(message: str, status: int = 400) -> APIError:
    return APIError(status, message)


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    parts = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}.{i}: only text blocks are supported here")
        parts.append(b["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    """Anthropic messages (+ system) → the OpenAI-shaped messages that render_chat reads."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: a non-empty list is required")
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content: must be a string or a list of content blocks")
        text, reasoning, calls, results = [], [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _bad(f"{at}: a tool_use block has a name and an input object")
                calls.append({"id": b.get("id") or "", "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                                "content": _text_blocks(result, f"{at}.content")})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                if isinstance(b.get("thinking"), str):
                    reasoning.append(b["thinking"])
            else:
                raise _bad(f"{at}: content blocks of type {kind!r} are not supported in a {m['role']} message "
                           "(text, tool_use, tool_result, thinking)")
        out.extend(results)
        if m["role"] == "user" and (text or not results):
            out.append({"role": "user", "content": "".join(text)})
        elif m["role"] == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
    return out


def _tools(body: dict):
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad(f"tools.{i}: a tool has a name")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema: must be an object")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": schema}})
    return out or None


def _number(body: dict, name: str, default, low, high, integer=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not low <= v <= high:
        raise _bad(f"{name}: must be {'an integer' if integer else 'a number'} in [{low}, {high}], got {v!r}")
    return v


def parse_messages(body, max_tokens_limit: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model: a string is required")
    if "max_tokens" not in body:
        raise _bad("max_tokens: Field required")
    max_tokens = _number(body, "max_tokens", None, 1, max_tokens_limit, integer=True)
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences: must be a list of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    tools = _tools(body)
    choice, parallel = body.get("tool_choice"), True
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice: one of {'type': 'auto' | 'any' | 'tool' | 'none'}")
        parallel = not choice.get("disable_parallel_tool_use", False)
        kind = choice["type"]
        if kind == "none":
            tools, choice = None, None
        elif kind == "auto":
            choice = None
        elif not tools:
            raise _bad(f"tool_choice {kind!r} needs tools")
        elif kind == "any":
            choice = "required"
        else:
            if not isinstance(choice.get("name"), str):
                raise _bad("tool_choice.name: a string is required with type 'tool'")
            choice = {"type": "function", "function": {"name": choice["name"]}}
    response_format = None
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise _bad("output_config: must be an object")
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise _bad("output_config.format: {'type': 'json_schema', 'schema': {...}}")
            response_format = {"type": "json_schema", "json_schema": {"schema": fmt["schema"], "strict": True}}
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking: {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
        kwargs["enable_thinking"] = thinking["type"] != "disabled"
    try:
        sampling = SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0.0, 1.0)),
                                  top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
                                  top_k=_number(body, "top_k", 0, 0, 2 ** 31, integer=True),
                                  max_tokens=max_tokens, stop=[s for s in stops if s])
    except InvalidParam as e:
        raise _bad(f"{e.param}: {e}") from None
    return GenerationRequest(kind="chat", model=model, sampling=sampling, stream=stream, include_usage=True,
                             messages=_messages(body), tools=tools, template_kwargs=kwargs, tool_choice=choice,
                             parallel_tool_calls=parallel, response_format=response_format)


def _authorize(server, request: Request) -> None:
    key = request.headers.get("x-api-key")
    if server.api_key is not None and key is not None:
        if not hmac.compare_digest(key.strip().encode(), server.api_key.encode()):
            raise APIError(401, "invalid x-api-key", type="authentication_error")
        return
    try:
        server.authorize(request)
    except APIError:
        raise APIError(401, "missing or wrong API key (x-api-key: KEY, or Authorization: Bearer KEY)") from None


class _Blocks:
    """The reply's content blocks as the model writes them: what a Step adds, as Anthropic stream
    events and as the final content list."""

    def __init__(self):
        self.content: list[dict] = []
        self.kind: str | None = None   # the open block's type
        self.calls: dict[int, dict] = {}

    def _open(self, kind: str, start: dict, events: list) -> None:
        if self.kind == kind and kind != "tool_use":
            return
        self._close(events)
        self.kind = kind
        self.content.append(start)
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                               "content_block": dict(start)}))

    def _close(self, events: list) -> None:
        if self.kind is None:
            return
        i = len(self.content) - 1
        if self.kind == "thinking":
            events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        self.kind = None

    def _delta(self, delta: dict, events: list) -> None:
        events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                               "delta": delta}))

    def add(self, delta) -> list:
        """delta: a textgen MessageDelta. Returns the (event, data) pairs it makes."""
        events: list = []
        if delta.reasoning:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, events)
            self.content[-1]["thinking"] += delta.reasoning
            self._delta({"type": "thinking_delta", "thinking": delta.reasoning}, events)
        if delta.content:
            self._open("text", {"type": "text", "text": ""}, events)
            self.content[-1]["text"] += delta.content
            self._delta({"type": "text_delta", "text": delta.content}, events)
        for t in delta.tool_calls:
            if t.name is not None:  # a call's first piece: its block opens
                call = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": t.name, "input": {}}
                self._open("tool_use", call, events)
                self.calls[t.index] = {"block": self.content[-1], "json": ""}
            entry = self.calls.get(t.index)
            if entry is not None and t.arguments:
                entry["json"] += t.arguments
                self._delta({"type": "input_json_delta", "partial_json": t.arguments}, events)
        return events

    def finish(self) -> list:
        events: list = []
        self._close(events)
        for entry in self.calls.values():
            try:
                args = json.loads(entry["json"]) if entry["json"] else {}
            except ValueError:
                args = {}
            entry["block"]["input"] = args if isinstance(args, dict) else {}
        return events


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def _stop(text, reason: str) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the reply or None)."""
    matched = getattr(text.gen.stops, "matched", None)
    if reason == "stop" and matched is not None:
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason, "end_turn"), None


def routes(server) -> list[Route]:
    sched = server.scheduler

    def error_response(e: Exception) -> JSONResponse:
        e = server.error_of(e)
        server.rejected[e.status] += 1
        return JSONResponse(error_body(e.status, e.message), status_code=e.status)

    async def messages(request: Request):
        try:
            _authorize(server, request)
            req = parse_messages(await server.read_json(request), server.max_tokens_limit)
            server.check_model(req.model)
            choices, events = await server.generate(request, req)
            job, text = choices[0]
        except Exception as e:  # noqa: BLE001 — every failure is answered in Anthropic's shape
            return error_response(e)
        mid = "msg_" + uuid.uuid4().hex[:24]
        head = {"id": mid, "type": "message", "role": "assistant", "model": server.model}
        if req.stream:
            return StreamingResponse(_stream(server, job, text, events, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(server.watch_disconnect(request, choices))
        blocks = _Blocks()
        try:
            while True:
                _, kind, payload = await events.get()
                if kind == "token":
                    blocks.add(payload.delta)
                elif kind == "error":
                    return error_response(payload)
                else:
                    reason, usage = payload
                    break
        except asyncio.CancelledError:
            sched.cancel(job)
            raise
        finally:
            watcher.cancel()
        blocks.finish()
        stop_reason, stop_sequence = _stop(text, reason)
        return JSONResponse({**head, "content": blocks.content, "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": usage["prompt_tokens"],
                                       "output_tokens": usage["completion_tokens"],
                                       "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"]}})

    async def count_tokens(request: Request):
        try:
            _authorize(server, request)
            body = await server.read_json(request)
            if isinstance(body, dict):
                body = {**body, "max_tokens": 1}
            req = parse_messages(body, server.max_tokens_limit)
            server.check_model(req.model)
            ids, _ = await server.prompt_ids(req)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return JSONResponse({"input_tokens": len(ids)})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


async def _stream(server, job, text, events: asyncio.Queue, head: dict):
    blocks = _Blocks()
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            **head, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(job.prompt_ids), "output_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        while True:
            _, kind, payload = await events.get()
            if kind == "token":
                for name, data in blocks.add(payload.delta):
                    yield _event(name, data)
            elif kind == "done":
                reason, usage = payload
                for name, data in blocks.finish():
                    yield _event(name, data)
                stop_reason, stop_sequence = _stop(text, reason)
                yield _event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": {"output_tokens": usage["completion_tokens"]}})
                yield _event("message_stop", {"type": "message_stop"})
                break
            else:
                e = server.error_of(payload)
                yield _event("error", error_body(e.status, e.message))
                break
    finally:
        if not job.finished:
            server.scheduler.cancel(job)
