"""Write a generated Llama3 plan in the JSON Lines form unit by unit, then read it back.

    python scripts/bench_stream.py [--layers 32 --dp 16 --tp 8 --pp 4 --mb 8] [--keep DIR]
                                   [--reuse] [--gz] [--load]

Issue 12 item 4's configuration is the default (3.6M parallel nodes). Each phase runs in its own
process, so that its peak memory is its own:

* write: `StreamedPlan` -> `write_unit_source` (the plan is never held whole);
* iterate: `tvsmt.plan.stream.iter_records`, every record checked and dropped (what a
  streaming consumer such as the folder pays for reading);
* load (with --load): `load_plan`, the whole plan as objects.

Printed per phase: wall time, CPU time of the process, peak resident memory. On a shared
machine, the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PHASE = r"""
import resource, sys, time
sys.path.insert(0, {root!r})
t, c = time.perf_counter(), time.process_time()
phase, path = {phase!r}, {path!r}
if phase == "write":
    from tvsmt.frontends.builder import write_unit_source
    from tvsmt.frontends.stream import StreamedPlan
    source = StreamedPlan("llama3", layers={layers}, hidden=64, heads=8, ffn=128, vocab=128,
                          seq=8, dp={dp}, tp={tp}, pp={pp}, mb={mb})
    write_unit_source(path, source)
    what = "written"
elif phase == "iterate":
    from collections import Counter
    from tvsmt.plan.stream import iter_records
    counts = Counter(type(r).__name__ for r in iter_records(path))
    what = ", ".join(f"{{v}} {{k}}" for k, v in counts.items())
else:
    from tvsmt.plan import load_plan
    p = load_plan(path)
    what = f"{{len(p.nodes)}} nodes, {{len(p.tensors)}} tensors"
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(f"{{phase}}: {{what}}; wall {{time.perf_counter() - t:.1f}} s, "
      f"cpu {{time.process_time() - c:.1f}} s, peak {{peak}} MB", flush=True)
"""


def run(phase: str, path: str, args) -> None:
    code = PHASE.format(root=str(ROOT), phase=phase, path=path, layers=args.layers, dp=args.dp,
                        tp=args.tp, pp=args.pp, mb=args.mb)
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 32), ("dp", 16), ("tp", 8), ("pp", 4), ("mb", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--gz", action="store_true", help="write parallel.jsonl.gz")
    ap.add_argument("--load", action="store_true", help="also load the whole plan")
    ap.add_argument("--keep", default=None, help="folder to keep the file in")
    ap.add_argument("--reuse", action="store_true",
                    help="read the file already kept in --keep instead of writing it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "parallel.jsonl" + (".gz" if args.gz else ""))
        if not (args.reuse and os.path.exists(path)):
            run("write", path, args)
        print(f"file: {os.path.getsize(path) / 1e6:.0f} MB", flush=True)
        run("iterate", path, args)
        if args.load:
            run("load", path, args)


if __name__ == "__main__":
    main()
