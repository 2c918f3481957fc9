"""The measurements of `python -m pysmoe bench VAULT` (pysmoe/cli/bench.py): time to first token
and decode speed, against the machine's limits.

    python -m pysmoe bench /work/vault --prompt-lengths 1,8,45,64,256 --cache-frac 0.1 --threads 2

What it measures, all in one run (bench/README.md says more):

- TTFT, cold: the wall time of ``Session.prefill(ids)`` after ``reset(); clear_cache();
  reset_stats()``, reads with Direct I/O (the run checks ``stats()["direct_io"]`` and says so
  loudly when O_DIRECT was not in force), for each prefill path; bytes and blob reads per run.
- The I/O floor: the bytes of the prompt's exact union (every (layer, expert) its exact routing
  needs, read once: the blob reads of a prefill into an empty cache that can hold every expert)
  divided by the best Direct I/O rate this disk gave in the same run: the maximum of a
  random-blob probe at ``io_threads`` readers and the engine's own cold runs (bytes read / TTFT).
  The last makes TTFT / floor ≥ 1 by construction; the table says which set the floor.
  bench/disk_floor.py runs the same benchmark with a sweep of read patterns over the union added
  to those rates (run_bench's `sweep`), for the tightest floor this disk allows.
- The compute floor: the same prefill on a session whose cache holds every expert, warmed by one
  run, then timed (the timed runs must show no miss; the table says when they do).
- TTFT / max(I/O floor, compute floor), the number we steer by, and layer-major / token-serial.
- Overlap, per cold run: io_wait_s / TTFT, io_wait_s / I/O floor (target ≤ 1: compute waited no
  longer than the disk needs for the union) and TTFT − io_wait_s against the compute floor.
- Decode tokens/s after a prompt, at the cache budget and with every expert resident.
- With --decode-budgets: decode tokens/s against the cache budget, a fresh session per run and
  budget (after the TTFT sessions are closed, so that 100% has their memory).

Every figure is a median over ``--repeats`` runs. Inside one repeat the contenders (each path
cold, the pread probe, each path resident) run back to back in an order that rotates from one
repeat to the next, and each ratio is taken between runs of the same repeat before its median, so
that a shared, noisy machine moves both sides of a comparison alike.

The cold sessions of both paths are one session whose ``prefill_path`` is switched between runs
(same cache budget, same planes; every run starts cold anyway); this keeps the memory of a large
vault's benchmark to one cold cache plus one resident cache.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

DEFAULT_LENGTHS = (1, 8, 45, 64, 256, 1024)
PATHS = ("layer-major", "token-serial")
MiB = 1 << 20


# ------------------------------------------------------------------------------- the machine

def machine_info() -> dict:
    info = {"cpus": os.cpu_count(), "platform": sys.platform}
    try:
        import platform
        info["machine"] = platform.machine()
        info["python"] = platform.python_version()
    except Exception:  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git"] = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                                     text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    from ._ffi import ffi, lib
    try:
        info["libsmoe"] = ffi.string(lib.smoe_version()).decode()
        info["kernels"] = ffi.string(lib.smoe_kernels()).decode()
    except Exception:  # pragma: no cover
        pass
    info["smoe_lib"] = os.environ.get("SMOE_LIB")
    info["mem_total_mb"] = _meminfo("MemTotal")
    info["mem_available_mb"] = _meminfo("MemAvailable")
    return info


def _meminfo(key: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _available_mib() -> float | None:
    """Memory available now, MiB: MemAvailable or the memory cgroup's room, the less
    (pysmoe.memory.available_memory)."""
    from .memory import available_memory
    avail = available_memory()
    return None if avail is None else avail / MiB


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


# ----------------------------------------------------------------------- the Direct I/O probe

class DirectReader:
    """A plain parallel pread loop over a vault's blobs: `io_threads` readers, each reading whole
    blobs with one preadv into its own page-aligned buffer (an anonymous mmap), the file opened
    with O_DIRECT (F_NOCACHE on macOS). No cache, no engine: the disk's bandwidth at this read
    size and queue depth."""

    def __init__(self, vault_dir, io_threads: int = 4):
        import pathlib

        import numpy as np

        from .vaultio import VaultFile
        vf = VaultFile(vault_dir)
        try:
            E = vf.binary_config["num_experts"]
            self.blob_bytes = int(vf.header.blob_bytes)  # the largest layer's
            self.offsets = np.array([int(o) for i, o in enumerate(vf.blob_offsets) if vf.sparse[i // E]],
                                    dtype=np.int64)
            self.sizes = np.array([vf.layer_blob_bytes[i // E] for i in range(len(vf.blob_offsets))
                                   if vf.sparse[i // E]], dtype=np.int64)  # each blob's own length
            self.path = pathlib.Path(vf.path)
        finally:
            vf.close()
        self.io_threads = int(io_threads)
        self.direct_io = False
        flags = os.O_RDONLY
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct_io = True
            except OSError:
                self.fd = os.open(self.path, flags)
        else:
            self.fd = os.open(self.path, flags)
            try:
                import fcntl
                if hasattr(fcntl, "F_NOCACHE"):
                    fcntl.fcntl(self.fd, fcntl.F_NOCACHE, 1)
                    self.direct_io = True
            except OSError:
                pass
        self._calls = 0

    def _direct_failed(self):
        """O_DIRECT opened but reads refuse it (some file systems): fall back, say so."""
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct_io = False

    def read(self, n_blobs: int, seed: int = 0) -> dict:
        """Read n_blobs distinct random blobs, io_threads in flight; returns seconds, bytes, GB/s."""
        import numpy as np
        n_blobs = max(1, min(int(n_blobs), len(self.offsets)))
        rng = np.random.default_rng([seed, self._calls])
        self._calls += 1
        pick = rng.choice(len(self.offsets), n_blobs, replace=False)
        r = self.read_requests([(int(self.offsets[i]), int(self.sizes[i])) for i in pick], self.io_threads)
        del r["requests"]
        return {**r, "blobs": n_blobs}

    def read_requests(self, reqs, depth: int) -> dict:
        """Reads reqs, a list of (offset, size) with both multiples of 16 KiB, in order, with `depth`
        threads each reading into its own page-aligned buffer; returns seconds, bytes, GB/s."""
        import concurrent.futures as cf
        import itertools
        import mmap
        size = max(n for _, n in reqs)
        bufs = [mmap.mmap(-1, size) for _ in range(depth)]
        counter = itertools.count()

        def worker(k: int) -> int:
            done = 0
            with memoryview(bufs[k]) as mv:
                while True:
                    i = next(counter)
                    if i >= len(reqs):
                        return done
                    off, n = reqs[i]
                    with mv[:n] as part:
                        got = os.preadv(self.fd, [part], off)
                    if got != n:
                        raise OSError(f"short read at {off}: {got} of {n} bytes")
                    done += got

        try:
            with cf.ThreadPoolExecutor(depth, thread_name_prefix="floor-probe") as pool:
                t0 = time.perf_counter()
                total = sum(f.result() for f in [pool.submit(worker, k) for k in range(depth)])
                dt = time.perf_counter() - t0
        except OSError as e:
            if self.direct_io and e.errno == 22:  # EINVAL: O_DIRECT refused by the file system
                self._direct_failed()
                return self.read_requests(reqs, depth)
            raise
        finally:
            for b in bufs:
                b.close()
        return {"seconds": dt, "bytes": total, "requests": len(reqs), "gbps": total / dt / 1e9,
                "direct_io": self.direct_io}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------ the I/O floor
#
# The I/O floor is the union's bytes over the best rate this disk gives in the same run: the
# random-blob probe's, and the engine's own cold runs counted as bytes read / TTFT. That last term
# makes the floor a floor by construction: union bytes / (the run's bytes / its TTFT) ≤ its TTFT,
# because a run reads at least the union, so no cold run can come in under it. run_bench's
# `sweep` adds the rates of more read patterns over the union (bench/disk_floor.py's floor sweep:
# every pattern read first and again, since these virtual disks cache on the host), for a floor
# that a smarter read pattern could not beat either.

def floor_rates(probe: list, sweep: list, cold_runs: dict, io_threads: int) -> list[tuple]:
    """(GB/s, what) of every rate the I/O floor may take: the random-blob probe's, the sweep's
    first touches and repeats (if run_bench was given a sweep), and each cold run's bytes read /
    TTFT."""
    rates = [(x["gbps"], f"random blob reads, depth {io_threads} (first touch)") for x in probe]
    for p in sweep:
        rates.append((p["first"]["gbps"], f"{p['pattern']} (first touch)"))
        rates.append((p["repeat"]["gbps"], f"{p['pattern']} (repeat)"))
    for path, runs in cold_runs.items():
        for i, x in enumerate(runs):
            if x["ttft_s"] > 0 and x["bytes_read"]:
                rates.append((x["bytes_read"] / x["ttft_s"] / 1e9, f"the engine's own cold {path} run {i + 1} "
                                                                      f"(bytes read / TTFT)"))
    return rates


# ------------------------------------------------------------------------------- the runs

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def make_prompt(vocab: int, n: int, seed: int = 0, ids=None):
    """The first n ids of one fixed random sequence (so shorter prompts are prefixes of longer),
    or of ids when given (--prompt-ids: e.g. coherent ids sampled from the model itself,
    pysmoe.routing.coherent_prompt), which must then hold at least n."""
    import numpy as np
    if ids is not None:
        if len(ids) < n:
            raise ValueError(f"the prompt ids hold {len(ids)} ids, {n} are needed")
        return np.asarray(ids[:n], dtype=np.int32)
    rng = np.random.default_rng([seed, 0xB3])
    return rng.integers(0, vocab, max(n, 1), dtype=np.int64)[:n].astype(np.int32)


def load_prompt_ids(path: str, vocab: int):
    """Prompt ids from a .npy file or a text file of integers (whitespace or commas)."""
    import numpy as np
    if str(path).endswith(".npy"):
        ids = np.load(path)
    else:
        with open(path) as f:
            ids = np.array([int(t) for t in f.read().replace(",", " ").split()], dtype=np.int64)
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{path}: prompt ids must be non-empty and within [0, {vocab})")
    return ids.astype(np.int32)


class Bench:
    """The sessions and probe of one benchmark run over one vault.

    cold: a session with the cache budget, every run started cold (reset, clear_cache,
    reset_stats); resident: a session whose cache holds every expert, kept warm."""

    def __init__(self, vault_path, *, cache_bytes=None, cache_frac=0.1, threads=None, chunk=None, io_threads=4,
                 context=4096, resident=True, resident_bytes=None, probe_bytes=1 << 30, seed=0, log=None,
                 prompt_ids=None, verify_blobs="on", coalesce_bytes=None, kv_dtype=None):
        from .engine import open_vault
        from ._ffi import lib
        self.vault = open_vault(vault_path)
        self.log = log or (lambda msg: None)
        v = self.vault
        self.vocab = v.config["vocab_size"]
        self.blob_bytes = v.blob_bytes
        self.expert_bytes = v.expert_bytes
        self.cache_bytes = int(cache_bytes if cache_bytes is not None else cache_frac * v.expert_bytes)
        self.io_threads = io_threads
        self.chunk = chunk
        self.seed = seed
        self.prompt_ids = prompt_ids
        kw = dict(threads=threads, chunk=chunk, io_threads=io_threads, context=context, direct_io=True,
                  verify_blobs=verify_blobs != "off", coalesce_bytes=coalesce_bytes,
                  kv_dtype=kv_dtype)
        self.coalesce_bytes = int(lib.smoe_session_default_params().coalesce_bytes if coalesce_bytes is None
                                  else coalesce_bytes)
        self.probe_bytes = int(probe_bytes)
        self.cold = v.session(cache_bytes=self.cache_bytes, **kw)
        # --verify-blobs both: the same cold session unchecked, to time both in one repeat
        self.cold_unchecked = (v.session(cache_bytes=self.cache_bytes, **dict(kw, verify_blobs=False))
                               if verify_blobs == "both" else None)
        self.threads = self.cold.threads
        self.chunk = self.cold.chunk
        self.resident = None
        self.resident_bytes = None
        self.resident_full = False
        self.warnings = []
        if resident:
            if resident_bytes is None:
                # Every expert, and a slot more per sparse layer, so that the budget is never the limit
                # -- unless that would not fit in this machine's available memory next to the cold cache.
                want = v.expert_bytes + v.blob_bytes * v.num_sparse_layers
                avail = _available_mib()
                if avail is not None:
                    room = int(avail * MiB) - self.cache_bytes - (3 << 29)
                    if want > room:
                        self.warnings.append(
                            f"the resident cache is cut to {max(room, 0) / MiB:,.0f} MiB of the {want / MiB:,.0f} "
                            f"MiB of experts to fit in available memory: the compute floor may include reads")
                        want = max(room, v.blob_bytes * v.num_sparse_layers)
                resident_bytes = want
            self.resident_bytes = int(resident_bytes)
            self.resident_full = self.resident_bytes >= v.expert_bytes
            self.resident = v.session(cache_bytes=self.resident_bytes, **kw)
        for w in self.warnings:
            self.log("WARNING: " + w)
        self.probe = DirectReader(v.path, io_threads)
        self.probe_blobs_max = max(1, int(probe_bytes // max(self.blob_bytes, 1)))
        self._exact = {}        # prompt length -> exact union blobs
        self._warm = set()      # (path, length) already run on the resident session

    def close(self):
        for s in (self.cold, self.cold_unchecked, self.resident):
            if s is not None:
                s.close()
        self.probe.close()
        self.vault.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prompt(self, n: int):
        return make_prompt(self.vocab, n, self.seed, self.prompt_ids)

    # -- single runs
    @staticmethod
    def _timed_prefill(session, path, ids) -> dict:
        session.prefill_path = path
        t0 = time.perf_counter()
        session.prefill(ids)
        dt = time.perf_counter() - t0
        st = session.stats()
        return {"ttft_s": dt, "blob_reads": st["blob_reads"], "bytes_read": st["bytes_read"],
                "cache_hits": st["cache_hits"], "cache_misses": st["cache_misses"], "io_wait_s": st["io_wait_s"],
                "direct_io": st["direct_io"], "union_sum": sum(st["union_sizes"]),
                "resident_bytes": st["resident_bytes"], "kv_bytes": st["kv_bytes"]}

    def cold_ttft(self, path: str, n: int, checked: bool = True) -> dict:
        s = self.cold if checked else self.cold_unchecked
        s.reset()
        s.clear_cache()
        s.reset_stats()
        return self._timed_prefill(s, path, self.prompt(n))

    def exact_union(self, n: int) -> int | None:
        """Blobs the prompt's exact routing needs, each once: the reads of a prefill into an empty
        cache that holds every expert (it also warms the resident session for this prompt)."""
        if n not in self._exact:
            if self.resident is None:
                return None
            s = self.resident
            s.reset()
            s.clear_cache()
            s.reset_stats()
            rec = self._timed_prefill(s, "layer-major", self.prompt(n))
            self._exact[n] = rec["blob_reads"]
            self._warm = {("layer-major", n)}
        return self._exact[n]

    def resident_ttft(self, path: str, n: int) -> dict:
        s = self.resident
        ids = self.prompt(n)
        if (path, n) not in self._warm:
            s.reset()
            self._timed_prefill(s, path, ids)  # warm-up: whatever this prompt needs comes in
            self._warm.add((path, n))
        s.reset()
        s.reset_stats()
        return self._timed_prefill(s, path, ids)

    def io_probe(self, n_blobs: int, rep: int) -> dict:
        return self.probe.read(min(max(n_blobs, 8 * self.io_threads), self.probe_blobs_max), seed=self.seed * 7919 + rep)

    def decode_run(self, which: str, prompt_len: int, n_tokens: int) -> dict:
        """Prefill a prompt (layer-major), then time n_tokens greedy decode steps."""
        import numpy as np
        s = self.cold if which == "budget" else self.resident
        ids = self.prompt(prompt_len)
        s.prefill_path = "layer-major"
        if which == "budget":
            s.clear_cache()
        elif ("decode", prompt_len, n_tokens) not in self._warm:
            self._warm.add(("decode", prompt_len, n_tokens))
            self.decode_run(which, prompt_len, n_tokens)   # warm-up: the same greedy tokens come in
        s.reset()
        logits = s.prefill(ids)
        s.reset_stats()
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            logits = s.decode(int(np.argmax(logits)))
        dt = time.perf_counter() - t0
        st = s.stats()
        return {"seconds": dt, "tokens": n_tokens, "tps": n_tokens / dt if dt > 0 else None,
                "blob_reads": st["blob_reads"], "bytes_read": st["bytes_read"], "cache_hits": st["cache_hits"],
                "cache_misses": st["cache_misses"], "direct_io": st["direct_io"]}


def _rotate(items: list, k: int) -> list:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def _vault_info(v) -> dict:
    return {"path": str(v.path), "blob_bytes": v.blob_bytes, "expert_bytes": v.expert_bytes,
            "dense_bytes": v.dense_bytes, "layers": v.config["num_hidden_layers"],
            "sparse_layers": v.num_sparse_layers, "experts": v.config["num_experts"],
            "top_k": v.config["num_experts_per_tok"], "hidden_size": v.config["hidden_size"]}


def run_bench(vault_path, lengths, paths=PATHS, repeats=3, cache_bytes=None, cache_frac=0.1, chunk=None, threads=None,
              io_threads=4, decode_tokens=16, decode_prompt=8, serial_max_len=None, resident=True,
              resident_bytes=None, probe_bytes=1 << 30, seed=0, context=None, log=None, checkpoint=None,
              ttft=True, decode_budgets=None, budget_prompt=64, prompt_ids=None, verify_blobs="on",
              coalesce_bytes=None, kv_dtype=None, sweep=None) -> dict:
    """Run the benchmark; returns a dict of the raw runs and the medians (what --json writes).
    checkpoint(partial_result), if given, is called after each prompt length and each repeat of
    the budget curve (so a run that dies leaves what it measured).

    ttft=False skips the TTFT table and the two-point decode (and so the resident session);
    decode_budgets (percentages of the expert bytes) adds the decode-against-budget curve, run
    after the TTFT sessions are closed so that its largest budget has their memory.

    sweep: None, or more rates for the I/O floor: called as sweep(bench, session) after each
    prompt length's cold runs (session: the cold session, whose routing counts are that
    prompt's), it returns pattern records {"pattern", "kind", "request_bytes", "depth", "first",
    "repeat"}, the last two DirectReader.read_requests results; the record keeps them as the
    row's "floor_sweep", and sweep.settings as settings["sweep"] (bench/disk_floor.py)."""
    log = log or (lambda msg: None)
    checkpoint = checkpoint or (lambda res: None)
    lengths, paths = (list(lengths) if ttft else []), list(paths)
    decode_budgets = sorted(set(decode_budgets or []))
    if context is None:
        context = max(lengths + [decode_prompt + decode_tokens if ttft else 0,
                                 budget_prompt + decode_tokens if decode_budgets else 0]) + 1
    result = {"machine": machine_info(), "loadavg_before": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": sys.argv[1:], "ttft": [], "decode": {}, "warnings": [],
              "prompt": "random" if prompt_ids is None else "given ids"}
    t_start = time.perf_counter()
    if ttft:
        _run_ttft(result, vault_path, lengths, paths, repeats, cache_bytes, cache_frac, chunk, threads, io_threads,
                  decode_tokens, decode_prompt, serial_max_len, resident, resident_bytes, probe_bytes, seed, context,
                  log, checkpoint, prompt_ids, verify_blobs, coalesce_bytes, kv_dtype, sweep)
    if decode_budgets:
        from .engine import open_vault
        with open_vault(vault_path) as v:
            if not ttft:
                result["vault"] = _vault_info(v)
                result["settings"] = {"cache_bytes": None, "cache_frac": None, "resident_cache_bytes": None,
                                      "chunk": chunk, "threads": threads, "io_threads": io_threads,
                                      "repeats": repeats, "paths": [], "lengths": [], "decode_tokens": decode_tokens,
                                      "decode_prompt": None, "serial_max_len": None, "seed": seed,
                                      "probe_direct_io": None, "activations": "q8", "sweep": None}
            result["decode_budgets"] = decode_budget_curve(
                v, decode_budgets, repeats=repeats, threads=threads, chunk=chunk, io_threads=io_threads,
                context=context, prompt_len=budget_prompt, n_tokens=decode_tokens, seed=seed, log=log,
                prompt_ids=prompt_ids, kv_dtype=kv_dtype,
                checkpoint=lambda curve: checkpoint(dict(result, decode_budgets=curve, partial=True,
                                                         loadavg_now=loadavg())))
            if not ttft:
                result["settings"].update(threads=result["decode_budgets"]["threads"],
                                          chunk=result["decode_budgets"]["chunk"])
    result["partial"] = False
    result["loadavg_after"] = loadavg()
    result["wall_s"] = time.perf_counter() - t_start
    curve = result.get("decode_budgets") or {"budgets": []}
    result["direct_io_everywhere"] = (
        all(run["direct_io"] for row in result["ttft"] for key, rs in row["runs"].items() for run in rs
            if key.startswith("cold") or key == "probe")
        and all(d["direct_io"] for d in result["decode"].values())
        and all(b["direct_io"] for b in curve["budgets"] if b["direct_io"] is not None))
    cpus = result["machine"]["cpus"] or 1
    busy = [x for x in (result["loadavg_before"], result["loadavg_after"]) if x]
    result["machine_busy"] = any(x[0] > 0.5 * cpus for x in busy)
    return result


