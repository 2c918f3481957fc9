"""`python -m pysmoe bench` runs end to end on the tiny vault (no timing asserts: speed lives in
bench/). Checks the table, the JSON record and the I/O accounting the figures rest on."""
from __future__ import annotations

import json

import pytest

import pysmoe
from pysmoe.bench import DirectReader, format_table, make_prompt, run_bench
from pysmoe.cli import main


def test_bench_cli_table_and_json(tiny_vault, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(tiny_vault), "--prompt-lengths", "1,5,9", "--repeats", "2", "--threads", "1",
               "--chunk", "4", "--decode-tokens", "3", "--decode-prompt", "4", "--json", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("layer-major", "token-serial", "I/O floor", "compute fl.", "LM/TS", "tok/s", "decode", "wait/TTFT",
                 "wait/I/O fl.", "busy/comp."):
        assert word in text
    assert ("O_DIRECT) in force" in text) or ("NOT in force" in text)

    res = json.loads(out.read_text())
    v = res["vault"]
    assert [row["prompt_tokens"] for row in res["ttft"]] == [1, 5, 9]
    for row in res["ttft"]:
        n = row["prompt_tokens"]
        assert set(row["paths"]) == {"layer-major", "token-serial"}
        assert len(row["runs"]["cold:layer-major"]) == 2 and len(row["runs"]["probe"]) == 2
        # The exact union: at most top-k blobs per sparse layer per token, at least top-k per layer.
        assert v["top_k"] * v["sparse_layers"] <= row["exact_union_blobs"] <= n * v["top_k"] * v["sparse_layers"]
        assert row["exact_union_bytes"] == row["exact_union_blobs"] * v["blob_bytes"]
        assert row["io_floor_s"] > 0 and row["compute_floor_s"] > 0 and row["disk_gbps"] > 0
        assert row["compute_floor_misses"] == 0  # the resident session really held everything
        assert row["lm_over_ts"] > 0
        for p, pr in row["paths"].items():
            assert pr["ttft_s"] > 0 and pr["ttft_over_floor"] > 0
            # Every cold run starts with an empty cache, so it reads at least the exact union.
            assert pr["blob_reads"] >= row["exact_union_blobs"]
            assert pr["bytes_read"] == pr["blob_reads"] * v["blob_bytes"]
            assert isinstance(pr["direct_io"], bool)
            # Overlap: io_wait is part of the TTFT; busy is the rest.
            assert 0 <= pr["io_wait_frac"] <= 1
            assert pr["io_wait_over_io_floor"] >= 0 and pr["compute_busy_over_compute_floor"] > 0
            assert 0 < pr["compute_busy_s"] <= pr["ttft_s"]
        if n == 1:  # one token: both paths run the same single step
            assert row["paths"]["layer-major"]["blob_reads"] == row["paths"]["token-serial"]["blob_reads"]
    assert set(res["decode"]) == {"budget", "resident"}
    assert res["decode"]["resident"]["cache_misses"] == 0
    assert res["decode"]["budget"]["tps"] > 0
    assert isinstance(res["direct_io_everywhere"], bool)
    assert format_table(res) == text.rstrip("\n")


def test_bench_one_path_no_resident(tiny_vault):
    res = run_bench(tiny_vault, [3], paths=["layer-major"], repeats=1, threads=1, decode_tokens=0, resident=False)
    (row,) = res["ttft"]
    assert set(row["paths"]) == {"layer-major"} and "lm_over_ts" not in row
    assert row["compute_floor_s"] is None
    # Without a resident session the layer-major cold run's reads stand in for the union.
    assert row["exact_union_blobs"] == row["paths"]["layer-major"]["blob_reads"]
    assert row["io_floor_s"] > 0
    assert res["decode"] == {}
    format_table(res)


def test_bench_serial_max_len(tiny_vault):
    res = run_bench(tiny_vault, [2, 6], repeats=1, threads=1, decode_tokens=0, serial_max_len=2, resident=False)
    assert set(res["ttft"][0]["paths"]) == {"layer-major", "token-serial"}
    assert set(res["ttft"][1]["paths"]) == {"layer-major"}


def test_direct_reader_reads_whole_blobs(tiny_vault):
    with DirectReader(tiny_vault, io_threads=3) as r:
        res = r.read(10)
        assert res["blobs"] == 10 and res["bytes"] == 10 * r.blob_bytes
        assert r.read(10 ** 6)["blobs"] == len(r.offsets)  # at most every blob once
        assert isinstance(res["direct_io"], bool)


def test_prompts_are_prefixes():
    a, b = make_prompt(1000, 5), make_prompt(1000, 9)
    assert (b[:5] == a).all() and a.dtype.name == "int32"


@pytest.mark.parametrize("argv", [["--prompt-lengths", "0"], ["--paths", "sideways"], ["--cache-mb", "1", "--cache-frac", "0.1"]])
def test_bench_cli_bad_arguments(tiny_vault, argv):
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_vault), *argv])
    assert e.value.code == 2


