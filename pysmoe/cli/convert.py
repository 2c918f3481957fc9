"""python -m pysmoe convert SRC OUT: a checkpoint on disk → a vault (pysmoe.convert)."""
from __future__ import annotations

from .args import positive_int, vault_out


def add_parser(p, name: str = "convert") -> None:
    """The arguments of `python -m pysmoe convert` on its (sub)parser p (pysmoe.cli makes p)."""
    from .. import quant
    from ..convert import FORMATS
    p.description = ("Convert a checkpoint into a vault: an MLX checkpoint (mlx_lm convert, "
                     "mlx-community; quantised tensors copied as stored) or a Hugging Face "
                     "checkpoint of floats (quantised with MLX's quantiser: Qwen3-MoE, Mixtral, OLMoE, GLM-4.5/4.6/Air, "
                     "gpt-oss, Qwen3-Next, Qwen3.5/3.6-MoE; docs/families.md), or a llama.cpp GGUF file (tensors "
                     "kept in their GGML types). No torch needed.")
    p.add_argument("src", metavar="SRC", help="checkpoint directory (config.json, *.safetensors) or a .gguf file "
                   "(the first of a split set: NAME-00001-of-0000N.gguf)")
    p.add_argument("out", metavar="OUT", type=vault_out, help="vault directory to write (empty or new, unless --force)")
    p.add_argument("--experts", choices=FORMATS, help="expert format (default: q4 for a float checkpoint; "
                   "as stored for MLX and for gpt-oss's MXFP4 release; MXFP4: llama.cpp's quantiser)")
    p.add_argument("--dense", choices=FORMATS, help="format of every dense matrix (default: the writer's / as stored)")
    p.add_argument("--attention", choices=FORMATS, help="format of q/k/v/o_proj (overrides --dense)")
    p.add_argument("--embed", choices=FORMATS, help="format of embed_tokens (overrides --dense)")
    p.add_argument("--lm-head", dest="lm_head", choices=FORMATS, help="format of lm_head (overrides --dense)")
    p.add_argument("--scale-dtype", choices=quant.SCALE_DTYPES,
                   help="dtype of the scales and biases of q4/q8 tensors made here (default: the checkpoint's)")
    p.add_argument("--group-size", dest="group", type=int, choices=quant.GROUPS, default=quant.GROUP,
                   help="group size of q4/q8 tensors made here (default 64)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="processes that quantise a float checkpoint's experts (default: one a core)")
    p.add_argument("--embedding-in-memory", dest="paged_embedding", action="store_false",
                   help="keep the embedding table in memory (default: left on disk, each token's row read when needed; docs/vault.md 4.1)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT (only once the new vault is complete)")
    p.add_argument("--quiet", "--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args) -> int:
    from ..convert import DENSE_MATRIX_ROLES, convert_checkpoint
    dense = {role: args.dense for role in DENSE_MATRIX_ROLES} if args.dense else {}
    for role in ("attention", "embed", "lm_head"):
        if getattr(args, role):
            dense[role] = getattr(args, role)
    convert_checkpoint(args.src, args.out, experts=args.experts, dense=dense or None, scale_dtype=args.scale_dtype,
                       group=args.group, progress=args.progress, force=args.force, jobs=args.jobs,
                       paged_embedding=args.paged_embedding)
    return 0
