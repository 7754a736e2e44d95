#!/usr/bin/env python3
"""Time `tvsmt verify` end to end on the nnScaler fixture pairs (../shared/plans).

Reports the wall time of the whole CLI process (interpreter start-up included) with
--jobs 2, and of verify_pair() in a warm process, best of N runs each, next to the reference verifier's time on this machine as quoted in
the project's issue (0.4 s MLP, 4.7 s Llama3, 2 workers); the reference itself is not
distributed with the project, so its figures are quoted, not re-measured here.

    python scripts/bench_fixtures.py [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT.parent / "shared" / "plans"
REFERENCE_S = {"mlp-ly2-dp2pp2tp2mb2": 0.4, "llama3-ly2-dp2pp2tp2mb2": 4.7,
               "br0-llama3-ly1-dp2pp2tp2mb2": None}


def time_cli(folder: Path, repeat: int) -> tuple[float, int]:
    best, code = float("inf"), -1
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tvsmt.cli", "verify",
                               str(folder / "single.json.gz"), str(folder / "parallel.json.gz"),
                               "--jobs", "2", "--no-corpus"], capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
        code = proc.returncode
    return best, code


def time_inprocess(folder: Path, repeat: int) -> float:
    """verify_pair in this process (imports and solver start-up already paid), best of N."""
    from tvsmt.verify import Options, verify_pair

    best = float("inf")
    for _ in range(repeat + 1):  # the first run warms up imports and the solver process
        t0 = time.perf_counter()
        verify_pair(str(folder / "single.json.gz"), str(folder / "parallel.json.gz"),
                    Options(jobs=2))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not PLANS.exists():
        print(f"fixture plans not found at {PLANS}", file=sys.stderr)
        return 2
    rows = []
    for name, ref in REFERENCE_S.items():
        secs, code = time_cli(PLANS / name, args.repeat)
        inproc = time_inprocess(PLANS / name, args.repeat)
        rows.append({"pair": name, "cli_s": round(secs, 3), "verify_s": round(inproc, 3),
                     "exit_code": code, "reference_s": ref,
                     "speedup_cli": round(ref / secs, 2) if ref else None,
                     "speedup_verify": round(ref / inproc, 2) if ref else None})
    print(f"{'pair':30} {'CLI (s)':>8} {'verify (s)':>10} {'reference (s)':>13} "
          f"{'speed-up CLI / verify':>22} exit")
    for r in rows:
        ref = f"{r['reference_s']:.1f}" if r["reference_s"] else "-"
        sp = (f"{r['speedup_cli']:.1f}x / {r['speedup_verify']:.1f}x" if r["reference_s"]
              else "-")
        print(f"{r['pair']:30} {r['cli_s']:>8.2f} {r['verify_s']:>10.2f} {ref:>13} {sp:>22} "
              f"{r['exit_code']}")
    print("\nCLI = whole `tvsmt verify` process (interpreter start-up and imports, ~0.3 s, "
          "included); verify = verify_pair() in a warm process.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
