#!/usr/bin/env python3
"""pysmoe against llama.cpp on the same weights: TTFT and decode tokens/s, side by side.

    .venv/bin/python bench/peer.py --gguf MODEL-Q4_K_M.gguf [--prompt-lengths 8,45] ...  # one file, both engines
    .venv/bin/python scripts/export_gguf.py VAULT OUT.gguf    # or: a vault's weights requantised for llama.cpp
    .venv/bin/python bench/peer.py VAULT --gguf OUT.gguf [--prompt-lengths 8,45] [--threads 2] \
        [--llama-threads 1,2] [--omp-policies default,passive] [--repeats 3] [--decode-tokens 16] \
        [--modes check,warm,cold] [--blocks] [--cache-frac 0.1] [--readahead-kb 128,8192] [--json OUT]

llama.cpp runs through llama-cpp-python in child processes of this one (workers speaking JSON
lines on stdin/stdout), one per OpenMP wait policy (--omp-policies: libgomp's default, which spins
at barriers before it sleeps, and PASSIVE), each at every --llama-threads count; pysmoe runs in
this process (warm) or in a child worker (cold). All contenders take turns, run by run (rotated
each repeat); every figure is a median of --repeats runs, and llama.cpp's figure is that of its
fastest variant for that figure (named in the table and JSON). Modes (bench/peer.md says why each
is set up as it is):

check  llama.cpp's logits against pysmoe's for every position of the longest prompt (argmax
       agreement, correlation): both engines run the same model (the same bytes when VAULT is
       left out and pysmoe imports the GGUF; up to Q4_0 vs q4 with export_gguf.py's file).
warm   everything in memory: pysmoe with a cache that holds every expert, warmed; llama.cpp with
       the model loaded (mmap, its default CPU repacking) and warmed by the same prompt. Needs
       memory for the model 1 + len(policies) times; --blocks runs it NOT alternated, one engine
       at a time (page cache dropped before each block), for a model that does not fit.
cold   the model does not fit: budget = pysmoe's stats()["resident_bytes"] with a cache of
       --cache-frac of the expert bytes. Each run is a fresh worker that joins a fresh memory
       cgroup before it loads anything: llama.cpp's limited to the budget; pysmoe's to the
       smallest limit it survives, searched up from the same budget and reported (--pysmoe-limit).
       Page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each run. Run at each
       --readahead-kb value set on the disk that holds the vault and GGUF (restored afterwards);
       the first is the headline. The headline figure is load + TTFT. Needs root and a cgroup
       memory controller; skipped with a message otherwise.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import pathlib
import signal
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


# ================================================================== workers (children)

def _kib_fields(path, names):
    """{name: bytes} of the `name: N kB` lines of a /proc file (status, smaps_rollup, meminfo); {}
    where unreadable."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, rest = line.partition(":")
                words = rest.split()
                if k in names and words:
                    out[k] = int(words[0]) * 1024
    except OSError:
        pass
    return out


def _vm_hwm():
    """This process's peak resident set (VmHWM), bytes."""
    return _kib_fields("/proc/self/status", ("VmHWM",)).get("VmHWM")


def _join_cgroup(procs):
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def _pysmoe_worker_main(args) -> int:
    """Runs in the child: join the cgroup first, then open the vault and a session with a cache of
    --cache-bytes (timed as load; < 0: the cache `pysmoe run` would choose here, pysmoe.memory's
    default under this cgroup's limit), then serve one or more runs. The cold mode's pysmoe side."""
    if args.cgroup_procs:
        _join_cgroup(args.cgroup_procs)
    t0 = time.perf_counter()
    from pysmoe import open_vault
    v = open_vault(args.vault)
    cache = args.cache_bytes
    if cache < 0:
        from pysmoe.memory import default_cache_bytes
        cache = default_cache_bytes(v, args.ctx)
    s = v.session(cache_bytes=cache, threads=args.threads, context=args.ctx)
    s.clear_cache()
    load_s = time.perf_counter() - t0

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "load_s": load_s, "kernels": _pysmoe_kernels()})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        rec = pysmoe_run(s, np.array(req["ids"], dtype=np.int32), req.get("decode", 0), req.get("decode_max_s"))
        st = s.stats()
        rec.update(direct_io=st["direct_io"], resident_bytes=st["resident_bytes"], bytes_read=st["bytes_read"],
                   vm_hwm_bytes=_vm_hwm(), cache_bytes=cache)
        reply(rec)
    s.close()
    v.close()
    return 0


def _worker_main(args) -> int:
    """Runs in the child: optionally join a cgroup first, load the GGUF, then serve requests."""
    if args.cgroup_procs:
        _join_cgroup(args.cgroup_procs)
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
    threads = args.threads
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
            if req.get("threads") and req["threads"] != threads:
                threads = int(req["threads"])
                llama_cpp.llama_set_n_threads(ctx, threads, threads)
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(last_logits()))
            ttft = time.perf_counter() - t0
            toks = [tok]
            t1 = time.perf_counter()
            limit = req.get("decode_max_s")
            for _ in range(req.get("decode", 0)):
                if limit and toks[1:] and time.perf_counter() - t1 > limit:
                    break
                llm.eval([tok])
                tok = int(np.argmax(last_logits()))
                toks.append(tok)
            dec = time.perf_counter() - t1
            reply({"ttft_s": ttft, "decode_s": dec, "tokens": toks, "threads": threads, "vm_hwm_bytes": _vm_hwm()})
        elif op == "logits":  # every position's logits (needs logits_all), saved to a .npy
            ids = [int(i) for i in req["ids"]]
            llm.reset()
            llm.eval(ids)
            np.save(req["out"], np.array(llm.scores[:len(ids)], dtype=np.float32))
            reply({"ok": True})
    return 0


OMP_POLICIES = ("default", "passive", "active")


