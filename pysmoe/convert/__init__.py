"""`pysmoe convert SRC OUT`: a checkpoint on disk → a vault, without torch.

    python -m pysmoe convert mlx-community/Qwen3-30B-A3B-4bit/ vault/   # MLX: copied as stored
    python -m pysmoe convert Qwen/Qwen3-30B-A3B/ vault/ --experts q4     # HF bf16: MLX's quantiser

SRC is recognised by what it holds (`detect`):

- **mlx**: config.json has `quantization`, or the experts are stacked as `switch_mlp` (mlx.py).
  Quantised tensors are copied byte for byte in the format MLX gave them; nothing is
  requantised.
- **gguf**: a llama.cpp GGUF file (or the first of a split set, NAME-00001-of-0000N.gguf)
  (gguf.py). Tensors keep their GGML types byte for byte; the tokenizer and chat template come
  from the file's metadata. Needs the `gguf` extra.
- **hf**: a Hugging Face checkpoint of floats (bf16, f16, f32), sharded or not (hf.py).
  Quantised formats are made with MLX's affine quantiser (pysmoe.quant), scales and biases in the
  source dtype unless asked otherwise, so the vault equals an import of `mlx_lm convert -q`.

Both are planned from the safetensors headers first (safetensors_io.py: header parsed here,
data np.memmap'ed): every problem is reported before a byte is written. Then tensors are written
one at a time (memory stays near one expert), with a progress bar of input bytes, rate and ETA.
The vault directory also gets the checkpoint's tokenizer files, generation_config.json and a
`source.json` that says where it came from (`pysmoe info` shows it).
"""
from __future__ import annotations

import json
import logging
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from .. import quant
from .hf import DENSE_MATRIX_ROLES, DENSE_ROLES, FORMATS, ConvertError, load_config, plan, resolve_formats
from .safetensors_io import Checkpoint, SafetensorsError
from ..vaultio import TensorFormat

_SCALE_OF = {"BF16": "bf16", "F16": "f16", "F32": "f32"}

__all__ = ["ConvertError", "convert_checkpoint", "detect", "load_config", "plan"]

log = logging.getLogger("pysmoe.convert")

# Copied into the vault as they are: what the tokenizer and the chat template need.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "special_tokens_map.json")
SOURCE_FILE = "source.json"


def detect(src) -> str:
    """"gguf" for a GGUF file, "mlx" or "hf" for a checkpoint directory (ConvertError if it is
    none of them)."""
    from .mlx import is_mlx

    src = Path(src)
    if src.is_file():
        with open(src, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ConvertError(f"{src}: a file, but not a GGUF file (give a checkpoint directory or a .gguf)")
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory (give a checkpoint directory or a .gguf file)")
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src}: no config.json (is this a checkpoint directory?)")
    try:
        ckpt = Checkpoint(src)
    except SafetensorsError as exc:
        raise ConvertError(str(exc)) from None
    return "mlx" if is_mlx(src, ckpt) else "hf"


@contextmanager
def _target(out: Path, force: bool):
    """The directory the vault is written into: a temporary one beside out, renamed into place
    once complete and verified (pysmoe.vaultdir.staged); a non-empty out is refused unless force."""
    from ..vaultdir import staged
    with staged(out, force) as tmp:
        yield tmp


