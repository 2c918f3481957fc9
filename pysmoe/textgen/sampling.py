"""SamplingParams: a request's sampling settings and stop conditions, checked, with OpenAI's names,
ranges and error messages.

There is one sampler, the engine's (csrc/engine/sample.c; smoe.h, "sampler"): every front end
(Session.generate, stream_generate, run, chat, the server) sets it on the session with
Session.set_sampler(**params.sampler_kwargs()) and takes the ids it draws (prefill_next,
decode_next, decode_batch(..., sample=True)), so the same seed and settings give the same ids
everywhere. sampler_kwargs() is the one place SamplingParams meets it. Logprobs are the model's
(log-softmax of the raw logits, pysmoe.logprobs), whatever the sampling settings.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import numpy as np

from ..errors import InvalidArgument

MAX_TOP_LOGPROBS = 20   # OpenAI's limit
MAX_STOP_STRINGS = 16   # OpenAI allows 4; a local server can afford more
MAX_STOP_CHARS = 1024


class InvalidParam(InvalidArgument):
    """A sampling parameter out of range or of the wrong type. `param` names it (OpenAI's error
    body has a field of that name)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _real(name: str, value, low: float, high: float, *, low_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidParam(name, f"Invalid type for '{name}': expected a number, but got {value!r}.")
    v = float(value)
    if v < low or (low_open and v == low):
        raise InvalidParam(name, f"{value!r} is {'less than or equal to' if low_open else 'less than'} the minimum "
                                 f"of {low:g} - '{name}'")
    if v > high:
        raise InvalidParam(name, f"{value!r} is greater than the maximum of {high:g} - '{name}'")
    return v


def _int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidParam(name, f"Invalid type for '{name}': expected an integer, but got {value!r}.")
    if value < low:
        raise InvalidParam(name, f"{value!r} is less than the minimum of {low} - '{name}'")
    if high is not None and value > high:
        raise InvalidParam(name, f"{value!r} is greater than the maximum of {high} - '{name}'")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to choose each token and when to stop. Construct with keyword arguments; every field
    is checked (InvalidParam, a ValueError, names the field). `stop` takes a string or a list
    of strings (stored as a tuple); `seed` None draws one at random (stored, so the request is
    reproducible from it); `max_tokens` None: until a stop or the context is full; 0: nothing is
    generated (the server's echo of a prompt, for its logprobs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 (or -1, vLLM's spelling, stored as 0): off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64         # ids of history the repetition penalty looks at (csrc's default)
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        s = object.__setattr__
        s(self, "temperature", _real("temperature", self.temperature, 0.0, math.inf))
        s(self, "top_p", _real("top_p", self.top_p, 0.0, 1.0, low_open=True))
        s(self, "top_k", max(0, _int("top_k", self.top_k, -1, 2 ** 32 - 1)))
        s(self, "min_p", _real("min_p", self.min_p, 0.0, 1.0))
        s(self, "presence_penalty", _real("presence_penalty", self.presence_penalty, -2.0, 2.0))
        s(self, "frequency_penalty", _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        s(self, "repetition_penalty", _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                            low_open=True))
        s(self, "repetition_window", _int("repetition_window", self.repetition_window, 0, 2 ** 32 - 1))
        seed = secrets.randbits(63) if self.seed is None else self.seed
        s(self, "seed", _int("seed", seed, -(2 ** 63), 2 ** 64 - 1))
        if self.max_tokens is not None:
            s(self, "max_tokens", _int("max_tokens", self.max_tokens, 0))  # 0: the prompt only (echo)
        s(self, "stop", _stop_strings(self.stop))
        s(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        if not isinstance(self.logprobs, bool):
            raise InvalidParam("logprobs", f"Invalid type for 'logprobs': expected a boolean, "
                                           f"but got {self.logprobs!r}.")
        s(self, "top_logprobs", _int("top_logprobs", 0 if self.top_logprobs is None else self.top_logprobs, 0,
                                     MAX_TOP_LOGPROBS))
        if self.top_logprobs and not self.logprobs:
            raise InvalidParam("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampler_kwargs(self) -> dict:
        """The keyword arguments of Session.set_sampler for these settings: the engine's sampler
        draws the ids. A negative seed (the server takes int64 ones) counts as its two's
        complement, seed % 2**64: the same seed and settings give the same ids (OpenAI's
        seed). top_k −1 is already 0 (off)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, repetition_window=self.repetition_window,
                    seed=self.seed % 2 ** 64, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    try:
        items = list(items)
    except TypeError:
        raise InvalidParam("stop", f"Invalid type for 'stop': expected a string or an array of strings, "
                                   f"but got {stop!r}.") from None
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidParam("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for x in items:
        if not isinstance(x, str):
            raise InvalidParam("stop", f"Invalid type for 'stop': expected strings, but got {x!r}.")
        if not x or len(x) > MAX_STOP_CHARS:
            raise InvalidParam("stop", f"a 'stop' string must have 1 to {MAX_STOP_CHARS} characters, got {len(x)}")
    return tuple(dict.fromkeys(items))


def _stop_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    try:
        items = list(ids)
    except TypeError:
        raise InvalidParam("stop_token_ids", f"Invalid type for 'stop_token_ids': expected an array of integers, "
                                             f"but got {ids!r}.") from None
    return tuple(dict.fromkeys(_int("stop_token_ids", i, 0, 2 ** 31 - 1) for i in items))
