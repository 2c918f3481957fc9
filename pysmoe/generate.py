"""Text in, tokens out: stream_generate() yields one small record per generated token.

The ids are drawn by the session's sampler, the engine's one sampler (csrc/engine/sample.c), set
from the arguments as Session.generate sets it: the same arguments give the same ids from both.
What it adds is pysmoe.textgen's, the code the server shares: the incremental detokenizer, stop
strings matched across token boundaries, the chat template.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

from .engine import Session, check_int, check_stop_ids
from .errors import Cancelled, InvalidArgument


@dataclasses.dataclass(frozen=True)
class GenerationResponse:
    token: int
    text: str                  # the new text this token completes ("" while a character is partial
                               # or text may be the start of a stop string)
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
            from .textgen import render_chat
            return render_chat(tok, [{"role": "user", "content": prompt}], chat_template_kwargs=template_kwargs).ids
        return tok.encode(prompt)
    try:
        return [int(i) for i in prompt]
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"a prompt is text or a sequence of token ids ({e})") from None


def stream_generate(session: Session, prompt: str | Sequence[int], max_tokens: int = 64, *,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, seed: int = 0, chat: bool = False,
                    stop: Sequence[int] | None = None, stop_strings: Sequence[str] | str | None = None,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    chat_template_kwargs: dict | None = None) -> Iterator[GenerationResponse]:
    """Generate from a prompt (text, or ids) and yield a GenerationResponse per token. Every
    argument is checked here, before anything is fed. The sampling arguments are
    Session.generate's, and so are the ids: the session's sampler draws them (the repetition
    penalty looks at every id the session holds, the prompt and what came before it). stop: ids
    that end generation (default: the tokenizer's end-of-sequence ids); stop_strings: texts that
    end it, matched across token boundaries and never shown. chat_template_kwargs: variables of
    the chat template (Qwen3: {"enable_thinking": False}).

    If the iteration raises (Cancelled included), the position goes back to where it was before
    the prompt; closing the iterator early keeps what was fed (as Session.generate)."""
    from .textgen import Generation, SamplingParams
    ids = _as_ids(session, prompt, chat, chat_template_kwargs)
    arr = session.check_ids(ids)
    max_tokens = check_int("max_tokens", max_tokens, 0)
    # the rules of Session.generate (top_k ≥ 0, seed ≥ 0); SamplingParams also takes the OpenAI
    # server's spellings (top_k −1, negative seeds)
    session.check_sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty, seed=seed, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, seed=seed, max_tokens=max(max_tokens, 1),
                            stop=stop_strings)
    tok = session.vault.tokenizer
    stop_ids = check_stop_ids(tok.eos_ids if stop is None and tok is not None else stop)
    session.check_room(len(arr))
    if max_tokens == 0:
        return iter(())

    def new_generation(start_pos: int):
        return Generation(tok, params, ids, eos_ids=stop_ids, room=session.context - start_pos - len(ids) + 1)
    return _responses(session, new_generation, params, arr, max_tokens, time.perf_counter())


def _responses(session: Session, new_generation, params, arr, max_tokens: int,
               start: float) -> Iterator[GenerationResponse]:
    first = None
    start_pos = session.position  # where the work starts: the session may have moved since the call
    gen = new_generation(start_pos)
    try:
        session.set_sampler(**params.sampler_kwargs())
        logits, token = session.prefill_next(arr, want_logits=gen.wants_logits)
        while True:
            step = gen.push(token, logits)
            now = time.perf_counter()
            if first is None:
                first = now
            n = len(gen.tokens)
            finish = step.finish_reason
            if finish == "length" and n < max_tokens:
                finish = "context"
            ttft = first - start
            yield GenerationResponse(
                token=step.token, text=step.text, prompt_tokens=len(arr), generation_tokens=n,
                prompt_tps=len(arr) / ttft if ttft > 0 else float("inf"),
                generation_tps=(n - 1) / (now - first) if now > first else 0.0,
                ttft_s=ttft, finish_reason=finish)
            if finish is not None:
                return
            logits, token = session.decode_next(step.token, want_logits=gen.wants_logits)
    except GeneratorExit:  # closed early: keep what was fed
        raise
    except BaseException:
        try:
            if session.position > start_pos:
                session.rewind(start_pos)
        except Exception:  # a closed or busy session: nothing to rewind or not ours to touch
            pass
        raise


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
