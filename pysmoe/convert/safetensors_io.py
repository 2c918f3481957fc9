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

FP8 releases (Qwen3-*-FP8, GLM-4.5-FP8 and the like: `quantization_config.quant_method = "fp8"`)
store a linear map's weight as float8 e4m3 with a float scale per block of rows and columns
(`NAME.weight_scale_inv`, despite its name the factor the stored values are multiplied by). After
`Checkpoint.dequantize_fp8` such a weight reads through `floats()` and `rows()` as f32, each value
`e4m3(w) * scale` rounded once in f32 (as transformers' and DeepSeek's dequantisation compute it),
and its scale tensor is no longer listed: the converters see a float checkpoint.

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
FP8_SCALE = ".weight_scale_inv"


def _e4m3_table() -> np.ndarray:
    """The 256 values of float8 e4m3 ("fn": no infinities, NaN at S.1111.111), as f32."""
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (sign * v).astype(np.float32)


E4M3 = _e4m3_table()
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


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of this shape in blocks (the last two axes)."""
    if block is None:
        return ()
    return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], block)))


def _expand(s: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """Block scales repeated over their blocks' (rows, columns), cut to shape's last two axes."""
    s = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)
    return s[..., : shape[-2], : shape[-1]]


class Checkpoint:
    """Every tensor of a checkpoint directory, by name, read on demand."""

    def __init__(self, ckpt_dir):
        self.dir = Path(ckpt_dir)
        self.files = shard_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        self.duplicates: list[str] = []
        self._fds: dict[Path, int] = {}
        self.fp8: dict[str, tuple[TensorInfo, tuple[int, int] | None]] = {}  # weight -> (scale, block)
        for f in self.files:
            tensors, _ = read_header(f)
            for name, info in tensors.items():
                if name in self.tensors:
                    self.duplicates.append(name)
                self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def is_float(self, name: str) -> bool:
        """Whether floats() reads this tensor: a float dtype, or FP8 with its scales."""
        return self.tensors[name].dtype in FLOATS or name in self.fp8

    def dequantize_fp8(self, block: tuple[int, int] | None) -> None:
        """Read every F8_E4M3 tensor through its NAME_scale_inv as f32 (see the module's doc);
        block: the scale's (rows, columns) per value, None for one scale per tensor. The scale
        tensors leave `tensors`. Raises SafetensorsError naming every tensor that does not fit."""
        bad = []
        for name, t in list(self.tensors.items()):
            if t.dtype == "F8_E5M2":
                bad.append(f"{name} is F8_E5M2 (only e4m3 FP8 is read)")
            if t.dtype != "F8_E4M3":
                continue
            scale = self.tensors.get(name[: -len(".weight")] + FP8_SCALE) if name.endswith(".weight") else None
            if scale is None or scale.dtype not in FLOATS:
                bad.append(f"{name} is FP8 without a float {FP8_SCALE[1:]} beside it")
                continue
            want = _scale_shape(t.shape, block)
            if tuple(scale.shape) != want and not (block is None and scale.shape in ((), (1,))):
                bad.append(f"{scale.name} is {list(scale.shape)}, want {list(want)} for {name} "
                           f"{list(t.shape)} in blocks of {list(block) if block else 'the whole tensor'}")
                continue
            self.fp8[name] = (scale, block)
        orphans = [n for n in self.tensors if n.endswith(FP8_SCALE)
                   and n[: -len(FP8_SCALE)] + ".weight" not in self.fp8]
        bad += [f"{n} scales no FP8 weight" for n in orphans if not bad]
        if bad:
            raise SafetensorsError("FP8 checkpoint: " + "; ".join(bad[:20]) +
                                   (f" ... and {len(bad) - 20} more" if len(bad) > 20 else ""))
        for scale, _ in self.fp8.values():
            del self.tensors[scale.name]

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def raw(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as stored (bf16 as u16 bits), or its slice [index] along the first axis,
        read from the file into a new array."""
        return self._slice(self.tensors[name], index)

    def _slice(self, t: TensorInfo, index: int | None) -> np.ndarray:
        name = t.name
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
        if len(t.shape) != 2 or not 0 <= r0 <= r1 <= t.shape[0] or not self.is_float(name):
            raise SafetensorsError(f"{name} {t.dtype} {list(t.shape)}: no float rows [{r0}, {r1})")
        row = t.nbytes // t.shape[0]
        a = self._pread(t, t.start + r0 * row, (r1 - r0) * row).view(DTYPES[t.dtype]).reshape(r1 - r0, t.shape[1])
        if name in self.fp8:
            scale, block = self.fp8[name]
            s = _widen(self._slice(scale, None), scale.dtype)
            if block is not None:
                b0 = r0 // block[0]
                s = _expand(s[b0: -(-r1 // block[0])], block, (r1 - b0 * block[0], t.shape[1]))[r0 - b0 * block[0]:]
            return self._fp8_values(name, a, s)
        return _widen(a, t.dtype)

    def _fp8_values(self, name: str, a: np.ndarray, scale: np.ndarray) -> np.ndarray:
        out = E4M3[a] * scale  # both f32: one rounding, as torch's dequantisation
        if np.isnan(out).any():
            raise SafetensorsError(f"{name}: FP8 NaN (byte 0x7f or 0xff) among its values")
        return out

    def floats(self, name: str, index=None) -> np.ndarray:
        """A float tensor as f32 (bf16 and f16 widen exactly); index: a slice number along the
        first axis, or a tuple (number, then numpy indices into that slice)."""
        t = self.tensors[name]
        if name in self.fp8:
            first = index[0] if isinstance(index, tuple) else index
            if first is not None and len(t.shape) < 3:
                raise SafetensorsError(f"{name}: an FP8 matrix is read whole or by rows(), not by index")
            scale, block = self.fp8[name]
            w = self.raw(name, first)
            s = _widen(self._slice(scale, first if scale.shape and len(scale.shape) == len(t.shape) else None),
                       scale.dtype)
            a = self._fp8_values(name, w, s.reshape(()) if block is None else _expand(s, block, w.shape))
            return a[index[1:]] if isinstance(index, tuple) else a
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
