#!/usr/bin/env python3
"""pysmoe against llama.cpp on the same weights: TTFT and decode tokens/s, side by side.

    .venv/bin/python scripts/export_gguf.py VAULT OUT.gguf
    .venv/bin/python bench/peer.py VAULT --gguf OUT.gguf [--prompt-lengths 8,45] [--threads 2] \
        [--repeats 3] [--decode-tokens 16] [--modes check,warm,cold] [--blocks] [--cache-frac 0.1] [--json OUT]

llama.cpp runs through llama-cpp-python in a child process of this one (a worker speaking JSON
lines on stdin/stdout), pysmoe in this process; the two take turns, run by run, and every
figure is a median of --repeats runs. Modes (bench/peer.md says why each is set up as it is):

check  llama.cpp's logits against pysmoe's for every position of the longest prompt (argmax
       agreement, correlation): both engines run the same model, up to Q4_0 vs q4.
warm   everything in memory: pysmoe with a cache that holds every expert, warmed; llama.cpp with
       the model loaded (mmap, its default CPU repacking) and warmed by the same prompt. Needs
       memory for the model twice; --blocks runs it NOT alternated, one engine at a time (all
       pysmoe repeats, then all llama.cpp repeats, page cache dropped before each block), for a
       model that does not fit twice.
cold   the model does not fit: budget = pysmoe's stats()["resident_bytes"] with a cache of
       --cache-frac of the expert bytes. pysmoe: a fresh open_vault + session with that cache,
       Direct I/O. llama.cpp: a fresh worker that moves itself into a memory cgroup limited to
       the budget before it loads anything. Page cache dropped (sync; echo 3 >
       /proc/sys/vm/drop_caches) before each. Needs root and a cgroup memory controller; skipped
       with a message otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20



def _pysmoe_kernels() -> str:
    from pysmoe._ffi import ffi, lib
    return ffi.string(lib.smoe_kernels()).decode()

def make_prompt(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """The first n ids of one fixed random sequence (pysmoe.bench.make_prompt's sequence)."""
    rng = np.random.default_rng([seed, 0xB3])
    return rng.integers(0, vocab, max(n, 1), dtype=np.int64)[:n].astype(np.int32)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ================================================================== llama.cpp worker (child)

def _worker_main(args) -> int:
    """Runs in the child: optionally join a cgroup first, load the GGUF, then serve requests."""
    if args.cgroup_procs:
        with open(args.cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    t0 = time.perf_counter()
    import llama_cpp
    import llama_cpp.llama as llama_mod
    if args.no_repack:
        orig = llama_mod.llama_cpp.llama_model_default_params

        def params():
            p = orig()
            p.use_extra_bufts = False
            return p
        llama_mod.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, use_mmap=True, logits_all=args.logits_all, verbose=args.verbose)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx
    out = sys.stdout

    def last_logits():
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "load_s": load_s, "n_vocab": n_vocab})
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "quit":
            break
        if op == "run":
            ids = [int(i) for i in req["ids"]]
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(last_logits()))
            ttft = time.perf_counter() - t0
            toks = [tok]
            t1 = time.perf_counter()
            for _ in range(req.get("decode", 0)):
                llm.eval([tok])
                tok = int(np.argmax(last_logits()))
                toks.append(tok)
            dec = time.perf_counter() - t1
            reply({"ttft_s": ttft, "decode_s": dec, "tokens": toks})
        elif op == "logits":  # every position's logits (needs logits_all), saved to a .npy
            ids = [int(i) for i in req["ids"]]
            llm.reset()
            llm.eval(ids)
            np.save(req["out"], np.array(llm.scores[:len(ids)], dtype=np.float32))
            reply({"ok": True})
    return 0


