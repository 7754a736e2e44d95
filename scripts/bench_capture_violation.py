#!/usr/bin/env python3
"""How long `tvsmt check` takes to report a violation found through hypotheses, now and at an
earlier revision, in one run: the capture script of tests/test_capture_optimizer.py's
`BUILT_OPTIMIZER` (an optimizer held by the model) with a rank that leaves another Adam first
moment for the next step (`OPTIMIZER=adamw TVSMT_BUG=state-left-on-rank-1`), at the default
solver timeout (60 s), a fresh corpus each run.

    python scripts/bench_capture_violation.py --base REV [--repeat 1]

Each run is `python -m tvsmt check train.py` from a fresh temporary folder with PYTHONPATH set
to one of the two trees; the two sides alternate. Printed per side: exit codes (1 is a
violation), wall times, and the ratio now / base of the fastest runs. Used for the note of
2026-12-07 (the settled hypotheses' budget, capture/driver.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from revision import ROOT, checked_out

sys.path.insert(0, str(ROOT / "tests"))
from capture_helpers import write_script  # noqa: E402
from test_capture_optimizer import BUILT_OPTIMIZER  # noqa: E402


def once(tree: Path, script_text: str) -> tuple[int, float]:
    """(exit code, seconds) of one `tvsmt check` with `tree` on the path."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_script(Path(tmp), script_text)
        env = dict(os.environ, PYTHONPATH=str(tree), OPTIMIZER="adamw", WARM="",
                   TVSMT_BUG="state-left-on-rank-1")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tvsmt", "check", path], cwd=tmp, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return proc.returncode, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    got: dict[str, list[tuple[int, float]]] = {"base": [], "now": []}
    with checked_out(args.base) as base:
        for _ in range(args.repeat):
            for side, tree in (("base", base), ("now", ROOT)):
                got[side].append(once(tree, BUILT_OPTIMIZER))
                print(f"... {side}: exit {got[side][-1][0]}, {got[side][-1][1]:.1f} s",
                      flush=True)
    best = {side: min(s for _, s in runs) for side, runs in got.items()}
    for side, runs in got.items():
        print(f"{side:5s} exits {[c for c, _ in runs]} fastest {best[side]:.1f} s")
    print(f"now / base: {best['now'] / best['base']:.2f}x")


if __name__ == "__main__":
    main()
