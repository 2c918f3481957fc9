"""Generation: the state of one request, token by token (see the package docstring for the loop).

The ids come from the engine's sampler (the session's, set from params.sampler_kwargs()); each
one goes, in order, through: stop ids (the id ends the request and shows no text)
→ Detokenizer → StopMatcher (stop strings, across token boundaries) → the output parser (the
vault's format's reasoning and tool calls, pysmoe.textgen.formats, for chat; none for
completions) → a Step carrying the delta to send.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from ..engine import logprobs as model_logprobs
from .chat import token_text
from .formats import DEFAULT_FORMAT, make_parser
from .qwen3 import MessageDelta
from .sampling import SamplingParams
from .text import Detokenizer, StopMatcher


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    def to_openai(self, tokenizer) -> dict:
        """An entry of a chat completion's logprobs.content."""
        def one(i, lp):
            text, b = token_text(tokenizer, i)
            return {"token": text, "logprob": lp, "bytes": b}
        return {**one(self.token, self.logprob), "top_logprobs": [one(i, lp) for i, lp in self.top]}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The `logprobs` object of a /v1/completions choice for these tokens (legacy shape:
    tokens, token_logprobs, top_logprobs as {token: logprob}, text_offset). text_offset: where
    the first token's text starts in the completion."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = text_offset
    for e in entries:
        text = token_text(tokenizer, e.token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        top: dict = {}
        for i, lp in e.top:  # best first; two ids of one text (half a UTF-8 character, say) keep the better
            top.setdefault(token_text(tokenizer, i)[0], lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(at)
        at += len(text)
    return out


@dataclasses.dataclass
class Step:
    """What one token changed: the text to send (delta.content for completions and chat;
    delta.reasoning and delta.tool_calls for chat), the token's logprobs when asked, and
    finish_reason once the request is over ("stop", "length" or "tool_calls")."""

    token: int | None
    delta: MessageDelta
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        """For a completions request: the new text (there is no parser there)."""
        return self.delta.content

    def chat_delta(self) -> dict:
        """OpenAI's `delta` of a chat.completion.chunk (may be empty, {})."""
        d: dict = {}
        if self.delta.reasoning:
            d["reasoning_content"] = self.delta.reasoning
        if self.delta.content:
            d["content"] = self.delta.content
        if self.delta.tool_calls:
            d["tool_calls"] = [t.to_openai() for t in self.delta.tool_calls]
        return d


class Generation:
    """One request's generation state. It samples nothing: the session's sampler draws each id
    (Session.set_sampler(**params.sampler_kwargs()), then prefill_next / decode_next /
    decode_batch(..., sample=True)) and push() takes it.

    tokenizer: the vault's (pysmoe.tokenizer.Tokenizer); params: SamplingParams; prompt_ids:
    what will be fed before the first generated id. chat: parse the reasoning (and tool calls
    when tools is true, or the request's tools list) out of the text, in output format chat_format
    (a name of pysmoe.textgen.formats.FORMATS: "qwen3", "qwen3_coder", "glm45", "harmony" for
    gpt-oss's channels, "plain", ...); starts_in_reasoning: the prompt left the model inside <think>
    (ChatPrompt.starts_in_reasoning). eos_ids: ids that end generation besides params.stop_token_ids
    (default: the tokenizer's). room: the most ids the context can still take after the prompt
    (session.context − position after the prompt + 1; None: unbounded)."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: Sequence[int], *, chat: bool = False,
                 tools=False, starts_in_reasoning: bool = False, eos_ids: Iterable[int] | None = None,
                 room: int | None = None, chat_format: str = DEFAULT_FORMAT):
        self.tok, self.params = tokenizer, params
        self.prompt_tokens = len(prompt_ids)
        eos = tokenizer.eos_ids if eos_ids is None and tokenizer is not None else (eos_ids or ())
        self.stop_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        limit = params.max_tokens
        if room is not None:
            limit = room if limit is None else min(limit, room)
        self.limit = limit
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopMatcher(params.stop)
        self.parser = make_parser(chat_format, reasoning=True, tools=tools, starts_in_reasoning=starts_in_reasoning) \
            if chat else None
        self.tokens: list[int] = []
        self.text = ""               # what was shown, for completions (stop strings removed)
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_logits(self) -> bool:
        """Whether push() needs the logits the id was drawn from (params.logprobs): only then
        should the engine copy them out."""
        return self.params.logprobs

    @property
    def usage(self) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def push(self, token: int, logits=None) -> Step:
        """Take the id the engine drew next; the Step to send. logits: those it was drawn from
        (after the prompt or the last id fed), wanted only when params.logprobs (wants_logits):
        the Step then carries the model's logprob of the id and its params.top_logprobs likeliest
        ids (pysmoe.logprobs); an id pushed without logits (forced, say) has none. After a Step
        with finish_reason set, the caller stops feeding."""
        if self.done:
            raise RuntimeError("this generation has finished")
        token = int(token)
        lps = []
        if self.params.logprobs and logits is not None:
            lp, top = model_logprobs(logits, token, self.params.top_logprobs)
            lps = [TokenLogprob(token, lp, tuple(top))]
        self.tokens.append(token)
        delta = MessageDelta()
        if token in self.stop_ids:
            return self._finish(delta, "stop", lps, token)
        text = self.detok.push(token) if self.detok is not None else ""
        shown, stopped = self.stops.push(text)
        self._show(delta, shown)
        if stopped:
            return self._finish(delta, "stop", lps, token, flush=False)
        if self.limit is not None and len(self.tokens) >= self.limit:
            return self._finish(delta, "length", lps, token)
        return Step(token, delta, lps)

    def finish(self, reason: str = "length") -> Step:
        """End the request now (context full, the client went away, ...): the held text is flushed."""
        if self.done:
            return Step(None, MessageDelta(), [], self.finish_reason)
        return self._finish(MessageDelta(), reason, [], None)

    def _show(self, delta: MessageDelta, text: str) -> None:
        if not text:
            return
        self.text += text
        if self.parser is None:
            delta.content += text
        else:
            delta.extend(self.parser.feed(text))

    def _finish(self, delta: MessageDelta, reason: str, lps, token, flush: bool = True) -> Step:
        if flush:
            shown, stopped = self.stops.push(self.detok.flush() if self.detok is not None else "")
            self._show(delta, shown)
            if not stopped:
                shown, stopped = self.stops.flush()
                self._show(delta, shown)
            if stopped:
                reason = "stop"
        if self.parser is not None:
            delta.extend(self.parser.finish())
            if self.parser.tool_calls and reason == "stop":
                reason = "tool_calls"
        self.finish_reason = reason
        return Step(token, delta, lps, reason)

    def message(self) -> dict:
        """The whole assistant message (chat), OpenAI's shape: role, content, and
        reasoning_content / tool_calls when there are any."""
        if self.parser is None:
            return {"role": "assistant", "content": self.text}
        return self.parser.message()