def omp_env(policy: str) -> dict:
    """The environment of a llama.cpp worker under one libgomp wait policy: "default" leaves
    OMP_WAIT_POLICY unset (libgomp then spins at each barrier for a while before it sleeps),
    "passive" and "active" set it."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


class Worker:
    """A child process of this script speaking JSON lines on stdin/stdout; its first line is
    {"ready": true, "load_s": ...}."""

    what = "worker"

    def __init__(self, cmd, env=None, verbose=False):
        self.t_spawn = time.perf_counter()
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  stderr=None if verbose else subprocess.DEVNULL)
        try:
            hello = self._read()
        except BaseException:
            self.close()
            raise
        self.load_s = hello["load_s"]
        self.hello = hello
        self.spawn_to_ready_s = time.perf_counter() - self.t_spawn

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait()
            raise WorkerDied(f"{self.what} worker died (exit {rc}{', killed: OOM?' if rc in (-9, 137) else ''})", rc)
        return json.loads(line)

    def call(self, **req):
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        return self._read()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"op": "quit"}\n')
                self.p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


class WorkerDied(RuntimeError):
    def __init__(self, msg, rc):
        super().__init__(msg)
        self.rc = rc


class LlamaWorker(Worker):
    """A llama.cpp child process (see _worker_main) under one OpenMP wait policy (omp_env)."""

    what = "llama.cpp"

    def __init__(self, gguf, threads, ctx, *, policy="passive", cgroup_procs=None, no_repack=False, logits_all=False,
                 verbose=False):
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
        self.policy = policy
        super().__init__(cmd, env=omp_env(policy), verbose=verbose)


class PysmoeWorker(Worker):
    """A pysmoe child process (see _pysmoe_worker_main): joins the cgroup before it imports pysmoe
    or opens the vault, as the llama.cpp worker does before it loads the GGUF."""

    what = "pysmoe"

    def __init__(self, vault, cache_bytes, threads, ctx, *, cgroup_procs=None, env=None, verbose=False):
        cmd = [sys.executable, __file__, "--gguf", "-", "--_pysmoe-worker", str(vault), "--cache-bytes",
               str(int(cache_bytes)), "--threads", str(threads), "--ctx", str(ctx)]
        if cgroup_procs:
            cmd += ["--cgroup-procs", str(cgroup_procs)]
        super().__init__(cmd, env=env, verbose=verbose)


# ================================================================== memory cgroup

HOST_LEAF = "smoe-peer-host"


def _delegate(parent: str, controller: str) -> None:
    """Enables `controller` for the children of cgroup v2 group `parent`. cgroup v2 lets a group
    other than the root hand a controller to its children only while it holds no process itself
    (writing cgroup.subtree_control fails with EBUSY): where it does (a container or VM whose
    processes sit in one group), they all move first into a leaf child, HOST_LEAF, beside the
    limited groups this script makes."""
    sub = os.path.join(parent, "cgroup.subtree_control")
    with open(sub) as f:
        if controller in f.read().split():
            return
    try:
        with open(sub, "w") as f:
            f.write("+" + controller)
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    leaf = os.path.join(parent, HOST_LEAF)
    os.makedirs(leaf, exist_ok=True)
    for _ in range(5):  # processes may fork while they move
        with open(os.path.join(parent, "cgroup.procs")) as f:
            pids = f.read().split()
        if not pids:
            break
        for pid in pids:
            try:
                with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                    f.write(pid)
            except OSError:  # gone meanwhile, or not movable (then the write below says so)
                pass
    with open(sub, "w") as f:
        f.write("+" + controller)


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
            if os.path.basename(rel) == HOST_LEAF:  # moved there by _delegate: its parent delegates
                rel = os.path.dirname(rel)
            parent = "/sys/fs/cgroup" + rel
            ctl = open(os.path.join(parent, "cgroup.controllers")).read().split()
            if "memory" not in ctl:
                raise OSError(f"cgroup v2: the memory controller is not available in {parent}")
            _delegate(parent, "memory")
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

def pysmoe_run(session, ids, n_decode, max_s=None):
    """Prefill ids (TTFT up to the first token's argmax), then up to n_decode greedy steps (fewer
    if max_s seconds of decode have passed: the record's tokens say how many)."""
    session.reset()
    t0 = time.perf_counter()
    logits = session.prefill(ids)
    tok = int(np.argmax(logits))
    ttft = time.perf_counter() - t0
    toks = [tok]
    t1 = time.perf_counter()
    for _ in range(n_decode):
        if max_s and toks[1:] and time.perf_counter() - t1 > max_s:
            break
        tok = int(np.argmax(session.decode(tok)))
        toks.append(tok)
    return {"ttft_s": ttft, "decode_s": time.perf_counter() - t1, "tokens": toks}


def _tps(rec, n):
    """Decode tokens/s of one run: the steps it made (n, or fewer when --decode-max-s cut it)."""
    if "tokens" in rec:
        n = len(rec["tokens"]) - 1
    return n / rec["decode_s"] if n and rec.get("decode_s") else None


# ================================================================== modes

def every_expert_bytes(v) -> int:
    """A cache budget that holds every expert of open vault v (one blob per layer of slack for the
    slots a step holds while it reads)."""
    return v.expert_bytes + v.blob_bytes * v.num_sparse_layers


def mode_check(vault, gguf, args, log):
    from pysmoe import open_vault
    n = max(args.prompt_lengths)
    v = open_vault(vault)
    ids = make_prompt(v.config["vocab_size"], n, args.seed)
    with v.session(cache_bytes=every_expert_bytes(v), threads=args.threads,
                   context=args.ctx) as s:
        ours = np.stack([s.decode(int(t)) for t in ids])   # logits after each position
    v.close()
    w = LlamaWorker(gguf, args.threads, args.ctx, logits_all=True, policy=args.omp_policies[0])
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


def vname(policy: str, threads: int) -> str:
    """A llama.cpp variant's name in the records: its wait policy and thread count."""
    return f"{policy} t{threads}"


def llama_variants(args) -> list[tuple[str, int]]:
    return [(p, t) for p in args.omp_policies for t in args.llama_threads]


def _rotated(xs, r):
    k = r % len(xs)
    return xs[k:] + xs[:k]


class PysmoeWarm:
    """pysmoe with every expert in memory: one session whose cache holds them all, warmed by a
    longer prompt (and each timed prompt once more, untimed, by prepare)."""
    name = "pysmoe"

    def __init__(self, vault, args, warm_ids):
        from pysmoe import open_vault
        t0 = time.perf_counter()
        self.v = open_vault(vault)
        self.cache = every_expert_bytes(self.v)
        try:
            self.s = self.v.session(cache_bytes=self.cache, threads=args.threads, context=args.ctx)
        except BaseException:
            self.v.close()
            raise
        self.load_s = time.perf_counter() - t0
        self.decode = args.decode_tokens
        pysmoe_run(self.s, warm_ids, 0)

    def prepare(self, ids, threads=None):
        pysmoe_run(self.s, ids, self.decode)
        self.s.reset_stats()

    def run(self, ids, threads=None):
        return pysmoe_run(self.s, ids, self.decode)

    def extra(self) -> dict:
        return {"cache_misses_timed": self.s.stats()["cache_misses"]}

    def close(self):
        self.s.close()
        self.v.close()


class PysmoeWarmAvx2:
    """pysmoe held to its AVX2 kernels (SMOE_NO_AVX512=1: the kernel choice is read once per
    process, so this one is a child worker), every expert in memory, warmed as PysmoeWarm: the
    AVX-512 kernels' gain measured in the same run as llama.cpp (--pysmoe-avx2)."""
    name = "pysmoe avx2"

    def __init__(self, vault, args, warm_ids):
        from pysmoe import open_vault
        with open_vault(vault) as v:
            cache = every_expert_bytes(v)
        self.w = PysmoeWorker(vault, cache, args.threads, args.ctx, env=dict(os.environ, SMOE_NO_AVX512="1"),
                              verbose=args.verbose)
        self.load_s = self.w.load_s
        self.kernels = self.w.hello.get("kernels")
        self.decode = args.decode_tokens
        self.w.call(op="run", ids=warm_ids.tolist(), decode=0)

    def prepare(self, ids, threads=None):
        self.w.call(op="run", ids=ids.tolist(), decode=self.decode)

    def run(self, ids, threads=None):
        r = self.w.call(op="run", ids=ids.tolist(), decode=self.decode)
        return {k: r[k] for k in ("ttft_s", "decode_s", "tokens")}

    def extra(self) -> dict:
        return {"kernels": self.kernels}

    def close(self):
        self.w.close()


class LlamaWarm:
    """llama.cpp under one OpenMP wait policy with the model loaded (mmap, its default CPU
    repacking unless --no-repack-warm), warmed the same way; each run may ask for a thread count
    (llama_set_n_threads), so one worker serves every --llama-threads setting."""
    name = "llama.cpp"

    def __init__(self, gguf, args, warm_ids, policy):
        self.w = LlamaWorker(gguf, args.llama_threads[0], args.ctx, no_repack=args.no_repack_warm, policy=policy)
        self.load_s = self.w.load_s
        self.decode = args.decode_tokens
        self.w.call(op="run", ids=warm_ids.tolist(), decode=0)

    def prepare(self, ids, threads=None):
        self.w.call(op="run", ids=ids.tolist(), decode=self.decode, threads=threads)

    def run(self, ids, threads=None):
        return self.w.call(op="run", ids=ids.tolist(), decode=self.decode, threads=threads)

    def extra(self) -> dict:
        return {}

    def close(self):
        self.w.close()


def _mem_available():
    from pysmoe.memory import available_memory
    return available_memory()


MEM_MARGIN = 3 << 29   # left free beside an engine holding a whole model: Python, KV, the rest of the machine


def warm_needs(vault, gguf) -> dict:
    """Bytes each engine holds with the whole model in memory: pysmoe its dense weights and a cache
    of every expert; one llama.cpp worker about its GGUF (the experts repacked into anonymous
    memory, the rest mapped)."""
    from pysmoe import open_vault
    with open_vault(vault) as v:
        pysmoe_b = v.dense_bytes + v.expert_bytes
    return {"pysmoe": pysmoe_b, "llama.cpp": os.path.getsize(gguf)}


def mode_warm(vault, gguf, args, log):
    """Everything in memory, pysmoe and one llama.cpp worker per wait policy open at once, runs
    alternated (rotated) run by run (needs room for the model 1 + len(policies) times; --blocks
    otherwise)."""
    from pysmoe import open_vault
    need = warm_needs(vault, gguf)
    avail = _mem_available()
    total = (1 + args.pysmoe_avx2) * need["pysmoe"] + len(args.omp_policies) * need["llama.cpp"] + MEM_MARGIN
    if avail is not None and total > avail:
        why = (f"{1 + args.pysmoe_avx2} pysmoe and {len(args.omp_policies)} llama.cpp workers (one per wait policy) holding the model at once "
               f"need about {total / MiB:,.0f} MiB (pysmoe {need['pysmoe'] / MiB:,.0f}, llama.cpp "
               f"{need['llama.cpp'] / MiB:,.0f} each, margin {MEM_MARGIN / MiB:,.0f}) and {avail / MiB:,.0f} MiB are "
               f"available: run it with --blocks")
        log(f"warm: SKIPPED: {why}")
        return {"skipped": why, "alternated": True}
    with open_vault(vault) as v:
        vocab = v.config["vocab_size"]
    warm_ids = make_prompt(vocab, min(args.ctx - args.decode_tokens - 2, 256), args.seed + 1)
    engines = {}
    out = {"alternated": True, "pysmoe_kernels": _pysmoe_kernels()}
    contenders = [("pysmoe", "pysmoe", None)] + [(vname(p, t), p, t) for p, t in llama_variants(args)]
    if args.pysmoe_avx2:
        contenders.insert(1, (PysmoeWarmAvx2.name, PysmoeWarmAvx2.name, None))
    try:
        # warm-up: a longer prompt pulls (nearly) every expert into pysmoe's cache and llama.cpp's
        # page cache / repacked buffers; then each timed prompt once more, untimed.
        engines["pysmoe"] = PysmoeWarm(vault, args, warm_ids)
        if args.pysmoe_avx2:
            engines[PysmoeWarmAvx2.name] = PysmoeWarmAvx2(vault, args, warm_ids)
            log(f"warm: pysmoe {_pysmoe_kernels()} in this process, {PysmoeWarmAvx2.name} "
                f"({engines[PysmoeWarmAvx2.name].kernels}) in a child")
        for pol in args.omp_policies:
            engines[pol] = LlamaWarm(gguf, args, warm_ids, pol)
            log(f"warm: llama.cpp ({pol}) loaded in {engines[pol].load_s:.2f} s")
        log(f"warm: pysmoe cache {engines['pysmoe'].cache / MiB:,.0f} MiB (every expert); contenders, rotated run by "
            f"run: {', '.join(c for c, _, _ in contenders)}")
        # pysmoe runs in this process: how much of it is on huge pages, and what the page cache is
        # still writing back (a machine's first minutes after a build), as the runs start
        mem = _kib_fields("/proc/self/smaps_rollup", ("Rss", "AnonHugePages"))
        mem.update(_kib_fields("/proc/meminfo", ("Dirty", "Writeback", "MemFree")))
        out["memory_at_start_mib"] = {k: round(v / MiB) for k, v in mem.items()}
        log("warm: at the start " + ", ".join(f"{k} {v:,} MiB" for k, v in out["memory_at_start_mib"].items()))
        for n in args.prompt_lengths:
            ids = make_prompt(vocab, n, args.seed)
            for _, e, t in contenders:
                engines[e].prepare(ids, t)
            runs = {c: [] for c, _, _ in contenders}
            for r in range(args.repeats):
                for c, e, t in _rotated(contenders, r):
                    if args.settle_ms:
                        time.sleep(args.settle_ms / 1000)
                    runs[c].append(dict(engines[e].run(ids, t), load_s=engines[e].load_s))
            out[n] = _summary(runs, n, args.decode_tokens)
            out[n]["pysmoe"].update(engines["pysmoe"].extra())
            if args.pysmoe_avx2:
                out[n]["pysmoe_avx2"].update(engines[PysmoeWarmAvx2.name].extra())
            log(_line("warm", n, out[n]))
    finally:
        for e in engines.values():
            e.close()
    return out


def mode_warm_blocks(vault, gguf, args, log):
    """Everything in memory, one engine at a time: all of pysmoe's repeats, then all of each
    llama.cpp wait policy's (its thread settings alternated within the block), each engine opened
    once and closed before the next opens, the page cache dropped before each block. For a model
    that does not fit in memory twice (the full a3b: an 18 GB vault and an 18 GB GGUF on a 24 GB
    machine). NOT alternated between engines: the blocks run minutes apart, so a change in the
    machine's load between them moves the ratio; each block's load average is recorded."""
    from pysmoe import open_vault
    with open_vault(vault) as v:
        vocab = v.config["vocab_size"]
    warm_ids = make_prompt(vocab, min(args.ctx - args.decode_tokens - 2, 256), args.seed + 1)
    need = warm_needs(vault, gguf)
    block_list = [("pysmoe", None, [("pysmoe", None)])] + [
        (f"llama.cpp {p}", p, [(vname(p, t), t) for t in args.llama_threads]) for p in args.omp_policies]
    runs = {n: {c: [] for _, _, cs in block_list for c, _ in cs} for n in args.prompt_lengths}
    extra = {n: {} for n in args.prompt_lengths}
    blocks = {}
    log("warm in blocks: NOT alternated (all pysmoe repeats, then all llama.cpp repeats of each wait policy, one engine "
        f"in memory at a time{'' if args.no_drop_caches else ', the page cache dropped before each'}): the machine's "
        "load may differ between the blocks")
    for who, policy, cs in block_list:
        kind = "pysmoe" if policy is None else "llama.cpp"
        info = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dropped_caches": False, "skipped": None,
                "need_bytes": need[kind]}
        if not args.no_drop_caches:
            try:
                drop_caches()
                info["dropped_caches"] = True
            except OSError as e:
                log(f"warm {who} block: could not drop the page cache ({e}); continuing without")
        avail = _mem_available()
        info["mem_available_bytes"] = avail
        info["loadavg_before"] = list(os.getloadavg())
        if avail is not None and need[kind] + MEM_MARGIN > avail:
            info["skipped"] = (f"{who} holding the model needs about {(need[kind] + MEM_MARGIN) / MiB:,.0f} MiB "
                               f"(with a {MEM_MARGIN / MiB:,.0f} MiB margin), {avail / MiB:,.0f} MiB available")
            log(f"warm {who} block: SKIPPED: {info['skipped']}")
            blocks[who] = info
            continue
        t0 = time.perf_counter()
        e = PysmoeWarm(vault, args, warm_ids) if policy is None else LlamaWarm(gguf, args, warm_ids, policy)
        info["load_s"] = e.load_s
        try:
            for n in args.prompt_lengths:
                ids = make_prompt(vocab, n, args.seed)
                for _, t in cs:
                    e.prepare(ids, t)
                for r in range(args.repeats):
                    for c, t in _rotated(cs, r):
                        runs[n][c].append(dict(e.run(ids, t), load_s=e.load_s))
                if policy is None:
                    extra[n] = e.extra()
                for c, _ in cs:
                    log(f"warm {c} block n={n}: TTFT {_f(_median([x['ttft_s'] for x in runs[n][c]]))} s")
        finally:
            e.close()
        info["seconds"] = time.perf_counter() - t0
        info["loadavg_after"] = list(os.getloadavg())
        blocks[who] = info
    out = {"alternated": False, "blocks": blocks,
           "note": "not alternated: all pysmoe repeats, then all llama.cpp repeats of each wait policy, one engine in "
                   "memory at a time (the model does not fit twice); ratios are of medians taken in different blocks"}
    for n in args.prompt_lengths:
        out[n] = _summary(runs[n], n, args.decode_tokens)
        out[n]["pysmoe"].update(extra[n])
        log(_line("warm (blocks)", n, out[n]))
    return out


