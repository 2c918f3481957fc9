"""The default cache budget (pysmoe.memory): bounded by the vault's experts, by available memory
less KV and planes, and never below one token's experts."""
from __future__ import annotations

import numpy as np
import pytest

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


# ------------------------------------------------------------------ the memory cgroup's room

def _write_tree(root, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _room(tmp_path, meminfo="meminfo"):
    from pysmoe.memory import memory_headroom
    return memory_headroom(str(tmp_path / meminfo), str(tmp_path / "self"), str(tmp_path / "cg"))


def test_cgroup_v2_room_is_the_tightest_level(tmp_path):
    cg = tmp_path / "cg"
    _write_tree(tmp_path, {
        "meminfo": "MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n",
        "self": "0::/user.slice/app.service\n",
        "cg/memory.stat": "inactive_file 999\n",                       # the root: no limit files
        "cg/user.slice/memory.max": "max\n",
        "cg/user.slice/memory.current": "5000000000\n",
        "cg/user.slice/app.service/memory.max": "1000000000\n",
        "cg/user.slice/app.service/memory.high": "max\n",
        "cg/user.slice/app.service/memory.current": "300000000\n",
        "cg/user.slice/app.service/memory.stat": "anon 250000000\nfile 50000000\ninactive_file 40000000\n",
    })
    leaf = cg / "user.slice/app.service"
    assert _room(tmp_path) == (1000000000 - 300000000 + 40000000, f"cgroup v2 limit of {leaf}")
    (leaf / "memory.high").write_text("600000000\n")                      # a lower high limit binds
    assert _room(tmp_path)[0] == 600000000 - 300000000 + 40000000
    (cg / "user.slice/memory.max").write_text("5100000000\n")              # the parent is tighter still
    assert _room(tmp_path) == (100000000, f"cgroup v2 limit of {cg / 'user.slice'}")
    (cg / "user.slice/memory.max").write_text("4000000000\n")              # over its limit: no room, not < 0
    assert _room(tmp_path)[0] == 0
    for f in ("user.slice/memory.max", "user.slice/app.service/memory.max", "user.slice/app.service/memory.high"):
        (cg / f).write_text("max\n")
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")               # no limit anywhere
    (cg / "user.slice/app.service/memory.max").write_text(f"{8 << 40}\n")   # a limit above MemAvailable
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")


def test_cgroup_v1_room_and_a_container_mount(tmp_path):
    cg = tmp_path / "cg"
    _write_tree(tmp_path, {
        "meminfo": "MemAvailable: 4000000 kB\n",
        "self": "12:pids:/docker/abc\n4:blkio,memory:/docker/abc\n0::/\n",
        # in a container the group's own path is not under the mount: its root is the group
        "cg/memory/memory.limit_in_bytes": "536870912\n",
        "cg/memory/memory.usage_in_bytes": "134217728\n",
        "cg/memory/memory.stat": "cache 0\ninactive_file 1\ntotal_inactive_file 4096\n",
    })
    assert _room(tmp_path) == (536870912 - 134217728 + 4096, f"cgroup v1 limit of {cg / 'memory'}")
    (cg / "memory/memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")   # v1's "no limit"
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")
    (cg / "memory/memory.limit_in_bytes").write_text("lots\n")                  # unreadable: no limit taken
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")
    (cg / "memory/memory.limit_in_bytes").write_text("536870912\n")
    (cg / "memory/memory.usage_in_bytes").unlink()                               # no usage: no answer from it
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")
    (tmp_path / "self").write_text("not a cgroup line\n")
    assert _room(tmp_path) == (4000000 * 1024, "MemAvailable")
    # no /proc/meminfo: half the RAM (a system where sysconf says it), else unknown
    avail, source = _room(tmp_path, meminfo="missing")
    assert (avail is None and source == "memory unknown") or (avail > 0 and source == "half the RAM")


def _child_cgroup(limit: int):
    """A memory-limited child of this process's cgroup (bench/peer.py's MemCgroup), or skip."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        from peer import MemCgroup
        return MemCgroup(limit, name=f"smoe-test-memory-{os.getpid()}")
    except (OSError, PermissionError, IndexError) as e:
        pytest.skip(f"no memory cgroup to make here: {e}")


def test_the_default_cache_fits_a_real_cgroup(tiny_vault):
    # In a group limited to 160 MiB (1 GiB under ASan), available_memory() (and so the default
    # cache) is bounded by the group's room, not the machine's; `pysmoe run` says so and runs.
    import json
    import os
    import subprocess
    import sys
    # (a sanitizer's runtime, preloaded by `make asan`, holds far more: its quarantine alone 256 MiB)
    limit = (1 << 30) if "libasan" in os.environ.get("LD_PRELOAD", "") else 160 << 20
    cg = _child_cgroup(limit)
    try:
        def join():
            with open(cg.procs_file, "w") as f:
                f.write("0")
        code = ("from pysmoe.memory import memory_headroom; a, s = memory_headroom(); "
                "print(a); print(s)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=join,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        avail, source = out.stdout.split("\n")[:2]
        assert 0 < int(avail) <= limit and source.startswith("cgroup") and "smoe-test-memory" in source
        run = subprocess.run([sys.executable, "-m", "pysmoe", "run", "--vault", str(tiny_vault), "--ids", "1,2,3",
                              "--max-tokens", "3", "--json"], capture_output=True, text=True, preexec_fn=join,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        assert "cache budget" in run.stderr and "cgroup" in run.stderr
        assert json.loads(run.stdout)["resident_bytes"] <= FRACTION * limit
    finally:
        cg.remove()


def test_memory_promised_to_an_arriving_lm_head_is_not_available(make_vault, monkeypatch):
    """Bytes promised and not yet touched (a deferred lm_head's, while its read is in flight: the
    cgroup and MemAvailable do not count them yet) are held back from smoe_memory_available, so a
    cache sized right after an open leaves them; once the read lands they are released."""
    from pysmoe._ffi import lib
    from pysmoe.memory import memory_headroom
    assert lib.smoe_memory_promised(0) == 0
    big = 1 << 50
    assert lib.smoe_memory_promised(big) == big
    try:
        assert memory_headroom()[0] == 0  # everything is spoken for
    finally:
        assert lib.smoe_memory_promised(-big) == 0
    free = memory_headroom()[0]
    assert free is None or free > 0
    path = make_vault("paged_q8", preset="tiny", seed=3, formats={"embed": "q8"})
    monkeypatch.setenv("SMOE_DENSE_DEFER_MIN", "1")  # the tiny lm_head read beside the first pass
    with pysmoe.open_vault(path) as v, v.session(context=64) as s:
        s.prefill([1, 2, 3])  # waits for lm_head: its promise is settled by then
        assert lib.smoe_memory_promised(0) == 0
    for _ in range(3):  # closed with the read perhaps in flight: the close joins it
        pysmoe.open_vault(path).close()
        assert lib.smoe_memory_promised(0) == 0
