#!/usr/bin/env python3
"""Scale benchmark: generate Llama3 plans with the built-in generator and verify them.

For each configuration it prints, per phase (generate, load, fold, stages, templates, shapes,
encoding, solving, report), the wall time, the number of parallel nodes checked by replica
folding, stages, stage templates, unique obligations, solver calls and the peak memory of the
process tree that did the work (the child, its joblib workers and solver processes, sampled
every 0.2 s; "peak memory" sums their resident sizes, which counts a page that forked
workers share with their parent once per process, "peak PSS" their proportional sizes, which
counts it once), as a table and as JSON. "shapes" and "encoding" are summed over the worker
processes when stage templates are encoded in parallel; "encoding (wall)" is then the wall
time of both. It also prints a reference floor: the time z3 takes on an empty query times
the number of unique obligations.

Plans up to --max-nodes parallel nodes are generated, written to .json.gz, read back and
verified, as `tvsmt plan generate` + `tvsmt verify` would ("file"). Larger ones, and the
mutated 405B plan, are streamed: the generator produces them unit by unit
(tvsmt/frontends/stream.py), every unit is checked by replica folding and the folded plan is
verified ("stream"); they are never written or held whole.

    python scripts/bench.py                      # every configuration (about 25 minutes)
    python scripts/bench.py --configs 32L-dp2pp2tp2mb2 --json bench.json
    python scripts/bench.py --markdown           # the README's performance table

Each configuration runs in its own process with a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "32L-dp2pp2tp2mb2": dict(layers=32, dp=2, pp=2, tp=2, mb=2),
    "32L-dp16pp4tp8mb8": dict(layers=32, dp=16, pp=4, tp=8, mb=8),
    "80L-dp16pp4tp8mb32 (70B)": dict(layers=80, dp=16, pp=4, tp=8, mb=32),
    "126L-dp64pp16tp8mb16 (405B)": dict(layers=126, dp=64, pp=16, tp=8, mb=16),
    "405B + bug in replica 37, micro-batch 5, layer 80": dict(
        layers=126, dp=64, pp=16, tp=8, mb=16,
        mutation=["grad-scale-wrong", [37, 5], "L80.ffn.up:BW.linear@"]),
    # DeepSeek-V3-671B-shaped: 61 layers (3 dense), 256 routed experts, 8 active, ep = tp
    "61L-dp32pp8tp8mb16 (DeepSeek-V3 671B)": dict(
        model="deepseek-v3", layers=61, dp=32, pp=8, tp=8, mb=16),
    "671B + expert gradient x EP in replica 21, micro-batch 9, layer 40": dict(
        model="deepseek-v3", layers=61, dp=32, pp=8, tp=8, mb=16,
        mutation=["moe-expert-grad-not-divided", [21, 9],
                  "L40.moe.experts.tokens_out:BW.nnscaler_moe_gmm@"]),
}
NODES_PER_LAYER_REPLICA = 108  # measured on generated plans: parallel nodes / (layers*dp*tp*mb)
DIMS = dict(hidden=64, heads=8, ffn=128, vocab=128, seq=8)

# "file": generate, write .json.gz, read back and verify, as `tvsmt plan generate` and
# `tvsmt verify` would. "stream": the generator's plan unit by unit (frontends/stream.py),
# checked and folded as it streams, never written or held whole.
CHILD = r"""
import json, resource, sys, time, os
cfg = json.loads(sys.argv[1]); out = sys.argv[2]; mode = sys.argv[3]
dims = json.loads(sys.argv[4])
from peak_memory import TreeMemory  # scripts/peak_memory.py (PYTHONPATH set by the parent)
memory = TreeMemory()
from tvsmt.verify import Options, Timer, verify_pair, verify_source
opts = Options(jobs=2, progress=None, corpus=None)
t0 = time.perf_counter()
extra = {}
model = cfg.pop("model", "llama3")
if mode == "file":
    from tvsmt.frontends import write_pair
    s, p = write_pair(out, model, **dims, **cfg)
    gen = time.perf_counter() - t0
    rep = verify_pair(s, p, opts)
    extra["plan_bytes"] = os.path.getsize(p)
else:
    from tvsmt.frontends.stream import StreamedPlan
    mutation = cfg.pop("mutation", None)
    if mutation:
        mutation = (mutation[0], tuple(mutation[1]), mutation[2])
    source = StreamedPlan(model, **dims, **cfg, mutation=mutation)
    gen = time.perf_counter() - t0
    rep = verify_source(source, opts)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tree = memory.rss_mb
fold = rep.fold or {}
print(json.dumps({"generate": gen, "verdict": rep.verdict, "timings": rep.timings,
                  "stages": rep.stages_total, "templates": rep.stage_templates,
                  "obligations": rep.obligations_total, "unique": rep.obligations_unique,
                  "solver_calls": rep.obligations_unique - rep.cache_hits,
                  "checked_nodes": (fold.get("checked") or {}).get("nodes"),
                  "exceptions": fold.get("exceptions"), "fold_note": rep.fold_note,
                  "failures": [f.message for f in rep.failures][:3],
                  "peak_rss_mb": rss, "peak_rss_tree_mb": tree,
                  "peak_pss_tree_mb": memory.pss_mb, **extra}))
