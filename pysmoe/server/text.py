"""A request's text side, as the scheduler and the routes see it: pysmoe.textgen's Generation
(stop strings, detokenisation, Qwen3's reasoning and tool calls — shared with run and chat) plus
the shapes of OpenAI's choices. It samples nothing: the request's session draws every id with the
engine's sampler, set from sampler_kwargs() (the scheduler does it when the job starts).

    sampler_kwargs() -> dict     Session.set_sampler's arguments for this request
    wants_logits                 whether step() needs the logits (the request wants logprobs)
    step(token, logits) -> Step  take the id the session drew (Step.finish_reason ends the job)
    finish(reason) -> Step       end now (the context is full), flushing held-back text
    chunk(step, finish)          an OpenAI streaming choice (step None: the closing chunk)
    message(finish)              the OpenAI non-streamed choice
"""
from __future__ import annotations

from ..textgen import Generation, Step, completion_logprobs
from .schemas import GenerationRequest


class RequestText:
    def __init__(self, req: GenerationRequest, tokenizer, prompt_ids: list[int], *, context: int,
                 starts_in_reasoning: bool = False, chat_format: str = "qwen3"):
        self.req, self.tok = req, tokenizer
        self.chat = req.kind == "chat"
        self.gen = Generation(tokenizer, req.sampling, prompt_ids, chat=self.chat, tools=bool(req.tools),
                              starts_in_reasoning=starts_in_reasoning, eos_ids=() if req.ignore_eos else None,
                              room=context - len(prompt_ids) + 1, chat_format=chat_format)
        self.logprobs: list = []   # every token's TokenLogprob, for the non-streamed answer
        self.offset = 0            # completions' text_offset

    def sampler_kwargs(self) -> dict:
        return self.req.sampling.sampler_kwargs()

    @property
    def wants_logits(self) -> bool:
        return self.gen.wants_logits

    def step(self, token: int, logits=None) -> Step:
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

    def chunk(self, step: Step | None, finish: str | None) -> dict:
        lp = self._logprobs(step.logprobs) if step is not None else None
        if self.chat:
            return {"index": 0, "delta": step.chat_delta() if step is not None else {}, "logprobs": lp,
                    "finish_reason": finish}
        return {"index": 0, "text": step.text if step is not None else "", "logprobs": lp, "finish_reason": finish}

    def message(self, finish: str) -> dict:
        lp = self._logprobs(self.logprobs)
        if self.chat:
            return {"index": 0, "message": self.gen.message(), "logprobs": lp, "finish_reason": finish}
        return {"index": 0, "text": self.gen.text, "logprobs": lp, "finish_reason": finish}