def convert_checkpoint(src, out_dir, experts: str | None = None, dense=None, scale_dtype: str | None = None,
            group: int = quant.GROUP, progress: bool = False, force: bool = False, jobs: int | None = None,
            paged_embedding: bool = True) -> Path:
    """Convert the checkpoint in src (MLX or Hugging Face, see `detect`) into a vault at out_dir.

    experts: expert format (q4, q8, bf16, f32, MXFP4); for an HF checkpoint default q4; for MLX only
    for experts stored unquantised (quantised ones are copied as they are). dense: None (the
    writer's defaults for HF; as stored for MLX), one format for every dense matrix, or {role:
    format} with roles embed, lm_head, attention, router, mlp, norms. scale_dtype: f16, bf16 or
    f32 for the q4/q8 tensors made here; default the checkpoint's dtype (as MLX does). group:
    their group size (32, 64, 128). jobs: processes that quantise a float checkpoint's experts
    (default one a core; 1 = this process alone); the vault's bytes do not depend on it.
    paged_embedding: an untied embedding stays on disk, read a row at a time (docs/vault.md 4.1);
    False keeps it in memory. Raises ConvertError before writing anything when the checkpoint
    cannot be converted."""
    from ..progress import Progress
    from ..vaultio import VaultWriter

    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise ConvertError(f"jobs must be a positive number of processes, not {jobs!r}")
    if jobs is None:
        from ..workers import default_procs
        jobs = default_procs()
    kind = detect(src)
    if kind == "gguf":
        _only_defaults(experts, dense, scale_dtype, group)
        from .gguf import convert_gguf
        return convert_gguf(src, out_dir, progress=progress, force=force, paged_embedding=paged_embedding)
    try:
        ckpt = Checkpoint(src)
    except SafetensorsError as exc:
        raise ConvertError(str(exc)) from None
    with ExitStack() as stack:
        stack.callback(ckpt.close)
        if kind == "mlx":
            job = _MlxJob(src, ckpt, experts, dense, scale_dtype, group)
        else:
            job = _HfJob(src, ckpt, experts, dense, scale_dtype, group)
        with _target(out_dir, force) as target:
            with VaultWriter(target, job.config, formats=job.formats, scale_dtype=job.scale_dtype,
                             group=group, paged_embedding=paged_embedding) as writer:
                with Progress(job.total, "convert", unit="B", enabled=progress) as bar:
                    job.write(writer, bar, jobs)
            _side_files(src, target)
            (target / SOURCE_FILE).write_text(json.dumps(job.source(), indent=2) + "\n")
    return out_dir


def _only_defaults(experts, dense, scale_dtype, group) -> None:
    """A GGUF file is converted as stored: format options would mean requantising."""
    asked = [n for n, v in (("--experts", experts), ("--dense/--attention/--embed/--lm-head", dense),
                            ("--scale-dtype", scale_dtype)) if v] + (["--group-size"] if group != quant.GROUP else [])
    if asked:
        raise ConvertError(f"a GGUF file is converted with its tensors as stored; {', '.join(asked)} "
                           "would requantise them and is not supported")


