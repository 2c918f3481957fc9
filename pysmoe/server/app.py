"""The starlette app: OpenAI routes over a Scheduler.

    GET  /health                 {"status": "ok", running, queued, max_batch} (no key needed)
    GET  /v1/models              the one model this server serves
    POST /v1/chat/completions    chat, streamed (SSE) or not
    POST /v1/completions         text or token-id prompt, streamed or not
    GET  /metrics                counters (JSON): requests, tokens, TTFT, tokens/s, batch sizes,
                                 blob reads and cache hit rate of the shared retention cache

Streaming follows OpenAI's wire format: `data: {chunk}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the
end; with stream_options.include_usage every chunk carries "usage": null and a last chunk with
no choices carries the usage. A client that disconnects cancels its job (the scheduler frees its
slot; a running prefill stops within a layer).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import BadToken, ContextFull, InvalidArgument
from ..textgen import render_chat
from .scheduler import Job, Scheduler
from .schemas import APIError, GenerationRequest, parse_chat, parse_completion
from .text import RequestText


class Server:
    """What the routes need: the scheduler, the tokenizer, the limits."""

    def __init__(self, scheduler: Scheduler, tokenizer, *, model: str, vocab_size: int, context: int,
                 api_key: str | None = None, max_request_bytes: int = 1 << 20, max_tokens_limit: int = 4096):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.context = context
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_tokens_limit = max_tokens_limit
        self.created = int(time.time())

    # ------------------------------------------------------------------ request plumbing
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    async def read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise APIError(413, f"the request body is over {self.max_request_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_request_bytes:
                raise APIError(413, f"the request body is over {self.max_request_bytes} bytes",
                               code="request_too_large")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def prompt(self, req: GenerationRequest) -> tuple[list[int], bool, str]:
        """The prompt's ids, whether it leaves the model inside a <think> block, and the output
        format of the chat template's model (ChatPrompt.format)."""
        tok = self.tokenizer
        starts_in_reasoning, chat_format = False, "qwen3"
        if req.kind == "chat":
            if tok is None:
                raise APIError(400, "this vault has no tokenizer: use /v1/completions with token ids")
            try:
                p = render_chat(tok, req.messages, tools=req.tools, chat_template_kwargs=req.template_kwargs)
            except InvalidArgument as e:
                raise APIError(400, str(e), param="messages") from None
            ids, starts_in_reasoning, chat_format = p.ids, p.starts_in_reasoning, p.format
        elif isinstance(req.prompt, str):
            if tok is None:
                raise APIError(400, "this vault has no tokenizer: send the prompt as token ids", param="prompt")
            ids = tok.encode(req.prompt)
        else:
            ids = req.prompt
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt", code="invalid_token_id")
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        if len(ids) >= self.context:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context is {self.context} "
                                "(prompt and at least one generated token)", param="messages" if req.kind == "chat"
                           else "prompt", code="context_length_exceeded")
        return ids, starts_in_reasoning, chat_format

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, req: GenerationRequest):
        ids, starts_in_reasoning, chat_format = self.prompt(req)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind, payload):  # engine thread → this request's queue
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
                pass

        text = RequestText(req, self.tokenizer, ids, context=self.context, starts_in_reasoning=starts_in_reasoning,
                           chat_format=chat_format)
        job = Job(ids, text, emit)
        self.scheduler.submit(job)
        return job, text, events

    def error_of(self, e: Exception) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, (BadToken, ContextFull, InvalidArgument)):
            return APIError(400, str(e))
        return APIError(500, f"{type(e).__name__}: {e}", type="server_error")


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(request: Request, scheduler: Scheduler, job: Job) -> None:
    """Cancel the job when the client goes away (a non-streamed request: nothing is written
    until the end, so the receive channel is the only sign)."""
    while not job.finished:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scheduler.cancel(job)
            return


def build_app(server: Server) -> Starlette:
    sched = server.scheduler

    async def health(request: Request):
        return JSONResponse({"status": "ok", **sched.load})

    async def models(request: Request):
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": server.model, "object": "model", "created": server.created, "owned_by": "pysmoe"}]})

    async def metrics(request: Request):
        server.authorize(request)
        snap = await asyncio.get_running_loop().run_in_executor(None, sched.metrics)
        return JSONResponse(snap)

    async def completions(request: Request, kind: str):
        server.authorize(request)
        body = await server.read_json(request)
        parse = parse_chat if kind == "chat" else parse_completion
        req = parse(body, server.max_tokens_limit)
        job, text, events = await server.generate(request, req)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": rid, "object": obj + (".chunk" if req.stream and kind == "chat" else ""),
                "created": created, "model": server.model}
        if req.stream:
            return StreamingResponse(_stream(server, job, text, events, head, req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_watch_disconnect(request, sched, job))
        try:
            while True:
                kind_, payload = await events.get()
                if kind_ == "error":
                    raise server.error_of(payload)
                if kind_ == "done":
                    reason, usage = payload
                    break
        except asyncio.CancelledError:
            sched.cancel(job)
            raise
        finally:
            watcher.cancel()
        return JSONResponse({**head, "choices": [text.message(reason)], "usage": usage,
                             "system_fingerprint": None})

    async def chat(request: Request):
        return await completions(request, "chat")

    async def completion(request: Request):
        return await completions(request, "completion")

    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, exc.detail or "error", type=kind))

    async def disconnect(request: Request, exc: ClientDisconnect):
        return JSONResponse({}, status_code=499)

    async def internal(request: Request, exc: Exception):
        return _error_response(server.error_of(exc))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, ClientDisconnect: disconnect, Exception: internal}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _stream(server: Server, job: Job, text, events: asyncio.Queue, head: dict, req: GenerationRequest):
    """The SSE body of a streamed request. Starlette cancels this generator when the client
    disconnects (or writing to it fails): the job is cancelled then."""
    usage_field = {"usage": None} if req.include_usage else {}
    try:
        if req.kind == "chat":
            yield _sse({**head, "system_fingerprint": None,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}], **usage_field})
        while True:
            kind, payload = await events.get()
            if kind == "token":
                yield _sse({**head, "system_fingerprint": None, "choices": [text.chunk(payload, None)],
                            **usage_field})
            elif kind == "done":
                reason, usage = payload
                yield _sse({**head, "system_fingerprint": None, "choices": [text.chunk(None, reason)],
                            **usage_field})
                if req.include_usage:
                    yield _sse({**head, "system_fingerprint": None, "choices": [], "usage": usage})
                break
            else:  # an engine error after the stream began: an error object, as OpenAI does
                yield _sse(server.error_of(payload).body())
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not job.finished:
            server.scheduler.cancel(job)
