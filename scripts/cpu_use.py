#!/usr/bin/env python3
"""How busy one verification keeps the machine's cores: `verify_pair` on each plan pair in a
fresh child process (tvsmt imported first), its wall time and the CPU time of that process
and of every process it waited for (forked loaders, encoding workers, solvers).

    python scripts/cpu_use.py DIR [DIR ...] [--repeat N]

A plan whose verification already keeps both cores busy can only get faster by doing less
work (docs/performance.md, "2026-12-06, morning").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
from tvsmt.verify import Options, verify_pair
d = sys.argv[1]
before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
t0 = time.perf_counter()
report = verify_pair(d + "/single.json.gz", d + "/parallel.json.gz", Options(jobs=2))
wall = time.perf_counter() - t0
after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
user = sum(a.ru_utime - b.ru_utime for a, b in zip(after, before))
system = sum(a.ru_stime - b.ru_stime for a, b in zip(after, before))
print(json.dumps({"verdict": report.verdict, "wall": wall, "user": user, "sys": system}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    for _ in range(args.repeat):
        for d in args.dirs:
            out = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True,
                                 text=True, cwd=root, check=False)
            if out.returncode != 0:
                print(f"{d.name}: failed: {(out.stderr.strip().splitlines() or [''])[-1]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            cpu = r["user"] + r["sys"]
            print(f"{d.name}: {r['verdict']}, wall {r['wall']:.2f} s, CPU {cpu:.2f} s "
                  f"(user {r['user']:.2f}, sys {r['sys']:.2f}), {cpu / r['wall']:.2f} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
