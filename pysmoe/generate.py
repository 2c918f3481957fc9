"""Text in, tokens out: stream_generate() yields one small record per generated token."""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

from .engine import Session, _stop_ids
from .errors import Cancelled, InvalidArgument


@dataclasses.dataclass(frozen=True)
class GenerationResponse:
    token: int
    text: str                  # the new text this token completes ("" while a character is partial)
    prompt_tokens: int
    generation_tokens: int     # generated so far, this one included
    prompt_tps: float          # prompt tokens per second of time to first token
    generation_tps: float      # tokens per second after the first
    ttft_s: float              # seconds from the call to the first generated token
    finish_reason: str | None  # None while running; "stop", "length" or "context" on the last


def _as_ids(session: Session, prompt, chat: bool, template_kwargs: dict | None = None) -> list[int]:
    if isinstance(prompt, str):
        tok = session.vault.tokenizer
        if tok is None:
            raise InvalidArgument("this vault has no tokenizer.json: pass token ids instead of text")
        if chat:
            return tok.apply_chat_template([{"role": "user", "content": prompt}], **(template_kwargs or {}))
        return tok.encode(prompt)
    try:
        return [int(i) for i in prompt]
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"a prompt is text or a sequence of token ids ({e})") from None


def stream_generate(session: Session, prompt: str | Sequence[int], max_tokens: int = 64, *,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, seed: int = 0, chat: bool = False,
                    stop: Sequence[int] | None = None,
                    chat_template_kwargs: dict | None = None) -> Iterator[GenerationResponse]:
    """Generate from a prompt (text, or ids) and yield a GenerationResponse per token. Every
    argument is checked here, before anything is fed (Session.generate says what a failure
    leaves). chat_template_kwargs: variables of the chat template (Qwen3: {"enable_thinking": False})."""
    ids = _as_ids(session, prompt, chat, chat_template_kwargs)
    tok = session.vault.tokenizer
    if stop is None:
        stop = tok.eos_ids if tok is not None else ()
    stop = _stop_ids(stop)
    start = time.perf_counter()
    gen = session.generate(ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, top_k=top_k,
                           min_p=min_p, repetition_penalty=repetition_penalty, stop=stop)
    return _responses(session, tok, ids, gen, max_tokens, stop, start)


def _responses(session: Session, tok, ids: list[int], gen: Iterator[int], max_tokens: int, stop: frozenset,
               start: float) -> Iterator[GenerationResponse]:
    first = None
    out: list[int] = []
    emitted = ""
    for token in gen:
        now = time.perf_counter()
        if first is None:
            first = now
        out.append(token)
        text = ""
        if tok is not None:
            full = tok.decode(out)
            # Hold back a trailing replacement character: the next token may complete it.
            if not full.endswith("\ufffd"):
                text, emitted = full[len(emitted):], full
        finish = None
        if token in stop:
            finish = "stop"
        elif len(out) == max_tokens:
            finish = "length"
        elif session.position >= session.context:
            finish = "context"
        ttft = first - start
        yield GenerationResponse(
            token=token, text=text, prompt_tokens=len(ids), generation_tokens=len(out),
            prompt_tps=len(ids) / ttft if ttft > 0 else float("inf"),
            generation_tps=(len(out) - 1) / (now - first) if now > first else 0.0,
            ttft_s=ttft, finish_reason=finish)


def generate(session: Session, prompt: str | Sequence[int], max_tokens: int = 64, **kwargs) -> str:
    """The whole generated text (needs a tokenizer)."""
    return "".join(r.text for r in stream_generate(session, prompt, max_tokens, **kwargs))


def interruptible(session: Session, items: Iterator):
    """Iterate items on a worker thread and yield them here, so that Ctrl-C stops a long call in
    libsmoe within a layer: Python runs a signal handler only between bytecodes, so a main thread
    inside a prefill would see KeyboardInterrupt only when the whole chunk returned. Here the main
    thread waits on a queue instead; on KeyboardInterrupt it calls session.cancel(), waits for the
    worker (whose method then fails with Cancelled and rewinds, docs/binding.md) and re-raises
    KeyboardInterrupt; a Ctrl-C that comes between two items is thrown into items as Cancelled, so
    a Session method rewinds either way. The worker advances items only when asked for the next
    one (lockstep), so stopping early leaves the session exactly where a plain loop would.
    Exceptions of the worker are raised here."""
    import queue
    import threading

    ask: queue.Queue = queue.Queue()
    got: queue.Queue = queue.Queue()
    done = object()

    def work():
        it = iter(items)
        while (cmd := ask.get()) == "next":
            try:
                got.put((next(it, done), None))
            except BaseException as e:  # handed to the main thread, which raises it
                got.put((None, e))
                return
        try:  # "close": the caller stopped early; "abort": it failed, so the method rewinds too
            if cmd == "abort" and hasattr(it, "throw"):
                it.throw(Cancelled("interrupted"))
            elif hasattr(it, "close"):
                it.close()
        except BaseException:  # the main thread is already leaving, with its own exception if any
            pass

    worker = threading.Thread(target=work, name="pysmoe-generate", daemon=True)
    worker.start()
    end = "close"
    try:
        while True:
            ask.put("next")
            item, err = got.get()
            if err is not None:
                end = "done"
                raise err
            if item is done:
                return
            yield item
    except GeneratorExit:  # the caller stopped early: not a failure, nothing to cancel
        raise
    except BaseException:  # KeyboardInterrupt (or another error here): stop the call in flight
        if end != "done":
            end = "abort"
            session.cancel()
        raise
    finally:
        ask.put(end)
        worker.join()
