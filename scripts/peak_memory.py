"""Peak memory of this process and its children (joblib workers, solvers), sampled every
0.2 s by a daemon thread: what the benchmark children report.

Two sums: resident set sizes (a page shared by forked workers counts once per process, an
upper bound) and proportional set sizes (a shared page counted once in all).
"""

from __future__ import annotations

import threading
import time

import psutil


class TreeMemory:
    """Start sampling on creation; `rss_mb` and `pss_mb` are the peaks so far."""

    def __init__(self, every: float = 0.2):
        self.rss = self.pss = 0
        self._every = every
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        me = psutil.Process()
        while True:
            rss = pss = 0
            for p in [me] + me.children(recursive=True):
                try:
                    rss += p.memory_info().rss
                    pss += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            time.sleep(self._every)

    @property
    def rss_mb(self) -> float:
        return self.rss / 2**20

    @property
    def pss_mb(self) -> float:
        return self.pss / 2**20
