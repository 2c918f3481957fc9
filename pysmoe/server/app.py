"""The starlette app: OpenAI routes over a Scheduler.

    GET  /health                 {"status": "ok", running, queued, max_batch} (no key needed)
    GET  /v1/models              the one model this server serves (and its aliases)
    POST /v1/chat/completions    chat, streamed (SSE) or not; n choices
    POST /v1/completions         text or token-id prompts (several per request), streamed or not; n
                                 choices per prompt; echo, with the prompt's logprobs, and
                                 max_tokens 0 with echo (lm-evaluation-harness's log-likelihoods)
    POST /tokenize               {"content" or "prompt": text, "add_special", "with_pieces"} →
                                 {"tokens": ids (or {id, piece} with with_pieces), "count",
                                 "max_model_len"}: llama-server's and vLLM's spellings both
    POST /detokenize             {"tokens": ids} → {"content": text, "prompt": text}
    GET  /tokenizer_info         eos/bos/pad tokens, chat template, model_max_length (vLLM's; what
                                 lm-eval's tokenizer_backend=remote reads)
    GET  /metrics                counters (JSON): requests, tokens, TTFT, tokens/s, batch sizes,
                                 blob reads and cache hit rate of the shared retention cache
    POST /v1/messages            Anthropic's Messages API (anthropic.py), streamed or not
    GET  /                       the chat page (page.py, static/)

A request naming a model other than the served one or one of its aliases (`serve --alias`) is
answered 404 model_not_found, as OpenAI answers it; a request without a model gets the served one.
The choices of a request are jobs of the scheduler: each prompt's first is queued at once (so the
prompts of one request decode together in one batch), its other n − 1 follow on its session,
reusing the prompt's KV (scheduler.py).

Streaming follows OpenAI's wire format: `data: {chunk}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the
end; with stream_options.include_usage every chunk carries "usage": null and a last chunk with
no choices carries the usage. A client that disconnects cancels its job (the scheduler frees its
slot; a running prefill stops within a layer).

Nothing slow runs on the event loop: a prompt is rendered and tokenised on a small thread pool
(PROMPT_THREADS at once, which also bounds the memory that tokenising huge prompts takes), and a
text that cannot fit the context (Tokenizer.min_tokens) is refused before it is tokenised. A body
must arrive within request_timeout seconds (408), be valid JSON nested at most MAX_JSON_DEPTH deep
and hold only valid Unicode (400). A 500's body names the exception's type only; its message
(which may hold a path of this machine) goes to the log.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import BadToken, ContextFull, InvalidArgument
from ..textgen import render_chat, token_text
from ..textgen.formats import format_of
from ..tokenizer import _token_text
from . import anthropic, page
from .grammar import CALL_FORMATS, Grammars
from .scheduler import Job, Scheduler
from .schemas import _bool, _is_ids, _type_error
from .schemas import APIError, GenerationRequest, parse_chat, parse_completion
from .text import RequestText

log = logging.getLogger("pysmoe.server")

PROMPT_THREADS = 2      # prompts rendered and tokenised at once, off the event loop
MAX_JSON_DEPTH = 64     # request bodies nested deeper are refused (Python's json parser recurses)


class Server:
    """What the routes need: the scheduler, the tokenizer, the limits."""

    def __init__(self, scheduler: Scheduler, tokenizer, *, model: str, vocab_size: int, context: int,
                 api_key: str | None = None, max_request_bytes: int = 1 << 20, max_tokens_limit: int = 4096,
                 aliases=(), request_timeout: float = 30.0, model_type: str | None = None):
        if api_key == "":
            raise ValueError("an empty API key would let 'Authorization: Bearer' with nothing after it in: "
                             "give a key, or None for none")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        # how replies are read (reasoning, tool calls): the vault's family and its template say
        self.chat_format = format_of(model_type, tokenizer.chat_template if tokenizer is not None else None)
        self.model = model
        self.aliases = tuple(a for a in aliases if a != model)
        self.vocab_size = vocab_size
        self.context = context
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.grammars = Grammars(tokenizer, vocab_size) if tokenizer is not None else None
        self.rejected = collections.Counter()   # requests answered with an error status, by status
        self._prompts = concurrent.futures.ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="pysmoe-prompt")

    def close(self) -> None:
        self._prompts.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ request plumbing
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        # a header arrives as the latin-1 text of its bytes; clients send a non-ASCII key as UTF-8
        sent = key.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.api_key.encode("utf-8")):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name and name != self.model and name not in self.aliases:
            raise APIError(404, f"The model '{name}' does not exist (this server serves '{self.model}'"
                                + (f", also called {', '.join(repr(a) for a in self.aliases)}" if self.aliases else "")
                                + ")", param="model", code="model_not_found")

    def need_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this vault has no tokenizer")
        return self.tokenizer

    async def read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise APIError(413, f"the request body is over {self.max_request_bytes} bytes", code="request_too_large")
        body = bytearray()

        async def receive():
            async for part in request.stream():
                body.extend(part)
                if len(body) > self.max_request_bytes:
                    raise APIError(413, f"the request body is over {self.max_request_bytes} bytes",
                                   code="request_too_large")

        try:
            await asyncio.wait_for(receive(), self.request_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.request_timeout:g} s",
                           code="request_timeout") from None
        try:
            value = json.loads(body)
        except RecursionError:
            raise APIError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json") from None
        except ValueError as e:  # not JSON, not UTF-8, an integer over Python's 4300 digits
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        _check_json(value)
        return value

    def prompt(self, req: GenerationRequest) -> tuple[list[int], bool]:
        """The prompt's ids and whether it leaves the model inside a <think> block (blocking: run
        it on a thread, as prompt_ids does)."""
        tok = self.tokenizer
        starts_in_reasoning = False
        if req.kind == "chat":
            if tok is None:
                raise APIError(400, "this vault has no tokenizer: use /v1/completions with token ids")
            try:
                p = render_chat(tok, req.messages, tools=req.tools, chat_template_kwargs=req.template_kwargs,
                                check_text=lambda text: self._fits(text, "messages"))
            except InvalidArgument as e:
                raise APIError(400, str(e), param="messages") from None
            ids, starts_in_reasoning = p.ids, p.starts_in_reasoning
        elif isinstance(req.prompt, str):
            if tok is None:
                raise APIError(400, "this vault has no tokenizer: send the prompt as token ids", param="prompt")
            self._fits(req.prompt, "prompt")
            try:
                ids = tok.encode(req.prompt)
            except InvalidArgument as e:
                raise APIError(400, str(e), param="prompt") from None
        else:
            ids = req.prompt
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt", code="invalid_token_id")
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        if len(ids) >= self.context:
            raise self._too_long(f"{len(ids)} tokens", "messages" if req.kind == "chat" else "prompt")
        return ids, starts_in_reasoning

    def _fits(self, text: str, where: str) -> None:
        """Refuse, before tokenising it, a text that has more tokens than the context for sure."""
        least = self.tokenizer.min_tokens(text)
        if least >= self.context:
            raise self._too_long(f"at least {least} tokens", where)

    def _too_long(self, count: str, where: str) -> APIError:
        return APIError(400, f"the prompt has {count}; this server's context is {self.context} "
                             "(prompt and at least one generated token)", param=where, code="context_length_exceeded")

    async def prompt_ids(self, req: GenerationRequest) -> tuple[list[int], bool]:
        """prompt(req) on the prompt threads: the event loop goes on serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prompts, self.prompt, req)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, req: GenerationRequest):
        """Queue the request's choices: [(job, text)] in the answer's order, and the queue of their
        events, (choice index, kind, payload). Every prompt is checked before anything is queued."""
        subs = [dataclasses.replace(req, prompt=p) for p in req.prompts] if req.kind == "completion" else [req]
        prompts = [await self.prompt_ids(r) for r in subs]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(index: int):
            def emit(kind, payload):  # engine thread → this request's queue
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, kind, payload))
                except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
                    pass
            return emit

        choices, first = [], []
        for r, (ids, starts_in_reasoning) in zip(subs, prompts):
            prev = None
            for k in range(req.n):  # choice k draws with seed + k
                rk = r if k == 0 else dataclasses.replace(
                    r, sampling=dataclasses.replace(r.sampling, seed=(r.sampling.seed + k) % 2 ** 64))
                constraint = None  # each choice its own grammar state
                if req.tool_choice is not None and self.chat_format not in CALL_FORMATS:
                    raise APIError(400, f"tool_choice {req.tool_choice!r:.60} cannot be enforced: this model's "
                                        f"chat format ({self.chat_format!r}) has no tool-call syntax pysmoe can "
                                        "force; leave tool_choice to 'auto'", param="tool_choice",
                                   code="unsupported_value")
                if req.response_format is not None or req.tool_choice is not None:
                    constraint = await loop.run_in_executor(None, functools.partial(
                        self.grammars.constraint, req.response_format, req.tools, req.tool_choice,
                        starts_in_reasoning=starts_in_reasoning, parallel=req.parallel_tool_calls,
                        call_format=self.chat_format))
                text = RequestText(rk, self.tokenizer, ids, context=self.context,
                                   starts_in_reasoning=starts_in_reasoning, index=len(choices), constraint=constraint,
                                   chat_format=self.chat_format)
                job = Job(ids, text, emitter(len(choices)))
                if prev is None:
                    first.append(job)
                else:
                    prev.then = job
                prev = job
                choices.append((job, text))
        for job in first:
            self.scheduler.submit(job)
        return choices, events

    async def watch_disconnect(self, request: Request, choices) -> None:
        """Cancel the jobs when the client goes away (a non-streamed request: nothing is written
        until the end, so the receive channel is the only sign)."""
        while not all(job.finished for job, _ in choices):
            message = await request.receive()
            if message["type"] == "http.disconnect":
                _cancel_all(self.scheduler, choices)
                return

    def error_of(self, e: Exception) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, (BadToken, ContextFull, InvalidArgument)):
            return APIError(400, str(e))
        # the message may name this machine's paths (a vault's): the log has it, the client the type
        log.error("internal error", exc_info=e)
        return APIError(500, f"internal error ({type(e).__name__}); the server's log has the details",
                        type="server_error")


