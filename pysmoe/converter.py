"""Old home of `pysmoe convert`; the converter is the pysmoe.convert package now."""
from .convert import ConvertError, add_parser, convert, detect, load_config, plan, run  # noqa: F401
from .convert.hf import resolve_formats  # noqa: F401