def _run_ttft(result, vault_path, lengths, paths, repeats, cache_bytes, cache_frac, chunk, threads, io_threads,
              decode_tokens, decode_prompt, serial_max_len, resident, resident_bytes, probe_bytes, seed, context,
              log, checkpoint, prompt_ids=None, verify_blobs="on", coalesce_bytes=None, kv_dtype=None,
              sweep=None) -> None:
    """The TTFT table and the two-point decode, into result."""
    with Bench(vault_path, cache_bytes=cache_bytes, cache_frac=cache_frac, threads=threads, chunk=chunk,
               io_threads=io_threads, context=context, resident=resident, resident_bytes=resident_bytes,
               probe_bytes=probe_bytes, seed=seed, log=log, prompt_ids=prompt_ids, verify_blobs=verify_blobs,
               coalesce_bytes=coalesce_bytes, kv_dtype=kv_dtype) as b:
        v = b.vault
        result["vault"] = _vault_info(v)
        result["settings"] = {"cache_bytes": b.cache_bytes, "cache_frac": b.cache_bytes / max(v.expert_bytes, 1),
                              "resident_cache_bytes": b.resident_bytes, "chunk": b.chunk, "threads": b.threads,
                              "io_threads": io_threads, "repeats": repeats, "paths": paths, "lengths": lengths,
                              "decode_tokens": decode_tokens, "decode_prompt": decode_prompt,
                              "serial_max_len": serial_max_len, "seed": seed, "probe_direct_io": b.probe.direct_io,
                              "activations": b.cold.activations, "verify_blobs": verify_blobs,
                              "coalesce_bytes": b.coalesce_bytes, "kv_dtype": b.cold.kv_dtype,
                              "sweep": None if sweep is None else sweep.settings}
        rows = []
        for n in lengths:
            cell_paths = [p for p in paths if p != "token-serial" or serial_max_len is None or n <= serial_max_len]
            exact = b.exact_union(n)
            contenders = [("cold", p) for p in cell_paths] + [("probe", None)]
            if b.cold_unchecked is not None:
                contenders += [("cold-unchecked", p) for p in cell_paths]
            if b.resident is not None:
                contenders += [("resident", p) for p in cell_paths]
            runs = {f"{k}:{p}" if p else k: [] for k, p in contenders}
            for r in range(repeats):
                for kind, p in _rotate(contenders, r):
                    if kind in ("cold", "cold-unchecked"):
                        rec = b.cold_ttft(p, n, checked=kind == "cold")
                        if not rec["direct_io"]:
                            log(f"WARNING: O_DIRECT NOT IN FORCE for the {p} run at {n} tokens: the page cache "
                                f"may have served these reads")
                    elif kind == "probe":
                        rec = b.io_probe(exact if exact is not None else n * v.config["num_experts_per_tok"]
                                         * v.num_sparse_layers, r)
                    else:
                        rec = b.resident_ttft(p, n)
                    runs[f"{kind}:{p}" if p else kind].append(rec)
                    what = f"{kind} {p}" if p else "pread probe"
                    fig = f"{rec['gbps']:.2f} GB/s" if kind == "probe" else f"{rec['ttft_s']:.3f} s"
                    log(f"  {n:5d} tokens  rep {r + 1}/{repeats}  {what:<24s} {fig}")
            # after the cold runs, b.cold's routing counts are this prompt's: sweep its union
            patterns = sweep(b, b.cold) if sweep is not None and cell_paths else []
            rows.append(_summarise_length(n, exact, runs, cell_paths, v.blob_bytes, b.resident is not None,
                                          resident_full=b.resident_full,
                                          max_union=min(v.num_sparse_layers * v.config["num_experts"],
                                                        n * v.config["num_experts_per_tok"] * v.num_sparse_layers),
                                          sweep=patterns, io_threads=io_threads))
            if b.cold_unchecked is not None:
                rows[-1]["checksum_cost"] = _checksum_cost(runs, cell_paths)
            checkpoint(dict(result, ttft=rows, partial=True, warnings=list(b.warnings), loadavg_now=loadavg()))
        result["ttft"] = rows
        result["warnings"] = list(b.warnings)
        decode = {}
        if decode_tokens > 0:
            kinds = ["budget"] + (["resident"] if b.resident is not None else [])
            runs = {k: [] for k in kinds}
            for r in range(repeats):
                for k in _rotate(kinds, r):
                    rec = b.decode_run(k, decode_prompt, decode_tokens)
                    runs[k].append(rec)
                    log(f"  decode {k:<8s} rep {r + 1}/{repeats}  {rec['tps']:.2f} tok/s")
            for k in kinds:
                rs = runs[k]
                decode[k] = {"tps": _median([x["tps"] for x in rs]), "tps_spread": _spread([x["tps"] for x in rs]),
                             "blob_reads_per_token": _median([x["blob_reads"] / x["tokens"] for x in rs]),
                             "mib_read_per_token": _median([x["bytes_read"] / x["tokens"] / MiB for x in rs]),
                             "cache_misses": _median([x["cache_misses"] for x in rs]),
                             "direct_io": all(x["direct_io"] for x in rs), "runs": rs}
        result["decode"] = decode