def _check_json(value) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH (what reads it later may recurse) or holding
    a string that is not valid Unicode (a lone surrogate, "\\ud800", which no tokenizer takes)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): "
                                        "not valid Unicode", code="invalid_unicode") from None
        elif isinstance(v, (list, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                               code="invalid_json")
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                v = v.values()
            stack.extend((x, depth + 1) for x in v)


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _cancel_all(scheduler: Scheduler, choices) -> None:
    for job, _ in choices:
        if not job.finished:
            scheduler.cancel(job)


def _usage(choices, n: int) -> dict:
    """The request's usage: each prompt counted once (its n choices share its KV), every
    choice's completion tokens."""
    firsts = [job for i, (job, _) in enumerate(choices) if i % n == 0]
    prompt = sum(len(j.prompt_ids) for j in firsts)
    completion = sum(j.generated for j, _ in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(j.reused for j in firsts)}}


def build_app(server: Server) -> Starlette:
    sched = server.scheduler

    async def health(request: Request):
        return JSONResponse({"status": "ok", **sched.load})

    async def models(request: Request):
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": server.created, "owned_by": "pysmoe"}
            for name in (server.model, *server.aliases)]})

    async def tokenize(request: Request):
        server.authorize(request)
        body = await server.read_json(request)
        tok = server.need_tokenizer()
        if not isinstance(body, dict):
            raise APIError(422, "the request body must be a JSON object", code="invalid_type")
        name = "content" if "content" in body else "prompt"
        text = body.get(name)
        if not isinstance(text, str):
            raise _type_error(name, "a string", text)
        special = _bool(body, "add_special", _bool(body, "add_special_tokens", False))
        ids = tok.encode(text, add_special_tokens=special)
        out = ids
        if _bool(body, "with_pieces", False):
            out = [{"id": i, "piece": token_text(tok, i)[0]} for i in ids]
        return JSONResponse({"tokens": out, "count": len(ids), "max_model_len": server.context})

    async def detokenize(request: Request):
        server.authorize(request)
        body = await server.read_json(request)
        tok = server.need_tokenizer()
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not _is_ids(ids):
            raise _type_error("tokens", "a list of token ids", ids)
        bad = next((i for i in ids if not 0 <= i < server.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {server.vocab_size})",
                           param="tokens", code="invalid_token_id")
        text = tok.decode(ids, skip_special_tokens=False)
        return JSONResponse({"content": text, "prompt": text})

    async def tokenizer_info(request: Request):
        server.authorize(request)
        tok = server.need_tokenizer()
        info = {k: _token_text(tok.config.get(k)) for k in ("eos_token", "bos_token", "pad_token", "unk_token")}
        if info["eos_token"] is None and tok.eos_id is not None:
            info["eos_token"] = tok.id_to_token(tok.eos_id)
        return JSONResponse({**info, "chat_template": tok.chat_template, "model_max_length": server.context,
                             "tokenizer_class": tok.config.get("tokenizer_class"), "vocab_size": server.vocab_size})

    async def metrics(request: Request):
        server.authorize(request)
        snap = await asyncio.get_running_loop().run_in_executor(None, sched.metrics)
        # requests answered with an error status, by status (the scheduler's
        # "requests" counts the jobs it ran, by outcome)
        snap["rejected"] = {str(k): v for k, v in sorted(server.rejected.items())}
        return JSONResponse(snap)

    async def completions(request: Request, kind: str):
        server.authorize(request)
        body = await server.read_json(request)
        parse = parse_chat if kind == "chat" else parse_completion
        req = parse(body, server.max_tokens_limit)
        server.check_model(req.model)
        choices, events = await server.generate(request, req)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": rid, "object": obj + (".chunk" if req.stream and kind == "chat" else ""),
                "created": created, "model": req.model or server.model}
        if req.stream:
            return StreamingResponse(_stream(server, choices, events, head, req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(server.watch_disconnect(request, choices))
        reasons: dict[int, str] = {}
        try:
            while len(reasons) < len(choices):
                index, kind_, payload = await events.get()
                if kind_ == "error":
                    raise server.error_of(payload)
                if kind_ == "done":
                    reasons[index] = payload[0]
        finally:
            watcher.cancel()
            _cancel_all(sched, choices)  # after an error or a cancellation: the others too
        return JSONResponse({**head, "choices": [text.message(reasons[i]) for i, (_, text) in enumerate(choices)],
                             "usage": _usage(choices, req.n), "system_fingerprint": None})

    async def chat(request: Request):
        return await completions(request, "chat")

    async def completion(request: Request):
        return await completions(request, "completion")

    def refuse(e: APIError) -> JSONResponse:
        server.rejected[e.status] += 1
        return _error_response(e)

    async def api_error(request: Request, exc: APIError):
        return refuse(exc)

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return refuse(APIError(exc.status_code, exc.detail or "error", type=kind))

    async def disconnect(request: Request, exc: ClientDisconnect):
        return JSONResponse({}, status_code=499)

    async def internal(request: Request, exc: Exception):
        return refuse(server.error_of(exc))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
    routes += anthropic.routes(server) + page.routes(server)
    handlers = {APIError: api_error, HTTPException: http_error, ClientDisconnect: disconnect, Exception: internal}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _stream(server: Server, choices, events: asyncio.Queue, head: dict, req: GenerationRequest):
    """The SSE body of a streamed request, its choices' chunks as they come (each with its index).
    Starlette cancels this generator when the client disconnects (or writing to it fails): the
    jobs are cancelled then."""
    usage_field = {"usage": None} if req.include_usage else {}
    try:
        if req.kind == "chat":
            for i in range(len(choices)):
                yield _sse({**head, "system_fingerprint": None,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}], **usage_field})
        done = 0
        while done < len(choices):
            index, kind, payload = await events.get()
            text = choices[index][1]
            if kind == "echo":
                yield _sse({**head, "system_fingerprint": None, "choices": [text.echo_chunk()], **usage_field})
            elif kind == "token":
                yield _sse({**head, "system_fingerprint": None, "choices": [text.chunk(payload, None)],
                            **usage_field})
            elif kind == "done":
                done += 1
                yield _sse({**head, "system_fingerprint": None, "choices": [text.chunk(None, payload[0])],
                            **usage_field})
            else:  # an engine error after the stream began: an error object, as OpenAI does
                yield _sse(server.error_of(payload).body())
                break
        else:
            if req.include_usage:
                yield _sse({**head, "system_fingerprint": None, "choices": [], "usage": _usage(choices, req.n)})
        yield b"data: [DONE]\n\n"
    finally:
        _cancel_all(server.scheduler, choices)
