"""`python -m pysmoe bench` with the honest I/O floor: the same benchmark, table and --json record,
and a sweep of read patterns over each prompt's union added to the rates the floor takes.

    python bench/disk_floor.py VAULT [the options of python -m pysmoe bench] [--floor-mb 256]

The I/O floor is the union's bytes over the best rate this disk gives for them, measured in the
same run. `pysmoe bench` takes that rate from a random-blob probe and from the engine's own cold
runs (bytes read / TTFT, which makes the floor a floor by construction: a run reads at least the
union, so none comes in under it). The sweep here adds the rates of read patterns over the
union's own blobs, after each prompt length's cold runs, so that the floor is one no read pattern
of this disk could beat either (issue 17: a floor measured only with blob-sized scattered reads
was beaten by the engine, 0.60x). The patterns (floor_patterns): the union's blobs one by one in
offset order, its runs of adjacent blobs (up to the engine's coalesce size, and up to 64 MiB), and
4, 16 and 64 MiB reads over each layer's span from its first to its last union blob; queue depths
1 to 32 (at most 512 MiB in flight); each on --floor-mb of layers no earlier pattern read, read
once (first touch) and again at once (repeat: the virtual disks here cache on the host, so a
repeat can be faster). About 24 patterns x 2 passes x --floor-mb per prompt length: 12 GiB at the
default. bench/coalesce_ttft.py uses the same sweep.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pysmoe import bench  # noqa: E402

MiB = 1 << 20

FLOOR_DEPTHS = (1, 4, 8, 16, 32)
FLOOR_BYTES = 256 * MiB  # per pattern and pass: 24 patterns × 2 passes ≈ 12 GiB read per prompt length
FLOOR_SPANS = ((4, (1, 4, 16, 32)), (16, (1, 4, 16, 32)), (64, (1, 4, 8)))  # MiB, depths (≤ 512 MiB in flight)


def drop_caches() -> bool:
    """Sync and drop the page cache (root only); False where it cannot."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def floor_patterns(io_threads: int, coalesce_bytes: int, blob_bytes: int) -> list[tuple]:
    """(name, kind, request bytes, depth) of every pattern the sweep reads: the union's blobs one
    by one in offset order, its runs of adjacent blobs (up to the engine's coalesce size, and up to
    64 MiB), and reads of 4, 16 and 64 MiB over each layer's span of blobs (first to last union
    blob: these read blobs between union members too; only their rate is used)."""
    depths = sorted(set(FLOOR_DEPTHS) | {io_threads})
    pats = [(f"blob reads by offset, depth {d}", "blobs", blob_bytes, d) for d in depths]
    runs = sorted({max(coalesce_bytes, blob_bytes), 64 * MiB})
    for r in runs:
        pats += [(f"runs of adjacent blobs up to {r / MiB:.0f} MiB, depth {d}", "runs", r, d) for d in depths
                 if r * d <= 512 * MiB or d == io_threads]
    for mib, ds in FLOOR_SPANS:
        pats += [(f"{mib} MiB reads over the union's span, depth {d}", "span", mib * MiB, d) for d in ds]
    return pats


