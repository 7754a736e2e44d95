"""CPU time of the random concrete evaluation (encoding/concrete.evaluate_at_random) in one
verification of each plan pair given, in this process, with one job (so that every stage is
encoded here), and how many points it drew.

    python scripts/evaluation_cost.py ../shared/plans/moe-ly2-dp16pp2tp4mb16 [--repeat 2]

To compare with another revision, run the same file against that revision's tvsmt:

    git worktree add /tmp/base REV
    (cd /tmp/base && PYTHONPATH=/tmp/base python /path/to/scripts/evaluation_cost.py DIR)
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="+", help="folders holding single.json.gz and parallel.json.gz")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    os.environ["TVSMT_FOLD_IN_CHILD"] = "0"  # the whole verification in this process

    import tvsmt.encoding.concrete as concrete
    import tvsmt.encoding.obligations as obligations
    import tvsmt.policy as policy
    from tvsmt.options import Options
    from tvsmt.verify import verify_pair

    spent = [0.0]
    real = concrete.evaluate_at_random

    def timed(*a, **k):
        t0 = time.process_time()
        try:
            return real(*a, **k)
        finally:
            spent[0] += time.process_time() - t0

    obligations.evaluate_at_random = policy.evaluate_at_random = timed
    print(f"tvsmt from {os.path.dirname(os.path.dirname(concrete.__file__))}")
    for plan in args.plans:
        for _ in range(args.repeat):
            spent[0] = 0.0
            report = verify_pair(os.path.join(plan, "single.json.gz"),
                                 os.path.join(plan, "parallel.json.gz"), Options(jobs=1))
            ev = getattr(report, "evaluated", None) or {}
            print(f"{os.path.basename(plan.rstrip('/'))}: {report.verdict}, evaluation "
                  f"{spent[0]:.3f} s of CPU, {ev.get('points', '?')} points for "
                  f"{ev.get('obligations', '?')} obligations")


if __name__ == "__main__":
    main()
