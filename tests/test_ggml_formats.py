"""The GGML block formats (Q4_K, Q8_0, MXFP4, ...; csrc/cpu/ggml_blocks.h, pysmoe/ggml_blocks.py):
dequantisation bit for bit against gguf-py's gguf.quants.dequantize (hypothesis over random
blocks where gguf is installed; golden vectors made by scripts/make_ggml_golden.py everywhere),
in numpy and in libsmoe; vaults holding them as experts and dense tensors, run layer-major =
token-serial bit for bit with 8-bit and with f32 activations, and against the numpy reference
forward on the dequantised weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe import ggml_blocks, quant
from pysmoe._ffi import check, ffi, lib
from pysmoe.errors import VaultError

GOLDEN = Path(__file__).parent / "data" / "ggml_golden.npz"
FORMATS = sorted(ggml_blocks.FORMATS)

try:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize
except ImportError:  # the golden vectors stand in
    gguf_dequantize = gguf_quantize = None


def c_dequantize(fmt: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.empty((rows, cols), np.float32)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    check(lib.smoe_dequantize(ggml_blocks.FORMATS[fmt][0], 0, 0, rows, cols, ffi.from_buffer(raw), raw.size,
                              ffi.cast("float *", ffi.from_buffer(out))))
    return out


def assert_same_values(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, except that a NaN need only be a NaN (its payload is the hardware's)."""
    got, want = got.reshape(-1), want.reshape(-1)
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN at other places"
    bad = np.flatnonzero(got[~nan_g].view(np.uint32) != want[~nan_w].view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} values differ, the first {got[~nan_g][bad[0]]!r} vs {want[~nan_w][bad[0]]!r}"


def shape_of(fmt: str, nblocks: int) -> tuple[int, int]:
    bs = ggml_blocks.FORMATS[fmt][1]
    return nblocks, bs if bs > 1 else 32  # F16: rows of 32 one-value blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_golden_dequantisation(fmt):
    """gguf-py's values for stored blocks (inf and NaN scales among them), in numpy and in C."""
    g = np.load(GOLDEN)
    raw, want = g[f"{fmt}_bytes"], g[f"{fmt}_values"].view(np.float32)
    rows, cols = want.shape
    assert_same_values(ggml_blocks.dequantize(raw, fmt, rows, cols), want, f"{fmt} numpy")
    assert_same_values(c_dequantize(fmt, raw, rows, cols), want, f"{fmt} libsmoe")
    assert np.isnan(want).any() == (fmt != "MXFP4"), "the sample has no inf or NaN scale"


@pytest.mark.skipif(gguf_dequantize is None, reason="gguf-py is not installed (the golden test stands in)")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_dequantisation_matches_gguf(data):
    fmt = data.draw(st.sampled_from(FORMATS), label="format")
    ts = ggml_blocks.FORMATS[fmt][2]
    bs = ggml_blocks.FORMATS[fmt][1]
    rows = data.draw(st.integers(1, 3), label="rows")
    per_row = data.draw(st.integers(1, 3), label="blocks per row") * (32 if bs == 1 else 1)
    raw = np.frombuffer(data.draw(st.binary(min_size=rows * per_row * ts, max_size=rows * per_row * ts)), np.uint8)
    cols = per_row * bs
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType[fmt]).reshape(rows, cols)
    assert_same_values(ggml_blocks.dequantize(raw, fmt, rows, cols), want, f"{fmt} numpy")
    assert_same_values(c_dequantize(fmt, raw, rows, cols), want, f"{fmt} libsmoe")


