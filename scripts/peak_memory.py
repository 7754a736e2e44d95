"""Peak memory of this process and its children (joblib workers, solvers), sampled by a daemon
thread: what the benchmark children report.

Two sums: resident set sizes (a page shared by forked workers counts once per process, an
upper bound), every 0.2 s, and proportional set sizes (a shared page counted once in all),
at most once a second and never more than 5% of the sampler's time. A PSS sample makes the
kernel walk every page of every process (about 40 ms per 2 GB resident, charged to the
sampled process, and it holds the memory map's lock the process needs to grow): taken every
0.2 s it cost the 3.6M-node from-disk run a third of its CPU time (cpu 110 against 75 s,
wall 106 against 76 s in two back-to-back runs of scripts/bench_stream.py, the second without
sampling), and every second still 12 s of CPU and 10 s of wall. So the PSS peak is the
largest of samples some seconds apart on a large run; the RSS peak, every 0.2 s, bounds it.
"""

from __future__ import annotations

import threading
import time

import psutil


class TreeMemory:
    """Start sampling on creation; `rss_mb` and `pss_mb` are the peaks so far."""

    def __init__(self, every: float = 0.2, pss_every: float = 1.0, pss_share: float = 0.05):
        self.rss = self.pss = 0
        self._every, self._pss_every, self._pss_share = every, pss_every, pss_share
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        me = psutil.Process()
        next_pss = float("-inf")
        while True:
            start = time.monotonic()
            with_pss = start >= next_pss
            rss = pss = 0
            for p in [me] + me.children(recursive=True):
                try:
                    rss += p.memory_info().rss
                    if with_pss:
                        pss += p.memory_full_info().pss
                except psutil.Error:
                    pass
            if with_pss:  # the next one after at least 1/share times this one's cost
                cost = time.monotonic() - start
                next_pss = start + max(self._pss_every, cost / self._pss_share)
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            time.sleep(self._every)

    @property
    def rss_mb(self) -> float:
        return self.rss / 2**20

    @property
    def pss_mb(self) -> float:
        return self.pss / 2**20
