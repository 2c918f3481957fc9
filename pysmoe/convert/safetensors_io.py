"""Read safetensors checkpoints without torch (and without the safetensors package).

A .safetensors file is

    u64 little-endian N | N bytes of JSON header | data

where the header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the first byte after the header) and may hold "__metadata__". Tensors are
row-major and little-endian. This module parses the header itself and hands tensors out as
np.memmap views, so nothing is read until it is used and a converter holds about one tensor at a
time. bf16, which numpy lacks, comes out as its u16 bits (`floats()` widens it to f32 exactly).

A checkpoint is one model.safetensors or the shards named by model.safetensors.index.json.
Every offset and size in a header is checked against the file before use.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SmoeError

# safetensors dtype -> numpy dtype of the stored elements (bf16 as its bits)
DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1",
    "F8_E4M3": "u1", "F8_E5M2": "u1",
}
FLOATS = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 << 20


class SafetensorsError(SmoeError, ValueError):
    """A safetensors file or index that cannot be read as one: the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: str               # safetensors spelling: BF16, F32, U32, ...
    shape: tuple[int, ...]
    start: int               # absolute offset of the first byte in file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """(tensors by name, __metadata__) of one .safetensors file; checks every offset."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{path}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, d in header.items():
        try:
            dtype, shape, (begin, end) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {d!r}") from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if not (0 <= begin <= end and base + end <= size) or end - begin != want or any(x < 0 for x in shape):
            raise SafetensorsError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has bytes "
                                   f"[{begin}, {end}) that do not fit its shape or the file")
        out[name] = TensorInfo(path, name, dtype, shape, base + begin, end - begin)
    return out, meta


def shard_files(ckpt_dir: Path) -> list[Path]:
    """The .safetensors files of a checkpoint directory: the index's shards, or the one file,
    or every *.safetensors when neither (MLX writes model.safetensors or model-0000N-of-...)."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{index}: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SafetensorsError(f"{index}: no weight_map")
        files = [ckpt_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if files:
        return files
    raise SafetensorsError(f"{ckpt_dir}: no model.safetensors, model.safetensors.index.json or *.safetensors")


class Checkpoint:
    """Every tensor of a checkpoint directory, by name, read lazily through np.memmap."""

    def __init__(self, ckpt_dir):
        self.dir = Path(ckpt_dir)
        self.files = shard_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        self.duplicates: list[str] = []
        self._maps: dict[Path, np.memmap] = {}
        for f in self.files:
            tensors, _ = read_header(f)
            for name, info in tensors.items():
                if name in self.tensors:
                    self.duplicates.append(name)
                self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _map(self, path: Path) -> np.memmap:
        m = self._maps.get(path)
        if m is None:
            m = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return m

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored: a read-only array view of the file (bf16 as u16 bits)."""
        t = self.tensors[name]
        if t.nbytes == 0:
            return np.zeros(t.shape, dtype=DTYPES[t.dtype])
        return self._map(t.file)[t.start:t.start + t.nbytes].view(DTYPES[t.dtype]).reshape(t.shape)

    def floats(self, name: str, index=None) -> np.ndarray:
        """A float tensor (or raw(name)[index]) as f32; bf16 and f16 widen exactly."""
        t = self.tensors[name]
        if t.dtype not in FLOATS:
            raise SafetensorsError(f"{name}: dtype {t.dtype} is not a float")
        a = self.raw(name)
        if index is not None:
            a = a[index]
        if t.dtype == "BF16":
            return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.ascontiguousarray(a, dtype=np.float32)

    def close(self) -> None:
        """Drop the mappings (views handed out keep theirs alive)."""
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
