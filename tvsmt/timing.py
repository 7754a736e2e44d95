"""Phase timings of one run (what the report's `timings` and the benchmarks show)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class Timer:
    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.timings.items()}
