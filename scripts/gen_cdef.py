"""Print the cffi cdef that pysmoe/_cdef.py holds, derived from csrc/smoe.h and csrc/smoe_testing.h.

    python scripts/gen_cdef.py > pysmoe/_cdef.py

tests/test_binding.py checks that the two agree, so the header stays the one source of truth.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cdef_from_header(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.rstrip()
        if s.startswith("#"):
            m = re.match(r"#define (SMOE_[A-Z_]+) (\d+)$", s)
            if m:
                out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        if 'extern "C"' in s or s == "}":
            continue
        s = re.sub(r"\s+", " ", s.replace("SMOE_API ", "")).strip()
        if s:
            out.append(s)
    return "\n".join(out) + "\n"


def render(text: str) -> str:
    return ('"""The C declarations the binding uses: generated from csrc/smoe.h and csrc/smoe_testing.h by scripts/gen_cdef.py."""\n\n'
            f'CDEF = """\n{cdef_from_header(text)}"""\n')


HEADERS = ("smoe.h", "smoe_testing.h")  # the ABI, then the calls for tests and tools


def header_text() -> str:
    return "\n".join((ROOT / "csrc" / h).read_text() for h in HEADERS)


if __name__ == "__main__":
    sys.stdout.write(render(header_text()))
