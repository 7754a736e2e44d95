#!/usr/bin/env python3
"""How much faster plan reading is than at an earlier revision, measured in one run.

    python scripts/bench_read_history.py [--base 885e592] [--repeat 3] [--only NAME]

`scripts/bench_read.py` compares JSON libraries inside today's reader; its `old` row already
builds today's (faster) plan model. This script instead runs `load_plan` of the revision
`--base` (default 885e592: the reader when issue 12 measured 57 us per node) from a temporary
git worktree, next to the working tree's, on every real parallel plan in ../shared/plans.
Each measurement is a fresh child process (so neither side's caches or heap help the other;
the reader's forked numbering is off: it moves work to the second core, which lowers the
wall time and raises the CPU time; any process a reader forks is counted anyway),
the two sides alternate, and the best CPU time of `--repeat` is kept. Printed per plan: nodes,
microseconds per node at the base and now, and their ratio; last the ratio over all nodes.
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
PLANS = ROOT.parent / "shared" / "plans"

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from tvsmt.plan import load_plan
# the reading's cost in one process: no forked numbering (it trades CPU for wall time); the
# switch is tvsmt.forked's now, tvsmt.plan.stream's in older revisions
for module in ("tvsmt.forked", "tvsmt.plan.stream"):
    try:
        __import__(module)
        sys.modules[module].PARALLEL = False
    except ImportError:
        pass
def children():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
t0, c0 = time.process_time(), children()
plan = load_plan(sys.argv[2])
print(json.dumps({"cpu": time.process_time() - t0 + children() - c0, "nodes": len(plan.nodes)}))
"""


def measure(tree: Path, plan: Path) -> dict | None:
    """CPU seconds and nodes of one load in a child process; None when that reader refuses
    the plan (the base predates some operators, e.g. the MoE ones)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(plan)],
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="885e592")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    plans = sorted(p for p in PLANS.glob("*/parallel.json.gz")
                   if args.only in p.parent.name and "nolineage" not in p.parent.name)
    with checked_out(args.base) as base:
        total = {"base": 0.0, "now": 0.0, "nodes": 0}
        print(f"{'plan':<36} {'nodes':>8} {'base us/node':>13} {'now us/node':>12} "
              f"{'ratio':>6}")
        for plan in plans:
            best = {"base": float("inf"), "now": float("inf")}
            for _ in range(args.repeat):
                for side, tree in (("base", base), ("now", ROOT)):
                    got = measure(tree, plan)
                    if got is None:
                        break
                    best[side] = min(best[side], got["cpu"])
                    nodes = got["nodes"]
                if got is None:
                    break
            if got is None:
                print(f"{plan.parent.name:<36} (the {side} reader refuses it: not compared)")
                continue
            total["base"] += best["base"]
            total["now"] += best["now"]
            total["nodes"] += nodes
            print(f"{plan.parent.name:<36} {nodes:>8} {best['base'] / nodes * 1e6:>13.1f} "
                  f"{best['now'] / nodes * 1e6:>12.1f} {best['base'] / best['now']:>6.1f}")
        print(f"{'all plans':<36} {total['nodes']:>8} "
              f"{total['base'] / total['nodes'] * 1e6:>13.1f} "
              f"{total['now'] / total['nodes'] * 1e6:>12.1f} "
              f"{total['base'] / total['now']:>6.1f}")


if __name__ == "__main__":
    main()