def test_bench_cut_resident_cache(tiny_vault):
    # A resident cache too small for every expert: the union becomes an upper bound and the
    # compute floor is still reported (net of I/O waits), both flagged in the table.
    from pysmoe.engine import open_vault
    with open_vault(tiny_vault) as v:
        small = v.blob_bytes * v.num_sparse_layers * 2
    res = run_bench(tiny_vault, [6], repeats=1, threads=1, decode_tokens=0, resident_bytes=small)
    (row,) = res["ttft"]
    assert "upper bound" in row["union_source"]
    assert row["exact_union_blobs"] <= min(p["blob_reads"] for p in row["paths"].values())
    assert row["compute_floor_s"] is not None
    assert "upper bound" in format_table(res)


# ------------------------------------------------------------- decode against the cache budget

def test_bench_decode_budgets(tiny_vault, tmp_path, capsys):
    out = tmp_path / "budgets.json"
    rc = main(["bench", str(tiny_vault), "--no-ttft", "--decode-budgets", "0,50,100", "--budget-prompt", "6",
               "--decode-tokens", "3", "--repeats", "2", "--threads", "1", "--chunk", "4", "--json", str(out),
               "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "decode against the cache budget" in text and "/largest" in text
    res = json.loads(out.read_text())
    assert res["ttft"] == [] and res["decode"] == {}
    assert format_table(res) == text.rstrip("\n")
    c = res["decode_budgets"]
    assert (c["prompt_tokens"], c["decode_tokens"], c["repeats"]) == (6, 3, 2)
    # Results never depend on the cache budget: every run decoded the same greedy tokens.
    assert c["tokens_identical"] is True
    rows = {b["budget_pct"]: b for b in c["budgets"]}
    assert sorted(rows) == [0, 50, 100]
    for b in rows.values():
        assert b["skipped"] is None and len(b["runs"]) == 2
        assert b["tps"] > 0 and b["tps_spread"][0] <= b["tps"] <= b["tps_spread"][1]
        assert 0 <= b["hit_rate"] <= 1 and b["blob_reads_per_token"] >= 0 and b["tps_over_largest"] > 0
        assert 0 < b["cache_frac"] <= 1 and isinstance(b["direct_io"], bool)
        for run in b["runs"]:
            assert run["cache_hits"] + run["cache_misses"] > 0 and run["blob_reads"] == run["cache_misses"]
    assert rows[100]["cache_frac"] == 1 and rows[100]["tps_over_largest"] == 1
    # Every expert fits: only first uses miss, so no budget reads less or hits more.
    assert rows[100]["blob_reads_per_token"] <= rows[0]["blob_reads_per_token"]
    assert rows[100]["hit_rate"] >= rows[50]["hit_rate"] >= rows[0]["hit_rate"]


def test_bench_decode_budget_skipped_without_memory(tiny_vault, monkeypatch):
    # Pretend that only the margin and a few slots are available: the 100% point is skipped, with why.
    import pysmoe.bench as bench
    from pysmoe.engine import open_vault
    with open_vault(tiny_vault) as v:
        room = (bench.MEM_MARGIN + bench.budget_slots(v, 0) * v.blob_bytes) / bench.MiB
    monkeypatch.setattr(bench, "_available_mib", lambda: room)
    res = run_bench(tiny_vault, [], ttft=False, decode_budgets=[0, 100], budget_prompt=4, decode_tokens=2,
                    repeats=1, threads=1)
    low, full = res["decode_budgets"]["budgets"]
    assert low["tps"] > 0 and low["skipped"] is None
    assert full["tps"] is None and "do not fit" in full["skipped"]
    assert "SKIPPED" in format_table(res)


def test_bench_no_ttft_needs_budgets(tiny_vault, capsys):
    assert main(["bench", str(tiny_vault), "--no-ttft"]) == 2
    assert main(["bench", str(tiny_vault), "--decode-budgets", "10", "--decode-tokens", "0"]) == 2


# ------------------------------------------------------------- bench/plot.py and bench/peer.py

def _load(name):
    from bench_scripts import load
    return load(name)


@pytest.fixture(scope="module")
def sparse_vault(make_vault):
    # llama.cpp's qwen3moe has no dense-MLP layers: tiny without its one.
    return make_vault("tiny_sparse", preset="tiny", seed=0, overrides={"mlp_only_layers": []})


@pytest.fixture(scope="module")
def bench_record(sparse_vault, tmp_path_factory):
    res = run_bench(sparse_vault, [1, 4], repeats=1, threads=1, chunk=4, decode_tokens=2, decode_prompt=2,
                    decode_budgets=[0, 100], budget_prompt=4)
    path = tmp_path_factory.mktemp("plot") / "tiny.json"
    path.write_text(json.dumps(res))
    return path


def test_plot_budget_curve_and_ttft(bench_record, tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("plot")
    assert plot.main([str(bench_record), "--out", str(tmp_path)]) == 0
    for name in ("tiny-ttft.png", "tiny-decode-budget.png", "decode-tps.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.fixture(scope="module")
def sparse_gguf(sparse_vault, tmp_path_factory):
    """The sparse vault exported for llama.cpp (scripts/export_gguf.py); the peer tests skip
    without llama-cpp-python and gguf."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import pathlib
    import subprocess
    import sys
    gguf = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "export_gguf.py"
    subprocess.run([sys.executable, str(script), str(sparse_vault), str(gguf)], check=True, capture_output=True)
    return gguf


def test_peer_warm_blocks_and_plot(sparse_vault, sparse_gguf, bench_record, tmp_path, capsys):
    import importlib.util
    gguf = sparse_gguf
    peer = _load("peer")
    out = tmp_path / "peer.json"
    # No page-cache drop from the test suite: it is machine-wide.
    assert peer.main([str(sparse_vault), "--gguf", str(gguf), "--modes", "warm", "--blocks", "--no-drop-caches",
                      "--prompt-lengths", "1,4", "--repeats", "2", "--decode-tokens", "2", "--threads", "1",
                      "--json", str(out)]) == 0
    assert "NOT alternated" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["warm_blocks"] is True and res["vault_info"]["layers"] >= 1 and res["partial"] is False
    warm = res["warm"]
    # one block per engine: pysmoe, then llama.cpp under each default wait policy
    assert warm["alternated"] is False and set(warm["blocks"]) == {"pysmoe", "llama.cpp default", "llama.cpp passive"}
    assert res["omp_policies"] == ["default", "passive"] and res["readahead_kb"] == [128, 8192]
    for b in warm["blocks"].values():
        assert b["skipped"] is None and b["dropped_caches"] is False and b["seconds"] > 0
    for n in ("1", "4"):
        for who in ("pysmoe", "llama.cpp"):
            assert len(warm[n][who]["ttft_all_s"]) == 2 and warm[n][who]["ttft_s"] > 0
        assert set(warm[n]["llama.cpp_variants"]) == {"default t1", "passive t1"}
        assert warm[n]["llama.cpp"]["ttft_by"] in warm[n]["llama.cpp_variants"]
        assert warm[n]["pysmoe"]["cache_misses_timed"] == 0
        assert warm[n]["ttft_ratio_llama_over_pysmoe"] > 0
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plot = _load("plot")
    rec = json.loads(bench_record.read_text())
    warnings = []
    peers = plot.pair_peers([rec], [res], warnings.append)
    assert peers == {0: [res]} and warnings == []   # the same vault shape
    # The cold mode needs root and a memory cgroup (and tiny's budget is smaller than a Python
    # process): its series is drawn from a record of the same shape as the warm one.
    cold = {"info": {"cache_bytes": rec["settings"]["cache_bytes"], "budget_bytes": 1 << 20},
            **{n: warm[n] for n in ("1", "4")}}
    fig, ax = plt.subplots()
    plot.plot_ttft(ax, rec, [dict(res, cold=cold)], warnings.append)
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert any(l.startswith("pysmoe layer-major") for l in labels) and any("token-serial" in l for l in labels)
    assert any("I/O floor" in l for l in labels) and any("llama.cpp, everything in memory (in blocks" in l
                                                          for l in labels)
    assert any(l.startswith("llama.cpp, cold, memory cgroup 1 MiB") for l in labels) and warnings == []
    assert plot.main([str(bench_record), "--peer", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "tiny-ttft.png").exists()


def test_peer_warm_alternated_with_pysmoe_avx2(sparse_vault, sparse_gguf, tmp_path, capsys):
    gguf = sparse_gguf
    peer = _load("peer")
    out = tmp_path / "peer.json"
    assert peer.main([str(sparse_vault), "--gguf", str(gguf), "--modes", "warm", "--pysmoe-avx2",
                      "--omp-policies", "passive", "--prompt-lengths", "3", "--repeats", "2", "--decode-tokens", "2",
                      "--threads", "1", "--json", str(out)]) == 0
    assert "against its AVX2 ones" in capsys.readouterr().out
    warm = json.loads(out.read_text())["warm"]
    r = warm["3"]
    assert warm["alternated"] is True and set(r["llama.cpp_variants"]) == {"passive t1"}
    assert r["pysmoe_avx2"]["kernels"].startswith("avx2") and "avx512" not in r["pysmoe_avx2"]["kernels"]
    # the kernels give the same bits, so the same greedy tokens
    assert r["pysmoe_avx2"]["first_tokens"] == r["pysmoe"]["first_tokens"] and len(r["pysmoe"]["first_tokens"]) == 3
    assert r["ttft_ratio_avx2_over_default"] > 0 and len(r["pysmoe_avx2"]["ttft_all_s"]) == 2


def test_peer_compares_the_best_llama_variant_of_each_figure():
    # llama.cpp's figure is its fastest variant's for that figure (not one variant for all of them)
    peer = _load("peer")
    runs = {"pysmoe": [{"ttft_s": 1.0, "decode_s": 1.0, "load_s": 1.0}] * 3,
            "default t2": [{"ttft_s": t, "decode_s": 4.0, "load_s": 3.0} for t in (0.5, 0.6, 9.0)],
            "passive t2": [{"ttft_s": 0.8, "decode_s": d, "load_s": 0.5} for d in (2.0, 2.0, 1.0)],
            "passive t1": [{"error": "killed", "ttft_s": None, "decode_s": None}]}
    r = peer._summary(runs, 10, 4)
    l = r["llama.cpp"]
    assert (l["ttft_s"], l["ttft_by"]) == (0.6, "default t2") and r["ttft_ratio_llama_over_pysmoe"] == 0.6
    assert (l["decode_tps"], l["decode_by"]) == (2.0, "passive t2") and r["decode_ratio_pysmoe_over_llama"] == 2.0
    assert (l["load_plus_ttft_s"], l["load_plus_ttft_by"]) == (1.3, "passive t2")
    assert r["load_ttft_ratio_llama_over_pysmoe"] == 1.3 / 2.0 and l["errors"] == ["killed"]


def test_peer_keeps_pysmoe_avx2_apart_from_llama_variants():
    # --pysmoe-avx2: pysmoe on its AVX2 kernels is a second pysmoe figure, never "the best llama.cpp"
    peer = _load("peer")
    runs = {"pysmoe": [{"ttft_s": 1.0, "decode_s": 1.0, "load_s": 1.0}] * 3,
            "pysmoe avx2": [{"ttft_s": 0.25, "decode_s": 0.5, "load_s": 1.0}] * 3,
            "default t2": [{"ttft_s": 0.5, "decode_s": 2.0, "load_s": 3.0}] * 3}
    r = peer._summary(runs, 10, 4)
    assert set(r["llama.cpp_variants"]) == {"default t2"} and r["llama.cpp"]["ttft_by"] == "default t2"
    assert r["pysmoe_avx2"]["ttft_s"] == 0.25 and r["ttft_ratio_avx2_over_default"] == 0.25
    assert r["decode_ratio_default_over_avx2"] == 0.5 and r["avx2_ttft_ratio_llama_over_pysmoe"] == 2.0
    assert r["avx2_decode_ratio_pysmoe_over_llama"] == 4.0 and r["decode_ratio_pysmoe_over_llama"] == 2.0
    table = peer.table({"warm": {"alternated": True, "pysmoe_kernels": "avx2+avx512vnni", 10: r}})
    assert "against its AVX2 ones" in table and "| 10 | 1.000 / 0.250 | 0.25× | 4.00 / 8.00 | 0.50× |" in table


def test_peer_limit_search_confirms_the_limit_it_finds():
    # a run once survived a cgroup limit that later runs did not: the search reports a limit only
    # after `confirm` more runs there survive, raising it by its resolution while one is killed
    peer = _load("peer")
    MiB, budget, calls = 1 << 20, 1000 << 20, []

    def run_at(limit):
        calls.append(limit)
        lucky = limit == budget + 16 * MiB and calls.count(limit) == 1
        return {"error": None if lucky or limit >= budget + 20 * MiB else "killed", "cgroup_peak_bytes": limit}

    fit = peer.find_pysmoe_limit(budget, run_at, lambda msg: None)
    assert fit["limit_bytes"] == budget + 24 * MiB and fit["extra_bytes"] == 24 * MiB
    assert [(t["limit_bytes"] - budget) // MiB for t in fit["trials"][1:]] == [0, 16, 8, 16, 24, 24]
    assert [t["survived"] for t in fit["trials"][-2:]] == [True, True]


def test_bench_prompt_ids(tiny_vault, tmp_path, capsys):
    import numpy as np
    from pysmoe.bench import run_bench
    ids = np.arange(3, 40, dtype=np.int32)
    rec = run_bench(tiny_vault, [4, 9], paths=["layer-major"], repeats=1, threads=1, decode_tokens=0,
                    resident=False, probe_bytes=1 << 20, prompt_ids=ids)
    assert rec["prompt"] == "given ids"
    # the runs use those ids: the random prompt given as ids reads what the default run reads
    kw = dict(paths=["layer-major"], repeats=1, threads=1, decode_tokens=0, resident=False, probe_bytes=1 << 20)
    default = run_bench(tiny_vault, [9], **kw)
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v:
        vocab = v.config["vocab_size"]
    given = run_bench(tiny_vault, [9], prompt_ids=make_prompt(vocab, 9), **kw)
    reads = lambda r: r["ttft"][0]["paths"]["layer-major"]["blob_reads"]  # noqa: E731
    assert reads(given) == reads(default)
    assert rec["ttft"][1]["paths"]["layer-major"]["blob_reads"] != reads(default)
    f = tmp_path / "ids.txt"
    f.write_text("1, 2 3")
    assert main(["bench", str(tiny_vault), "--prompt-ids", str(f), "--prompt-lengths", "8"]) == 2
    assert "holds 3 ids" in capsys.readouterr().err
    f.write_text("1 2 99999999")
    assert main(["bench", str(tiny_vault), "--prompt-ids", str(f), "--prompt-lengths", "2"]) == 2


def test_bench_verify_blobs_both(tiny_vault, capsys):
    """--verify-blobs both: checked and unchecked cold runs of the same repeats, and their ratio."""
    res = run_bench(tiny_vault, [6], paths=["layer-major"], repeats=2, threads=1, decode_tokens=0, resident=False,
                    verify_blobs="both")
    row = res["ttft"][0]
    assert len(row["runs"]["cold:layer-major"]) == len(row["runs"]["cold-unchecked:layer-major"]) == 2
    assert row["runs"]["cold:layer-major"][0]["blob_reads"] == row["runs"]["cold-unchecked:layer-major"][0]["blob_reads"]
    c = row["checksum_cost"]["layer-major"]
    assert len(c["ratios"]) == 2 and c["ratio"] > 0 and res["settings"]["verify_blobs"] == "both"
    from pysmoe.bench import format_table
    assert "checked / unchecked" in format_table(res)


# ------------------------------------------------------------- bench/disk_floor.py: the floor sweep

def _slow_disk(monkeypatch):
    """A probe and sweep that report a disk far slower than the engine's runs: the floor must then
    come from the engine's own runs, never sit above them."""
    real_read, real_requests = DirectReader.read, DirectReader.read_requests

    def slow(rec):
        return dict(rec, seconds=rec["seconds"] + 1e6, gbps=rec["bytes"] / (rec["seconds"] + 1e6) / 1e9)

    monkeypatch.setattr(DirectReader, "read", lambda self, *a, **k: slow(real_read(self, *a, **k)))
    monkeypatch.setattr(DirectReader, "read_requests", lambda self, *a, **k: slow(real_requests(self, *a, **k)))


@pytest.mark.parametrize("slow_disk", [False, True])
def test_io_floor_is_a_floor(tiny_vault, monkeypatch, slow_disk):
    run_bench = _load("disk_floor").run_bench  # pysmoe.bench's, with the floor sweep
    if slow_disk:
        _slow_disk(monkeypatch)
    res = run_bench(tiny_vault, [1, 6], repeats=2, threads=1, chunk=4, decode_tokens=0, io_threads=2)
    s = res["settings"]
    for row in res["ttft"]:
        # The sweep holds the engine's own pattern: runs of adjacent blobs up to its coalesce size,
        # io_threads reads in flight, over this prompt's union.
        engine = [p for p in row["floor_sweep"] if p["kind"] == "runs" and p["depth"] == s["io_threads"]
                  and p["request_bytes"] == max(s["coalesce_bytes"], res["vault"]["blob_bytes"])]
        assert engine and engine[0]["first"]["bytes"] > 0 and engine[0]["repeat"]["bytes"] > 0
        assert {p["kind"] for p in row["floor_sweep"]} == {"blobs", "runs", "span"}
        assert {p["depth"] for p in row["floor_sweep"]} >= {1, 32}
        assert row["best_first_touch"] and row["best_repeat"]
        # By construction no cold run comes in under the floor.
        for p, pr in row["paths"].items():
            for x in row["runs"][f"cold:{p}"]:
                assert row["io_floor_s"] <= x["ttft_s"]
            assert pr["ttft_over_floor"] >= 1
        if slow_disk:
            assert row["io_floor_set_by"].startswith("the engine's own cold")


def test_floor_requests_patterns():
    _floor_requests = _load("disk_floor")._floor_requests
    B = 1 << 14
    layer = [10 * B, 11 * B, 12 * B, 14 * B, 15 * B]
    reqs, used = _floor_requests("runs", 2 * B, [layer], B, 1 << 40)
    assert reqs == [(10 * B, 2 * B), (12 * B, B), (14 * B, 2 * B)] and used == 1
    reqs, _ = _floor_requests("blobs", B, [layer], B, 1 << 40)
    assert reqs == [(o, B) for o in layer]
    reqs, _ = _floor_requests("span", 4 * B, [layer], B, 1 << 40)
    assert reqs == [(10 * B, 4 * B), (14 * B, 2 * B)]  # first to last union blob, nothing past it
    reqs, used = _floor_requests("blobs", B, [layer, layer], B, 3 * B)
    assert len(reqs) == 3 and used == 1  # stops at the budget


def test_peer_on_one_gguf_file_for_both_engines(tmp_path):
    """bench/peer.py --gguf FILE without a vault: pysmoe runs its import of that very file
    (made once under --tmp), llama.cpp the file; a llama.cpp-made Q8_0 model agrees."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import pathlib
    gguf = pathlib.Path(__file__).parent / "data" / "gguf" / "tiny-q8_0.gguf"
    peer = _load("peer")
    out = tmp_path / "peer.json"
    assert peer.main(["--gguf", str(gguf), "--modes", "check", "--prompt-lengths", "12", "--threads", "1",
                      "--tmp", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert pathlib.Path(res["vault"]).parent == tmp_path and (pathlib.Path(res["vault"]) / "vault.bin").exists()
    assert res["check"]["positions"] == 12 and res["check"]["corr_median"] > 0.999


def test_peer_cold_worker_chooses_its_own_cache(sparse_vault):
    """--pysmoe-limit own-cache: the cold worker (no cgroup here) given a cache of -1 opens its
    session with pysmoe.memory's default for the memory it sees, as `pysmoe run` does, and says
    which; a cache it is given is used as given."""
    import numpy as np
    peer = _load("peer")
    v = pysmoe.open_vault(sparse_vault)
    blob, every = v.blob_bytes, v.expert_bytes
    v.close()
    got = {}
    for given in (-1, 3 * blob):
        w = peer.PysmoeWorker(sparse_vault, given, 1, 64)
        try:
            rec = w.call(op="run", ids=np.arange(1, 9).tolist(), decode=2)
        finally:
            w.close()
        assert rec["ttft_s"] > 0 and len(rec["tokens"]) == 3
        got[given] = rec["cache_bytes"]
    assert got[3 * blob] == 3 * blob
    # the tiny vault fits any machine's default: every expert (whole blobs)
    assert got[-1] == every and got[-1] % blob == 0
