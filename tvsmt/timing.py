"""Phase timings of one run (what the report's `timings` and the benchmarks show).

With $TVSMT_TIMELINE set, every phase also writes its start and end (wall clock) and its
process id to stderr, one line each (`timeline PID NAME START END`), and `mark` writes an
instant (`timeline PID NAME T T`): a run's phases across its forked processes can then be
laid side by side (`python scripts/timeline.py`).
"""

from __future__ import annotations

import contextlib
import os
import time
from contextlib import contextmanager

TIMELINE_ENV = "TVSMT_TIMELINE"
_TIMELINE = bool(os.environ.get(TIMELINE_ENV))


def _timeline(name: str, start: float, end: float) -> None:
    # one write of one short line: lines of several processes sharing the pipe never mix
    line = f"timeline {os.getpid()} {name.replace(' ', '_')} {start:.6f} {end:.6f}\n"
    with contextlib.suppress(OSError):
        os.write(2, line.encode())


def mark(name: str) -> None:
    """An instant of the timeline (nothing unless $TVSMT_TIMELINE is set)."""
    if _TIMELINE:
        now = time.time()
        _timeline(name, now, now)


@contextmanager
def span(name: str):
    """A stretch of the timeline that no `Timer` phase times (what a forked helper does,
    a wait inside a phase); nothing unless $TVSMT_TIMELINE is set."""
    if not _TIMELINE:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        _timeline(name, start, time.time())


class Timer:
    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            with span(name):
                yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.timings.items()}
