#!/usr/bin/env python3
"""What encoding one plan's stage templates costs, part by part, in one process (serially):
shape reduction, symbolic execution of both sides (`Interpreter.run`), printing the SMT-LIB
script (`print_obligation`), the rest of `encode_stage` (entry symbols, comparisons), and the
evaluation at random points. Each real plan's pair is folded first where it folds, as
`tvsmt verify` does; the cyclic collector is off during the encoding (a fold's large plan
would otherwise make its collections the biggest part).

    python scripts/encoding_parts.py DIR [DIR ...]

Used for docs/performance.md's "2026-12-05, late" section: which parts of the encoding cost more
on the 128-rank MoE plan than on the 8-rank fixture, relative to their whole runs.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TVSMT_FOLD_IN_CHILD", "never")  # the pair loaded here, then folded

from real_plans import folded_stages  # noqa: E402  (scripts/real_plans.py)

from tvsmt.encoding import interpreter, obligations  # noqa: E402
from tvsmt.ops.backend import SymbolicBackend  # noqa: E402
from tvsmt.stages.signature import stage_signatures  # noqa: E402
from tvsmt.timing import Timer  # noqa: E402


def timed(seconds: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
    return wrapper


def measure(folder: Path) -> None:
    single, parallel, stages = folded_stages(folder)
    first: dict = {}
    reps = sorted({first.setdefault(sig, i)
                   for i, sig in enumerate(stage_signatures(stages, single, parallel))})
    seconds: dict[str, float] = {}
    run, printer = interpreter.Interpreter.run, obligations.print_obligation
    interpreter.Interpreter.run = timed(seconds, "symbolic execution", run)
    obligations.print_obligation = timed(seconds, "printing", printer)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        be, timer = SymbolicBackend.fresh(), Timer()
        t0 = time.perf_counter()
        for i in reps:
            obligations.encode_one(stages[i], single, parallel, be, timer)
        total = time.perf_counter() - t0
    finally:
        interpreter.Interpreter.run, obligations.print_obligation = run, printer
        gc.enable()
        gc.unfreeze()
    t = timer.timings
    rest = t.get("encoding", 0.0) - seconds.get("symbolic execution", 0.0) \
        - seconds.get("printing", 0.0)
    parts = {"shapes": t.get("shapes", 0.0), **seconds, "rest of encode_stage": rest,
             "evaluation": t.get("evaluation", 0.0)}
    print(f"{folder.name}: {len(reps)} templates, {total:.3f} s")
    for name, secs in parts.items():
        print(f"  {name:22s} {secs:6.3f} s")


def main() -> None:
    for d in sys.argv[1:] or [str(Path(__file__).resolve().parents[2] / "shared" / "plans"
                                  / "llama3-ly2-dp2pp2tp2mb2")]:
        measure(Path(d))


if __name__ == "__main__":
    main()
