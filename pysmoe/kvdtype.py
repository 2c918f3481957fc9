"""The KV cache's element types: smoe_kv_dtype's names in the enum's order, the bytes of each,
and the library's default (what a session gets when kv_dtype is not given)."""
from __future__ import annotations

KV_DTYPES = ("f32", "bf16", "f16")  # smoe_kv_dtype's values, in order
KV_ELEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def default_kv_dtype() -> str:
    """The KV element type a session gets when kv_dtype is not given (the library's default)."""
    from ._ffi import lib
    return KV_DTYPES[lib.smoe_session_default_params().kv_dtype]
