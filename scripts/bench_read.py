"""How fast plan files are read: JSON libraries and validation compared in one run.

    python scripts/bench_read.py [--plans ../shared/plans] [--repeat 1] [--generated dp,tp,pp,mb]

For each parallel plan (the real nnScaler plans that tvsmt can read, and one generated Llama3
plan written in both forms), per node, best of `--repeat`:

* `old`: what load_plan did before (stdlib json, then `plan_from_dict`, collector on);
* `json`, `orjson`, `msgspec`: that library's generic decode, then `plan_from_dict`, with the
  cyclic garbage collector off during the load (as the reader now does);
* `typed`: msgspec decoding into the typed structs, then the fast check (`load_plan` now);
* `jsonl`: the JSON Lines form of the same plan, read with `load_plan` (generated plan only).

Ratios are old / method, from this one run. Decompression is included everywhere.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import orjson  # noqa: E402

from tvsmt.errors import PlanError  # noqa: E402
from tvsmt.plan import load_plan, plan_from_dict  # noqa: E402


def _text(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _generic(loads):
    def run(path):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return plan_from_dict(loads(_text(path)), path)
        finally:
            if enabled:
                gc.enable()
    return run


def _old(path):
    return plan_from_dict(json.loads(_text(path)), path)


METHODS = {"old": _old, "json": _generic(json.loads), "orjson": _generic(orjson.loads),
           "msgspec": _generic(msgspec.json.decode), "typed": load_plan}


def best(fn, path, repeat):
    times, plan = [], None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        plan = fn(path)
        times.append(time.perf_counter() - t0)
        n = len(plan.nodes)
        del plan
        gc.collect()
    return min(times), n


def generated(spec: str, folder: str, layers: int = 4) -> tuple[str, str]:
    from tvsmt.frontends.builder import write_plan
    from tvsmt.frontends.generator import generate_pair

    dp, tp, pp, mb = (int(x) for x in spec.split(","))
    _, parallel = generate_pair("llama3", layers=layers, dp=dp, tp=tp, pp=pp, mb=mb)
    doc = write_plan(os.path.join(folder, "parallel.json.gz"), parallel)
    lines = write_plan(os.path.join(folder, "parallel.jsonl.gz"), parallel)
    return doc, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=str(ROOT.parent / "shared" / "plans"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--generated", default="8,2,2,8", help="dp,tp,pp,mb of the generated plan")
    ap.add_argument("--layers", type=int, default=4, help="layers of the generated plan")
    ap.add_argument("--only", default="", help="only the real plans whose name contains this")
    args = ap.parse_args()
    rows = []
    plans = [p for p in sorted(Path(args.plans).glob("*/parallel.json.gz"))
             if args.only in p.parent.name]
    with tempfile.TemporaryDirectory() as tmp:
        doc, lines = generated(args.generated, tmp, args.layers)
        targets = [(p.parent.name, str(p), None) for p in plans]
        targets.append((f"generated llama3 ly{args.layers} dp/tp/pp/mb {args.generated}", doc,
                        lines))
        for name, path, jsonl in targets:
            try:
                load_plan(path)
            except PlanError as e:
                print(f"{name}: skipped ({e.detail})", flush=True)
                continue
            res = {m: best(fn, path, args.repeat) for m, fn in METHODS.items()}
            if jsonl:
                res["jsonl"] = best(load_plan, jsonl, args.repeat)
            nodes = res["old"][1]
            base = res["old"][0]
            cells = "  ".join(f"{m} {t / nodes * 1e6:6.2f} us ({base / t:4.1f}x)"
                              for m, (t, _) in res.items())
            print(f"{name} ({nodes} nodes): {cells}", flush=True)
            rows.append((name, nodes, res))
    total = {m: sum(r[2][m][0] for r in rows) for m in METHODS}
    nodes = sum(r[1] for r in rows)
    print("all plans above, per node: " + "  ".join(
        f"{m} {t / nodes * 1e6:.2f} us ({total['old'] / t:.1f}x)" for m, t in total.items()))


if __name__ == "__main__":
    main()