"""


def empty_query_seconds(repeat: int = 20) -> float:
    """Wall time of the z3 binary on an empty query (the per-call floor)."""
    z3 = os.path.join(os.path.dirname(sys.executable), "z3")
    if not os.path.exists(z3):
        return float("nan")
    with tempfile.NamedTemporaryFile("w", suffix=".smt2", delete=False) as f:
        f.write("(check-sat)\n")
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([z3, f.name], capture_output=True)
        best = min(best, time.perf_counter() - t)
    os.unlink(f.name)
    return best


def estimate(cfg: dict) -> int:
    return NODES_PER_LAYER_REPLICA * cfg["layers"] * cfg["dp"] * cfg["tp"] * cfg["mb"]


def run(name: str, cfg: dict, limit: float, mode: str) -> dict:
    row = {"config": name, **cfg, "mode": mode, "est_parallel_nodes": estimate(cfg)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                filter(None, [os.path.dirname(os.path.abspath(__file__)),
                              os.environ.get("PYTHONPATH")])))
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), tmp, mode,
                                   json.dumps(DIMS)],
                                  capture_output=True, text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired:
            row["status"] = f"timeout after {limit:.0f}s"
            return row
    if proc.returncode != 0:
        row["status"] = "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    t = row["timings"]
    # with parallel encoding, "shapes"/"encoding" are summed over workers: use the wall time
    inner = ("shapes", "encoding") if "encoding (wall)" in t else ("encoding (wall)",)
    row["total_s"] = row["generate"] + sum(v for k, v in t.items() if k not in inner)
    row["status"] = "ok"
    return row


def table(rows, floor, markdown=False):
    phases = ["generate", "load", "fold", "stages", "templates", "shapes", "encoding",
              "encoding (wall)", "solving", "report"]
    head = ["config", "mode", "verdict", "nodes checked", *phases, "total s", "stages",
            "templ.", "unique obl.", "solver calls", "floor s", "peak memory MB",
            "peak PSS MB"]
    lines = []
    for r in rows:
        if r.get("status") != "ok":
            lines.append([r["config"], r.get("mode", ""), r.get("status", "?")]
                         + [""] * (len(head) - 3))
            continue
        t = r["timings"]
        nodes = r.get("checked_nodes")
        lines.append([r["config"], r["mode"], r["verdict"],
                      f"{nodes / 1e6:.1f}M" if nodes else "-", f"{r['generate']:.1f}"]
                     + [f"{t.get(p, 0):.2f}" for p in phases[1:]]
                     + [f"{r['total_s']:.1f}", str(r["stages"]), str(r["templates"]),
                        str(r["unique"]), str(r["solver_calls"]), f"{floor * r['unique']:.2f}",
                        f"{max(r['peak_rss_mb'], r.get('peak_rss_tree_mb', 0)):.0f}",
                        f"{r['peak_pss_tree_mb']:.0f}" if "peak_pss_tree_mb" in r else "-"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])


# The reference verifier's published figures for the same configurations (TrainVerify,
# SOSP'25: the Llama3-405B plan took 8 hours on 32 cores and 1 TB of memory).
REFERENCE = {"126L-dp64pp16tp8mb16 (405B)": {"seconds": 8 * 3600, "memory_mb": 1024 * 1024}}


def plot(rows, path: str) -> None:
    """Time and peak memory against the plan's size (log scales), tvsmt against the
    reference's figures, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    nodes = [r.get("checked_nodes") or r["est_parallel_nodes"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "total_s", "total time (s)"),
                           (axes[1], "memory", "peak memory (MB)")):
        ys = [r["total_s"] if key == "total_s" else
              max(r["peak_rss_mb"], r.get("peak_rss_tree_mb", 0)) for r in ok]
        ax.loglog(nodes, ys, "o-", label="tvsmt (2 cores)")
        for r, x, y in zip(ok, nodes, ys):
            ax.annotate(r["config"].split(" ")[0], (x, y), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
        ref = [(n, REFERENCE[r["config"]]["seconds" if key == "total_s" else "memory_mb"])
               for r, n in zip(ok, nodes) if r["config"] in REFERENCE]
        if ref:
            ax.loglog(*zip(*ref), "s", color="tab:red", label="reference (32 cores)")
        ax.set_xlabel("parallel nodes")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("scripts/bench.py: generated Llama3 plans")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--max-nodes", type=int, default=1_000_000,
                    help="larger plans are streamed (never written or held whole) instead of "
                         "written to a file and read back")
    ap.add_argument("--limit", type=float, default=1800, help="seconds per configuration")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--from-json", nargs="*", default=None,
                    help="re-render the table from earlier --json outputs instead of running")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw time and memory against plan size (matplotlib)")
    args = ap.parse_args()
    if args.from_json:
        by_config, floor = {}, float("nan")
        for path in args.from_json:  # a later file's row replaces an earlier one
            with open(path) as f:
                saved = json.load(f)
            for row in saved["rows"]:
                if row.get("status") == "ok" or row["config"] not in by_config:
                    by_config[row["config"]] = row
            floor = saved["floor_s"]
        rows = [by_config[c] for c in CONFIGS if c in by_config]
        print(table(rows, floor, args.markdown))
        if args.plot:
            plot(rows, args.plot)
        print(f"\nz3 empty-query floor: {floor * 1000:.1f} ms per call")
        return 0
    floor = empty_query_seconds()
    rows = []
    for name in args.configs:
        cfg = dict(CONFIGS[name])
        mode = "stream" if estimate(cfg) > args.max_nodes or "mutation" in cfg else "file"
        rows.append(run(name, cfg, args.limit, mode))
        print(f"{name}: {rows[-1].get('status')}", file=sys.stderr)
    print(table(rows, floor, args.markdown))
    print(f"\nz3 empty-query floor: {floor * 1000:.1f} ms per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_s": floor, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
