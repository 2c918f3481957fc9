"""A request's text side, as the scheduler and the routes see it.

    sample(logits) -> id         the next id (the request's sampling parameters)
    push(id) -> finish | None    take a generated id; "stop" at an end-of-sequence id or a stop string
    delta(final) -> payload      what the client has not seen yet (None: nothing new)
    chunk(payload, finish)       an OpenAI streaming choice
    message(finish)              the OpenAI non-streamed choice

The generation logic itself lives in pysmoe.textgen (shared with run and chat); this module only
shapes its output into OpenAI's choices.
"""
from __future__ import annotations

import numpy as np

from .schemas import GenerationRequest


class TextState:
    def __init__(self, req: GenerationRequest, tokenizer):
        self.req = req
        self.tok = tokenizer
        self.eos = frozenset(tokenizer.eos_ids if tokenizer is not None and not req.ignore_eos else ())
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        s = req.sampling
        self.rng = np.random.default_rng(s.seed)

    def sample(self, logits: np.ndarray) -> int:
        s = self.req.sampling
        if s.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / s.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        return int(self.rng.choice(len(p), p=p))

    def push(self, token: int) -> str | None:
        if token in self.eos:
            return "stop"
        self.ids.append(token)
        if self.tok is not None:
            full = self.tok.decode(self.ids)
            if not full.endswith("\ufffd"):
                self.text = full
        return None

    def delta(self, final: bool):
        new = self.text[self.sent:]
        self.sent = len(self.text)
        return {"content": new} if new else None

    def chunk(self, payload, finish: str | None) -> dict:
        if self.req.kind == "chat":
            return {"index": 0, "delta": payload or {}, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": (payload or {}).get("content", ""), "logprobs": None, "finish_reason": finish}

    def message(self, finish: str) -> dict:
        if self.req.kind == "chat":
            return {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                    "finish_reason": finish}
        return {"index": 0, "text": self.text, "logprobs": None, "finish_reason": finish}