class LlamaWorker:
    """A llama.cpp child process (see _worker_main)."""

    def __init__(self, gguf, threads, ctx, *, cgroup_procs=None, no_repack=False, logits_all=False, verbose=False,
                 omp_active=False):
        cmd = [sys.executable, __file__, "--_worker", "--gguf", str(gguf), "--threads", str(threads),
               "--ctx", str(ctx)]
        if cgroup_procs:
            cmd += ["--cgroup-procs", str(cgroup_procs)]
        if no_repack:
            cmd.append("--no-repack")
        if logits_all:
            cmd.append("--logits-all")
        if verbose:
            cmd.append("--verbose")
        self.t_spawn = time.perf_counter()
        env = dict(os.environ)
        if not omp_active:
            # llama.cpp's CPU backend runs its threads under OpenMP; libgomp's default wait policy
            # spins at every barrier, and on a machine with more runnable threads than cores (a
            # shared one) a descheduled thread stalls the spinning one: measured on mini, 2.7 s
            # against 0.4 s TTFT at 8 tokens. PASSIVE is llama.cpp at its best here.
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  stderr=None if verbose else subprocess.DEVNULL)
        hello = self._read()
        self.load_s = hello["load_s"]
        self.spawn_to_ready_s = time.perf_counter() - self.t_spawn

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait()
            raise RuntimeError(f"llama.cpp worker died (exit {rc}{', killed: OOM?' if rc in (-9, 137) else ''})")
        return json.loads(line)

    def call(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"op": "quit"}\n')
                self.p.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


# ================================================================== memory cgroup

class MemCgroup:
    """A memory-limited child cgroup of this process's own group (v1 or v2), or a reason why not."""

    def __init__(self, limit_bytes: int, name: str | None = None):
        self.limit = int(limit_bytes)
        self.path = None
        self.version = None
        name = name or f"smoe-peer-{os.getpid()}"
        if os.geteuid() != 0:
            raise PermissionError("needs root (a memory cgroup and /proc/sys/vm/drop_caches)")
        fstype = subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip()
        lines = open("/proc/self/cgroup").read().splitlines()
        v1 = [l.split(":", 2)[2] for l in lines if l.split(":", 2)[1].split(",").count("memory")]
        if v1 and os.path.isdir("/sys/fs/cgroup/memory"):
            self.version = 1
            parent = "/sys/fs/cgroup/memory" + v1[0]
            self.path = os.path.join(parent, name)
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.limit_in_bytes", self.limit)
            for f, val in (("memory.swappiness", 0),              # never swap (no swap here anyway)
                           ("memory.move_charge_at_immigrate", 3)):  # the worker's pages so far come along
                try:
                    self._write(f, val)
                except OSError:
                    pass
        elif fstype == "cgroup2fs":
            self.version = 2
            rel = [l.split(":", 2)[2] for l in lines if l.startswith("0::")][0]
            parent = "/sys/fs/cgroup" + rel
            ctl = open(os.path.join(parent, "cgroup.controllers")).read().split()
            if "memory" not in ctl:
                raise OSError(f"cgroup v2: the memory controller is not available in {parent}")
            sub = os.path.join(parent, "cgroup.subtree_control")
            if "memory" not in open(sub).read().split():
                with open(sub, "w") as f:  # fails if parent has processes and is not the root
                    f.write("+memory")
            self.path = os.path.join(parent, name)
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.max", self.limit)
            try:
                self._write("memory.swap.max", 0)
            except OSError:
                pass
        else:
            raise OSError(f"no cgroup memory controller found (/sys/fs/cgroup is {fstype})")

    def _write(self, f, value):
        with open(os.path.join(self.path, f), "w") as fh:
            fh.write(str(value))

    def _read(self, f):
        try:
            return open(os.path.join(self.path, f)).read()
        except OSError:
            return None

    @property
    def procs_file(self):
        return os.path.join(self.path, "cgroup.procs")

    def reset_peak(self):
        if self.version == 1:
            try:
                self._write("memory.max_usage_in_bytes", 0)
            except OSError:
                pass

    def peak(self):
        v = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(v) if v else None

    def oom_kills(self):
        t = self._read("memory.oom_control" if self.version == 1 else "memory.events") or ""
        for line in t.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return None

    def remove(self):
        if self.path and os.path.isdir(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                pass


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


# ================================================================== pysmoe side

def pysmoe_run(session, ids, n_decode):
    session.reset()
    t0 = time.perf_counter()
    logits = session.prefill(ids)
    tok = int(np.argmax(logits))
    ttft = time.perf_counter() - t0
    toks = [tok]
    t1 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(session.decode(tok)))
        toks.append(tok)
    return {"ttft_s": ttft, "decode_s": time.perf_counter() - t1, "tokens": toks}