# ------------------------------------------------------------------ decode against the cache budget

MEM_MARGIN = 3 << 29   # bytes left free beside a big cache: KV, planes, Python, the rest of the machine


def budget_slots(v, pct: float) -> int:
    """The slots a session gets for a cache of pct % of the expert bytes: the engine's rule (whole
    blobs, at least one token's experts of one layer, at most every blob)."""
    total = v.num_sparse_layers * v.config["num_experts"]
    want = int(pct / 100 * v.expert_bytes) // max(v.blob_bytes, 1)
    return max(v.config["num_experts_per_tok"], min(total, want))


def budget_decode_run(v, pct, ids, n_tokens, *, threads, chunk, io_threads, context, kv_dtype=None) -> dict:
    """A fresh session with a cache of pct % of the expert bytes (Direct I/O): prefill ids
    layer-major (the cache fills as far as its budget lets), then time n_tokens greedy decode
    steps. Counters are those of the decode steps alone."""
    import numpy as np
    t0 = time.perf_counter()
    cache = budget_slots(v, pct) * v.blob_bytes
    with v.session(cache_bytes=cache, threads=threads, chunk=chunk, io_threads=io_threads, context=context,
                   direct_io=True, kv_dtype=kv_dtype) as s:
        open_s = time.perf_counter() - t0
        s.prefill_path = "layer-major"
        t0 = time.perf_counter()
        logits = s.prefill(ids)
        prefill_s = time.perf_counter() - t0
        st = s.stats()
        pre = {"prefill_s": prefill_s, "prefill_blob_reads": st["blob_reads"], "prefill_io_wait_s": st["io_wait_s"]}
        s.reset_stats()
        toks = []
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            toks.append(int(np.argmax(logits)))
            logits = s.decode(toks[-1])
        dt = time.perf_counter() - t0
        st = s.stats()
        uses = st["cache_hits"] + st["cache_misses"]
        return {"budget_pct": pct, "cache_bytes": st["cache_bytes"], "cache_slots": st["cache_slots"],
                "resident_bytes": st["resident_bytes"], "kv_bytes": st["kv_bytes"], "open_s": open_s, **pre,
                "seconds": dt, "tokens": n_tokens, "tps": n_tokens / dt if dt > 0 else None,
                "blob_reads": st["blob_reads"], "bytes_read": st["bytes_read"], "cache_hits": st["cache_hits"],
                "cache_misses": st["cache_misses"], "hit_rate": st["cache_hits"] / uses if uses else None,
                "io_wait_s": st["io_wait_s"], "direct_io": st["direct_io"], "threads": s.threads, "chunk": s.chunk,
                "ids": toks + [int(np.argmax(logits))]}