def _set_grid_index(fmt: str, blk: np.ndarray, i: int, idx: int) -> None:
    """Write grid index idx for group i of a codebook format's block (groups of 8 columns, of 4 for
    the IQ3 formats), where the format keeps it (csrc/cpu/ggml_blocks.h, gb_iq_part)."""
    if fmt == "IQ2_XXS":
        blk[2 + 8 * (i // 4) + i % 4] = idx
    elif fmt == "IQ3_XXS":
        blk[2 + i] = idx
    elif fmt == "IQ2_XS":
        q = int(blk[2 + 2 * i]) | int(blk[3 + 2 * i]) << 8
        q = (q & ~511) | idx
        blk[2 + 2 * i], blk[3 + 2 * i] = q & 255, q >> 8
    elif fmt == "IQ2_S":
        blk[2 + i] = idx & 255
        sh = 2 * (i % 4)
        blk[66 + i // 4] = (int(blk[66 + i // 4]) & ~(3 << sh) & 255) | (idx >> 8) << sh
    elif fmt == "IQ3_S":
        blk[2 + i] = idx & 255
        sh = i % 8
        blk[66 + i // 8] = (int(blk[66 + i // 8]) & ~(1 << sh) & 255) | (idx >> 8) << sh
    elif fmt == "IQ1_S":
        blk[2 + i] = idx & 255
        at, sh = 34 + 2 * (i // 4), 3 * (i % 4)
        q = int(blk[at]) | int(blk[at + 1]) << 8
        q = (q & ~(7 << sh)) | (idx >> 8) << sh
        blk[at], blk[at + 1] = q & 255, q >> 8
    else:  # IQ1_M
        blk[i] = idx & 255
        sh = 4 * (i % 2)
        blk[32 + i // 2] = (int(blk[32 + i // 2]) & ~(7 << sh) & 255) | (idx >> 8) << sh


@pytest.mark.skipif(gguf_dequantize is None, reason="gguf-py is not installed")
@pytest.mark.parametrize("fmt", ggml_blocks.CODEBOOK_FORMATS)
def test_every_codebook_entry_matches_gguf(fmt):
    """libsmoe's codebooks (csrc/cpu/ggml_iq_grids.h) entry by entry: blocks whose grid indices run
    through every entry, each under random signs and scales, dequantised as gguf-py does."""
    import gguf.quants

    _, _, ts = ggml_blocks.FORMATS[fmt]
    entries, width = getattr(gguf.quants, fmt).grid_shape  # codebook entries, values per entry
    groups = 256 // width
    rng = np.random.default_rng(5)
    blocks = ggml_blocks.random_blocks(fmt, entries // groups, 256, 1.0, rng).reshape(-1, ts)
    for i in range(entries):
        _set_grid_index(fmt, blocks[i // groups], i % groups, i)
    raw = blocks.reshape(-1)
    rows = blocks.shape[0]
    want = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType[fmt]).reshape(rows, 256)
    assert np.isfinite(want).all() and np.count_nonzero(want) > want.size // 2
    assert_same_values(c_dequantize(fmt, raw, rows, 256), want, f"{fmt} libsmoe")


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "MXFP4"])
def test_non_finite_scales(fmt):
    """An inf scale gives ±inf where the code is not zero and NaN where it is (inf·0); a NaN
    scale gives NaN: IEEE arithmetic, as gguf-py and llama.cpp compute it. (MXFP4's e8m0 scale is
    a power of two from 2^-128 to 2^127, never inf or NaN, but 2^127·12 overflows to inf.)"""
    rows, cols = shape_of(fmt, 2)
    raw = ggml_blocks.random_blocks(fmt, rows, cols, 0.05, np.random.default_rng(3)).reshape(rows, -1).copy()
    at = {"Q4_0": 0, "Q8_0": 0, "IQ4_NL": 0, "Q4_K": 0, "Q6_K": 208}.get(fmt)
    if at is None:
        raw[0, 0], raw[1, 0] = 255, 0  # 2^127: its products with |k| ≥ 2 overflow to ±inf
        w = c_dequantize(fmt, raw, rows, cols)
        assert np.isinf(w[0]).any() and not np.isnan(w).any() and np.abs(w[1]).max() < 2.0 ** -124
        assert_same_values(w, ggml_blocks.dequantize(raw, fmt, rows, cols), fmt)
        return
    raw[0, at:at + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    raw[1, at:at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    w = c_dequantize(fmt, raw, rows, cols)
    assert np.isnan(w[1]).all()
    assert (np.isinf(w[0]) | np.isnan(w[0])).all() and np.isinf(w[0]).any()
    assert_same_values(w, ggml_blocks.dequantize(raw, fmt, rows, cols), fmt)


def test_mxfp4_quantiser_by_hand():
    """quantize_mxfp4's rule on one block worked out by hand: amax 7 gives e = floor(log2 7) − 2 +
    127 = 127 (one E2M1 unit is 2^0); 7 saturates to 6; 0.75 is a tie between 0.5 and 1 and goes to
    the smaller magnitude (llama.cpp's rule: OCP's round-half-to-even would give 1); −0.1 is 0
    (code 0, not −0); a block of zeros gets e = 0."""
    w = np.zeros((2, 32), np.float32)
    w[0, :8] = [7.0, -7.0, 4.0, 0.75, -0.75, 2.9, -0.1, 1.5]
    got = ggml_blocks.quantize_mxfp4(w).reshape(2, 17)
    codes = np.zeros(32, np.uint8)
    codes[:8] = [7, 15, 6, 1, 9, 5, 0, 3]  # E2M1: 0, .5, 1, 1.5, 2, 3, 4, 6; +8 negative
    assert got[0, 0] == 127 and got[1, 0] == 0 and not got[1, 1:].any()
    assert np.array_equal(got[0, 1:], codes[:16] | (codes[16:] << 4))
    assert np.array_equal(ggml_blocks.dequantize(got, "MXFP4", 2, 32)[0, :8], [6, -6, 4, 0.5, -0.5, 3, 0, 1.5])
    assert bytes(got.reshape(-1)) == quant.quantize(w, "MXFP4")  # the converter's path


def test_mxfp4_quantiser_round_trip():
    """Weights already on the MXFP4 grid come back as the same bytes; a weight within E2M1's range
    (|w| ≤ 6 units of 2^(e−127)) is within half a step (a step is at most 2 units), and one past it
    (up to 8 units: e puts amax there) saturates to ±6 units."""
    rng = np.random.default_rng(7)
    raw = ggml_blocks.random_blocks("MXFP4", 8, 256, 0.02, rng)
    w = ggml_blocks.dequantize(raw, "MXFP4", 8, 256)
    again = ggml_blocks.quantize_mxfp4(w)
    assert np.array_equal(ggml_blocks.dequantize(again, "MXFP4", 8, 256), w)
    x = (rng.standard_normal((8, 256)) * 0.02).astype(np.float32)
    q = ggml_blocks.quantize_mxfp4(x)
    y = ggml_blocks.dequantize(q, "MXFP4", 8, 256)
    unit = np.ldexp(1.0, q.reshape(-1, 17)[:, 0].astype(int) - 127).repeat(32).reshape(8, 256)
    inside = np.abs(x) <= 6 * unit
    assert (np.abs(x - y)[inside] <= unit[inside]).all() and np.abs(x - y).max() > 0
    assert (~inside).any() and np.array_equal(np.abs(y[~inside]), 6 * unit[~inside])
    with pytest.raises(ValueError, match="finite"):
        ggml_blocks.quantize_mxfp4(np.full((1, 32), np.inf, np.float32))


@pytest.mark.skipif(gguf_quantize is None, reason="gguf-py is not installed (the hand-made block stands in)")
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mxfp4_quantiser_matches_gguf(data):
    """Byte for byte gguf-py's MXFP4 quantiser (llama.cpp's quantize_row_mxfp4_ref in numpy), on
    random weights and on weights made of quarter units, which land on E2M1's ties."""
    rows = data.draw(st.integers(1, 3), label="rows")
    blocks = data.draw(st.integers(1, 3), label="blocks per row")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    scale = np.float32(2.0 ** data.draw(st.integers(-20, 10), label="log2 scale"))
    if data.draw(st.booleans(), label="ties"):
        w = rng.integers(-28, 29, size=(rows, blocks * 32)).astype(np.float32) * np.float32(0.25) * scale
    else:
        w = rng.standard_normal((rows, blocks * 32)).astype(np.float32) * scale
    want = gguf_quantize(w, GGMLQuantizationType.MXFP4)
    assert np.array_equal(ggml_blocks.quantize_mxfp4(w), want.reshape(rows, -1))


def test_sizes_and_refusals():
    assert quant.tensor_nbytes("Q4_K", 3, 512) == 3 * 2 * 144
    assert quant.tensor_nbytes("MXFP4", 2, 64) == 2 * 2 * 17
    with pytest.raises(ValueError, match="cols % 256"):
        quant.tensor_nbytes("Q6_K", 1, 128)
    with pytest.raises(ValueError, match="does not quantise"):
        quant.quantize(np.zeros((1, 32), np.float32), "Q8_0")
    raw = np.zeros(18, np.uint8)
    with pytest.raises(pysmoe.SmoeError, match="invalid format"):  # cols not a multiple of the block
        check(lib.smoe_dequantize(34, 0, 0, 1, 16, ffi.from_buffer(raw), 9, ffi.new("float[16]")))
    with pytest.raises(pysmoe.SmoeError, match="invalid format"):  # a GGML format takes no scale format
        check(lib.smoe_dequantize(34, 1, 0, 1, 32, ffi.from_buffer(raw), 18, ffi.new("float[32]")))
    with pytest.raises(pysmoe.SmoeError, match="invalid format"):  # ggml_type 34 (TQ1_0) is not one of them
        check(lib.smoe_dequantize(66, 0, 0, 1, 256, ffi.from_buffer(np.zeros(54, np.uint8)), 54, ffi.new("float[256]")))


# ----------------------------------------------------------------------------------- vaults

# 256 columns everywhere, so that every format fits every tensor
SHAPE = dict(hidden_size=256, head_dim=64, moe_intermediate_size=256, intermediate_size=256, num_hidden_layers=3,
             mlp_only_layers=[1], vocab_size=384)
MIXES = {
    # experts and dense tensors of the types a Q4_K_M GGUF holds, and the rest elsewhere
    "q4km": dict(experts="Q4_K", formats={"experts.down": "Q6_K", "attention": "Q8_0", "embed": "Q6_K",
                                          "lm_head": "Q5_K", "mlp": "Q5_0"}),
    "mxfp4": dict(experts="MXFP4", formats={"attention": "IQ4_NL", "embed": "Q4_0", "lm_head": "Q8_0",
                                            "mlp": "IQ4_XS", "experts.down": "Q3_K"}),
    "f16": dict(experts="Q2_K", formats={"experts.up": "F16", "experts.down": "Q5_1", "attention": "F16",
                                         "embed": "Q8_0", "lm_head": "Q4_1", "mlp": "Q4_K"}),
    # the codebook formats of the low-bit mixes (Unsloth's UD-IQ1_S ... UD-IQ3_XXS)
    "iq": dict(experts="IQ2_XXS", formats={"experts.up": "IQ1_S", "experts.down": "IQ3_S", "attention": "IQ3_XXS",
                                           "embed": "IQ1_M", "lm_head": "IQ2_XS", "mlp": "IQ2_S"}),
}


@pytest.fixture(scope="module", params=sorted(MIXES))
def ggml_vault(request, make_vault):
    return request.param, make_vault(f"ggml_{request.param}", preset="tiny", seed=7, overrides=SHAPE,
                                     **MIXES[request.param])


def prefill_logits(vault, ids, prefill, activations, chunk=None):
    with vault.session(prefill=prefill, activations=activations, context=256, chunk=chunk or 64, threads=2) as s:
        out = [s.prefill(ids)]
        out += [s.decode(int(np.argmax(out[-1]))) for _ in range(3)]
        kv = [s.kv(layer) for layer in range(vault.config["num_hidden_layers"])]
    return out, kv


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layer_major_is_token_serial_bit_for_bit(ggml_vault, data):
    _, path = ggml_vault
    vault = pysmoe.open_vault(path)
    n = data.draw(st.integers(1, 40), label="prompt length")
    ids = data.draw(st.lists(st.integers(0, vault.config["vocab_size"] - 1), min_size=n, max_size=n), label="ids")
    chunk = data.draw(st.integers(1, 16), label="chunk")
    for act in ("q8", "f32"):
        (ls, kvs), (lb, kvb) = (prefill_logits(vault, ids, "token-serial", act),
                                prefill_logits(vault, ids, "layer-major", act, chunk))
        for a, b in zip(ls, lb):
            assert np.isfinite(a).all()
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{act}: logits differ"
        for (ka, va), (kb, vb) in zip(kvs, kvb):
            assert np.array_equal(ka.view(np.uint32), kb.view(np.uint32)), f"{act}: K differs"
            assert np.array_equal(va.view(np.uint32), vb.view(np.uint32)), f"{act}: V differs"


def test_against_the_reference_forward(ggml_vault):
    """f32 activations: the numpy reference on the dequantised weights (pysmoe/ggml_blocks.py),
    within 1e-4 of max|logit|; 8-bit activations within 5e-2 (the quantisation of x)."""
    from pysmoe.reference import ReferenceModel

    _, path = ggml_vault
    vault = pysmoe.open_vault(path)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, vault.config["vocab_size"], 12)]
    ref = ReferenceModel(path).logits(ids)[-1]
    scale = float(np.abs(ref).max())
    for act, tol in (("f32", 1e-4), ("q8", 5e-2)):
        with vault.session(activations=act) as s:
            got = s.prefill(ids)
        err = float(np.abs(got - ref).max())
        assert err <= tol * scale, f"{act}: max error {err:.3g}, max|logit| {scale:.3g}"


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.__setitem__(slice(42, 44), b"\x20\x00"), "group_size 32 for Q8_0 \\(must be 0\\)"),
    (lambda d: d.__setitem__(41, 1), "scale_format 1 does not go with format Q8_0"),
    (lambda d: d.__setitem__(slice(48, 52), (272).to_bytes(4, "little")), "Q8_0 needs cols % 32 == 0, cols is 272"),
    (lambda d: d.__setitem__(40, 36), "unknown format 36"),
])
def test_the_parser_checks_ggml_descriptors(tmp_path, make_vault, edit, match):
    """A GGML tensor has group 0, no scale format and whole blocks; ggml types pysmoe does not
    read (36 = 32 + 4, a type ggml no longer has) are unknown formats."""
    from test_vault_errors import dense_index, seal

    path = Path(make_vault("ggml_q4km", preset="tiny", seed=7, overrides=SHAPE, **MIXES["q4km"]))
    buf = bytearray((path / "vault.bin").read_bytes())
    at = dense_index(buf, "layers.0.q_proj")
    assert buf[at + 40] == 40  # Q8_0
    desc = bytearray(buf[at:at + 64])
    edit(desc)
    buf[at:at + 64] = desc
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(bytes(seal(buf)) if f.name == "vault.bin" else f.read_bytes())
    with pytest.raises(VaultError, match=match):
        pysmoe.open_vault(bad)


def _rewritten(src, dst, mix: str, dense=None, blob=None):
    """dst: the vault at src written again (the same mix), each dense tensor's and each expert blob's
    bytes first passed to dense(name, tensor, raw) / blob(layer, expert, tensors, raw), which may
    change them in place (bytearrays)."""
    from pysmoe import vaultio as V

    r = V.read_vault(src)
    try:
        with V.VaultWriter(dst, r.config, formats=MIXES[mix]["formats"] | {"experts": MIXES[mix]["experts"]}) as w:
            for name, t in r.tensors.items():
                raw = bytearray(r.raw(name))
                if dense:
                    dense(name, t, raw)
                w.add_dense_raw(name, raw)
            for l in range(len(r.sparse)):
                for e in range(r.binary_config["num_experts"] if r.sparse[l] else 0):
                    raw = bytearray(r.blob(l, e))
                    if blob:
                        blob(l, e, r.expert_tensors, raw)
                    w.add_expert_raw(l, e, raw)
    finally:
        r.close()
    return dst


def test_verify_names_non_finite_ggml_scales(make_vault, tmp_path):
    """pysmoe verify reports an inf or NaN f16 scale of a GGML tensor (a dense Q8_0 one and a blob's
    Q6_K down), naming the tensor, the row and the block; the vault still opens."""
    src = make_vault("ggml_q4km", preset="tiny", seed=7, overrides=SHAPE, **MIXES["q4km"])

    def dense(name, t, raw):
        if name == "layers.1.q_proj":  # Q8_0, 34-byte blocks: row 1, block 2
            at = (1 * (t.cols // 32) + 2) * 34
            raw[at:at + 2] = np.float16(np.nan).tobytes()

    def blob(l, e, tensors, raw):
        if (l, e) == (2, 5):
            t = next(t for t in tensors if t.name == "down")  # Q6_K: d at 208
            raw[t.offset + 3 * 210 + 208:t.offset + 3 * 210 + 210] = np.float16(np.inf).tobytes()

    with pysmoe.open_vault(_rewritten(src, tmp_path / "bad", "q4km", dense, blob)) as vault:
        problems = vault.verify()
    assert [(k, l, e) for k, l, e, _ in problems] == [("values", -1, -1), ("values", 2, 5)], problems
    assert problems[0][3].startswith("layers.1.q_proj scales: 1 non-finite value(s) (NaN or inf), the first at row 1, block 2")
    assert problems[1][3].startswith("down scales: 1 non-finite value(s) (NaN or inf), the first at row 3, block 0")
    with pysmoe.open_vault(src) as good:
        assert good.verify() == []


def test_verify_reads_iq1m_scattered_scale(make_vault, tmp_path):
    """IQ1_M keeps its f16 d in the top nibbles of four scale words: a NaN written there is found
    and named like any other block's scale."""
    src = make_vault("ggml_iq", preset="tiny", seed=7, overrides=SHAPE, **MIXES["iq"])

    def dense(name, t, raw):
        if name == "embed_tokens":  # IQ1_M, 56-byte blocks of 256: row 2, block 0
            blk = 2 * (t.cols // 256) * 56
            block = np.frombuffer(bytes(raw[blk:blk + 56]), np.uint8).copy().reshape(1, 56)
            ggml_blocks.set_iq1m_d(block, np.nan)
            raw[blk:blk + 56] = block.tobytes()

    with pysmoe.open_vault(_rewritten(src, tmp_path / "bad", "iq", dense)) as vault:
        problems = vault.verify()
    assert [(k, l, e) for k, l, e, _ in problems] == [("values", -1, -1)], problems
    assert problems[0][3].startswith("embed_tokens scales: 1 non-finite value(s) (NaN or inf), the first at row 2, block 0")
    with pysmoe.open_vault(src) as good:
        assert good.verify() == []


# ------------------------------------------------------------------------- on the GPU (CUDA)

def test_gpu_runs_every_ggml_format(ggml_vault):
    """The four mixes hold all twenty-one GGML formats as experts and dense tensors (embedding and
    lm_head included). On device="cuda" (csrc/cuda/ggml.cu; skipped without a GPU): the prefill's
    and three decode steps' logits within test_cuda's ATOL + RTOL_F16 of the CPU's (activations="f32":
    the same dequantised weights, another summation order, and flash attention's f16 Q, K, V and P
    for the head size 64); and on the GPU layer-major in chunks
    of 1, 5 and 16, the experts in VRAM or streamed through two slots, gives token-serial's
    logits and KV rows bit for bit."""
    from pysmoe.errors import Unsupported
    from test_cuda import ATOL, RTOL_F16

    name, path = ggml_vault
    with pysmoe.open_vault(path) as vault:
        try:
            vault.session(device="cuda").close()
        except Unsupported as e:
            pytest.skip(f"no CUDA here: {e}")
        ids = [int(i) for i in np.random.default_rng(4).integers(0, vault.config["vocab_size"], 33)]
        L = vault.config["num_hidden_layers"]

        def run(device, prefill="layer-major", chunk=64, **kw):
            with vault.session(device=device, prefill=prefill, activations="f32", context=256, chunk=chunk, **kw) as s:
                out = [s.prefill(ids)]
                out += [s.decode(int(np.argmax(out[-1]))) for _ in range(3)]
                kv = [s.kv(layer) for layer in range(L)]
            return np.stack(out), kv

        cpu, _ = run("cpu")
        want, want_kv = run("cuda", "token-serial", gpu_cache_bytes=1 << 30)
        err, top = float(np.max(np.abs(want - cpu))), float(np.max(np.abs(cpu)))
        print(f"{name}: max|gpu - cpu| / max|logit| = {err / top:.3g}")
        assert np.isfinite(want).all() and err <= ATOL + RTOL_F16 * top, (name, err, top)
        for chunk in (1, 5, 16):
            for gpu in (1 << 30, 2 * vault.blob_bytes):
                got, kv = run("cuda", chunk=chunk, gpu_cache_bytes=gpu)
                assert got.tobytes() == want.tobytes(), (name, chunk, gpu)
                for (ka, va), (kb, vb) in zip(kv, want_kv):
                    assert ka.tobytes() == kb.tobytes() and va.tobytes() == vb.tobytes(), (name, chunk, gpu)