def _tps(rec, n):
    return n / rec["decode_s"] if n and rec.get("decode_s") else None


# ================================================================== modes

def mode_check(vault, gguf, args, log):
    from pysmoe import open_vault
    n = max(args.prompt_lengths)
    v = open_vault(vault)
    ids = make_prompt(v.config["vocab_size"], n, args.seed)
    with v.session(cache_bytes=v.expert_bytes + v.blob_bytes * v.num_sparse_layers, threads=args.threads,
                   context=args.ctx) as s:
        ours = np.stack([s.decode(int(t)) for t in ids])   # logits after each position
    v.close()
    w = LlamaWorker(gguf, args.threads, args.ctx, logits_all=True, omp_active=args.omp_active)
    try:
        tmp = pathlib.Path(args.tmp) / f"peer-logits-{os.getpid()}.npy"
        w.call(op="logits", ids=[int(i) for i in ids], out=str(tmp))
        theirs = np.load(tmp)
        tmp.unlink()
    finally:
        w.close()
    theirs = theirs[:, :ours.shape[1]]
    agree = float(np.mean(ours.argmax(1) == theirs.argmax(1)))
    corr = [float(np.corrcoef(a, b)[0, 1]) for a, b in zip(ours, theirs)]
    top5 = [len(set(np.argsort(a)[-5:]) & set(np.argsort(b)[-5:])) / 5 for a, b in zip(ours, theirs)]
    rel = float(np.linalg.norm(ours - theirs) / np.linalg.norm(ours))
    res = {"positions": n, "argmax_agreement": agree, "corr_median": float(np.median(corr)),
           "corr_min": float(np.min(corr)), "top5_overlap": float(np.mean(top5)), "rel_l2": rel,
           "logit_std": float(ours.std())}
    log(f"check: {n} positions, argmax agreement {agree:.0%}, correlation median {res['corr_median']:.4f} "
        f"(min {res['corr_min']:.4f}), top-5 overlap {res['top5_overlap']:.0%}, relative L2 {rel:.3f}")
    return res


class PysmoeWarm:
    """pysmoe with every expert in memory: one session whose cache holds them all, warmed by a
    longer prompt (and each timed prompt once more, untimed, by prepare)."""
    name = "pysmoe"

    def __init__(self, vault, args, warm_ids):
        from pysmoe import open_vault
        t0 = time.perf_counter()
        self.v = open_vault(vault)
        self.cache = self.v.expert_bytes + self.v.blob_bytes * self.v.num_sparse_layers
        try:
            self.s = self.v.session(cache_bytes=self.cache, threads=args.threads, context=args.ctx)
        except BaseException:
            self.v.close()
            raise
        self.load_s = time.perf_counter() - t0
        self.decode = args.decode_tokens
        pysmoe_run(self.s, warm_ids, 0)

    def prepare(self, ids):
        pysmoe_run(self.s, ids, self.decode)
        self.s.reset_stats()

    def run(self, ids):
        return pysmoe_run(self.s, ids, self.decode)

    def extra(self) -> dict:
        return {"cache_misses_timed": self.s.stats()["cache_misses"]}

    def close(self):
        self.s.close()
        self.v.close()


class LlamaWarm:
    """llama.cpp with the model loaded (mmap, its default CPU repacking unless --no-repack-warm),
    warmed the same way."""
    name = "llama.cpp"

    def __init__(self, gguf, args, warm_ids):
        self.w = LlamaWorker(gguf, args.threads, args.ctx, no_repack=args.no_repack_warm, omp_active=args.omp_active)
        self.load_s = self.w.load_s
        self.decode = args.decode_tokens
        self.w.call(op="run", ids=warm_ids.tolist(), decode=0)

    def prepare(self, ids):
        self.w.call(op="run", ids=ids.tolist(), decode=self.decode)

    def run(self, ids):
        return self.w.call(op="run", ids=ids.tolist(), decode=self.decode)

    def extra(self) -> dict:
        return {}

    def close(self):
        self.w.close()


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


MEM_MARGIN = 3 << 29   # left free beside an engine holding a whole model: Python, KV, the rest of the machine


