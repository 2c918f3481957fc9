"""Read safetensors checkpoints without torch (and without the safetensors package).

A .safetensors file is

    u64 little-endian N | N bytes of JSON header | data

where the header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the first byte after the header) and may hold "__metadata__". Tensors are
row-major and little-endian. This module parses the header itself and reads a tensor (or one
slice along its first axis: one expert of a stacked tensor) with pread into a fresh array when
asked, so a converter holds about one tensor at a time. (Not np.memmap: pages of a long-lived
mapping stay in the process's resident set as they are touched, so peak RSS would grow to the
size of the checkpoint.) bf16, which numpy lacks, comes out as its u16 bits (`floats()` widens
it to f32 exactly).

A checkpoint is one model.safetensors or the shards named by model.safetensors.index.json.
Every offset and size in a header is checked against the file before use.
"""
from __future__ import annotations

import json
import os
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


def _widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float values (bf16 as u16 bits) -> f32, exactly."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


class Checkpoint:
    """Every tensor of a checkpoint directory, by name, read on demand."""

    def __init__(self, ckpt_dir):
        self.dir = Path(ckpt_dir)
        self.files = shard_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        self.duplicates: list[str] = []
        self._fds: dict[Path, int] = {}
        for f in self.files:
            tensors, _ = read_header(f)
            for name, info in tensors.items():
                if name in self.tensors:
                    self.duplicates.append(name)
                self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def raw(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as stored (bf16 as u16 bits), or its slice [index] along the first axis,
        read from the file into a new array."""
        t = self.tensors[name]
        dt = np.dtype(DTYPES[t.dtype])
        off, shape, n = t.start, t.shape, t.nbytes
        if index is not None:
            if not t.shape or not 0 <= index < t.shape[0]:
                raise IndexError(f"{name} {list(t.shape)}: no slice {index}")
            n = t.nbytes // t.shape[0]
            off, shape = t.start + index * n, t.shape[1:]
        return self._pread(t, off, n).view(dt).reshape(shape)

    def _pread(self, t: TensorInfo, off: int, n: int) -> np.ndarray:
        buf = np.empty(n, dtype=np.uint8)
        view, fd, done = memoryview(buf), self._fd(t.file), 0
        while done < n:
            got = os.preadv(fd, [view[done:]], off + done)
            if got <= 0:
                raise SafetensorsError(f"{t.file}: short read of {t.name}")
            done += got
        return buf

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of a 2-D float tensor as f32 (read from the file: contiguous bytes)."""
        t = self.tensors[name]
        if len(t.shape) != 2 or not 0 <= r0 <= r1 <= t.shape[0] or t.dtype not in FLOATS:
            raise SafetensorsError(f"{name} {t.dtype} {list(t.shape)}: no float rows [{r0}, {r1})")
        row = t.nbytes // t.shape[0]
        a = self._pread(t, t.start + r0 * row, (r1 - r0) * row).view(DTYPES[t.dtype]).reshape(r1 - r0, t.shape[1])
        return _widen(a, t.dtype)

    def floats(self, name: str, index=None) -> np.ndarray:
        """A float tensor as f32 (bf16 and f16 widen exactly); index: a slice number along the
        first axis, or a tuple (number, then numpy indices into that slice)."""
        t = self.tensors[name]
        if t.dtype not in FLOATS:
            raise SafetensorsError(f"{name}: dtype {t.dtype} is not a float")
        if isinstance(index, tuple):
            a = self.raw(name, index[0])[index[1:]]
        else:
            a = self.raw(name, index)
        return _widen(a, t.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
