#!/usr/bin/env python3
"""How much faster each phase of `verify` is than at an earlier revision, measured in one run.

    python scripts/bench_phases_history.py --base REV DIR [DIR ...] [--repeat 3]

Each DIR holds single.json.gz and parallel.json.gz (a real plan from ../shared/plans, or one
written by `tvsmt plan generate`). The revision `--base` is checked out in a temporary git
worktree; each measurement is `verify_pair` (jobs=1, folding on) in a fresh child process of
either tree, the two sides alternate, and each phase keeps its fastest time of `--repeat`.
Printed per plan: the verdict of both sides (they must agree), then per phase the seconds at
the base and now and their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from revision import checked_out

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tvsmt.verify import Options, verify_pair
r = verify_pair(sys.argv[2] + "/single.json.gz", sys.argv[2] + "/parallel.json.gz",
                Options(jobs=1))
print(json.dumps({"verdict": r.verdict, "timings": r.timings}))
"""


def measure(tree: Path, folder: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), folder], capture_output=True,
                         text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"{folder}: the {tree} side failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--base", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with checked_out(args.base) as base:
        for folder in args.folders:
            best: dict[str, dict[str, float]] = {"base": {}, "now": {}}
            verdicts = set()
            for _ in range(args.repeat):
                for side, tree in (("base", base), ("now", ROOT)):
                    got = measure(tree, folder)
                    verdicts.add((side, got["verdict"]))
                    for phase, s in got["timings"].items():
                        best[side][phase] = min(best[side].get(phase, s), s)
            print(f"{folder}: verdicts {sorted(verdicts)}")
            for phase in best["now"]:
                b, n = best["base"].get(phase), best["now"][phase]
                ratio = f"{b / n:6.1f}" if b and n else "     -"
                print(f"  {phase:<18} base {b if b is not None else float('nan'):8.3f} s  "
                      f"now {n:8.3f} s  x{ratio}")


if __name__ == "__main__":
    main()
