#!/usr/bin/env python3
"""Where one verification's wall time goes, process by process: runs it with
$TVSMT_TIMELINE set (tvsmt/timing.py) and lays its phases side by side, in seconds from the
start.

    python scripts/timeline.py DIR [--in-process] [--jobs 2]

DIR holds single.json.gz and parallel.json.gz. By default the command `python -m tvsmt
verify` is timed from its start (interpreter and imports included); `--in-process` times
`verify_pair` in a process that has imported tvsmt first (as scripts/bench_real.py does).
Per process and phase: the first start, the last end, how many times it ran and the summed
time (an encoding worker runs "shapes", "encoding" and "evaluation" once per template).
Processes are named by their first phase: the verifying process, a forked load and fold
("load" in a child), the process it forks to number the document's names and split it into
units ("names decode", tvsmt/plan/numbering.py), the encoding workers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

IN_PROCESS = """
import sys, time
from tvsmt.verify import Options, verify_pair
print(f"timeline-start {time.time():.6f}", file=sys.stderr, flush=True)
report = verify_pair(sys.argv[1], sys.argv[2], Options(jobs=int(sys.argv[3])))
print(f"timeline-end {time.time():.6f} {report.verdict}", file=sys.stderr, flush=True)
"""


def run(folder: Path, in_process: bool, jobs: int) -> tuple[int, float, float, str, list]:
    """(verifying pid, start, end, verdict, timeline rows (pid, name, start, end))."""
    single, parallel = str(folder / "single.json.gz"), str(folder / "parallel.json.gz")
    env = dict(os.environ, TVSMT_TIMELINE="1")
    if in_process:
        argv = [sys.executable, "-c", IN_PROCESS, single, parallel, str(jobs)]
    else:
        argv = [sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", str(jobs),
                single, parallel]
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    _, stderr = proc.communicate()
    t1 = time.time()
    rows, verdict = [], f"exit {proc.returncode}"
    for line in stderr.splitlines():
        f = line.split()
        if f[:1] == ["timeline"] and len(f) == 5:
            rows.append((int(f[1]), f[2].replace("_", " "), float(f[3]), float(f[4])))
        elif f[:1] == ["timeline-start"]:
            t0 = float(f[1])
        elif f[:1] == ["timeline-end"]:
            t1, verdict = float(f[1]), f[2]
    return proc.pid, t0, t1, verdict, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    pid, t0, t1, verdict, rows = run(args.dir, args.in_process, args.jobs)
    first: dict[int, tuple[float, str]] = {}
    for p, name, a, _ in rows:
        if p not in first or a < first[p][0]:
            first[p] = (a, name)
    workers = sorted(p for p in first if first[p][1] in ("shapes", "encoding"))
    role = {p: f"encoding worker {workers.index(p) + 1}" if p in workers
            else "forked load and fold" if first[p][1] == "load" and p != pid
            else "forked numbering" if first[p][1] == "names decode"
            else "verifying process" for p in first}
    spans: dict[tuple[int, str], list] = {}
    for p, name, a, b in rows:
        s = spans.setdefault((p, name), [a, b, 0, 0.0])
        s[0], s[1], s[2], s[3] = min(s[0], a), max(s[1], b), s[2] + 1, s[3] + (b - a)
    print(f"{args.dir.name}: {verdict}, {t1 - t0:.3f} s "
          f"({'in-process' if args.in_process else 'command'}, --jobs {args.jobs})")
    print(f"{'process':22} {'phase':18} {'start':>7} {'end':>7} {'runs':>5} {'summed':>7}")
    for (p, name), (a, b, n, total) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        print(f"{role[p]:22} {name:18} {a - t0:7.3f} {b - t0:7.3f} {n:5d} {total:7.3f}")


if __name__ == "__main__":
    main()
