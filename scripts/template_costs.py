#!/usr/bin/env python3
"""What the stage templates of one plan pair cost to encode, split by what they became: an
obligation for the solver, a failure, or nothing to ask (both sides computed the same terms:
proven without a solver). Serially, in one process, after folding as `tvsmt verify` folds.

    python scripts/template_costs.py DIR

Used for the note of 2026-12-07: on the 128-rank MoE plan most templates (152 of 190) end
without an obligation and cost about half of the encoding, so making the encoding cheaper
lowers the fixture's time as much as the MoE plan's and does not move issue 12's ratio.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TVSMT_FOLD_IN_CHILD", "never")  # the pair loaded here, then folded

from real_plans import folded_stages  # noqa: E402  (scripts/real_plans.py)

from tvsmt.encoding import obligations  # noqa: E402
from tvsmt.ops.backend import SymbolicBackend  # noqa: E402
from tvsmt.stages.signature import stage_signatures  # noqa: E402
from tvsmt.timing import Timer  # noqa: E402


def main() -> None:
    folder = Path(sys.argv[1])
    single, parallel, stages = folded_stages(folder)
    first: dict = {}
    reps = sorted({first.setdefault(sig, i)
                   for i, sig in enumerate(stage_signatures(stages, single, parallel))})
    gc.collect()
    gc.freeze()
    gc.disable()
    be, timer = SymbolicBackend.fresh(), Timer()
    seconds: Counter = Counter()
    count: Counter = Counter()
    for i in reps:
        t0 = time.perf_counter()
        out = obligations.encode_one(stages[i], single, parallel, be, timer)
        kind = ("obligation" if out.obligation is not None else
                "failure" if out.failure is not None else "nothing to ask")
        seconds[kind] += time.perf_counter() - t0
        count[kind] += 1
    print(f"{folder.name}: {len(reps)} templates, {sum(seconds.values()):.3f} s")
    for kind in sorted(count):
        print(f"  {kind:15s} {count[kind]:4d} templates {seconds[kind]:7.3f} s")


if __name__ == "__main__":
    main()