def _budget_room(v, pct) -> str | None:
    """Why a session at pct % would not fit in available memory now, or None."""
    avail = _available_mib()
    if avail is None:
        return None
    need = budget_slots(v, pct) * v.blob_bytes + MEM_MARGIN
    if need > avail * MiB:
        return (f"a {pct:g}% cache ({budget_slots(v, pct) * v.blob_bytes / MiB:,.0f} MiB) and a "
                f"{MEM_MARGIN / MiB:,.0f} MiB margin do not fit in the {avail:,.0f} MiB available")
    return None


def decode_budget_curve(v, budgets_pct, *, repeats=3, threads=None, chunk=None, io_threads=4, context=None,
                        prompt_len=64, n_tokens=16, seed=0, log=None, checkpoint=None, prompt_ids=None,
                        kv_dtype=None) -> dict:
    """Decode tokens/s against the cache budget. For each budget (percent of the expert bytes; 100
    holds every expert) a fresh session with that cache prefills the same prompt, then decodes
    n_tokens greedy tokens (budget_decode_run). Inside each repeat the budgets alternate in an
    order that rotates by one per repeat; tps_over_largest is each run's tokens/s over that of
    the largest budget in the same repeat, then the median. A budget whose cache does not fit in
    available memory (checked before every session) is skipped, with the reason."""
    log = log or (lambda msg: None)
    checkpoint = checkpoint or (lambda curve: None)
    budgets = sorted(set(float(b) for b in budgets_pct))
    ids = make_prompt(v.config["vocab_size"], prompt_len, seed, prompt_ids)
    if context is None:
        context = prompt_len + n_tokens + 1
    runs = {b: [] for b in budgets}
    curve = {"prompt_tokens": prompt_len, "decode_tokens": n_tokens, "repeats": repeats, "budgets": [],
             "threads": None, "chunk": None, "tokens_identical": None}

    def summarise():
        rows = []
        for b in budgets:
            rs = [x for x in runs[b] if "skipped" not in x]
            row = {"budget_pct": b, "cache_bytes": budget_slots(v, b) * v.blob_bytes,
                   "cache_frac": budget_slots(v, b) * v.blob_bytes / max(v.expert_bytes, 1),
                   "runs": runs[b], "skipped": None}
            if not rs:
                row.update(tps=None, tps_spread=None, tps_over_largest=None, hit_rate=None,
                           blob_reads_per_token=None, mib_read_per_token=None, prefill_s=None, direct_io=None)
                row["skipped"] = next((x["skipped"] for x in runs[b] if "skipped" in x), "not run")
            else:
                row.update(tps=_median([x["tps"] for x in rs]), tps_spread=_spread([x["tps"] for x in rs]),
                           tps_over_largest=_median([x.get("tps_over_largest") for x in rs]),
                           hit_rate=_median([x["hit_rate"] for x in rs]),
                           blob_reads_per_token=_median([x["blob_reads"] / x["tokens"] for x in rs]),
                           mib_read_per_token=_median([x["bytes_read"] / x["tokens"] / MiB for x in rs]),
                           prefill_s=_median([x["prefill_s"] for x in rs]),
                           direct_io=all(x["direct_io"] for x in rs))
            rows.append(row)
        done = [x for b in budgets for x in runs[b] if "skipped" not in x]
        curve["budgets"] = rows
        curve["tokens_identical"] = len({tuple(x["ids"]) for x in done}) <= 1 if done else None
        if done:
            curve["threads"], curve["chunk"] = done[0]["threads"], done[0]["chunk"]
        return curve

    for r in range(repeats):
        rep = []
        for b in _rotate(budgets, r):
            why = _budget_room(v, b)
            if why:
                rec = {"budget_pct": b, "skipped": why}
                log(f"  decode at {b:g}% SKIPPED: {why}")
            else:
                rec = budget_decode_run(v, b, ids, n_tokens, threads=threads, chunk=chunk, io_threads=io_threads,
                                        kv_dtype=kv_dtype,
                                        context=context)
                rep.append(rec)
                log(f"  decode at {b:5g}% ({rec['cache_bytes'] / MiB:,.0f} MiB)  rep {r + 1}/{repeats}  "
                    f"{rec['tps']:.2f} tok/s, hit rate {rec['hit_rate'] or 0:.0%}")
            runs[b].append(rec)
        if rep:
            top = max(rep, key=lambda x: x["budget_pct"])
            for x in rep:
                x["tps_over_largest"] = x["tps"] / top["tps"] if top["tps"] else None
        checkpoint(summarise())
    curve = summarise()
    if curve["tokens_identical"] is False:
        log("WARNING: the greedy tokens differed between cache budgets: results must not depend on the budget")
    return curve


