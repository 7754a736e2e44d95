"""Huge pages for a reader's heap (tvsmt/heap.py `huge_pages_for_heap`), on and off: the wall
time of `tvsmt verify --no-corpus -j 2` on one real plan pair, alternating
`$TVSMT_HUGE_PAGES=never` and the default in one run, with each run's load and fold times
from its JSON report. The machine's speed drifts within minutes, so the two sides alternate
and medians are compared.

    python scripts/bench_huge_pages.py [--plan ../shared/plans/moe-ly2-dp16pp2tp4mb16] [--runs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = ROOT.parent / "shared" / "plans" / "moe-ly2-dp16pp2tp4mb16"


def one_run(plan: Path, mode: str, report: str) -> tuple[float, dict]:
    env = dict(os.environ, TVSMT_HUGE_PAGES=mode)
    argv = [sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", "2", "--report",
            report, str(plan / "single.json.gz"), str(plan / "parallel.json.gz")]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{mode}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    with open(report) as f:
        return wall, json.load(f)["timings"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", type=Path, default=DEFAULT_PLAN)
    ap.add_argument("--runs", type=int, default=6, help="runs of each side, alternating")
    args = ap.parse_args()
    if not (args.plan / "parallel.json.gz").exists():
        sys.exit(f"no plan pair in {args.plan}")
    got: dict[str, list] = {"never": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        one_run(args.plan, "never", report)  # warm the page cache and the machine
        for _ in range(args.runs):
            for mode in ("never", "on"):
                got[mode].append(one_run(args.plan, mode, report))
    print(f"{args.plan.name}, {args.runs} alternating runs each "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"{'huge pages':>10} {'command s (median; range)':>28} {'load s':>7} {'fold s':>7}")
    medians = {}
    for mode, rows in got.items():
        walls = [w for w, _ in rows]
        medians[mode] = statistics.median(walls)
        load = statistics.median(t.get("load", 0.0) for _, t in rows)
        fold = statistics.median(t.get("fold", 0.0) for _, t in rows)
        print(f"{mode:>10} {medians[mode]:>9.2f} ({min(walls):.2f}-{max(walls):.2f})"
              f"{'':>8} {load:>7.2f} {fold:>7.2f}")
    print(f"ratio never / on (medians): {medians['never'] / medians['on']:.2f}")


if __name__ == "__main__":
    main()
