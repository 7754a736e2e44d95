#!/usr/bin/env python3
"""What the direct infix operators (tvsmt/ops/backend.py `_direct_infix`) save, in one run.

    python scripts/bench_infix.py DIR [DIR ...] [--repeat 3]

Each DIR holds single.json.gz and parallel.json.gz (e.g. a real plan of ../shared/plans).
Every verification runs in this process with one job (so the encoding's CPU is this
process's), loading and folding here, alternately with pysmt's own `+ - *` and with the
direct ones; the obligations must be the same (their digests are compared). Printed per
plan and side: the fastest run's encoding phase ("encoding": symbolic execution and
printing) and the whole verification, and the ratio direct / pysmt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TVSMT_FOLD_IN_CHILD"] = "0"

from pysmt.fnode import FNode  # noqa: E402

from tvsmt.ops import SymbolicBackend  # noqa: E402
from tvsmt.verify import Options, verify_pair  # noqa: E402


SymbolicBackend.fresh()  # the first backend installs the direct operators
DIRECT = (FNode.__add__, FNode.__sub__, FNode.__mul__)


def operators(direct: bool) -> None:
    FNode.__add__, FNode.__sub__, FNode.__mul__ = DIRECT if direct else FNode._tvsmt_pysmt_infix


def once(folder: Path, direct: bool) -> tuple[float, float, list]:
    operators(direct)
    t0 = time.perf_counter()
    report = verify_pair(str(folder / "single.json.gz"), str(folder / "parallel.json.gz"),
                         Options(jobs=1))
    seconds = time.perf_counter() - t0
    digests = sorted({row[4] for row in report.stages})
    return report.timings.get("encoding", 0.0), seconds, [report.verdict, digests]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'plan':32} {'encoding pysmt':>14} {'direct':>7} {'x':>5} "
          f"{'total pysmt':>12} {'direct':>7} {'x':>5}")
    for folder in args.dirs:
        best: dict[bool, tuple[float, float]] = {}
        seen: dict[bool, list] = {}
        for _ in range(args.repeat):
            for direct in (False, True):
                enc, total, what = once(folder, direct)
                seen[direct] = what
                old = best.get(direct)
                best[direct] = (min(enc, old[0]), min(total, old[1])) if old else (enc, total)
        operators(True)
        if seen[False] != seen[True]:
            sys.exit(f"{folder.name}: the two operators gave different obligations")
        (e0, t0), (e1, t1) = best[False], best[True]
        print(f"{folder.name:32} {e0:14.2f} {e1:7.2f} {e1 / e0:5.2f} {t0:12.2f} {t1:7.2f} "
              f"{t1 / t0:5.2f}")


if __name__ == "__main__":
    main()
