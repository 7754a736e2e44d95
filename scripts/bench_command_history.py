#!/usr/bin/env python3
"""How much faster the `verify` command is than at an earlier revision, measured in one run.

    python scripts/bench_command_history.py --base REV DIR [DIR ...] [--repeat 6] [--jobs 2]
        [--in-process]

Each DIR holds single.json.gz and parallel.json.gz (e.g. a real plan of ../shared/plans).
The revision `--base` is checked out in a temporary git worktree. Each measurement is the
wall time of `python -m tvsmt verify --no-corpus -j JOBS` run from outside both trees with
PYTHONPATH set to one of them (what a user waits for: start, imports, exit included). The
two sides alternate, plan after plan, `--repeat` rounds, so that the machine's changing load
falls on both alike. Both trees are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set
(as on this machine), a module without its .pyc would be compiled again on every run, on one
side only. Printed per plan and side: the verdicts (they must agree), the median and the
fastest time, and the median ratio now / base.

`--in-process`: each measurement is instead `verify_pair` timed inside a fresh process that
has already imported tvsmt (scripts/bench_real.py's "in-process" time), its exit code 0 for
a verdict.
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from revision import checked_out

ROOT = Path(__file__).resolve().parents[1]


IN_PROCESS = """
import sys, time
from tvsmt.verify import Options, verify_pair
t0 = time.perf_counter()
verify_pair(sys.argv[1], sys.argv[2], Options(jobs=int(sys.argv[3])))
print(time.perf_counter() - t0)
"""


def run(tree: Path, folder: Path, jobs: int, in_process: bool = False) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    pair = [str(folder / "single.json.gz"), str(folder / "parallel.json.gz")]
    if in_process:
        cmd = [sys.executable, "-c", IN_PROCESS, *pair, str(jobs)]
    else:
        cmd = [sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", str(jobs), *pair]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True)
    seconds = time.perf_counter() - t0
    if in_process and done.returncode == 0:
        seconds = float(done.stdout.decode().split()[-1])
    return seconds, done.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--base", required=True)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--in-process", action="store_true",
                    help="time verify_pair in a process that has imported tvsmt")
    args = ap.parse_args()
    folders = [f.resolve() for f in args.folders]
    with checked_out(args.base) as base:
        sides = {"base": base, "now": ROOT}
        for tree in sides.values():
            compileall.compile_dir(str(tree / "tvsmt"), quiet=1)
        times = {(side, f): [] for side in sides for f in folders}
        codes = {(side, f): set() for side in sides for f in folders}
        for _ in range(args.repeat):
            for f in folders:
                for side, tree in sides.items():
                    seconds, code = run(tree, f, args.jobs, args.in_process)
                    times[side, f].append(seconds)
                    codes[side, f].add(code)
        print(f"| plan | exit codes (base/now) | base median (fastest) s | now median "
              f"(fastest) s | now / base |\n| --- | --- | ---: | ---: | ---: |")
        for f in folders:
            b, n = times["base", f], times["now", f]
            print(f"| `{f.name}` | {sorted(codes['base', f])}/{sorted(codes['now', f])} | "
                  f"{statistics.median(b):.2f} ({min(b):.2f}) | "
                  f"{statistics.median(n):.2f} ({min(n):.2f}) | "
                  f"{statistics.median(n) / statistics.median(b):.2f} |")


if __name__ == "__main__":
    main()
