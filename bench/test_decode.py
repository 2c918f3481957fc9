"""Decode speed after a prompt, at the cache budget and with every expert resident.

    .venv/bin/python -m pytest bench/test_decode.py -p no:cacheprovider --benchmark-only

Each round: prefill an 8-token prompt (layer-major; untimed setup), then time 16 greedy decode
steps. extra_info holds tokens/s and the reads of the last round. At the budget the round starts
with an empty cache (clear_cache before the prompt); resident, a warm-up round loads the experts
that the same greedy tokens need.
"""
from __future__ import annotations

import numpy as np
import pytest

PROMPT, TOKENS = 8, 16


def _decode_bench(benchmark, bench, s, rounds, record, cold: bool):
    ids = bench.prompt(PROMPT)
    s.prefill_path = "layer-major"
    state = {}

    def setup():
        if cold:
            s.clear_cache()
        s.reset()
        state["logits"] = s.prefill(ids)
        s.reset_stats()

    def decode():
        logits = state["logits"]
        for _ in range(TOKENS):
            logits = s.decode(int(np.argmax(logits)))

    if not cold:
        setup()
        decode()  # warm-up
    benchmark.group = "decode"
    benchmark.pedantic(decode, setup=setup, rounds=rounds, iterations=1)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None else None
    return record(benchmark, s, tokens=TOKENS, prompt_tokens=PROMPT, tps=TOKENS / median if median else None)


def test_decode_budget(benchmark, bench, rounds, record):
    info = _decode_bench(benchmark, bench, bench.cold, rounds, record, cold=True)
    benchmark.extra_info["cache_bytes"] = bench.cache_bytes
    assert info["tokens"] == TOKENS


def test_decode_resident(benchmark, bench, rounds, record):
    if bench.resident is None:
        pytest.skip("--bench-no-resident")
    _decode_bench(benchmark, bench, bench.resident, rounds, record, cold=False)
    benchmark.extra_info["cache_bytes"] = bench.resident_bytes