# ================================================================== block-device readahead

def readahead_queues(paths) -> list[str]:
    """The read_ahead_kb files of the whole disks that hold these files: the file's st_dev is
    MAJ:MIN, /sys/dev/block/MAJ:MIN links to its block device, and a partition's (it has a
    `partition` file) queue is its parent disk's."""
    out = []
    for path in paths:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sysdir = os.path.realpath(f"/sys/dev/block/{dev}")
        if not os.path.isdir(sysdir):
            raise OSError(f"{path}: device {dev} is not a block device (/sys/dev/block/{dev} missing)")
        if os.path.exists(os.path.join(sysdir, "partition")):
            sysdir = os.path.dirname(sysdir)
        q = os.path.join(sysdir, "queue", "read_ahead_kb")
        if not os.path.exists(q):
            raise OSError(f"{path}: no {q}")
        if q not in out:
            out.append(q)
    return out


class Readahead:
    """Sets read_ahead_kb on the given queues for a `with` block and ALWAYS puts the original
    values back on the way out (an exception, Ctrl-C, or SIGTERM: main turns it into SystemExit).
    The setting is the disk's, machine-wide, for as long as the block runs."""

    def __init__(self, queues, kb):
        self.queues, self.kb, self.orig = list(queues), kb, {}

    def __enter__(self):
        for q in self.queues:
            self.orig[q] = int(open(q).read())
        try:
            for q in self.queues:
                with open(q, "w") as f:
                    f.write(str(self.kb))
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self):
        for q, v in self.orig.items():
            try:
                with open(q, "w") as f:
                    f.write(str(v))
            except OSError as e:
                print(f"peer.py: could not restore {q} to {v}: {e}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self.restore()
        return False


# ================================================================== cold mode

def cold_run(limit, start, ids, n_decode, tag, decode_max_s=None):
    """One cold run: a fresh memory cgroup limited to `limit`, a fresh worker (start(procs_file))
    that joins it before it loads anything, the prompt and the decode; the cgroup's peak and OOM
    kills recorded; the group removed. A worker that dies (OOM) gives a record with an error."""
    cg = MemCgroup(limit, name=f"smoe-peer-{os.getpid()}-{tag}")
    try:
        try:
            w = start(cg.procs_file)
            try:
                rec = w.call(op="run", ids=ids.tolist(), decode=n_decode, decode_max_s=decode_max_s)
                rec["load_s"] = w.load_s
            finally:
                w.close()
        except WorkerDied as e:
            rec = {"error": str(e), "ttft_s": None, "decode_s": None}
        rec["limit_bytes"] = limit
        rec["cgroup_peak_bytes"] = cg.peak()
        rec["oom_kills"] = cg.oom_kills() or 0
    finally:
        cg.remove()
    return rec


def find_pysmoe_limit(budget, run_at, log, resolution=8 * MiB, confirm=2):
    """The smallest cgroup limit (to `resolution`) at which pysmoe's worker survives one run of the
    longest prompt and the decode, starting at `budget` (its own resident_bytes): first the budget,
    then budget + 16, 32, 64, ... MiB until a run survives, then bisection; then `confirm` more runs
    at the limit found, raised by `resolution` each time one is killed (a run once survived a limit
    that a later one did not: the peak moves a few MiB from run to run). Also one run under a
    generous limit (2 × budget + 1 GiB) for the cgroup's unconstrained peak. Returns a dict."""
    trials = []

    def trial(limit):
        rec = run_at(limit)
        ok = rec.get("error") is None
        trials.append({"limit_bytes": limit, "survived": ok, "cgroup_peak_bytes": rec.get("cgroup_peak_bytes"),
                       "vm_hwm_bytes": rec.get("vm_hwm_bytes"), "oom_kills": rec.get("oom_kills")})
        log(f"cold: pysmoe at a cgroup limit of {limit / MiB:,.1f} MiB (budget + {(limit - budget) / MiB:,.1f}): "
            f"{'ran' if ok else 'killed (' + str(rec.get('error')) + ')'}, cgroup peak "
            f"{_f((rec.get('cgroup_peak_bytes') or 0) / MiB, '{:,.1f}')} MiB, VmHWM "
            f"{_f((rec.get('vm_hwm_bytes') or 0) / MiB, '{:,.1f}')} MiB")
        return ok

    free = trial(2 * budget + (1 << 30))
    unconstrained = trials[-1]
    found = None
    if trial(budget):
        found = budget
    else:
        lo, step = budget, 16 * MiB
        while step <= 4 << 30:
            if trial(budget + step):
                found = budget + step
                break
            lo, step = budget + step, step * 2
        while found is not None and found - lo > resolution:
            mid = (lo + found) // 2 // MiB * MiB
            if trial(mid):
                found = mid
            else:
                lo = mid
    ok_in_a_row = 0
    while found is not None and ok_in_a_row < confirm and found - budget <= 4 << 30:
        if trial(found):
            ok_in_a_row += 1
        else:
            found, ok_in_a_row = found + resolution, 0
    return {"budget_bytes": budget, "limit_bytes": found, "extra_bytes": None if found is None else found - budget,
            "unconstrained_peak_bytes": unconstrained["cgroup_peak_bytes"] if free else None,
            "unconstrained_vm_hwm_bytes": unconstrained["vm_hwm_bytes"] if free else None, "trials": trials}


def mode_cold(vault, gguf, args, log):
    from pysmoe import open_vault
    v = open_vault(vault)
    vocab = v.config["vocab_size"]
    cache = int(args.cache_frac * v.expert_bytes)
    if args.budget_mib is not None:  # a fixed budget: the cache is what fills it
        want = int(args.budget_mib * MiB)

        def resident(c):
            with v.session(cache_bytes=c, threads=args.threads, context=args.ctx) as s:
                return s.stats()["resident_bytes"]

        # the largest cache (in whole blobs) whose resident bytes stay within the budget: the engine
        # rounds a budget to slots and keeps a least number of them, so search rather than subtract
        lo, hi = 0, max(0, want) // v.blob_bytes + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if resident(mid * v.blob_bytes) <= want else (lo, mid)
        cache = lo * v.blob_bytes
        if resident(cache) > want:
            raise SystemExit(f"--budget-mib {args.budget_mib:g}: pysmoe needs {resident(cache) / MiB:,.1f} MiB "
                             f"with its least cache")
        args.cache_frac = cache / v.expert_bytes
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
        MemCgroup(budget, name=f"smoe-peer-{os.getpid()}-probe").remove()
    except (OSError, PermissionError) as e:
        log(f"cold: SKIPPED: {e}")
        return {"skipped": str(e), **info}
    try:
        queues = readahead_queues([vault, gguf])
        ras = list(args.readahead_kb)
        info["readahead_queues"] = {q: int(open(q).read()) for q in queues}
    except OSError as e:
        queues, ras = [], [None]
        info["readahead_note"] = f"readahead left as it is: {e}"
        log(f"cold: {info['readahead_note']}")
    cold_llama = [(p, t) for p, t in llama_variants(args)]

    own_cache = args.pysmoe_limit == "own-cache"
    wcache = -1 if own_cache else cache  # -1: the worker's own choice under its limit

    def pysmoe_at(limit, ids, tag):
        return cold_run(limit, lambda procs: PysmoeWorker(vault, wcache, args.threads, args.ctx, cgroup_procs=procs,
                                                          verbose=args.verbose), ids, args.decode_tokens, tag,
                        args.decode_max_s)

    def llama_at(policy, threads, ids, tag):
        return cold_run(budget, lambda procs: LlamaWorker(gguf, threads, args.ctx, policy=policy, cgroup_procs=procs,
                                                          no_repack=not args.repack_cold, verbose=args.verbose),
                        ids, args.decode_tokens, tag, args.decode_max_s)

    longest = make_prompt(vocab, max(args.prompt_lengths), args.seed)

    def calib_run(limit):
        drop_caches()
        return pysmoe_at(limit, longest, "calib")

    # pysmoe in its own cgroup: at its own budget, or at the smallest limit it survives (reported).
    if args.pysmoe_limit == "find":
        fit = find_pysmoe_limit(budget, calib_run, log)
        if fit["limit_bytes"] is None:
            log("cold: SKIPPED: pysmoe did not survive a limit of its budget + 4 GiB")
            return {"skipped": "pysmoe killed at every cgroup limit tried", "pysmoe_fit": fit, **info}
    else:
        fit = {"budget_bytes": budget, "limit_bytes": budget, "extra_bytes": 0, "trials": [],
               "note": "not searched" + (": pysmoe in the budget itself, with the cache it chooses there"
                                         if own_cache else "")}
    info["pysmoe_fit"] = fit
    plimit = fit["limit_bytes"]
    log(f"cold: pysmoe runs in a cgroup of {plimit / MiB:,.1f} MiB (its budget + {fit['extra_bytes'] / MiB:,.1f} MiB), "
        f"llama.cpp in one of {budget / MiB:,.1f} MiB")
    contenders = ["pysmoe"] + [vname(p, t) for p, t in cold_llama]
    out = {"info": info, "headline_readahead_kb": ras[0], "by_readahead_kb": {}}
    for ra in ras:
        res_ra = {}
        ctxm = Readahead(queues, ra) if ra is not None else None
        if ctxm:
            ctxm.__enter__()
        try:
            log(f"cold: read_ahead_kb = {ra if ra is not None else 'unchanged'}")
            for n in args.prompt_lengths:
                ids = make_prompt(vocab, n, args.seed)
                runs = {c: [] for c in contenders}
                for r in range(args.repeats):
                    for c in _rotated(contenders, r):
                        drop_caches()
                        if c == "pysmoe":
                            rec = pysmoe_at(plimit, ids, "pysmoe")
                        else:
                            p, t = c.split(" t")
                            rec = llama_at(p, int(t), ids, c.replace(" ", "-"))
                        runs[c].append(rec)
                res_ra[n] = _summary(runs, n, args.decode_tokens)
                ps = res_ra[n]["pysmoe"]
                ps["direct_io"] = all(r.get("direct_io") for r in runs["pysmoe"] if "error" not in r)
                ps["limit_mib"] = plimit / MiB
                ps["cache_mib"] = [r["cache_bytes"] / MiB for r in runs["pysmoe"] if "cache_bytes" in r]
                for c in contenders:
                    tgt = ps if c == "pysmoe" else res_ra[n]["llama.cpp_variants"][c]
                    tgt["cgroup_peak_mib"] = max((r.get("cgroup_peak_bytes") or 0) for r in runs[c]) / MiB
                    tgt["vm_hwm_mib"] = max((r.get("vm_hwm_bytes") or 0) for r in runs[c]) / MiB
                    tgt["oom_kills"] = sum(r.get("oom_kills") or 0 for r in runs[c])
                log(_line(f"cold ra={ra}", n, res_ra[n]))
                out["by_readahead_kb"][str(ra)] = res_ra
                if getattr(args, "save_partial", None):   # a long run that dies keeps what it measured
                    args.save_partial("cold", out)
        finally:
            if ctxm:
                ctxm.__exit__(None, None, None)
        out["by_readahead_kb"][str(ra)] = res_ra
    out.update(out["by_readahead_kb"][str(ras[0])])   # cold[n]: the headline readahead (plot.py reads these)
    return out


# ================================================================== summaries and tables

def _stats(rs, n, n_decode):
    ok = [r for r in rs if r.get("ttft_s") is not None]
    t = _median([r["ttft_s"] for r in ok])
    lt = [r["load_s"] + r["ttft_s"] for r in ok if r.get("load_s") is not None]
    return {"ttft_s": t, "ttft_all_s": [r["ttft_s"] for r in ok], "prefill_tps": n / t if t else None,
            "decode_tps": _median([_tps(r, n_decode) for r in ok if r.get("decode_s") is not None]),
            "decode_all_tps": [_tps(r, n_decode) for r in ok if r.get("decode_s") is not None],
            "load_s": _median([r.get("load_s") for r in ok]), "load_plus_ttft_s": _median(lt),
            "first_tokens": ok[0].get("tokens", [])[:8] if ok else [],
            "errors": [r["error"] for r in rs if "error" in r]}


def _summary(runs, n, n_decode):
    """Medians per contender; "llama.cpp" is the best llama.cpp variant for each figure (lowest
    TTFT, lowest load + TTFT, highest decode tok/s), with the variant that set it (`*_by`)."""
    per = {c: _stats(rs, n, n_decode) for c, rs in runs.items()}
    p = per.pop("pysmoe")
    p2 = per.pop(PysmoeWarmAvx2.name, None)

    def best(key, pick):
        cands = [(v[key], c) for c, v in per.items() if v[key] is not None]
        return pick(cands) if cands else (None, None)

    t, t_by = best("ttft_s", min)
    d, d_by = best("decode_tps", max)
    lt, lt_by = best("load_plus_ttft_s", min)
    l = {"ttft_s": t, "ttft_by": t_by, "ttft_all_s": per[t_by]["ttft_all_s"] if t_by else [],
         "prefill_tps": n / t if t else None, "decode_tps": d, "decode_by": d_by,
         "load_s": per[lt_by]["load_s"] if lt_by else None, "load_plus_ttft_s": lt, "load_plus_ttft_by": lt_by,
         "first_tokens": per[t_by]["first_tokens"] if t_by else [],
         "errors": [e for v in per.values() for e in v["errors"]]}

    def ratio(a, b):
        return a / b if a and b else None

    out = {"pysmoe": p, "llama.cpp": l, "llama.cpp_variants": per,
           "ttft_ratio_llama_over_pysmoe": ratio(t, p["ttft_s"]),
           "load_ttft_ratio_llama_over_pysmoe": ratio(lt, p["load_plus_ttft_s"]),
           "decode_ratio_pysmoe_over_llama": ratio(p["decode_tps"], d)}
    if p2 is not None:   # the same pysmoe on its AVX2 kernels (--pysmoe-avx2)
        out["pysmoe_avx2"] = p2
        out["avx2_ttft_ratio_llama_over_pysmoe"] = ratio(t, p2["ttft_s"])
        out["avx2_decode_ratio_pysmoe_over_llama"] = ratio(p2["decode_tps"], d)
        out["ttft_ratio_avx2_over_default"] = ratio(p2["ttft_s"], p["ttft_s"])
        out["decode_ratio_default_over_avx2"] = ratio(p["decode_tps"], p2["decode_tps"])
    return out


def _f(x, fmt="{:.3f}"):
    return "—" if x is None else fmt.format(x)


def _line(mode, n, r):
    p, l = r["pysmoe"], r["llama.cpp"]
    return (f"{mode} n={n}: TTFT pysmoe {_f(p['ttft_s'])} s, llama.cpp {_f(l['ttft_s'])} s [{l['ttft_by']}] "
            f"(llama/pysmoe {_f(r['ttft_ratio_llama_over_pysmoe'], '{:.2f}')}×); load+TTFT pysmoe "
            f"{_f(p['load_plus_ttft_s'])} s, llama.cpp {_f(l['load_plus_ttft_s'])} s [{l['load_plus_ttft_by']}]; "
            f"decode pysmoe {_f(p['decode_tps'], '{:.2f}')} tok/s, llama.cpp {_f(l['decode_tps'], '{:.2f}')} tok/s "
            f"[{l['decode_by']}]")


def _rows(m):
    return [(n, r) for n, r in m.items() if isinstance(r, dict) and "ttft_ratio_llama_over_pysmoe" in r]


def table(res) -> str:
    """Markdown: the warm table, the cold table (every readahead), and each llama.cpp variant's
    medians. llama.cpp's figures are its best variant's, named in brackets."""
    out = []
    m = res.get("warm") or {}
    if _rows(m):
        label = "warm (blocks, not alternated)" if m.get("alternated") is False else "warm"
        out += [f"{label}:", "",
                "| prompt | pysmoe TTFT s | llama.cpp TTFT s [best] | llama/pysmoe TTFT | pysmoe prefill tok/s | "
                "llama.cpp prefill tok/s | pysmoe decode tok/s | llama.cpp decode tok/s [best] | pysmoe/llama decode |",
                "|---|---|---|---|---|---|---|---|---|"]
        for n, r in _rows(m):
            p, l = r["pysmoe"], r["llama.cpp"]
            out.append(f"| {n} | {_f(p['ttft_s'])} | {_f(l['ttft_s'])} [{l['ttft_by']}] | "
                       f"{_f(r['ttft_ratio_llama_over_pysmoe'], '{:.2f}')}× | {_f(p['prefill_tps'], '{:.1f}')} | "
                       f"{_f(l['prefill_tps'], '{:.1f}')} | {_f(p['decode_tps'], '{:.2f}')} | "
                       f"{_f(l['decode_tps'], '{:.2f}')} [{l['decode_by']}] | "
                       f"{_f(r['decode_ratio_pysmoe_over_llama'], '{:.2f}')}× |")
        out.append("")
        if any("pysmoe_avx2" in r for _, r in _rows(m)):
            out += [f"pysmoe's own kernels ({m.get('pysmoe_kernels')}) against its AVX2 ones (SMOE_NO_AVX512=1), "
                    "same run:", "",
                    "| prompt | TTFT s own / avx2 | avx2/own TTFT | decode tok/s own / avx2 | own/avx2 decode | "
                    "llama/pysmoe-avx2 TTFT | pysmoe-avx2/llama decode |", "|---|---|---|---|---|---|---|"]
            for n, r in _rows(m):
                p, a = r["pysmoe"], r.get("pysmoe_avx2")
                if a:
                    out.append(f"| {n} | {_f(p['ttft_s'])} / {_f(a['ttft_s'])} | "
                               f"{_f(r['ttft_ratio_avx2_over_default'], '{:.2f}')}× | {_f(p['decode_tps'], '{:.2f}')} / "
                               f"{_f(a['decode_tps'], '{:.2f}')} | {_f(r['decode_ratio_default_over_avx2'], '{:.2f}')}× | "
                               f"{_f(r['avx2_ttft_ratio_llama_over_pysmoe'], '{:.2f}')}× | "
                               f"{_f(r['avx2_decode_ratio_pysmoe_over_llama'], '{:.2f}')}× |")
            out.append("")
    c = res.get("cold") or {}
    if c.get("by_readahead_kb"):
        info = c.get("info", {})
        fit = info.get("pysmoe_fit", {})
        out += [f"cold (budget {info.get('budget_bytes', 0) / MiB:,.1f} MiB for llama.cpp; pysmoe's cgroup "
                f"{_f((fit.get('limit_bytes') or 0) / MiB, '{:,.1f}')} MiB; headline readahead "
                f"{c.get('headline_readahead_kb')} KiB):", "",
                "| read_ahead_kb | prompt | pysmoe load+TTFT s | llama.cpp load+TTFT s [best] | llama/pysmoe load+TTFT | "
                "pysmoe TTFT s | llama.cpp TTFT s [best] | llama/pysmoe TTFT | pysmoe decode tok/s | "
                "llama.cpp decode tok/s [best] | pysmoe/llama decode | peak MiB pysmoe / llama.cpp |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for ra, rr in c["by_readahead_kb"].items():
            for n, r in _rows(rr):
                p, l = r["pysmoe"], r["llama.cpp"]
                lpk = max((v.get("cgroup_peak_mib") or 0) for v in r["llama.cpp_variants"].values())
                out.append(f"| {ra} | {n} | {_f(p['load_plus_ttft_s'])} | {_f(l['load_plus_ttft_s'])} "
                           f"[{l['load_plus_ttft_by']}] | {_f(r['load_ttft_ratio_llama_over_pysmoe'], '{:.2f}')}× | "
                           f"{_f(p['ttft_s'])} | {_f(l['ttft_s'])} [{l['ttft_by']}] | "
                           f"{_f(r['ttft_ratio_llama_over_pysmoe'], '{:.2f}')}× | {_f(p['decode_tps'], '{:.2f}')} | "
                           f"{_f(l['decode_tps'], '{:.2f}')} [{l['decode_by']}] | "
                           f"{_f(r['decode_ratio_pysmoe_over_llama'], '{:.2f}')}× | "
                           f"{_f(p.get('cgroup_peak_mib'), '{:,.0f}')} / {_f(lpk, '{:,.0f}')} |")
        out.append("")
    var = ["| mode | prompt | llama.cpp variant | TTFT s | load+TTFT s | decode tok/s | errors |",
           "|---|---|---|---|---|---|---|"]
    for mode, rr in [("warm", m)] + [(f"cold ra={ra}", x) for ra, x in (c.get("by_readahead_kb") or {}).items()]:
        for n, r in _rows(rr):
            if r["pysmoe"]["errors"]:   # pysmoe killed in some run (its cgroup limit too small)
                var.append(f"| {mode} | {n} | (pysmoe) | {_f(r['pysmoe']['ttft_s'])} | "
                           f"{_f(r['pysmoe']['load_plus_ttft_s'])} | {_f(r['pysmoe']['decode_tps'], '{:.2f}')} | "
                           f"{len(r['pysmoe']['errors'])} |")
            for name, v in r["llama.cpp_variants"].items():
                var.append(f"| {mode} | {n} | {name} | {_f(v['ttft_s'])} | {_f(v['load_plus_ttft_s'])} | "
                           f"{_f(v['decode_tps'], '{:.2f}')} | {len(v['errors'])} |")
    if len(var) > 2:
        out += ["llama.cpp variants (medians; the best of each column is the one compared above):", ""] + var
    return "\n".join(out)


def gguf_vault(gguf: pathlib.Path, tmp: pathlib.Path) -> pathlib.Path:
    """pysmoe's import of a GGUF file (`pysmoe convert`), made once per file under tmp and reused
    while the file is unchanged (its size and mtime are in the directory's name)."""
    from pysmoe.convert import convert_checkpoint

    st = gguf.stat()
    out = tmp / f"peer-vault-{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    if not (out / "vault.bin").exists():
        print(f"converting {gguf} into {out} (pysmoe convert)", file=sys.stderr, flush=True)
        convert_checkpoint(gguf, out, progress=False, force=True)
    return out


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)   # so that `finally` blocks run (readahead restored, cgroups removed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vault", nargs="?", help="pysmoe's vault (default: the GGUF file imported by pysmoe convert, "
                    "so that both engines run the same file's weights)")
    ap.add_argument("--gguf", required=True, help="the GGUF llama.cpp runs: any llama.cpp file (Q4_K_M, Q8_0, "
                    "...), or the vault's weights written by scripts/export_gguf.py")
    ap.add_argument("--prompt-lengths", default="8,45", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--threads", type=int, default=2, help="pysmoe's threads (and llama.cpp's unless --llama-threads)")
    ap.add_argument("--llama-threads", default=None, type=lambda s: [int(x) for x in s.split(",") if x],
                    help="llama.cpp thread counts to try, e.g. 1,2 (default: --threads); its best is compared")
    ap.add_argument("--omp-policies", default="default,passive", type=lambda s: [x for x in s.split(",") if x],
                    help="llama.cpp under each of these libgomp wait policies (default: OMP_WAIT_POLICY unset, "
                         "spinning for a while at barriers; passive; active), alternated; its best is compared")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle-ms", type=float, default=100,
                    help="warm: the process tree left idle this long before each timed run, so that no run "
                         "starts beside the threads of the one before it still spinning (libgomp's default "
                         "wait policy spins 5-15 ms after each parallel region before it sleeps: bench/peer.md); "
                         "0 = back to back, as before 7 Dec 2026")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--decode-max-s", type=float, default=None,
                    help="cold mode: stop a run's decode after this many seconds (at least one step; tokens/s over "
                         "the steps made) -- llama.cpp under a budget can take minutes for 16 tokens")
    ap.add_argument("--cache-frac", type=float, default=0.1, help="pysmoe cache for the cold mode, of the expert bytes")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="cold mode: the budget itself, in MiB (instead of --cache-frac): pysmoe's cache is what "
                         "fills it beside its resident bytes without one, so that runs of two vault layouts (or "
                         "versions) meet llama.cpp at the same memory")
    ap.add_argument("--readahead-kb", default="128,8192", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="cold mode: the block-device read_ahead_kb values to run at (the disk holding the vault and "
                         "GGUF; restored afterwards); the first is the headline")
    ap.add_argument("--pysmoe-limit", choices=("find", "budget", "own-cache"), default="find",
                    help="cold mode: pysmoe's cgroup limit: the smallest it survives, searched up from its budget "
                         "(find), or exactly its budget (budget; a kill is then recorded as an error), or exactly "
                         "llama.cpp's and with the cache pysmoe chooses itself within it, as `pysmoe run` does "
                         "without --cache-mb (own-cache: the same memory for both, pysmoe as a user meets it)")
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
    ap.add_argument("--pysmoe-avx2", action="store_true",
                    help="warm mode (alternated): pysmoe on its AVX2 kernels (SMOE_NO_AVX512=1, a child worker) as "
                         "one more contender, to measure the AVX-512 kernels' gain in the same run")
    ap.add_argument("--no-repack-warm", action="store_true", help="warm llama.cpp without its CPU weight repacking")
    ap.add_argument("--repack-cold", action="store_true",
                    help="cold llama.cpp with repacking (copies the experts to anonymous memory: OOM in the cgroup)")
    ap.add_argument("--thp", choices=("always", "madvise", "never"), default=None,
                    help="the system's transparent huge pages setting for the run (root; restored afterwards): "
                         "pysmoe asks for huge pages for its weights itself (madvise), llama.cpp gets them for its "
                         "repacked weights only under always (default: leave the setting as it is)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--json", default=None)
    # worker side
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_pysmoe-worker", dest="pysmoe_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup-procs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-repack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--logits-all", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help="the workers' logs on stderr")
    args = ap.parse_args(argv)
    if args._worker:
        return _worker_main(args)
    if args.pysmoe_worker:
        args.vault = args.pysmoe_worker
        return _pysmoe_worker_main(args)
    if not args.vault:
        # The same file for both engines: the GGUF as llama.cpp runs it, and pysmoe's import of it
        # (tensors copied in their GGML types: nothing requantised on either side).
        args.vault = str(gguf_vault(pathlib.Path(args.gguf), pathlib.Path(args.tmp)))
    if args.ctx is None:
        args.ctx = max(512, max(args.prompt_lengths) + args.decode_tokens + 2)
    args.llama_threads = args.llama_threads or [args.threads]
    bad = [p for p in args.omp_policies if p not in OMP_POLICIES]
    if bad or not args.omp_policies:
        ap.error(f"--omp-policies: choose from {','.join(OMP_POLICIES)}")
    if not args.readahead_kb:
        ap.error("--readahead-kb: at least one value")
    if args.pysmoe_avx2 and args.blocks:
        ap.error("--pysmoe-avx2 runs only in the alternated warm mode (not with --blocks)")

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
    res = {"omp_policies": args.omp_policies, "llama_threads": args.llama_threads,
           "vault": str(args.vault), "vault_info": vault_info, "gguf": str(args.gguf), "argv": sys.argv,
           "threads": args.threads, "repeats": args.repeats, "decode_tokens": args.decode_tokens,
           "prompt_lengths": args.prompt_lengths, "ctx": args.ctx, "cache_frac": args.cache_frac,
           "readahead_kb": args.readahead_kb, "decode_max_s": args.decode_max_s, "pysmoe_limit": args.pysmoe_limit,
           "warm_blocks": args.blocks, "settle_ms": args.settle_ms, "loadavg_start": list(os.getloadavg()), "cpus": os.cpu_count(),
           "cpu_model": _cpu_model(), "pysmoe_activations": "q8", "pysmoe_kernels": _pysmoe_kernels(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import llama_cpp
        res["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        log("llama-cpp-python is not installed (pip install llama-cpp-python): nothing to compare against")
        return 2
    def save_partial(mode, part):
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(dict(res, **{mode: part}, partial=True), indent=1,
                                                          default=str) + "\n")
    args.save_partial = save_partial
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    thp_was = _thp(args.thp)
    res["thp"] = _thp(None)
    try:
        for m in modes:
            fn = {"check": mode_check, "warm": mode_warm_blocks if args.blocks else mode_warm, "cold": mode_cold}[m]
            res[m] = fn(args.vault, args.gguf, args, log)
            res[f"loadavg_after_{m}"] = list(os.getloadavg())
            if args.json:  # after each mode, so that a long run that dies leaves what it measured
                pathlib.Path(args.json).write_text(json.dumps(dict(res, partial=True), indent=1, default=str) + "\n")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if args.thp:
            _thp(thp_was)
    res["loadavg_end"] = list(os.getloadavg())
    print(table(res))
    if (res.get("warm") or {}).get("alternated") is False:
        print("warm ran in blocks, NOT alternated (--blocks): all pysmoe repeats, then all llama.cpp repeats, one "
              "engine in memory at a time; the load average of each block is in the JSON (warm.blocks).")
    print(f"load average: start {res['loadavg_start']}, end {res['loadavg_end']} ({os.cpu_count()} CPUs, "
          f"{res['cpu_model']}; transparent huge pages: {res['thp']})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(res, partial=False), indent=1, default=str) + "\n")
    return 0


THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp(mode):
    """The system's transparent huge pages setting ("always [madvise] never": the bracketed one), set to
    mode first when mode is given; returns the setting before, None where the kernel has none."""
    try:
        was = THP.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        if mode:
            raise SystemExit(f"--thp {mode}: this kernel has no {THP}")
        return None
    if mode and mode != was:
        try:
            THP.write_text(mode)
        except OSError as e:
            raise SystemExit(f"--thp {mode}: cannot write {THP} ({e.strerror}; root only)")
    return was


def _cpu_model() -> str | None:
    """The CPU's name with its family and model numbers ("AMD EPYC" alone names several
    generations: family 25 is Zen 3/4, 26 Zen 5) and whether it has AVX-512 (F) and AVX512-VNNI."""
    info = {}
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("model name", "cpu family", "model", "flags") and k not in info:
                info[k] = v.strip()
            if len(info) == 4:
                break
    except OSError:
        pass
    if "model name" not in info:
        return None
    flags = info.get("flags", "").split()
    isa = ", ".join(f for f in ("avx512f", "avx512_vnni") if f in flags) or "no AVX-512"
    return f"{info['model name']} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}; {isa})"


if __name__ == "__main__":
    sys.exit(main())
