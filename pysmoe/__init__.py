"""pysmoe: run Qwen3-MoE models larger than memory.

    import pysmoe
    vault = pysmoe.open_vault("path/to/vault")
    with vault.session(cache_bytes=2 << 30) as s:
        for token in s.generate(ids, max_tokens=32):
            ...

Names resolve lazily so that `import pysmoe` stays cheap and the converters do not pull in the
engine (or the engine the converters).
"""
from .errors import (BadToken, ContextFull, InternalError, InvalidArgument, OutOfMemory, ReadError,
                     SessionBroken, SmoeError, Unsupported, VaultError)

__version__ = "0.1.0"

_LAZY = {
    "open_vault": "engine", "Vault": "engine", "Session": "engine",
    "stream_generate": "generate", "generate": "generate", "GenerationResponse": "generate",
    "synth": "synth", "PRESETS": "synth",
    "convert": "convert",
}

__all__ = ["SmoeError", "VaultError", "InvalidArgument", "BadToken", "ContextFull", "ReadError",
           "OutOfMemory", "SessionBroken", "Unsupported", "InternalError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'pysmoe' has no attribute {name!r}")
