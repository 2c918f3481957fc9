"""The default cache budget (pysmoe.memory): bounded by the vault's experts, by available memory
less KV and planes, and never below one token's experts."""
from __future__ import annotations

import numpy as np

import pysmoe
from pysmoe.memory import FRACTION, available_memory, choose_cache, default_cache_bytes, kv_bytes, plane_bytes


def test_budget_between_one_token_and_all_experts(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v:
        cfg, blob = v.config, v.blob_bytes
        one = cfg["num_experts_per_tok"] * v.num_sparse_layers * blob
        reserved = kv_bytes(cfg, 1024) + plane_bytes(cfg, 1024)
        assert choose_cache(v, 1024, available=1 << 40).bytes == v.expert_bytes  # plenty: every expert
        assert choose_cache(v, 1024, available=0).bytes == one                   # none: one token's experts
        avail = reserved + int((one + v.expert_bytes) / 2 / FRACTION) + blob // 2  # half-way, plus half a blob
        c = choose_cache(v, 1024, available=avail)
        assert one < c.bytes < v.expert_bytes and c.bytes % blob == 0
        assert c.bytes <= FRACTION * (avail - reserved)
        assert choose_cache(v, 1024, available=avail + 4 * blob).bytes > c.bytes  # grows with free memory
        assert choose_cache(v, 4096, available=avail).bytes < c.bytes             # longer KV, less cache
        assert 0 < default_cache_bytes(v, 1024) <= v.expert_bytes
        assert "cache budget" in c.describe()


def test_available_memory_is_measured():
    a = available_memory()
    assert a is None or a > 0


def test_the_default_chunk_follows_the_cache(tiny_vault):
    # every expert in the cache: 256 (the fastest resident chunk); a smaller cache: 1,024 (at most
    # the context) when its extra planes cost at most a quarter of the budget, else 256
    import types
    from pysmoe.memory import BUDGET_CHUNK, RESIDENT_CHUNK, default_chunk
    with pysmoe.open_vault(tiny_vault) as v:
        cfg, all_experts = v.config, v.expert_bytes
        extra = plane_bytes(cfg, 4096, BUDGET_CHUNK) - plane_bytes(cfg, 4096, RESIDENT_CHUNK)
        big = types.SimpleNamespace(config=cfg, expert_bytes=1 << 40)   # the same shape, a huge model
        assert default_chunk(v, all_experts, 4096) == RESIDENT_CHUNK == 256
        assert default_chunk(big, 4 * extra, 4096) == BUDGET_CHUNK == 1024
        assert default_chunk(big, 4 * extra - 1, 4096) == 256     # the planes would eat the budget
        assert default_chunk(big, 1 << 39, 600) == 600              # at most the context
        assert default_chunk(big, 1 << 39, 200) == 256              # the library's default below that
        assert default_chunk(v, 0, 4096) == 256                     # tiny: its planes outweigh its experts
        with v.session(cache_bytes=all_experts) as s:
            assert s.chunk == 256
            vocab = cfg["vocab_size"]
            ids = [3 + i % (vocab - 3) for i in range(600)]
            a = s.prefill(ids)
        with v.session(cache_bytes=0, chunk=1024, context=2048) as s:   # an explicit chunk is kept
            assert s.chunk == 1024
            assert np.array_equal(s.prefill(ids), a)   # the same bits for any chunk