def _overlap(cold, io_floor_reps, comp_reps) -> dict:
    """How a path's cold TTFT splits into waiting on I/O and computing, each repeat against that
    repeat's floors, then the median. io_wait_s is the wall time the compute thread (there is one
    that waits) spent blocked on blobs still loading, so it is part of TTFT, never more."""
    def per_rep(f):
        return _median([f(i, x) for i, x in enumerate(cold)])

    def ratio(a, b):
        return a / b if b else None

    io_ok = bool(io_floor_reps) and len(io_floor_reps) >= len(cold)
    comp_ok = bool(comp_reps) and len(comp_reps) >= len(cold)
    return {
        "io_wait_frac": per_rep(lambda i, x: ratio(x["io_wait_s"], x["ttft_s"])),
        "io_wait_over_io_floor": per_rep(lambda i, x: ratio(x["io_wait_s"], io_floor_reps[i])) if io_ok else None,
        "compute_busy_s": per_rep(lambda i, x: x["ttft_s"] - x["io_wait_s"]),
        "compute_busy_over_compute_floor":
            per_rep(lambda i, x: ratio(x["ttft_s"] - x["io_wait_s"], comp_reps[i])) if comp_ok else None,
    }


def _checksum_cost(runs, paths) -> dict:
    """Per path: checked and unchecked cold TTFT (medians) and the median of the per-repeat ratios
    checked / unchecked (both runs of a ratio come from the same repeat)."""
    out = {}
    for p in paths:
        on, off = runs[f"cold:{p}"], runs[f"cold-unchecked:{p}"]
        out[p] = {"checked_s": _median([x["ttft_s"] for x in on]), "unchecked_s": _median([x["ttft_s"] for x in off]),
                  "ratio": _median([a["ttft_s"] / b["ttft_s"] for a, b in zip(on, off)]),
                  "ratios": [a["ttft_s"] / b["ttft_s"] for a, b in zip(on, off)]}
    return out


