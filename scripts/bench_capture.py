"""Capture and verification times of the capture examples, printed as a table.

    python scripts/bench_capture.py [--timeout S] [--jobs N] [--examples megatron_mlp,llama_block]

Capture = tracing every program (single + ranks, two random draws) + conversion + lineage
inference and hypotheses; verify = the hypothesis driver (all rounds). Each example runs in
this process, one after the other.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from tvsmt.capture import capture
    from tvsmt.capture.driver import check_pair
    from tvsmt.verify import Options

    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--examples", default="megatron_mlp,llama_block")
    args = ap.parse_args()
    rows = []
    for name in args.examples.split(","):
        path = os.path.join(ROOT, "examples", f"{name}.py")
        t0 = time.perf_counter()
        pair = capture(path)
        t_capture = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = check_pair(pair, Options(jobs=args.jobs, timeout=args.timeout))
        t_verify = time.perf_counter() - t0
        h = report.hypotheses
        rows.append((name, len(pair.parallel["nodes"]), f"{pair.timings['trace']:.2f}",
                     f"{t_capture:.2f}", f"{t_verify:.2f}", f"{h['proposed']}/{h['dropped']}",
                     str(h["rounds"]), report.verdict))
    head = ("example", "par. nodes", "trace s", "capture s", "verify s", "hyp./dropped",
            "rounds", "verdict")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"\n(--timeout {args.timeout} s per obligation, --jobs {args.jobs}; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
