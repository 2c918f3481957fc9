"""The default cache budget (pysmoe.memory): bounded by the vault's experts, by available memory
less KV and planes, and never below one token's experts."""
from __future__ import annotations

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