def _side_files(src: Path, out: Path) -> None:
    if not (src / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: the vault will have none", src)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def _check_float_format(role: str, fmt: str | None) -> str | None:
    if fmt is not None and fmt not in FORMATS:
        raise ConvertError(f"unknown format {fmt!r} for {role} (one of {', '.join(FORMATS)})")
    return fmt


def plan_checkpoint(src, cfg: dict | None = None, ckpt: Checkpoint | None = None):
    """The plan of a Hugging Face checkpoint folder, by its family's planner (gpt-oss has its own;
    every other model type hf.plan's)."""
    cfg = load_config(Path(src)) if cfg is None else cfg
    if cfg.get("model_type") == "gpt_oss":
        from . import gpt_oss
        return gpt_oss.plan(src, cfg, ckpt)
    return plan(src, cfg, ckpt)


class _HfJob:
    def __init__(self, src, ckpt, experts, dense, scale_dtype, group):
        from ..vaultio import compute_layout
        from . import hf

        self.kind = "hf"
        cfg = load_config(src)
        self.plan = plan_checkpoint(src, cfg, ckpt)
        from .gpt_oss import is_mxfp4
        self.mxfp4 = is_mxfp4(self.plan)
        if self.mxfp4 and experts not in (None, "MXFP4"):
            log.warning("%s: the experts are MXFP4 as released; they are imported as stored (MXFP4), not "
                        "requantised to %s", src, experts)
        self.formats = resolve_formats(experts or "q4", dense) if not self.mxfp4 else \
            {**resolve_formats("q4", dense), "experts": "MXFP4"}
        self.ckpt = ckpt
        self.dtype = hf.source_dtype(ckpt, self.plan)
        self.scale_dtype = scale_dtype or self.dtype
        self.group = group
        try:  # limits, and formats that do not fit a shape (q4 needs cols % group == 0), fail here
            compute_layout(cfg, self.formats, self.scale_dtype, group)
        except ValueError as exc:
            raise ConvertError(f"cannot convert {src} with formats {self.formats}: {exc}") from None
        self.config = self.plan.config
        self.total = sum(s.nbytes for s in self.plan.dense.values())
        self.total += sum(s.nbytes for parts in self.plan.experts.values() for s in parts.values())

    def write(self, writer, bar, jobs: int = 1) -> None:
        from ..workers import fork_map
        from .hf import read

        for name, s in self.plan.dense.items():
            t = writer.layout.tensors[name]
            if s.expert is None and s.take is None and len(self.ckpt.tensors[s.name].shape) == 2:
                # by blocks of rows: an embedding never exists whole in f32 (a tensor whose rows
                # are taken apart, Qwen3-Next's q_proj and in-projections, is read whole)
                data = quant.quantize_rows(lambda r0, r1, n=s.name: self.ckpt.rows(n, r0, r1), t.rows, t.cols,
                                           t.format, t.scale_format or "f16", t.group or quant.GROUP)
                writer.add_dense_raw(name, data)
                del data
            else:
                writer.add_dense(name, read(self.ckpt, s))
            bar.update(s.nbytes)
        # Each expert read and quantised by one of `jobs` forked processes (numpy holds the GIL,
        # so threads would not help: pysmoe.workers), written here as its blob arrives.
        experts = list(self.plan.experts.items())

        def pack(item):
            (layer, _), parts = item
            if "gate_bias" not in parts:
                return writer.pack_expert(*(read(self.ckpt, parts[k]) for k in ("gate", "up", "down")), layer)
            # gpt-oss: biases too, and MXFP4 matrices as stored
            mats = {k: read(self.ckpt, s) for k, s in parts.items()}
            raw = {k: mats[k] for k in ("gate", "up", "down") if getattr(parts[k], "mxfp4", False)}
            floats = [None if k in raw else mats[k] for k in ("gate", "up", "down")]
            return writer.pack_expert(*floats, layer, [mats[k] for k in ("gate_bias", "up_bias", "down_bias")], raw)

        for i, blob in fork_map(pack, experts, jobs):
            (layer, e), parts = experts[i]
            writer.add_expert_raw(layer, e, blob)
            bar.update(sum(s.nbytes for s in parts.values()))

    def source(self) -> dict:
        if self.mxfp4:
            return {"kind": "hf", "path": str(Path(self.ckpt.dir).resolve()), "dtype": self.dtype,
                    "quantization": {"experts": "MXFP4 as released (rearranged into ggml's blocks, not requantised)",
                                     "formats": ", ".join(f"{k} {v}" for k, v in self.formats.items())}}
        q = {"quantiser": "mlx-affine", "formats": ", ".join(f"{k} {v}" for k, v in self.formats.items()),
             "group_size": self.group, "scale_dtype": self.scale_dtype}
        if "MXFP4" in self.formats.values():
            q["mxfp4_quantiser"] = "llama.cpp quantize_row_mxfp4_ref (ggml_blocks.quantize_mxfp4)"
        return {"kind": "hf", "path": str(Path(self.ckpt.dir).resolve()), "dtype": self.dtype, "quantization": q}


class _MlxJob:
    def __init__(self, src, ckpt, experts, dense, scale_dtype, group):
        from . import mlx

        self.kind = "mlx"
        floats = {}
        if experts:
            floats["experts"] = _check_float_format("experts", experts)
        if isinstance(dense, str):
            dense = {role: dense for role in DENSE_MATRIX_ROLES}
        for role, fmt in (dense or {}).items():
            if role not in DENSE_ROLES:
                raise ConvertError(f"unknown dense role {role!r} (one of {', '.join(DENSE_ROLES)})")
            floats[role] = _check_float_format(role, fmt)
        self.plan = p = mlx.plan(src, ckpt)
        self.ckpt = ckpt
        self.scale_dtype = scale_dtype or "f16"
        self.group = group
        from ..vaultio import role_of

        # A format asked for applies to tensors MLX left in floats (quantised with MLX's
        # quantiser, scales in that tensor's dtype unless scale_dtype says otherwise);
        # quantised tensors stay exactly as stored.
        def asked(fmt: str | None, current, module: str):
            stored = current.format in ("q4", "q8", "MXFP4")  # quantised by MLX: copied as stored
            if fmt is not None and stored and fmt != current.format:
                log.warning("%s is stored as %s by MLX; it is copied as stored, not converted to %s",
                            module, current.format, fmt)
            if fmt is None or stored:
                return current
            dtype = _SCALE_OF.get(ckpt.tensors[module + ".weight"].dtype, "f32") if module + ".weight" in ckpt \
                else "f32"
            return TensorFormat(fmt, group, scale_dtype or dtype)

        for name, e in list(p.dense.items()):
            p.dense[name] = replace(e, fmt=asked(floats.get(role_of(name)), e.fmt, e.module))
        self.stored = dict(p.experts)  # the experts' formats as MLX stored them
        for part in p.experts:
            module = mlx.switch_module(p.config, p.sparse[0], part, p.prefix)
            p.experts[part] = asked(floats.get("experts"), p.experts[part], module)
        self.formats = p.formats()
        self.config = p.config
        E = p.config["num_experts"]
        self.total = sum(e.nbytes for e in p.dense.values())
        for l in p.sparse:
            for part in ("gate", "up", "down"):
                module = mlx.switch_module(p.config, l, part, p.prefix)
                for k in ("weight", "scales", "biases", "bias"):
                    self.total += ckpt.tensors[f"{module}.{k}"].nbytes if f"{module}.{k}" in ckpt else 0
        self._per_expert = self.total - sum(e.nbytes for e in p.dense.values())
        self._per_expert //= max(1, E * len(p.sparse))

    def write(self, writer, bar, jobs: int = 1) -> None:  # copies: bound by the disk, not the cores
        import numpy as np

        from . import mlx

        p = self.plan
        for name, e in p.dense.items():
            if e.quantised:
                writer.add_dense_raw(name, mlx.read_quantised(self.ckpt, e))
            else:
                writer.add_dense(name, mlx.read_float(self.ckpt, e))
            bar.update(e.nbytes)
        cfg = p.config
        H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for l in p.sparse:
            entries = {}
            for part, (rows, cols) in shapes.items():
                module = mlx.switch_module(cfg, l, part, p.prefix)
                stored = self.stored[part]
                entries[part] = mlx.Entry(module, rows, cols, stored, stored.format in ("q4", "q8", "MXFP4"), 0)
            layout = writer.layout.layer_expert[l]
            for e in range(cfg["num_experts"]):
                # a part stored quantised in the vault's format is copied as stored; any other is
                # given as floats (a stored-quantised one decoded exactly) and quantised by the writer
                raw, mats = {}, []
                for t, part in zip(layout, ("gate", "up", "down")):
                    x = entries[part]
                    if x.quantised and t.format == x.fmt.format:
                        raw[part] = np.frombuffer(mlx.read_quantised(self.ckpt, x, e), dtype=np.uint8)
                        mats.append(None)
                    else:
                        mats.append(self._expert_floats(x, e))
                biases = [self.ckpt.floats(f"{entries[k].module}.bias", e) for k in ("gate", "up", "down")] \
                    if p.expert_bias else None
                writer.add_expert_raw(l, e, writer.pack_expert(*mats, l, biases, raw))
                bar.update(self._per_expert)

    def _expert_floats(self, entry, e):
        import numpy as np

        from . import mlx

        if entry.quantised:  # mixing a stored-quantised part with float parts: decode exactly
            raw = mlx.read_quantised(self.ckpt, entry, e)
            if entry.fmt.format == "MXFP4":
                from .. import ggml_blocks
                return ggml_blocks.dequantize(np.frombuffer(raw, dtype=np.uint8), "MXFP4", entry.rows, entry.cols)
            return quant.dequantize(raw, entry.fmt.format, entry.rows, entry.cols, entry.fmt.scale_dtype,
                                    entry.fmt.group)
        return mlx.read_float(self.ckpt, replace(entry, index=e))

    def source(self) -> dict:
        return {"kind": "mlx", "path": str(Path(self.ckpt.dir).resolve()),
                "quantization": self.plan.recipe or None}
