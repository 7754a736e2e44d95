"""Write a generated Llama3 plan in the JSON Lines form unit by unit, then read it back.

    python scripts/bench_stream.py [--layers 32 --dp 16 --tp 8 --pp 4 --mb 8] [--keep DIR]
                                   [--reuse] [--gz] [--load] [--verify] [--no-iterate]
                                   [--inline-check | --forked-check | --both]

Issue 12 item 4's configuration is the default (3.6M parallel nodes). Each phase runs in its own
process, so that its peak memory is its own:

* write: `StreamedPlan` -> `write_unit_source` (the plan is never held whole);
* iterate: `tvsmt.plan.stream.iter_records`, every record checked and dropped (what a
  streaming consumer such as the folder pays for reading);
* load (with --load): `load_plan`, the whole plan as objects;
* verify (with --verify): `tvsmt.verify.verify_pair` on the files, as `tvsmt verify` does:
  the file is read in one pass into integer columns (tvsmt/plan/scan.py: by two processes,
  a forked one reading the first part, when a core is idle), folded over them
  (tvsmt/fold/columns.py) and the folded pair verified (two jobs). `--forked-check` forces the
  two processes, `--inline-check` one, `--both` verifies both ways in one run (tvsmt itself
  decides by load: `tvsmt.forked.use_second_core`).

Printed per phase: wall time, CPU time of the process, peak resident memory (for verify, also the
peak of the process and its workers and solvers together, as the sum of their resident sizes
sampled every 0.2 s, which counts a page shared by forked workers once per process, and as the
sum of their proportional sizes, which counts it once, sampled less often: see
scripts/peak_memory.py and `--pss-every`). On a shared machine, the CPU time is the steadier
figure.
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
import os, resource, sys, time
sys.path.insert(0, {root!r})
t, c = time.perf_counter(), time.process_time()
phase, path = {phase!r}, {path!r}
if phase == "write":
    from tvsmt.frontends.builder import write_unit_source
    from tvsmt.frontends.stream import StreamedPlan
    from tvsmt.frontends.builder import write_plan
    from tvsmt.plan.stream import node_dict
    source = StreamedPlan("llama3", layers={layers}, hidden=64, heads=8, ffn=128, vocab=128,
                          seq=8, dp={dp}, tp={tp}, pp={pp}, mb={mb})
    write_unit_source(path, source)
    s = source.single
    write_plan({single!r}, {{"format": "tvsmt.execplan", "version": 1, "kind": "single",
                "name": s.name, "world": s.world, "outputs": s.outputs,
                "tensors": {{t.id: {{"shape": list(t.shape), "role": t.role}}
                            for t in s.tensors.values()}},
                "nodes": [node_dict(n) for n in s.nodes]}})
    what = "written"
elif phase == "verify":
    import tvsmt.forked
    tvsmt.forked.PARALLEL = {parallel!r}
    forked, load0 = tvsmt.forked.use_second_core(), os.getloadavg()[0]
    sys.path.insert(0, {root!r} + "/scripts")
    from peak_memory import TreeMemory
    from tvsmt.verify import Options, verify_pair
    pss_every = {pss_every!r}
    memory = (TreeMemory(pss_every=pss_every, pss_share=1.0 if pss_every < 1 else 0.05)
              if pss_every > 0 else TreeMemory.off())
    rep = verify_pair({single!r}, path, Options(jobs=2, progress=None, corpus=None))
    fold = rep.fold or {{}}
    what = (f"{{rep.verdict}}, folded {{fold.get('kept_units')}} of "
            f"{{fold.get('replicas', 0) * fold.get('micro_batches', 0)}} units, "
            f"{{fold.get('checked', {{}}).get('nodes')}} nodes checked, note {{rep.fold_note}}, "
            f"read by {{'two processes' if forked else 'one process'}} "
            f"({{'by load' if {parallel!r} is None else 'forced'}}: load {{load0:.2f}} at the "
            f"start, {{os.getloadavg()[0]:.2f}} at the end), "
            f"timings {{rep.timings}}, tree peak {{memory.rss_mb:.0f}} MB rss, "
            f"{{memory.pss_mb:.0f}} MB pss")
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
    single = os.path.join(os.path.dirname(path), "single.json.gz")
    code = PHASE.format(root=str(ROOT), phase=phase, path=path, layers=args.layers, dp=args.dp,
                        tp=args.tp, pp=args.pp, mb=args.mb, single=single,
                        parallel=False if args.inline_check else
                        (True if args.both or args.forked_check else None),
                        pss_every=args.pss_every)
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 32), ("dp", 16), ("tp", 8), ("pp", 4), ("mb", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--gz", action="store_true", help="write parallel.jsonl.gz")
    ap.add_argument("--load", action="store_true", help="also load the whole plan")
    ap.add_argument("--verify", action="store_true", help="also verify the pair from the files")
    ap.add_argument("--no-iterate", action="store_true", help="skip the iterate phase")
    ap.add_argument("--inline-check", action="store_true",
                    help="verify: the file read by one process")
    ap.add_argument("--forked-check", action="store_true",
                    help="verify: the file read by two processes, whatever the load")
    ap.add_argument("--both", action="store_true",
                    help="verify twice: read by two processes, then by one (an A/B in one run)")
    ap.add_argument("--pss-every", type=float, default=0.2,
                    help="verify: seconds between the memory sampler's PSS samples (default "
                         "0.2; 1 or more: also at most 5%% of its time; 0: no sampler, to "
                         "measure what it costs)")
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
        if not args.no_iterate:
            run("iterate", path, args)
        if args.load:
            run("load", path, args)
        if args.verify or args.both or args.forked_check:
            run("verify", path, args)
        if args.both:
            run("verify", path, argparse.Namespace(**{**vars(args), "inline_check": True}))


if __name__ == "__main__":
    main()
