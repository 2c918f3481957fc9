"""A request's text side, as the scheduler and the routes see it: pysmoe.textgen's Generation
(stop strings, detokenisation, the reasoning and tool calls of the vault's output format —
pysmoe.textgen.formats — shared with run and chat) plus
the shapes of OpenAI's choices. It samples nothing: the request's session draws every id with the
engine's sampler, set from sampler_kwargs() (the scheduler does it when the job starts).

    sampler_kwargs() -> dict     Session.set_sampler's arguments for this request
    next_mask()                  the token bitmask for the next draw (Session.set_mask), or None
                                 when the request has no grammar (server.grammar)
    wants_logits                 whether step() needs the logits (the request wants logprobs)
    step(token, logits) -> Step  take the id the session drew (Step.finish_reason ends the job)
    finish(reason) -> Step       end now (the context is full), flushing held-back text
    chunk(step, finish)          an OpenAI streaming choice (step None: the closing chunk)
    message(finish)              the OpenAI non-streamed choice

Echo (completions): the choice's text starts with the prompt's. With logprobs, its tokens' too:
the first has none (null, as OpenAI gives it), each other's comes from the logits after the id
before it, which the scheduler computes in the prefill (Session.prefill_logits) and hands to
add_prompt_rows; a request's further choices copy the first's (copy_prompt_logprobs).
"""
from __future__ import annotations

from ..engine import logprobs as model_logprobs
from ..textgen import Generation, Step, TokenLogprob, completion_logprobs, token_text
from .schemas import GenerationRequest


class RequestText:
    def __init__(self, req: GenerationRequest, tokenizer, prompt_ids: list[int], *, context: int,
                 starts_in_reasoning: bool = False, index: int = 0, constraint=None,
                 chat_format: str = "qwen3"):
        self.req, self.tok = req, tokenizer
        self.index = index         # the choice's index in the answer
        self.prompt_ids = list(prompt_ids)
        self.prompt_logprobs: list[TokenLogprob] | None = None  # echo: the prompt's ids after the first
        self._rows: list[TokenLogprob] = []  # those computed so far (the prefill comes in chunks)
        self.constraint = constraint  # server.grammar.Constraint or None
        self.chat = req.kind == "chat"
        self.gen = Generation(tokenizer, req.sampling, prompt_ids, chat=self.chat, tools=list(req.tools or []),
                              starts_in_reasoning=starts_in_reasoning, eos_ids=() if req.ignore_eos else None,
                              room=context - len(prompt_ids) + 1, chat_format=chat_format)
        self.logprobs: list = []   # every token's TokenLogprob, for the non-streamed answer
        self.offset = 0            # completions' text_offset

    def sampler_kwargs(self) -> dict:
        return self.req.sampling.sampler_kwargs()

    @property
    def wants_logits(self) -> bool:
        return self.gen.wants_logits

    def next_mask(self):
        if self.constraint is None or self.constraint.done:
            return None
        return self.constraint.mask()

    @property
    def draws(self) -> bool:
        """Whether the request generates anything (max_tokens 0 with echo does not)."""
        return self.gen.limit != 0

    @property
    def echo(self) -> bool:
        return self.req.echo

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether the prefill must hand over the logits after each prompt id (echo with logprobs,
        not yet computed)."""
        return self.req.echo and self.req.sampling.logprobs and self.prompt_logprobs is None

    def add_prompt_rows(self, start: int, rows) -> None:
        """rows[j]: the logits after prompt id start + j; each gives the logprob of the id after it."""
        entries = self._rows
        top = self.req.sampling.top_logprobs
        for j, row in enumerate(rows):
            at = start + j + 1
            if at < len(self.prompt_ids):
                lp, best = model_logprobs(row, self.prompt_ids[at], top)
                entries.append(TokenLogprob(self.prompt_ids[at], lp, tuple(best)))
        if len(entries) == len(self.prompt_ids) - 1:
            self.prompt_logprobs = entries

    def copy_prompt_logprobs(self, other: "RequestText") -> None:
        self.prompt_logprobs = other.prompt_logprobs

    def step(self, token: int, logits=None) -> Step:
        if self.constraint is not None:
            self.constraint.consume(token)
        step = self.gen.push(token, logits)
        self.logprobs.extend(step.logprobs)
        return step

    def finish(self, reason: str) -> Step:
        return self.gen.finish(reason)

    @staticmethod
    def shows(step: Step) -> bool:
        """Whether a step has anything to send before the closing chunk."""
        return bool(step.delta) or bool(step.logprobs)

    def _logprobs(self, entries):
        if not self.req.sampling.logprobs or not entries:
            return None
        if self.chat:
            return {"content": [e.to_openai(self.tok) for e in entries]}
        out = completion_logprobs(self.tok, entries, self.offset)
        self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def _prompt_text(self) -> str:
        if isinstance(self.req.prompt, str):
            return self.req.prompt
        return self.tok.decode(self.prompt_ids, skip_special_tokens=False) if self.tok is not None else ""

    def _echo_logprobs(self) -> dict | None:
        """The prompt's part of a completion's logprobs (the first token's values null)."""
        if not self.req.sampling.logprobs:
            return None
        first = token_text(self.tok, self.prompt_ids[0])[0]
        out = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        if self.prompt_logprobs:
            rest = completion_logprobs(self.tok, self.prompt_logprobs, len(first))
            for k in out:
                out[k] += rest[k]
        self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def echo_chunk(self) -> dict:
        """The streamed choice that carries the echoed prompt (before the first token's)."""
        return {"index": self.index, "text": self._prompt_text(), "logprobs": self._echo_logprobs(),
                "finish_reason": None}

    def chunk(self, step: Step | None, finish: str | None) -> dict:
        lp = self._logprobs(step.logprobs) if step is not None else None
        if self.chat:
            return {"index": self.index, "delta": step.chat_delta() if step is not None else {}, "logprobs": lp,
                    "finish_reason": finish}
        return {"index": self.index, "text": step.text if step is not None else "", "logprobs": lp,
                "finish_reason": finish}

    def message(self, finish: str) -> dict:
        if self.chat:
            return {"index": self.index, "message": self.gen.message(), "logprobs": self._logprobs(self.logprobs),
                    "finish_reason": finish}
        if not self.req.echo:
            return {"index": self.index, "text": self.gen.text, "logprobs": self._logprobs(self.logprobs),
                    "finish_reason": finish}
        lp = self._echo_logprobs()
        more = self._logprobs(self.logprobs)
        if lp is not None and more is not None:
            for k in lp:
                lp[k] += more[k]
        return {"index": self.index, "text": self._prompt_text() + self.gen.text, "logprobs": lp,
                "finish_reason": finish}
