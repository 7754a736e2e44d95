"""The largest reduced tensor (in elements) of any stage, per real plan pair.

Backs tvsmt/shapes/reduce.py's MAX_REDUCED_ELEMENTS: a cap far above what real plans need.
Usage: python scripts/measure_reduced.py [FIXTURE ...]  (folders of ../shared/plans)
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import tvsmt.verify as pipeline
from tvsmt.errors import TvsmtError
from tvsmt.verify import Options, verify_pair

PLANS = Path(__file__).resolve().parents[1].parent / "shared" / "plans"
DEFAULT = ["mlp-ly2-dp2pp2tp2mb2", "llama3-ly2-dp2pp2tp2mb2", "br0-llama3-ly1-dp2pp2tp2mb2",
           "llama3adpt-ly2-dp2pp1tp1mb1", "llama3-ly2-dp2pp8tp2mb2"]


def main(names: list[str]) -> None:
    biggest: list = [0, None]
    reduce_stage = pipeline.reduce_stage

    def measured(stage, single, parallel):
        reduced = reduce_stage(stage, single, parallel)
        for shapes in (reduced.single, reduced.parallel):
            for tensor, shape in shapes.items():
                if math.prod(shape) > biggest[0]:
                    biggest[:] = [math.prod(shape), (tensor, shape)]
        return reduced

    pipeline.reduce_stage = measured
    for name in names:
        biggest[:] = [0, None]
        t0 = time.perf_counter()
        folder = PLANS / name
        try:
            verdict = verify_pair(str(folder / "single.json.gz"), str(folder / "parallel.json.gz"),
                                  Options(jobs=1, corpus=None)).verdict
        except TvsmtError as e:
            verdict = f"error ({e})"
        print(f"{name}: {verdict}; largest reduced tensor {biggest[0]} elements "
              f"{biggest[1]} ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
