#!/usr/bin/env python3
"""What the streamed generator's set-up costs, two ways each, in one run (issue 12's 405B
target streams from the generator): the trace of a pair with the cyclic collector running
and paused (`generator._build_pair` against `generator.build_pair`), and its parallel plan
read by the reference validator and by the typed fast path (`reader.plan_from_dict` against
`reader.plan_from_object`). Each pair alternates `--repeat` times; each side's fastest run is
kept and the ratio printed.

    python scripts/bench_generate.py [--layers 32 --dp 2 --tp 8 --pp 16 --mb 2] [--repeat 3]

The default is the representative world `StreamedPlan` traces for the 405B configuration,
with 32 instead of 126 layers.
"""

from __future__ import annotations

import argparse
import gc
import time

from tvsmt.frontends.generator import ModelConfig, _build_pair, build_pair, default_batch
from tvsmt.frontends.spmd import World
from tvsmt.plan.reader import plan_from_dict, plan_from_object


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t
    gc.collect()  # the next run starts from the same heap
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 32), ("dp", 2), ("tp", 8), ("pp", 16), ("mb", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig("llama3", args.layers, 64, 8, 128, 128, 8,
                      default_batch(args.dp, args.mb), 1e-5)
    world = World(args.dp, args.tp, args.pp, args.mb, None)
    _, parallel = build_pair(cfg, world)
    print(f"llama3 {args.layers}L dp{args.dp} tp{args.tp} pp{args.pp} mb{args.mb}: "
          f"{len(parallel['nodes'])} parallel nodes; fastest of {args.repeat}, alternating")
    pairs = [("trace", "collector running", lambda: _build_pair(cfg, world),
              "collector paused", lambda: build_pair(cfg, world)),
             ("read the trace", "plan_from_dict", lambda: plan_from_dict(parallel, "p"),
              "plan_from_object", lambda: plan_from_object(parallel, "p"))]
    for what, a_name, a, b_name, b in pairs:
        ta = tb = float("inf")
        for _ in range(args.repeat):
            ta, tb = min(ta, timed(a)), min(tb, timed(b))
        print(f"{what:15} {a_name} {ta:.2f} s, {b_name} {tb:.2f} s: {ta / tb:.1f}x")


if __name__ == "__main__":
    main()