def warm_needs(vault, gguf) -> dict:
    """Bytes each engine holds with the whole model in memory: pysmoe its dense weights and a cache
    of every expert; llama.cpp about its GGUF (the experts repacked into anonymous memory, the rest
    mapped)."""
    from pysmoe import open_vault
    with open_vault(vault) as v:
        pysmoe_b = v.dense_bytes + v.expert_bytes
    return {"pysmoe": pysmoe_b, "llama.cpp": os.path.getsize(gguf)}


def mode_warm(vault, gguf, args, log):
    """Everything in memory, both engines open at once, runs alternated (needs room for the model
    twice; --blocks otherwise)."""
    from pysmoe import open_vault
    need = warm_needs(vault, gguf)
    avail = _mem_available()
    total = sum(need.values()) + MEM_MARGIN
    if avail is not None and total > avail:
        why = (f"both engines holding the model at once need about {total / MiB:,.0f} MiB (pysmoe "
               f"{need['pysmoe'] / MiB:,.0f}, llama.cpp {need['llama.cpp'] / MiB:,.0f}, margin {MEM_MARGIN / MiB:,.0f}) "
               f"and {avail / MiB:,.0f} MiB are available: run it with --blocks")
        log(f"warm: SKIPPED: {why}")
        return {"skipped": why, "alternated": True}
    with open_vault(vault) as v:
        vocab = v.config["vocab_size"]
    warm_ids = make_prompt(vocab, min(args.ctx - args.decode_tokens - 2, 256), args.seed + 1)
    engines = {}
    out = {"alternated": True}
    try:
        # warm-up: a longer prompt pulls (nearly) every expert into pysmoe's cache and llama.cpp's
        # page cache / repacked buffers; then each timed prompt once more, untimed.
        engines["pysmoe"] = PysmoeWarm(vault, args, warm_ids)
        engines["llama.cpp"] = LlamaWarm(gguf, args, warm_ids)
        log(f"warm: llama.cpp loaded in {engines['llama.cpp'].load_s:.2f} s; pysmoe cache "
            f"{engines['pysmoe'].cache / MiB:,.0f} MiB (every expert)")
        for n in args.prompt_lengths:
            ids = make_prompt(vocab, n, args.seed)
            for e in engines.values():
                e.prepare(ids)
            runs = {"pysmoe": [], "llama.cpp": []}
            for r in range(args.repeats):
                order = ["pysmoe", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "pysmoe"]
                for who in order:
                    runs[who].append(engines[who].run(ids))
            out[n] = _summary(runs, n, args.decode_tokens)
            for who, e in engines.items():
                out[n][who].update(e.extra(), load_s=e.load_s)
            log(_line("warm", n, out[n]))
    finally:
        for e in engines.values():
            e.close()
    return out


