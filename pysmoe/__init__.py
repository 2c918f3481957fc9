"""pysmoe: run Qwen3-MoE models larger than memory.

    import pysmoe
    vault = pysmoe.open_vault("path/to/vault")
    with vault.session(cache_bytes=2 << 30) as s:
        for token in s.generate(ids, max_tokens=32):
            ...

Names resolve lazily so that `import pysmoe` stays cheap and the converters do not pull in the
engine (or the engine the converters).
"""
from .errors import (BadToken, Busy, Cancelled, ContextFull, InternalError, InvalidArgument, OutOfMemory, ReadError,
                     SessionBroken, SmoeError, Unsupported, VaultError)

__version__ = "0.1.0"

_LAZY = {
    "open_vault": "engine", "Vault": "engine", "Session": "engine", "decode_batch": "engine",
    "KV_DTYPES": "engine", "logprobs": "engine", "SessionPool": "server.pool",
    "stream_generate": "generate", "generate": "generate", "GenerationResponse": "generate",
    "synth": "synthesis", "PRESETS": "synthesis",
    "convert_checkpoint": "convert",
}

__all__ = ["SmoeError", "VaultError", "InvalidArgument", "BadToken", "ContextFull", "ReadError",
           "OutOfMemory", "SessionBroken", "Unsupported", "InternalError", "Busy", "Cancelled", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # resolve once
        # (modules are named apart from the functions they export, synthesis.synth and
        # convert.convert_checkpoint, because importing a submodule rebinds the package attribute.)
        return value
    raise AttributeError(f"module 'pysmoe' has no attribute {name!r}")