def _summarise_length(n, exact, runs, paths, blob_bytes, has_resident, resident_full=True, max_union=None,
                      sweep=(), io_threads=4) -> dict:
    probe = runs["probe"]
    # The best rate of the run, over the probe, the sweep (if any) and the engine's own cold runs
    # (see "the I/O floor"): the floor divides the union by it, so no cold run can beat the floor.
    rates = floor_rates(probe, list(sweep), {p: runs[f"cold:{p}"] for p in paths}, io_threads)
    best = max(rates) if rates else (None, None)
    gbps = best[0]
    firsts = [r for r in rates if r[1].endswith("(first touch)")]
    repeats_ = [r for r in rates if r[1].endswith("(repeat)")]
    union_source = "cold prefill into a cache holding every expert"
    if exact is not None and not resident_full:
        # The resident cache could not hold every expert: its cold run may have read some twice.
        # Any cold run's reads are ≥ the union, and so are every expert of the sparse layers and
        # top-k per token per layer; take the least (an upper bound).
        union_source = "fewest blob reads of a cold run, all experts, or top-k per token (resident cache cut: upper bound)"
        exact = min([exact] + [x["blob_reads"] for p in paths for x in runs[f"cold:{p}"]]
                    + ([max_union] if max_union else []))
    exact_bytes = exact * blob_bytes if exact is not None else None
    if exact_bytes is None and "layer-major" in paths:
        # No resident session: the fewest blob reads of a layer-major cold run stand in for the union
        # (an upper bound: the budget can make it read an expert twice, and the last token's reads add
        # in; still ≤ every cold run's reads, so the floor stays below every run).
        union_source = "blob reads of the layer-major cold run (no resident session; upper bound)"
        exact = min(x["blob_reads"] for x in runs["cold:layer-major"])
        exact_bytes = exact * blob_bytes
    io_floor = exact_bytes / (gbps * 1e9) if exact_bytes is not None and gbps else None
    if io_floor is not None:
        # Every cold run read ≥ the union at ≤ the best rate, so the floor is ≤ its TTFT; say so
        # exactly (bytes / (bytes / ttft) can round one ulp above ttft).
        io_floor = min([io_floor] + [x["ttft_s"] for p in paths for x in runs[f"cold:{p}"]
                                     if x["ttft_s"] > 0 and x["bytes_read"]])
    io_floor_reps = [io_floor] * max(len(runs[f"cold:{p}"]) for p in paths) if io_floor is not None else []
    row = {"prompt_tokens": n, "exact_union_blobs": exact, "exact_union_bytes": exact_bytes,
           "union_source": union_source,
           "disk_gbps": gbps, "disk_gbps_spread": _spread([r[0] for r in rates]), "io_floor_s": io_floor,
           "io_floor_set_by": best[1],
           "best_first_touch": {"gbps": max(firsts)[0], "pattern": max(firsts)[1]} if firsts else None,
           "best_repeat": {"gbps": max(repeats_)[0], "pattern": max(repeats_)[1]} if repeats_ else None,
           "floor_sweep": list(sweep), "paths": {}, "runs": runs}
    comp_reps = None
    if has_resident:
        # per repeat: the fastest resident path is the compute floor. A resident run that missed the
        # cache (its cache cut to fit in memory) counts its time net of the seconds it waited on I/O.
        per_path = [[x["ttft_s"] - (x["io_wait_s"] if x["cache_misses"] else 0.0) for x in runs[f"resident:{p}"]]
                    for p in paths]
        # A cold run computes the same thing, so none of its TTFTs can be below the compute floor
        # either: the floor is capped by the fastest cold run.
        fastest_cold = min(x["ttft_s"] for p in paths for x in runs[f"cold:{p}"])
        comp_reps = [min(min(vals), fastest_cold) for vals in zip(*per_path)]
        row["compute_floor_s"] = _median(comp_reps)
        row["compute_floor_misses"] = max(x["cache_misses"] for p in paths for x in runs[f"resident:{p}"])
    else:
        row["compute_floor_s"] = None
    for p in paths:
        cold = runs[f"cold:{p}"]
        t = [x["ttft_s"] for x in cold]
        pr = {"ttft_s": _median(t), "ttft_spread": _spread(t), "prompt_tps": n / _median(t),
              "blob_reads": _median([x["blob_reads"] for x in cold]),
              "bytes_read": _median([x["bytes_read"] for x in cold]),
              "cache_hits": _median([x["cache_hits"] for x in cold]),
              "io_wait_s": _median([x["io_wait_s"] for x in cold]),
              "union_sum": _median([x["union_sum"] for x in cold]),
              "direct_io": all(x["direct_io"] for x in cold)}
        if has_resident:
            pr["resident_s"] = _median([x["ttft_s"] for x in runs[f"resident:{p}"]])
        ratios = []
        for i, x in enumerate(cold):
            floors = [f for f in ((io_floor_reps[i] if io_floor_reps else None),
                                  (comp_reps[i] if comp_reps else None)) if f is not None]
            if floors:
                ratios.append(x["ttft_s"] / max(floors))
        pr["ttft_over_floor"] = _median(ratios) if ratios else None
        pr.update(_overlap(cold, io_floor_reps, comp_reps))
        row["paths"][p] = pr
    if "layer-major" in paths and "token-serial" in paths:
        lm, ts = runs["cold:layer-major"], runs["cold:token-serial"]
        row["lm_over_ts"] = _median([a["ttft_s"] / b["ttft_s"] for a, b in zip(lm, ts)])
    floors = [f for f in (io_floor, row["compute_floor_s"]) if f is not None]
    row["floor_s"] = max(floors) if floors else None
    return row