def mode_warm_blocks(vault, gguf, args, log):
    """Everything in memory, one engine at a time: all of pysmoe's repeats, then all of llama.cpp's,
    each engine opened once and closed before the other opens, the page cache dropped before each
    block. For a model that does not fit in memory twice (the full a3b: an 18 GB vault and an 18 GB
    GGUF on a 24 GB machine). NOT alternated: the two blocks run minutes apart, so a change in the
    machine's load between them moves the ratio; each block's load average is recorded."""
    from pysmoe import open_vault
    with open_vault(vault) as v:
        vocab = v.config["vocab_size"]
    warm_ids = make_prompt(vocab, min(args.ctx - args.decode_tokens - 2, 256), args.seed + 1)
    need = warm_needs(vault, gguf)
    runs = {n: {"pysmoe": [], "llama.cpp": []} for n in args.prompt_lengths}
    extra = {n: {"pysmoe": {}, "llama.cpp": {}} for n in args.prompt_lengths}
    blocks = {}
    log("warm in blocks: NOT alternated (all pysmoe repeats, then all llama.cpp repeats, one engine in memory at "
        f"a time{'' if args.no_drop_caches else ', the page cache dropped before each'}): the machine's load may "
        "differ between the blocks")
    for who in ("pysmoe", "llama.cpp"):
        info = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dropped_caches": False, "skipped": None,
                "need_bytes": need[who]}
        if not args.no_drop_caches:
            try:
                drop_caches()
                info["dropped_caches"] = True
            except OSError as e:
                log(f"warm {who} block: could not drop the page cache ({e}); continuing without")
        avail = _mem_available()
        info["mem_available_bytes"] = avail
        info["loadavg_before"] = list(os.getloadavg())
        if avail is not None and need[who] + MEM_MARGIN > avail:
            info["skipped"] = (f"{who} holding the model needs about {(need[who] + MEM_MARGIN) / MiB:,.0f} MiB "
                               f"(with a {MEM_MARGIN / MiB:,.0f} MiB margin), {avail / MiB:,.0f} MiB available")
            log(f"warm {who} block: SKIPPED: {info['skipped']}")
            blocks[who] = info
            continue
        t0 = time.perf_counter()
        e = PysmoeWarm(vault, args, warm_ids) if who == "pysmoe" else LlamaWarm(gguf, args, warm_ids)
        info["load_s"] = e.load_s
        try:
            for n in args.prompt_lengths:
                ids = make_prompt(vocab, n, args.seed)
                e.prepare(ids)
                for r in range(args.repeats):
                    runs[n][who].append(e.run(ids))
                extra[n][who] = e.extra()
                t = _median([x["ttft_s"] for x in runs[n][who]])
                log(f"warm {who} block n={n}: TTFT {_f(t)} s")
        finally:
            e.close()
        info["seconds"] = time.perf_counter() - t0
        info["loadavg_after"] = list(os.getloadavg())
        blocks[who] = info
    out = {"alternated": False, "blocks": blocks,
           "note": "not alternated: all pysmoe repeats, then all llama.cpp repeats, one engine in memory at a time "
                   "(the model does not fit twice); ratios are of medians taken in different blocks"}
    for n in args.prompt_lengths:
        out[n] = _summary(runs[n], n, args.decode_tokens)
        for who in ("pysmoe", "llama.cpp"):
            out[n][who].update(extra[n][who], load_s=blocks[who].get("load_s"))
        log(_line("warm (blocks)", n, out[n]))
    return out


def mode_cold(vault, gguf, args, log):
    from pysmoe import open_vault
    v = open_vault(vault)
    vocab = v.config["vocab_size"]
    cache = int(args.cache_frac * v.expert_bytes)
    with v.session(cache_bytes=cache, threads=args.threads, context=args.ctx) as s:
        budget = s.stats()["resident_bytes"]
    model_bytes = v.file_bytes
    gguf_bytes = os.path.getsize(gguf)
    v.close()
    info = {"cache_bytes": cache, "budget_bytes": budget, "vault_bytes": model_bytes, "gguf_bytes": gguf_bytes,
            "budget_frac_of_gguf": budget / gguf_bytes}
    log(f"cold: budget {budget / MiB:,.1f} MiB = pysmoe resident_bytes with a {cache / MiB:,.1f} MiB cache "
        f"({args.cache_frac:.0%} of experts); {budget / gguf_bytes:.0%} of the {gguf_bytes / MiB:,.0f} MiB GGUF")
    try:
        cg = MemCgroup(budget)
    except (OSError, PermissionError) as e:
        log(f"cold: SKIPPED: {e}")
        return {"skipped": str(e), **info}
    info["cgroup"] = {"version": cg.version, "path": cg.path}
    out = {"info": info}
    try:
        for n in args.prompt_lengths:
            ids = make_prompt(vocab, n, args.seed)
            runs = {"pysmoe": [], "llama.cpp": []}
            for r in range(args.repeats):
                order = ["pysmoe", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "pysmoe"]
                for who in order:
                    drop_caches()
                    if who == "pysmoe":
                        t0 = time.perf_counter()
                        vv = open_vault(vault)
                        ss = vv.session(cache_bytes=cache, threads=args.threads, context=args.ctx)
                        ss.clear_cache()
                        open_s = time.perf_counter() - t0
                        rec = pysmoe_run(ss, ids, args.decode_tokens)
                        st = ss.stats()
                        rec.update(load_s=open_s, direct_io=st["direct_io"], resident_bytes=st["resident_bytes"],
                                   bytes_read=st["bytes_read"])
                        ss.close()
                        vv.close()
                    else:
                        cg.reset_peak()
                        kills = cg.oom_kills() or 0
                        try:
                            w = LlamaWorker(gguf, args.threads, args.ctx, cgroup_procs=cg.procs_file,
                                            no_repack=not args.repack_cold, omp_active=args.omp_active)
                            try:
                                rec = w.call(op="run", ids=ids.tolist(), decode=args.decode_tokens)
                                rec["load_s"] = w.load_s
                            finally:
                                w.close()
                        except RuntimeError as e:
                            rec = {"error": str(e), "ttft_s": None, "decode_s": None}
                        rec["cgroup_peak_bytes"] = cg.peak()
                        rec["oom_kills"] = (cg.oom_kills() or 0) - kills
                    runs[who].append(rec)
            out[n] = _summary(runs, n, args.decode_tokens)
            out[n]["pysmoe"]["direct_io"] = all(r.get("direct_io") for r in runs["pysmoe"])
            out[n]["llama.cpp"]["cgroup_peak_mib"] = max((r.get("cgroup_peak_bytes") or 0) for r in runs["llama.cpp"]) / MiB
            out[n]["llama.cpp"]["errors"] = [r["error"] for r in runs["llama.cpp"] if "error" in r]
            log(_line("cold", n, out[n]))
    finally:
        cg.remove()
    return out


