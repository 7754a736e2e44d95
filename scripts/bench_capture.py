"""Capture and verification times of the capture examples, printed as a table.

    python scripts/bench_capture.py [--timeout S] [--jobs N] [--examples megatron_mlp,llama_block]
                                    [--no-8b]

Capture = tracing every program (single + ranks, two random draws) + conversion + lineage
inference and hypotheses; verify = the hypothesis driver (all rounds). Each example runs in
this process, one after the other, then the Llama block at Llama-3-8B widths (hidden 4096,
32 heads, FFN 14336, sequence 2048; TVSMT_LLAMA_WIDTHS=8b): traced with fake tensors (no
values), its lineages carried over by structure from the small capture just made
(tvsmt/capture/scale.py), verified with shape reduction. The last column is the ratio of
capture + verify to the small Llama block's, from this one run.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from tvsmt.capture import capture
    from tvsmt.capture.driver import check_pair
    from tvsmt.verify import Options

    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--examples", default="megatron_mlp,llama_block")
    ap.add_argument("--no-8b", action="store_true", help="skip the Llama-3-8B widths row")
    args = ap.parse_args()
    os.environ.pop("TVSMT_BUG", None)
    os.environ.pop("TVSMT_LLAMA_WIDTHS", None)
    rows, pairs, totals = [], {}, {}

    def measure(label, path, **kw):
        t0 = time.perf_counter()
        pair = capture(path, **kw)
        t_capture = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = check_pair(pair, Options(jobs=args.jobs, timeout=args.timeout))
        t_verify = time.perf_counter() - t0
        h = report.hypotheses
        totals[label] = t_capture + t_verify
        base = totals.get("llama_block")
        ratio = f"{totals[label] / base:.2f}x" if base and label.startswith("llama") else ""
        rows.append((label, len(pair.parallel["nodes"]), f"{pair.timings['trace']:.2f}",
                     f"{t_capture:.2f}", f"{t_verify:.2f}", f"{t_capture + t_verify:.2f}",
                     f"{h['proposed']}/{h['dropped']}", str(h["rounds"]), report.verdict,
                     ratio))
        return pair

    for name in args.examples.split(","):
        pairs[name] = measure(name, os.path.join(ROOT, "examples", f"{name}.py"))
    if not args.no_8b and "llama_block" in pairs:
        os.environ["TVSMT_LLAMA_WIDTHS"] = "8b"
        try:
            measure("llama_block @ 8B widths (fake)",
                    os.path.join(ROOT, "examples", "llama_block.py"),
                    carry_from=pairs["llama_block"])
        finally:
            os.environ.pop("TVSMT_LLAMA_WIDTHS", None)
    head = ("example", "par. nodes", "trace s", "capture s", "verify s", "total s",
            "hyp./dropped", "rounds", "verdict", "vs small")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n(--timeout {args.timeout} s per obligation, --jobs {args.jobs}; peak RSS of "
          f"this process {peak:.0f} MB; python {sys.version.split()[0]}, {os.cpu_count()} "
          f"cores; load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
