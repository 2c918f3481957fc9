"""pysmoe's own safetensors reader: same tensors as the safetensors package, and clear errors for
files whose header does not fit them."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from pysmoe.convert.safetensors_io import Checkpoint, SafetensorsError, read_header


def _write(path, tensors: dict, header_extra=None):
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header.update(header_extra or {})
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return path


def test_matches_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float16),
              "c": rng.integers(0, 2 ** 32, (2, 4), dtype=np.uint32), "d": np.zeros((0, 3), np.float32)}
    st.save_file(arrays, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    ck = Checkpoint(tmp_path)
    for k, a in arrays.items():
        assert np.array_equal(ck.raw(k), a) and ck.raw(k).dtype == a.dtype
    assert np.array_equal(ck.raw("a", 3), arrays["a"][3]) and np.array_equal(ck.rows("a", 1, 4), arrays["a"][1:4])
    ck.close()


def test_bf16_widens_exactly(tmp_path):
    bits = np.array([[0x3F80, 0xC000], [0x0001, 0x7F7F]], dtype="<u2")
    _write(tmp_path / "model.safetensors", {"w": ("BF16", bits)})
    with Checkpoint(tmp_path) as ck:
        got = ck.floats("w")
    assert np.array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["w"].update(data_offsets=[0, 4]), "do not fit"),          # shorter than its shape
    (lambda h: h["w"].update(data_offsets=[8, 24]), "do not fit"),         # runs past the file
    (lambda h: h["w"].update(dtype="Q7"), "unknown dtype"),
    (lambda h: h["w"].pop("shape"), "malformed"),
])
def test_bad_headers_are_refused(tmp_path, edit, match):
    w = np.zeros((2, 2), np.float32)
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    edit(header)
    h = json.dumps(header).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + w.tobytes())
    with pytest.raises(SafetensorsError, match=match):
        read_header(p)


def test_truncated_and_garbage_files(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsError, match="does not fit"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(SafetensorsError, match="not JSON"):
        read_header(p)