def _summary(runs, n, n_decode):
    res = {}
    for who, rs in runs.items():
        res[who] = {"ttft_s": _median([r["ttft_s"] for r in rs]),
                    "ttft_all_s": [r["ttft_s"] for r in rs],
                    "prefill_tps": (n / _median([r["ttft_s"] for r in rs])) if _median([r["ttft_s"] for r in rs]) else None,
                    "decode_tps": _median([_tps(r, n_decode) for r in rs if r.get("decode_s") is not None]),
                    "load_s": _median([r.get("load_s") for r in rs]),
                    "first_tokens": rs[0].get("tokens", [])[:8] if rs else []}
    a, b = res["pysmoe"]["ttft_s"], res["llama.cpp"]["ttft_s"]
    res["ttft_ratio_llama_over_pysmoe"] = (b / a) if a and b else None
    a, b = res["pysmoe"]["decode_tps"], res["llama.cpp"]["decode_tps"]
    res["decode_ratio_pysmoe_over_llama"] = (a / b) if a and b else None
    return res


def _f(x, fmt="{:.3f}"):
    return "—" if x is None else fmt.format(x)


def _line(mode, n, r):
    p, l = r["pysmoe"], r["llama.cpp"]
    return (f"{mode} n={n}: TTFT pysmoe {_f(p['ttft_s'])} s, llama.cpp {_f(l['ttft_s'])} s "
            f"(llama/pysmoe {_f(r['ttft_ratio_llama_over_pysmoe'], '{:.2f}')}×); decode pysmoe "
            f"{_f(p['decode_tps'], '{:.2f}')} tok/s, llama.cpp {_f(l['decode_tps'], '{:.2f}')} tok/s")