def _floor_requests(kind: str, size: int, layers: list, blob_bytes: int, budget: int):
    """Requests of one pattern over layers (each a sorted list of union blob offsets), until
    budget bytes; returns (requests, layers used)."""
    reqs, total = [], 0
    for used, offs in enumerate(layers, 1):
        if kind == "blobs":
            chunks = [(o, blob_bytes) for o in offs]
        elif kind == "runs":
            chunks, per = [], max(1, size // blob_bytes)
            for o in offs:
                if chunks and o == chunks[-1][0] + chunks[-1][1] and chunks[-1][1] < per * blob_bytes:
                    chunks[-1] = (chunks[-1][0], chunks[-1][1] + blob_bytes)
                else:
                    chunks.append((o, blob_bytes))
        else:
            lo, hi = offs[0], offs[-1] + blob_bytes
            chunks = [(o, min(size, hi - o)) for o in range(lo, hi, size)]
        for c in chunks:
            reqs.append(c)
            total += c[1]
            if total >= budget:
                return reqs, used
    return reqs, len(layers)


def floor_sweep(reader: bench.DirectReader, layers: list, blob_bytes: int, io_threads: int, coalesce_bytes: int,
                budget: int, log=None) -> list[dict]:
    """Every floor pattern on a sample of at most budget bytes of the union, read twice."""
    out, cursor = [], 0
    for name, kind, size, depth in floor_patterns(io_threads, coalesce_bytes, blob_bytes):
        rotated = layers[cursor:] + layers[:cursor]
        reqs, used = _floor_requests(kind, size, rotated, blob_bytes, budget)
        cursor = (cursor + used) % max(len(layers), 1)
        first = reader.read_requests(reqs, depth)
        again = reader.read_requests(reqs, depth)
        out.append({"pattern": name, "kind": kind, "request_bytes": size, "depth": depth, "first": first,
                    "repeat": again})
        if log:
            log(f"    floor sweep: {name:<52s} {first['gbps']:.2f} GB/s first, {again['gbps']:.2f} repeat")
    return out


def union_offsets(vault, session, blob_offsets=None) -> list[list[int]]:
    """Per sparse layer, the sorted file offsets of the blobs the session's tokens since its last
    reset_stats routed to (after a cold run: that prompt's exact union). blob_offsets: the vault's
    (layers x experts) table, 0 for no blob (default: read from the vault)."""
    from pysmoe._ffi import check, ffi, lib
    E = vault.config["num_experts"]
    if blob_offsets is None:
        blob_offsets = vault_blob_offsets(vault.path)
    counts = ffi.new("uint64_t[]", E)
    layers = []
    for layer in range(vault.config["num_hidden_layers"]):
        check(lib.smoe_stats_expert_counts(session.handle, layer, counts, E))
        offs = sorted(blob_offsets[layer * E + e] for e in range(E) if counts[e] and blob_offsets[layer * E + e])
        if offs:
            layers.append(offs)
    return layers


def vault_blob_offsets(vault_dir) -> list[int]:
    """The file offset of every (layer, expert) blob, layer-major, 0 where a layer has none."""
    from pysmoe.vaultio import VaultFile
    vf = VaultFile(vault_dir)
    try:
        return [int(o) for o in vf.blob_offsets]
    finally:
        vf.close()


class FloorSweep:
    """run_bench's `sweep`: after each prompt length's cold runs, every floor pattern over that
    prompt's union, at most floor_bytes of it per pattern (0: none)."""

    def __init__(self, floor_bytes: int = FLOOR_BYTES):
        self.floor_bytes = int(floor_bytes)
        self.settings = {"floor_bytes": self.floor_bytes}
        self._offsets = {}  # vault path -> its blob offsets

    def __call__(self, b, session) -> list[dict]:
        if self.floor_bytes <= 0:
            return []
        path = str(b.vault.path)
        if path not in self._offsets:
            self._offsets[path] = vault_blob_offsets(path)
        layers = union_offsets(b.vault, session, self._offsets[path])
        if not layers:
            return []
        return floor_sweep(b.probe, layers, b.blob_bytes, b.io_threads, b.coalesce_bytes,
                           max(self.floor_bytes, b.blob_bytes), log=b.log)


def run_bench(vault_path, lengths, *, floor_bytes: int = FLOOR_BYTES, **kwargs) -> dict:
    """pysmoe.bench.run_bench with the floor sweep (kwargs: its own)."""
    return bench.run_bench(vault_path, lengths, sweep=FloorSweep(floor_bytes), **kwargs)


def main(argv=None) -> int:
    from pysmoe.cli import bench as bench_cli
    from pysmoe.cli.args import HelpFormatter, mebibytes
    ap = argparse.ArgumentParser(prog="bench/disk_floor.py", description=__doc__.split("\n")[0],
                                 formatter_class=HelpFormatter)
    bench_cli.add_parser(ap)
    ap.add_argument("--floor-mb", type=mebibytes, default=FLOOR_BYTES / MiB,
                    help="MiB per pattern of the I/O floor sweep, each read twice (default 256; 0: no sweep, the floor "
                         "then comes from the random-blob probe and the engine's own runs, as in pysmoe bench)")
    args = ap.parse_args(argv)
    return bench_cli.run(args, sweep=FloorSweep(int(args.floor_mb * MiB)))


if __name__ == "__main__":
    sys.exit(main())
