#!/usr/bin/env python3
"""How long `tvsmt check` takes to report the bugs planted in the capture examples.

    python scripts/bench_planted_bugs.py [--base REV] [--only NAME ...] [--timeout 60]

Every example in examples/ names its planted bugs in its docstring (`TVSMT_BUG=NAME tvsmt
check examples/FILE.py`); each one is run as that command (`python -m tvsmt check
--no-corpus`, from outside the tree, PYTHONPATH set to it), once, and its wall time and exit
code printed. With `--base REV`, the revision is checked out in a temporary git worktree and
each bug runs there too, right after (the same machine moment for both sides), with the ratio
now / base. Bugs that torch itself refuses (the examples say "refused by torch") end with exit
code 2 on both sides.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from revision import checked_out

ROOT = Path(__file__).resolve().parents[1]
PLANTED = re.compile(r"TVSMT_BUG=([\w-]+) tvsmt check examples/(\w+\.py)")


def planted_bugs() -> list[tuple[str, str]]:
    """(bug, example file) for every planted bug the examples' docstrings name."""
    found: dict[tuple[str, str], None] = {}
    for path in sorted((ROOT / "examples").glob("*.py")):
        for bug, name in PLANTED.findall(path.read_text()):
            if name == path.name:
                found[(bug, name)] = None
    return list(found)


def run(tree: Path, bug: str, example: str, timeout: float) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(tree), TVSMT_BUG=bug)
    cmd = [sys.executable, "-m", "tvsmt", "check", "--no-corpus", "--timeout", str(timeout),
           str(tree / "examples" / example)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True)
    return time.perf_counter() - t0, done.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="a revision to compare with, in the same run")
    ap.add_argument("--only", action="append", default=[], help="a bug name (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0, help="tvsmt's --timeout")
    args = ap.parse_args()
    bugs = [b for b in planted_bugs() if not args.only or b[0] in args.only]
    if not bugs:
        sys.exit("no planted bug selected")

    def table(sides: dict[str, Path]) -> None:
        for tree in sides.values():
            compileall.compile_dir(str(tree / "tvsmt"), quiet=1)
        names = list(sides)
        head = " | ".join(f"{s} s (exit)" for s in names)
        print(f"| bug | example | {head} |" + (" now / base |" if len(names) > 1 else ""))
        print("| --- | --- |" + " ---: |" * (len(names) + (len(names) > 1)), flush=True)
        for bug, example in bugs:
            got = {s: run(tree, bug, example, args.timeout) for s, tree in sides.items()}
            cells = " | ".join(f"{got[s][0]:.1f} ({got[s][1]})" for s in names)
            ratio = (f" {got['now'][0] / got['base'][0]:.2f} |" if len(names) > 1 else "")
            print(f"| `{bug}` | `{example}` | {cells} |{ratio}", flush=True)

    if args.base:
        with checked_out(args.base) as base:
            table({"base": base, "now": ROOT})
    else:
        table({"now": ROOT})
    print(f"\n(tvsmt check --no-corpus --timeout {args.timeout:g}; {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
