#!/usr/bin/env python3
"""Where one verification's time goes: per phase, its wall time, the CPU time (user and
kernel) and page faults of this process and of its children (forked readers, encoding
workers, solvers), then the time to free the loaded plans, as a library caller would pay it
if it loaded them itself. Everything runs in this process, the load and the fold included:
`verify_pair` instead reads and folds a large document in a forked process
(tvsmt/fold_child.py), which frees nothing here; this script shows what each phase costs.

    python scripts/phase_costs.py ../shared/plans/moe-ly2-dp16pp2tp4mb16 [--jobs 2] [--repeat N]

Phases nest (encoding's "shapes", "encoding", "evaluation" are CPU sums over the workers,
inside "encoding (wall)"), so only the top-level ones are shown. A fresh process per run
would measure the same; here runs follow each other in one process, each on a fresh load.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvsmt import timing
from tvsmt.heap import plans_frozen
from tvsmt.verify import Options, PlanPair, _verify_loaded

NESTED = ("shapes", "encoding", "evaluation")


def usage() -> tuple:
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return (time.perf_counter(), s.ru_utime, s.ru_stime, s.ru_minflt, c.ru_utime, c.ru_stime,
            c.ru_minflt)


def delta(a: tuple, b: tuple) -> tuple:
    return tuple(y - x for x, y in zip(a, b))


def one_run(folder: Path, jobs: int) -> list[tuple[str, tuple]]:
    rows: list[tuple[str, tuple]] = []
    plain_phase = timing.Timer.phase

    @contextmanager
    def phase(self, name):
        before = usage()
        with plain_phase(self, name):
            yield
        if name not in NESTED:
            rows.append((name, delta(before, usage())))

    timing.Timer.phase = phase
    try:
        timer = timing.Timer()
        with timer.phase("load"):
            pair = PlanPair.load(str(folder / "single.json.gz"), str(folder / "parallel.json.gz"))
        objects = gc.get_freeze_count()  # the plans just read are frozen (heap.py)
        with plans_frozen():
            report = _verify_loaded(pair, Options(jobs=jobs), timer)
        before = usage()
        del pair
        rows.append((f"free the loaded plans ({objects} objects)", delta(before, usage())))
        rows.append((f"verdict: {report.verdict}", ()))
    finally:
        timing.Timer.phase = plain_phase
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    for run in range(args.repeat):
        print(f"run {run + 1}: {args.folder.name}")
        print(f"  {'phase':42} {'wall':>6} | {'this process: user':>18} {'kernel':>6} "
              f"{'faults':>7} | {'children: user':>14} {'kernel':>6} {'faults':>7}")
        for name, d in one_run(args.folder, args.jobs):
            if not d:
                print(f"  {name}")
                continue
            wall, su, ss, sf, cu, cs, cf = d
            print(f"  {name:42} {wall:6.3f} | {su:18.2f} {ss:6.2f} {sf:7d} | {cu:14.2f} "
                  f"{cs:6.2f} {cf:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