# ------------------------------------------------------------------------------------ output

def _f(x, fmt="{:.3f}", none="—"):
    return none if x is None else fmt.format(x)


def format_table(res: dict) -> str:
    v, s = res["vault"], res["settings"]
    out = []
    out.append(f"vault {v['path']}: {v['layers']} layers ({v['sparse_layers']} sparse), {v['experts']} experts top-"
               f"{v['top_k']}, blob {v['blob_bytes'] / MiB:.2f} MiB, experts {v['expert_bytes'] / MiB:,.0f} MiB")
    cache = (f"cache {s['cache_bytes'] / MiB:,.1f} MiB ({100 * s['cache_frac']:.1f}% of the experts), "
             if s.get("cache_bytes") is not None else "")
    out.append(f"{cache}chunk {s['chunk']}, threads {s['threads']}, io_threads {s['io_threads']}, median of "
               f"{s['repeats']}; load {res['loadavg_before']} -> {res['loadavg_after']} on {res['machine']['cpus']} CPUs")
    if not res["direct_io_everywhere"]:
        out.append("!!! WARNING: Direct I/O (O_DIRECT) was NOT in force for every cold run or probe: the page cache "
                   "may have served reads; these TTFTs are not cold !!!")
    else:
        out.append("Direct I/O (O_DIRECT) in force for every cold run and probe.")
    for w in res.get("warnings", []):
        out.append(f"WARNING: {w}")
    if res.get("machine_busy"):
        out.append("NOTE: the machine was busy (load average above half the CPUs): figures are preliminary.")
    if res["ttft"]:
        out += _ttft_tables(res)
    if res.get("decode"):
        out.append("")
        d = res["decode"]
        out.append(f"decode after a {s['decode_prompt']}-token prompt, {s['decode_tokens']} greedy tokens:")
        for k, x in d.items():
            if k == "budget":
                label = f"cache {s['cache_bytes'] / MiB:,.0f} MiB"
            elif x["cache_misses"]:
                label = f"resident cache {s['resident_cache_bytes'] / MiB:,.0f} MiB (cut)"
            else:
                label = "every expert resident"
            sp = x["tps_spread"]
            out.append(f"  {label:<24s} {x['tps']:8.2f} tok/s  ({sp[0]:.2f}-{sp[1]:.2f}), "
                       f"{x['blob_reads_per_token']:.1f} blob reads/token, {x['mib_read_per_token']:.1f} MiB/token"
                       + ("" if x["direct_io"] else "  NO O_DIRECT"))
    if res.get("decode_budgets"):
        out += _budget_table(res["decode_budgets"])
    out.append("")
    if res["ttft"]:
        out.append("TTFT: wall time of Session.prefill (cold: reset, clear_cache, reset_stats). union: blobs the "
                   "prompt's exact routing needs, once each. I/O floor: union bytes / the best disk GB/s of the run "
                   "(above). compute floor: the fastest path with every expert resident (capped by the fastest cold "
                   "run). /floor: TTFT / max(I/O floor, compute floor), never below 1. LM/TS: layer-major / "
                   "token-serial TTFT.")
        out.append("Overlap: io_wait = seconds compute waited on blobs still loading (part of TTFT); wait/TTFT = "
                   "io_wait / TTFT; wait/I/O fl. = io_wait / I/O floor, target <= 1 (reads overlap compute instead "
                   "of adding to it); busy = TTFT - io_wait, compute's own time; busy/comp. = busy / compute floor "
                   "(above 1: compute ran slower than with every expert resident, or the path does more work than "
                   "the fastest one). Ratios per repeat, then the median.")
    if res.get("decode_budgets"):
        out.append("Budget curve: each run a fresh session with that cache (Direct I/O) prefills the same prompt "
                   "layer-major, then decodes greedily; tok/s, hit rate and reads are the decode steps' alone. "
                   "/largest: tok/s over the largest budget's in the same repeat, then the median.")
    return "\n".join(out)


