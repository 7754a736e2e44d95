#!/usr/bin/env python3
"""Random signals at random moments of one real verification: whatever arrives, tvsmt must
leave no child process, no half-written report, no traceback, and end with the verdict's
code or as interrupted (one line `tvsmt: interrupted...`, 128 + signal).

    python scripts/probe_signals.py [--plan NAME] [--seed S] [--count N]
    python scripts/probe_signals.py --check examples/FILE.py [--bug NAME] --latest 8 ...

NAME is a pair of ../shared/plans or a pair's folder (default the 128-rank MoE plan, which
is read and folded in forked processes). The signals: SIGINT, SIGTERM, SIGHUP to tvsmt; Ctrl-C and a hangup
to its whole process group. tests/test_signals.py holds the same properties at chosen
moments; this draws the moments at random over the whole run. With `--check`, the run is `tvsmt check`
of a capture example (tracing every rank with torch, hypothesis rounds, solving), with
`TVSMT_BUG` set to `--bug` if given.

Measured on this machine (2026-12-06, the MoE plan): at 6168417, before SIGHUP was handled,
seed 3, 10 runs: 3 failed, all hangups (killed by the signal, exit -1, no line); at the
commit that adds this script, seed 5, 12 runs: none failed. With `--check` (2026-12-06,
afternoon, `--latest 8` or 6): `megatron_mlp.py --bug no-forward-allreduce` seed 1, 10 runs;
`dtensor_mlp.py --bug wrong-input-layout` seed 2, 10 runs; `llama_block.py` seed 3, 8 runs:
none failed (exit 129/130/143 with one line, no child left, no half-written report).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil
from real_plans import plan_folder  # scripts/real_plans.py

HOW = ["SIGINT", "SIGTERM", "SIGHUP", "ctrl-c", "hangup"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="moe-ly2-dp16pp2tp4mb16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--latest", type=float, default=2.6,
                    help="the latest moment drawn, in seconds after the start")
    ap.add_argument("--check", metavar="SCRIPT", help="run `tvsmt check SCRIPT` instead")
    ap.add_argument("--bug", help="with --check: the planted bug (TVSMT_BUG)")
    args = ap.parse_args()
    env = dict(os.environ)
    env.pop("TVSMT_BUG", None)
    if args.check:
        what = ["check", args.check]
        if args.bug:
            env["TVSMT_BUG"] = args.bug
    else:
        folder = plan_folder(args.plan)
        if folder is None:
            print(f"probe_signals: no real plan pair at {args.plan}", file=sys.stderr)
            return 2
        what = ["verify", str(folder / "single.json.gz"), str(folder / "parallel.json.gz")]
    rng = random.Random(args.seed)
    failed = 0
    for _ in range(args.count):
        how, delay = rng.choice(HOW), rng.uniform(0.15, args.latest)
        with tempfile.TemporaryDirectory() as work:
            report = os.path.join(work, "out.json")
            proc = subprocess.Popen(
                [sys.executable, "-m", "tvsmt", *what, "--no-corpus", "-j", "2",
                 "--report", report],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                env=env)
            time.sleep(delay)
            try:
                kids = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                kids = []
            if how in ("ctrl-c", "hangup"):
                os.killpg(proc.pid, signal.SIGINT if how == "ctrl-c" else signal.SIGHUP)
            else:
                os.kill(proc.pid, getattr(signal, how))
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err += b"\n(still running 30 s after the signal)"
            time.sleep(1.0)
            alive = [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
            text = err.decode(errors="replace")
            lines = text.strip().splitlines()
            whole = True
            if os.path.exists(report):
                try:
                    json.load(open(report))
                except ValueError:
                    whole = False
            ok = (not alive and whole and "Traceback" not in text
                  and (proc.returncode in (0, 1)
                       or (proc.returncode > 128 and lines
                           and lines[-1].startswith("tvsmt: interrupted"))))
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {how:8} at {delay:.2f} s: exit "
                  f"{proc.returncode}, {len(kids)} children, {len(alive)} left, report "
                  f"{'whole' if whole else 'HALF-WRITTEN'}; {lines[-1] if lines else ''}",
                  flush=True)
            for k in alive:
                try:
                    k.kill()
                except psutil.Error:
                    pass
    print(f"{args.count} runs, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
