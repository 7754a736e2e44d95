#!/usr/bin/env python3
"""Damage a real plan in many ways and run `tvsmt verify` on it: every damage must be one
line on stderr naming the file and the node or tensor, exit 2, no traceback; a change the
format allows (an unknown tensor `role`, which is informative only) must keep the verdict.

    python scripts/probe_hostile_real.py [--plan NAME]

NAME is a pair of ../shared/plans or a pair's folder (default the 64-rank `llama3-ly2-dp16pp4tp1mb8`: large
enough to be read and folded in forked processes, tvsmt/fold_child.py). tests/test_fuzz_input.py
damages small hand-made plans under Hypothesis; this takes the large-plan path.

Measured on this machine (2026-12-06, the default plan): 18 damages, each a one-line input
error; the role change kept `equivalent`. The same on the 512-rank plan grown by
scripts/grow_real_plan.py (`--plan DIR`, 6 min 47 s), where it showed that a node outside the
world was worded without naming the node; it is named since (`reader._misplaced`).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from real_plans import plan_folder  # scripts/real_plans.py


def damages(n: int) -> dict:
    """name -> function(plan dict) changing it in place (or returning "truncate")."""
    def tensor(p, i):
        return p["tensors"][list(p["tensors"])[i]]

    return {
        "dangling input": lambda p: p["nodes"][n // 2]["inputs"].__setitem__(0, "t999999v0@x"),
        "output written twice": lambda p: p["nodes"][n // 2 + 1]["outputs"].__setitem__(
            0, p["nodes"][n // 2]["outputs"][0]),
        "rank outside the world": lambda p: p["nodes"][n - 5].__setitem__(
            "rank", p["world"]["ranks"]),
        "micro-batch outside the world": lambda p: p["nodes"][n // 3].__setitem__(
            "mb", p["world"]["mb"]),
        "huge micro-batch": lambda p: p["nodes"][n // 3].__setitem__("mb", 10**30),
        "shape with a string": lambda p: tensor(p, 0).__setitem__("shape", [1, "x"]),
        "negative dimension": lambda p: tensor(p, 1000).__setitem__("shape", [-3, 4]),
        "unknown op": lambda p: p["nodes"][n // 4].__setitem__("op", "frobnicate"),
        "op not a string": lambda p: p["nodes"][n // 4].__setitem__("op", 7),
        "node without inputs": lambda p: p["nodes"][n // 5].pop("inputs"),
        "attrs not an object": lambda p: p["nodes"][n // 3].__setitem__("attrs", [1, 2]),
        "lineage slice reversed": lambda p: p["lineages"][3]["parts"][0].__setitem__(
            "slice", [[5, 2]]),
        "lineage names an unknown tensor": lambda p: p["lineages"][3]["parts"][0].__setitem__(
            "sum_of", ["nope"]),
        "node id used twice": lambda p: p["nodes"][n // 2].__setitem__(
            "id", p["nodes"][n // 2 - 1]["id"]),
        "reads a tensor written later": lambda p: p["nodes"][10]["inputs"].__setitem__(
            0, p["nodes"][n - 1]["outputs"][0]),
        "reads its own output": lambda p: p["nodes"][n // 2]["inputs"].__setitem__(
            0, p["nodes"][n // 2]["outputs"][0]),
        "world.ranks wrong": lambda p: p["world"].__setitem__("ranks", p["world"]["ranks"] - 1),
        "truncated": lambda p: "truncate",
    }


def run(single: Path, plan: dict, work: Path, truncate: bool = False):
    data = json.dumps(plan).encode()
    if truncate:
        data = data[: len(data) * 2 // 3]
    path = work / "parallel.json.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(data)
    return subprocess.run([sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", "1",
                           str(single), str(path)], capture_output=True, text=True,
                          timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="llama3-ly2-dp16pp4tp1mb8")
    args = ap.parse_args()
    folder = plan_folder(args.plan)
    if folder is None:
        print(f"probe_hostile_real: no real plan pair at {args.plan}", file=sys.stderr)
        return 2
    single = folder / "single.json.gz"
    with gzip.open(folder / "parallel.json.gz") as f:
        base = json.load(f)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, damage in damages(len(base["nodes"])).items():
            plan = copy.deepcopy(base)
            truncate = damage(plan) == "truncate"
            got = run(single, plan, work, truncate)
            lines = got.stderr.strip().splitlines()
            ok = (got.returncode == 2 and len(lines) == 1 and "Traceback" not in got.stderr
                  and lines[0].startswith("tvsmt: error: ") and "parallel.json.gz" in lines[0])
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {got.returncode}; "
                  f"{lines[0] if lines else ''}", flush=True)
        plan = copy.deepcopy(base)
        next(iter(plan["tensors"].values()))["role"] = "weird"
        got = run(single, plan, work)
        ok = got.returncode == 0
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} unknown role (informative only): exit "
              f"{got.returncode}", flush=True)
    print(f"{'failed ' + str(failed) if failed else 'all as expected'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