def _ttft_tables(res: dict) -> list[str]:
    s = res["settings"]
    out = [""]
    hdr = (f"{'tokens':>6} {'path':<13} {'TTFT s':>8} {'min-max':>15} {'tok/s':>8} {'reads':>6} {'MiB read':>9} "
           f"{'hits':>5} {'io_wait':>7} {'resid. s':>8} {'/floor':>6}")
    out.append(hdr)
    out.append("-" * len(hdr))
    for row in res["ttft"]:
        n = row["prompt_tokens"]
        for p, pr in row["paths"].items():
            sp = pr["ttft_spread"]
            out.append(f"{n:>6} {p:<13} {pr['ttft_s']:>8.3f} {f'{sp[0]:.3f}-{sp[1]:.3f}':>15} {pr['prompt_tps']:>8.1f} "
                       f"{pr['blob_reads']:>6.0f} {pr['bytes_read'] / MiB:>9.1f} {pr['cache_hits']:>5.0f} "
                       f"{pr['io_wait_s']:>7.3f} {_f(pr.get('resident_s')):>8} {_f(pr['ttft_over_floor'], '{:.2f}'):>6}"
                       + ("" if pr["direct_io"] else "  NO O_DIRECT"))
    out.append("")
    if any("checksum_cost" in row for row in res["ttft"]):
        out.append("per-read blob checksums (cold, same repeat): checked / unchecked")
        hdr_c = f"{'tokens':>6} {'path':<13} {'checked s':>9} {'unchecked s':>11} {'ratio':>7} {'per repeat':<30}"
        out.append(hdr_c)
        out.append("-" * len(hdr_c))
        for row in res["ttft"]:
            for p, c in row.get("checksum_cost", {}).items():
                reps = " ".join(f"{x:.3f}" for x in c["ratios"])
                out.append(f"{row['prompt_tokens']:>6} {p:<13} {c['checked_s']:>9.3f} {c['unchecked_s']:>11.3f} "
                           f"{c['ratio']:>7.3f} {reps:<30}")
        out.append("")
    hdr2 = (f"{'tokens':>6} {'union blobs':>11} {'union MiB':>9} {'disk GB/s':>9} {'I/O floor':>9} "
            f"{'compute fl.':>11} {'floor s':>8} {'LM/TS':>6}")
    out.append(hdr2)
    out.append("-" * len(hdr2))
    for row in res["ttft"]:
        ub = row["exact_union_bytes"]
        miss = row.get("compute_floor_misses")
        out.append(f"{row['prompt_tokens']:>6} {_f(row['exact_union_blobs'], '{:.0f}'):>11} "
                   f"{_f(ub / MiB if ub is not None else None, '{:.1f}'):>9} {_f(row['disk_gbps'], '{:.2f}'):>9} "
                   f"{_f(row['io_floor_s']):>9} {_f(row['compute_floor_s']):>11} {_f(row['floor_s']):>8} "
                   f"{_f(row.get('lm_over_ts'), '{:.2f}'):>6}"
                   + (f"  (resident runs missed up to {miss} blobs: compute floor net of their io_wait)"
                      if miss else "")
                   + ("  (union: upper bound)" if "upper bound" in row.get("union_source", "") else ""))
    out.append("")
    swept = any(row.get("floor_sweep") for row in res["ttft"])
    out.append("I/O floor: union bytes / the best rate of this run, over "
               + ("the floor sweep (first touch and repeat), " if swept else "")
               + "the random-blob probe and the engine's own cold runs (bytes read / TTFT, so no run can beat it):")
    for row in res["ttft"]:
        ft, rp = row.get("best_first_touch"), row.get("best_repeat")
        out.append(f"{row['prompt_tokens']:>6} tokens: {_f(row['disk_gbps'], '{:.2f}')} GB/s, set by "
                   f"{row.get('io_floor_set_by') or '—'}")
        if row.get("floor_sweep") and (ft or rp):
            out.append(f"{'':>6}   best first touch {_f(ft and ft['gbps'], '{:.2f}')} GB/s"
                       + (f" ({ft['pattern'].replace(' (first touch)', '')})" if ft else "")
                       + f"; best repeat {_f(rp and rp['gbps'], '{:.2f}')} GB/s"
                       + (f" ({rp['pattern'].replace(' (repeat)', '')})" if rp else ""))
    out.append("")
    out.append(f"overlap, cold runs (cache {100 * s['cache_frac']:.1f}%): how TTFT splits into waiting on I/O and "
               f"computing")
    hdr3 = (f"{'tokens':>6} {'path':<13} {'TTFT s':>8} {'io_wait':>8} {'wait/TTFT':>9} {'I/O floor':>9} "
            f"{'wait/I/O fl.':>12} {'busy s':>8} {'compute fl.':>11} {'busy/comp.':>10}")
    out.append(hdr3)
    out.append("-" * len(hdr3))
    for row in res["ttft"]:
        for p, pr in row["paths"].items():
            out.append(f"{row['prompt_tokens']:>6} {p:<13} {pr['ttft_s']:>8.3f} {pr['io_wait_s']:>8.3f} "
                       f"{_f(pr.get('io_wait_frac'), '{:.0%}'):>9} {_f(row['io_floor_s']):>9} "
                       f"{_f(pr.get('io_wait_over_io_floor'), '{:.2f}'):>12} {_f(pr.get('compute_busy_s')):>8} "
                       f"{_f(row['compute_floor_s']):>11} "
                       f"{_f(pr.get('compute_busy_over_compute_floor'), '{:.2f}'):>10}")
    return out


def _budget_table(c: dict) -> list[str]:
    out = ["", f"decode against the cache budget: a {c['prompt_tokens']}-token prompt, then {c['decode_tokens']} "
               f"greedy tokens, a fresh session per run (actual: the cache in whole blobs, at least top-k, as a "
               f"fraction of the expert bytes)"]
    hdr = (f"{'budget':>7} {'cache MiB':>10} {'actual':>7} {'tok/s':>8} {'min-max':>15} {'/largest':>8} {'hit rate':>8} "
           f"{'reads/tok':>9} {'MiB/tok':>8} {'prefill s':>9}")
    out.append(hdr)
    out.append("-" * len(hdr))
    for b in c["budgets"]:
        pct = f"{b['budget_pct']:g}%"
        if b["tps"] is None:
            out.append(f"{pct:>7} {b['cache_bytes'] / MiB:>10,.1f} {b['cache_frac']:>7.1%}  SKIPPED: {b['skipped']}")
            continue
        sp = b["tps_spread"]
        out.append(f"{pct:>7} {b['cache_bytes'] / MiB:>10,.1f} {b['cache_frac']:>7.1%} {b['tps']:>8.2f} {f'{sp[0]:.2f}-{sp[1]:.2f}':>15} "
                   f"{_f(b['tps_over_largest'], '{:.2f}'):>8} {_f(b['hit_rate'], '{:.0%}'):>8} "
                   f"{b['blob_reads_per_token']:>9.1f} {b['mib_read_per_token']:>8.1f} {b['prefill_s']:>9.3f}"
                   + ("" if b["direct_io"] else "  NO O_DIRECT"))
    if c.get("tokens_identical") is False:
        out.append("!!! WARNING: the greedy tokens differed between budgets (they must not) !!!")
    return out
