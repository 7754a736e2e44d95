#!/usr/bin/env python3
"""Random bug placements through replica folding: every bug of the catalogue
(tvsmt/frontends/mutations.py) put at a random place of a generated plan of 4 replicas and 4
micro-batches must still be a violation when the plan is verified folded. A case whose folded
verdict is not a violation is verified unfolded too: if that one is a violation, the fold
lost it, and the script exits 1.

tests/test_fold.py places each bug in a folded-away unit; this draws the places at random
(the representative units, the others, the global part), as many as asked. With `--real NAME`
the bugs go into a real nnScaler plan of ../shared/plans instead (folded by structure, the
units found from its ranks, micro-batches and dataflow).

    python scripts/fuzz_fold.py [--model llama3|moe | --real NAME] [--seed S] [--count N]
                                [--bug NAME ...]

Measured on this machine (2026-12-03): llama3, seed 1, 60 cases in 144 s; moe, seed 2, 40
cases in 1101 s (a slow hour of the machine): every folded verdict a violation.
On the real plans (2026-12-06, one run each, `--real`): llama3-ly2-dp16pp4tp1mb8 seeds 11
and 41, 46 cases in 963 s; llama3-ly2-dp4pp4tp8mb8 seed 31, 12 cases in 142 s;
llama3adpt-ly2-dp64pp2tp2mb1 seed 51, 12 cases in 485 s; moe-ly2-dp16pp2tp4mb16 seed 21, 12
cases in 694 s. None lost by the fold. Four were no violation folded or unfolded, rightly:
`pp-wrong-stage` re-routed the pipeline message of the causal mask (`create_mask`, a constant
of the sequence length, OPS.md) to another replica's copy of the same constant; drawn at
random, `pp-wrong-stage` now prefers messages with a lineage (seed 11 again, 12 cases in 190 s:
every one a violation, its two `pp-wrong-stage` on activations). A bug that
makes a unit read another's or a reducer miss one (`pp-wrong-stage`, `wrong-group`,
`reducer-before-last-accum`) is refused by the fold and verified unfolded.
On the two 8-rank MoE-family plans, which are not folded (a check of the verifier itself):
llama3moe-ly2-dp2pp2tp2mb2 seed 71, 40 cases in 44 s; moe-ly4-dp2pp2tp2mb2 seed 61, 40 cases
in 242 s (every MoE bug of the catalogue drawn): every verdict a violation. Again on
2026-12-06 after refuted obligations were asked at their points (3d27d6d): moe-ly4 seed 61,
40 cases in 43 s, every verdict a violation.
On the 512-rank plan grown from llama3-ly2-dp4pp4tp8mb8 (scripts/grow_real_plan.py --dp 16,
`--real DIR`): seed 82, 10 cases in 487 s, and seed 83, 10 cases in 864 s (beside a test
run), every one a violation; seed 81, the first two
cases (stopped then, to make two bugs' searches fast enough for 16k pipeline receives): one
a violation, one rightly none: `pp-wrong-stage` re-routed a chunk of the causal mask (this
plan's pipeline messages carry no lineage, so the bug cannot prefer one that has). Since
then `pp-wrong-stage` drawn at random also passes over messages computed from the mask alone
(the registry's `shape_only`, tvsmt/ops): `--bug pp-wrong-stage` (new) on
llama3-ly2-dp4pp4tp8mb8, seed 5, 8 cases in 192 s, on moe-ly2-dp16pp2tp4mb16, seed 22, 3 cases
in 874 s, and on the grown plan, seed 81, 3 cases in 375 s: every one a violation (refused by
the fold, verified unfolded). The bugs not drawn on
the grown plan before, `--bug drop-bw-reduction --bug wrong-constant-group --bug
reducer-before-last-accum`, seed 84, 4 cases in 112 s (two of each of the first two), and
`--bug reducer-before-last-accum`, seed 85, 2 cases in 239 s: every one a violation; so
every bug of the catalogue that applies to it (14) has been drawn there at least once.
`reducer-before-last-accum` on llama3-ly2-dp16pp4tp1mb8, seed 86, 1 case in 12 s: a violation.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_plans import plan_folder  # noqa: E402 (scripts/real_plans.py)

from tvsmt.frontends import generate_pair  # noqa: E402
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply  # noqa: E402
from tvsmt.plan import plan_from_dict  # noqa: E402
from tvsmt.verify import Options, verify_plans  # noqa: E402

SIZES = {"llama3": dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4),
         "moe": dict(hidden=16, heads=4, ffn=16, vocab=16, seq=4)}
WORLDS = {"llama3": dict(layers=2, dp=4, tp=2, pp=2, mb=4),
          "moe": dict(layers=2, dp=4, tp=2, pp=1, mb=4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SIZES), default="llama3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--real", metavar="NAME",
                    help="a real plan pair of ../shared/plans (e.g. llama3-ly2-dp16pp4tp1mb8), "
                         "or the folder of one (e.g. grown by scripts/grow_real_plan.py)")
    ap.add_argument("--bug", action="append", choices=sorted(MUTATIONS), metavar="NAME",
                    help="draw only this bug (repeatable; default: every bug that applies)")
    args = ap.parse_args()
    if args.real:
        folder = plan_folder(args.real)
        if folder is None:
            print(f"fuzz_fold: no real plan pair at {args.real}", file=sys.stderr)
            return 2
        single_d, parallel_d = (json.load(gzip.open(folder / f"{kind}.json.gz"))
                                for kind in ("single", "parallel"))
        moe = parallel_d["world"].get("model", {}).get("family") == "moe"
    else:
        single_d, parallel_d = generate_pair(args.model, **WORLDS[args.model],
                                             **SIZES[args.model])
        moe = args.model == "moe"
    single = plan_from_dict(single_d, "single")
    bugs = sorted(args.bug or (b for b, m in MUTATIONS.items()
                               if moe or m.category != "mixture of experts"))
    rng = random.Random(args.seed)
    t0, done, lost, not_caught = time.time(), 0, 0, 0
    drawn: collections.Counter = collections.Counter()
    refused: set = set()
    while done < args.count:
        bug = rng.choice(bugs)
        try:
            broken, record = apply(parallel_d, bug, seed=rng.randrange(10**6))
        except NotApplicable:
            refused.add(bug)
            if refused.issuperset(bugs) and not drawn:
                print(f"fuzz_fold: no bug of {', '.join(bugs)} applies to this plan",
                      file=sys.stderr)
                return 2
            continue
        parallel = plan_from_dict(broken, "parallel")
        folded = verify_plans(single, parallel, Options(jobs=1))
        done += 1
        drawn[bug] += 1
        if (args.real and folded.fold is None
                and not (folded.fold_note or "").startswith("nothing to fold")):
            print(f"{bug} at {record.get('target')}: not folded ({folded.fold_note})")
        if folded.verdict == "violation":
            continue
        unfolded = verify_plans(single, parallel, Options(jobs=1, fold=False))
        not_caught += 1
        print(f"{bug} at {record.get('target')}: folded {folded.verdict}, unfolded "
              f"{unfolded.verdict} ({folded.fold_note or folded.fold})")
        if unfolded.verdict == "violation":
            lost += 1
            print("  the fold lost this violation")
    print("bugs drawn: " + ", ".join(f"{b} {k}" for b, k in sorted(drawn.items())))
    print(f"{done} cases, {not_caught} not a violation folded, {lost} lost by the fold, "
          f"{time.time() - t0:.0f} s")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
