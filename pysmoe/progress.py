"""A tiny progress bar on stderr (no dependency).

    with Progress(total_bytes, "experts", unit="B") as bar:
        for blob in blobs:
            ...
            bar.update(len(blob))

On a terminal it redraws one line at most ten times a second; when stderr is not a terminal
(CI logs, a file) it prints one line when done, and one every LOG_INTERVAL seconds before that
for a long job, so logs stay short.
"""
from __future__ import annotations

import sys
import time

LOG_INTERVAL = 30.0  # seconds between lines when the stream is not a terminal


def _fmt(n: float, unit: str) -> str:
    if unit == "B":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or u == "TiB":
                return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
            n /= 1024
    for u in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or u == "T":
            return (f"{n:.0f}" if not u else f"{n:.1f}{u}") + (f" {unit}" if unit else "")
        n /= 1000


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, total: float, desc: str = "", unit: str = "", enabled: bool = True,
                 stream=None, width: int = 28):
        self.total = max(total, 0)
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.n = 0.0
        self.start = time.monotonic()
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last >= 0.1 or self.n >= self.total:
                self._last = now
                self._draw(now, end="")
        elif now - max(self._last, self.start) >= LOG_INTERVAL and self.n < self.total:
            self._last = now
            self._draw(now, end="\n")

    def _line(self, now: float) -> str:
        elapsed = now - self.start
        frac = min(1.0, self.n / self.total) if self.total else 1.0
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        rate = self.n / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 and frac < 1 else 0.0
        rate_s = f"{_fmt(rate, self.unit)}/s"
        return (f"{self.desc} [{bar}] {frac * 100:3.0f}% {_fmt(self.n, self.unit)}/{_fmt(self.total, self.unit)}"
                f" {_duration(elapsed)} {rate_s}" + (f" eta {_duration(eta)}" if eta else ""))

    def _draw(self, now: float, end: str) -> None:
        line = self._line(now)
        if self._tty:
            self.stream.write("\r" + line + "\x1b[K" + end)
        else:
            self.stream.write(line + end)
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw(time.monotonic(), end="\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
