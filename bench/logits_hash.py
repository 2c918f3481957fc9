#!/usr/bin/env python3
"""The SHA-1 of a fixed run's logits, to compare two libraries' bits (an A/B across builds).

    PYTHONPATH=CHECKOUT python bench/logits_hash.py VAULT [--device cpu|cuda] [--gpu-cache all|N]

Prompts of 1, 7, 45 and 130 random ids (seed 1), each followed by 4 greedy decode steps, in one
session (reset between prompts); every logits row goes into the hash. Uses only Session.prefill,
decode and reset, which every checkout has."""
import argparse
import hashlib

import numpy as np

import pysmoe

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("vault")
ap.add_argument("--device", default="cpu")
ap.add_argument("--gpu-cache", default="all", help="VRAM for experts: 'all' or a count of blobs")
a = ap.parse_args()
v = pysmoe.open_vault(a.vault)
kw = {}
if a.device == "cuda":
    blobs = v.expert_bytes + v.blob_bytes if a.gpu_cache == "all" else int(a.gpu_cache) * v.blob_bytes
    kw = dict(device="cuda", gpu_cache_bytes=blobs, cache_bytes=v.expert_bytes + v.blob_bytes)
rng = np.random.default_rng(1)
h = hashlib.sha1()
with v.session(chunk=64, **kw) as s:
    for n in (1, 7, 45, 130):
        s.reset()
        logits = s.prefill(rng.integers(0, v.config["vocab_size"], n).tolist())
        h.update(logits.tobytes())
        for _ in range(4):
            logits = s.decode(int(np.argmax(logits)))
            h.update(logits.tobytes())
print(f"{a.device} gpu-cache {a.gpu_cache}: logits sha1 {h.hexdigest()} ({pysmoe._ffi.LIB_PATH})")
