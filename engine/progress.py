"""A progress bar on stderr for the offline commands (`convert`, `info --verify`).

A `format.Progress` callable: `bar(done, total, what)`. On a terminal it redraws one line in
place at most ~10 times a second; otherwise it writes one line per 10% so logs stay short.
"""

from __future__ import annotations

import sys
import time


class StderrProgress:
    def __init__(self, title: str, stream=None):
        self.title, self.stream = title, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0, self.last, self.decile = time.monotonic(), 0.0, -1

    def __call__(self, done: int, total: int, what: str = "") -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        line = (f"{self.title} {frac * 100:5.1f}% {done / 1e9:6.2f}/{total / 1e9:.2f} GB "
                f"{now - self.t0:5.0f}s {what}")
        if self.tty:
            if now - self.last >= 0.1 or done >= total:
                self.stream.write("\r" + line[:120].ljust(120))
                self.last = now
        elif int(frac * 10) > self.decile:
            self.decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
