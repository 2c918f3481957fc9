"""SamplingParams (checked, OpenAI names and ranges) and the numpy Sampler that applies them.

The pipeline, per token, on the float32 logits the engine returns:
  1. NaN counts as −inf;
  2. repetition penalty (Hugging Face's, as csrc/sample.c applies it): over the last
     `repetition_window` ids of the history (prompt and generated), each distinct id once, a
     logit > 0 is divided by the penalty, any other multiplied by it;
  3. presence and frequency penalty (OpenAI's definition, over the *generated* ids only):
     logit[j] −= frequency_penalty · count[j] + presence_penalty · (count[j] > 0);
  4. temperature 0 → argmax (lowest id on ties), no random draw;
  5. logits / temperature; top-k (ties: lower id first); softmax in float64; top-p (the
     smallest best-first prefix whose mass is ≥ top_p); min-p (drop p < min_p · p_max);
  6. one uniform draw from numpy's PCG64 seeded with `seed`: the same seed and logits give the
     same ids.

Steps 1, 2 and 4 are exactly csrc/sample.c's, so greedy decoding gives the ids the C sampler
gives (tests/test_textgen.py checks it through Session.generate). The random draw is not the C
sampler's generator: with temperature > 0 the ids differ from Session.generate's for the same seed.

Logprobs are those of the model: log-softmax of the raw logits (step 1 only), in float64,
whatever the sampling settings — what vLLM returns by default and what a client comparing
tokens' likelihoods wants.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from typing import Iterable

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
    reproducible from it); `max_tokens` None: until a stop or the context is full."""

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
            s(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
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


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One chosen id; with logprobs asked for, its logprob and the top alternatives
    ((id, logprob), best first, ties by lower id)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def _clean(logits) -> np.ndarray:
    v = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
    v[np.isnan(v)] = -np.inf
    return v


def _rank(v: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids sorted best first: larger value, then lower id (a strict total order, as sample.c's)."""
    return ids[np.lexsort((ids, -v[ids]))]


def _best(v: np.ndarray, k: int) -> np.ndarray:
    """The k best ids of v (all if k ≥ len), best first, ties by lower id."""
    if k >= v.size:
        return _rank(v, np.arange(v.size))
    part = np.argpartition(-v, k - 1)[:k]
    # argpartition breaks ties at the k-th value arbitrarily: take every id tied with it
    return _rank(v, np.flatnonzero(v >= v[part].min()))[:k]


class Sampler:
    """Applies one request's SamplingParams, token after token. history: the ids before the
    first generated one (the prompt, or the whole conversation the session holds); only its
    last repetition_window ids matter. Call sample(logits) then observe(id) for each token."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = ()):
        self.p = params
        # a negative seed (the server takes int64 ones) counts as its two's complement
        self.rng = np.random.Generator(np.random.PCG64(params.seed % 2 ** 64))
        w = params.repetition_window
        self.history: list[int] = list(history)[-w:] if w else []
        self.counts: dict[int, int] = {}    # generated id → how many times

    def observe(self, token: int) -> None:
        """A token was generated (sampled here or forced by the caller)."""
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.p.repetition_window:
            self.history.append(token)
            if len(self.history) > 2 * self.p.repetition_window:  # trimmed now and then, not per token
                del self.history[:-self.p.repetition_window]

    def _penalised(self, v: np.ndarray) -> np.ndarray:
        p, vocab = self.p, v.size
        pen = np.float32(p.repetition_penalty)
        if pen != 1.0 and p.repetition_window and self.history:
            recent = np.unique(np.asarray(self.history[-p.repetition_window:], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < vocab)]
            x = v[recent]
            v[recent] = np.where(x > 0, x / pen, x * pen)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            cnt = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            ok = (ids >= 0) & (ids < vocab)
            ids, cnt = ids[ok], cnt[ok]
            v[ids] = (v[ids] - (p.frequency_penalty * cnt + p.presence_penalty)).astype(np.float32)
        return v

    def choose(self, logits) -> int:
        """The next id from these logits (no logprobs)."""
        v = self._penalised(_clean(logits))
        best = int(np.argmax(v))
        p = self.p
        if p.temperature == 0.0 or v[best] == -np.inf:
            return best
        with np.errstate(over="ignore"):
            v = v / np.float32(p.temperature)
        m = v[best]
        if m == np.inf:  # a temperature so small that it overflowed: as sample.c, the argmax
            return best
        # weights exp(v − m) ≤ 1, in float32 (exact enough to draw from), summed in float64
        w = np.exp(v - m)
        if 0 < p.top_k < v.size:
            cand = _best(v, p.top_k)
            z = float(w[cand].sum(dtype=np.float64))   # top-k first: the softmax is over the k
        elif p.top_p < 1.0 or p.min_p > 0.0:
            z = float(w.sum(dtype=np.float64))
            cand = self._prefix(v, w, z)
        else:  # the whole vocabulary in id order: no ranking needed
            cum = np.cumsum(w, dtype=np.float64)
            return min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), v.size - 1)
        wc = w[cand].astype(np.float64)
        keep = wc.size
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(wc) / z, p.top_p, side="left")) + 1)
        if p.min_p > 0.0:  # p ≥ min_p · p_max ⇔ w ≥ min_p · w_max, and the best has w = 1
            keep = min(keep, max(1, int(np.count_nonzero(wc >= p.min_p * wc[0]))))
        cum = np.cumsum(wc[:keep])
        j = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), keep - 1)
        return int(cand[j])

    def _prefix(self, v: np.ndarray, w: np.ndarray, z: float) -> np.ndarray:
        """The best ids, ranked, enough of them to hold the top-p and min-p cuts: sorting all
        151,936 ids of Qwen3 costs tens of ms, the few hundred that matter almost nothing."""
        p, k = self.p, 256
        while True:
            cand = _best(v, k)
            if cand.size == v.size or (p.top_p < 1.0 and w[cand].sum(dtype=np.float64) >= p.top_p * z) or (
                    p.min_p > 0.0 and w[cand[-1]] < p.min_p):
                return cand
            k *= 8

    def sample(self, logits, logprobs: bool | None = None, top_logprobs: int | None = None) -> Sampled:
        """choose() plus, when the params (or the arguments) ask, the model's logprobs."""
        token = self.choose(logits)
        want = self.p.logprobs if logprobs is None else logprobs
        if not want:
            return Sampled(token)
        n = self.p.top_logprobs if top_logprobs is None else top_logprobs
        return Sampled(token, *token_logprobs(logits, token, n))


def token_logprobs(logits, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's logprob of token and its n likeliest ids with theirs (ties by lower id)."""
    v = _clean(logits)
    m = float(v.max())
    if not math.isfinite(m):  # all −inf (or some +inf): no distribution worth the name
        lse = m
    else:
        lse = m + math.log(float(np.exp(v - np.float32(m)).sum(dtype=np.float64)))

    def lp(i):
        x = float(v[i])
        return 0.0 if x == lse else x - lse

    top = tuple((int(i), lp(i)) for i in _best(v, n)) if n > 0 else ()
    return lp(token), top