def table(res) -> str:
    rows = ["| mode | prompt | pysmoe TTFT s | llama.cpp TTFT s | llama/pysmoe TTFT | pysmoe prefill tok/s | "
            "llama.cpp prefill tok/s | pysmoe decode tok/s | llama.cpp decode tok/s | load s (pysmoe / llama.cpp) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in ("warm", "cold"):
        m = res.get(mode) or {}
        label = "warm (blocks, not alternated)" if mode == "warm" and m.get("alternated") is False else mode
        for n, r in m.items():
            if not isinstance(r, dict) or "ttft_ratio_llama_over_pysmoe" not in r:
                continue
            p, l = r["pysmoe"], r["llama.cpp"]
            rows.append(f"| {label} | {n} | {_f(p['ttft_s'])} | {_f(l['ttft_s'])} | "
                        f"{_f(r['ttft_ratio_llama_over_pysmoe'], '{:.2f}')}× | {_f(p['prefill_tps'], '{:.1f}')} | "
                        f"{_f(l['prefill_tps'], '{:.1f}')} | {_f(p['decode_tps'], '{:.2f}')} | "
                        f"{_f(l['decode_tps'], '{:.2f}')} | {_f(p['load_s'], '{:.2f}')} / {_f(l['load_s'], '{:.2f}')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vault", nargs="?")
    ap.add_argument("--gguf", required=True, help="the same weights as a GGUF (scripts/export_gguf.py)")
    ap.add_argument("--prompt-lengths", default="8,45", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--cache-frac", type=float, default=0.1, help="pysmoe cache for the cold mode, of the expert bytes")
    ap.add_argument("--ctx", type=int, default=None,
                    help="context of both engines (sizes pysmoe's KV and llama.cpp's; default: 512, or the longest "
                         "prompt + decode tokens + 2 when that is more)")
    ap.add_argument("--modes", default="check,warm,cold")
    ap.add_argument("--blocks", action="store_true",
                    help="warm mode in blocks, NOT alternated: all pysmoe repeats, then all llama.cpp repeats, one "
                         "engine in memory at a time, the page cache dropped before each block (for a model that "
                         "does not fit in memory twice)")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="--blocks without dropping the page cache between blocks (tests; small models)")
    ap.add_argument("--no-repack-warm", action="store_true", help="warm llama.cpp without its CPU weight repacking")
    ap.add_argument("--repack-cold", action="store_true",
                    help="cold llama.cpp with repacking (copies the experts to anonymous memory: OOM in the cgroup)")
    ap.add_argument("--omp-active", action="store_true",
                    help="leave libgomp's spinning wait policy (default: OMP_WAIT_POLICY=PASSIVE for llama.cpp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--json", default=None)
    # worker side
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup-procs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-repack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--logits-all", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's log on stderr")
    args = ap.parse_args(argv)
    if args._worker:
        return _worker_main(args)
    if not args.vault:
        ap.error("VAULT is required")
    if args.ctx is None:
        args.ctx = max(512, max(args.prompt_lengths) + args.decode_tokens + 2)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("check", "warm", "cold")]
    if bad:
        ap.error(f"unknown mode(s) {','.join(bad)}: choose from check,warm,cold")
    from pysmoe import open_vault
    with open_vault(args.vault) as v:
        vault_info = {"layers": v.config["num_hidden_layers"], "sparse_layers": v.num_sparse_layers,
                      "experts": v.config["num_experts"], "top_k": v.config["num_experts_per_tok"],
                      "hidden_size": v.config["hidden_size"], "blob_bytes": v.blob_bytes,
                      "expert_bytes": v.expert_bytes, "dense_bytes": v.dense_bytes}
    res = {"omp_wait_policy": "active (default)" if args.omp_active else os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "vault": str(args.vault), "vault_info": vault_info, "gguf": str(args.gguf), "argv": sys.argv,
           "threads": args.threads, "repeats": args.repeats, "decode_tokens": args.decode_tokens,
           "prompt_lengths": args.prompt_lengths, "ctx": args.ctx, "cache_frac": args.cache_frac,
           "warm_blocks": args.blocks, "loadavg_start": list(os.getloadavg()),
           "pysmoe_activations": "q8", "pysmoe_kernels": _pysmoe_kernels(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import llama_cpp
        res["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        log("llama-cpp-python is not installed (pip install llama-cpp-python): nothing to compare against")
        return 2
    for m in modes:
        fn = {"check": mode_check, "warm": mode_warm_blocks if args.blocks else mode_warm, "cold": mode_cold}[m]
        res[m] = fn(args.vault, args.gguf, args, log)
        res[f"loadavg_after_{m}"] = list(os.getloadavg())
        if args.json:  # after each mode, so that a long run that dies leaves what it measured
            pathlib.Path(args.json).write_text(json.dumps(dict(res, partial=True), indent=1, default=str) + "\n")
    res["loadavg_end"] = list(os.getloadavg())
    print(table(res))
    if (res.get("warm") or {}).get("alternated") is False:
        print("warm ran in blocks, NOT alternated (--blocks): all pysmoe repeats, then all llama.cpp repeats, one "
              "engine in memory at a time; the load average of each block is in the JSON (warm.blocks).")
    print(f"load average: start {res['loadavg_start']}, end {res['loadavg_end']} ({os.cpu_count()} CPUs)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(res, partial=False), indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
