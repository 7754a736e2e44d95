"""What witnessing an optimizer update by the step it took saves on a planted step bug.

    python scripts/bench_step_witness.py [--repeat N] [--timeout S]

Runs `tvsmt check` of `DS_STAGE=0 DS_STEP=1 TVSMT_BUG=clip-before-reduce
examples/deepspeed_zero.py` in this process, alternating the concrete run's comparison of
updated parameters by their steps (`build.concrete_mismatches` given `before`, the code) with
the comparison by their values (`before` withheld, as before 2026-12-07). Prints each run's
verdict, rounds, witnessed claims and seconds (a fresh corpus each), and the ratio of
the fastest runs (the first run also pays DeepSpeed's first initialisation in the
process, 35 s here: repeat at least twice). Needs deepspeed (the `deepspeed` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=0.25,
                        help="solver seconds per obligation (the test's budget)")
    args = parser.parse_args()
    os.environ.update(DS_STAGE="0", DS_STEP="1", TVSMT_BUG="clip-before-reduce")

    import tvsmt.capture.build as build
    from tvsmt.capture import check
    from tvsmt.verify import Options

    by_steps = build.concrete_mismatches

    def by_values(lineages, s_values, p_values, before=None):
        return by_steps(lineages, s_values, p_values)

    script = os.path.join(ROOT, "examples", "deepspeed_zero.py")
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for name, compare in (("by steps", by_steps), ("by values", by_values)):
            build.concrete_mismatches = compare
            t0 = time.perf_counter()
            report = check(script, Options(jobs=1, timeout=args.timeout,
                                           corpus=tempfile.mkdtemp(), fresh=True))
            took = time.perf_counter() - t0
            build.concrete_mismatches = by_steps
            witnessed = sum("confirmed on the concrete run" in f.message
                            for f in report.failures)
            print(f"{name:9}  {report.verdict:9}  rounds {report.hypotheses['rounds']}  "
                  f"witnessed {witnessed}  {took:6.1f} s", flush=True)
            best[name] = min(best.get(name, took), took)
    print(f"fastest: by steps {best['by steps']:.1f} s, by values {best['by values']:.1f} s: "
          f"{best['by steps'] / best['by values']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
