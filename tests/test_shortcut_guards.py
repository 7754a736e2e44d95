"""Tests that kill mutations of tvsmt's shortcuts that the rest of the suite let through
(scripts/mutate.py lists which test guards which mutation):

* stage templates: a signature that ignores lineage slices merges a stage whose claim has
  its slices swapped with the same stage of an identical layer;
* the corpus: a verdict is only ever reused for the very obligation it was given on, never
  for the obligation a stage of the same name had in an earlier run.
"""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner
from handmade import PlanDict, parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.frontends import generate_pair, write_pair_dicts
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_plans

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)


def test_swapped_slices_in_one_of_two_identical_layers_are_a_violation():
    """Layer 1's claim `L1.attn.q` with the slices of its two tensor-parallel parts swapped:
    rank 0 holds the first half of the heads, the lineage says the second. Layer 0 has the
    same stage with the right slices, so a template signature that ignored slices would
    reuse layer 0's proof."""
    single, parallel = generate_pair("llama3", layers=2, dp=1, tp=2, pp=1, mb=1, **DIMS)
    s = plan_from_dict(single, "single")
    assert verify_plans(s, plan_from_dict(parallel, "p"), Options(jobs=1)).verdict \
        == "equivalent"
    broken = copy.deepcopy(parallel)
    claims = [lin for lin in broken["lineages"] if lin["single"] == "L1.attn.q"]
    assert claims and len(claims[0]["parts"]) == 2
    a, b = claims[0]["parts"]
    assert a["slice"] != b["slice"]
    a["slice"], b["slice"] = b["slice"], a["slice"]
    report = verify_plans(s, plan_from_dict(broken, "p"), Options(jobs=1))
    assert report.verdict == "violation"
    assert any(f.tensor == "L1.attn.q" and f.kind == "counterexample" for f in report.failures)


def _split_pair(*c1: float) -> tuple[dict, dict]:
    """y_k = 5 x_k for each k; the parallel plan sums 2 x_k (rank 0) and c1[k] x_k (rank 1)
    with an all_reduce: for c1[k] = 3 a stage that only a solver proves (the two sides are
    different terms), the same for every k up to names."""
    single = PlanDict("single", "s", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    par = PlanDict("parallel", "p", {"dp": 1, "tp": 2, "pp": 1, "mb": 1, "ranks": 2})
    for k, c in enumerate(c1):
        x, y = f"x{k}", f"y{k}"
        single.t(x, [4, 2], "input"), single.t(y, [4, 2])
        single.n(f"op{k}", "mul", [x], [y], consts=[5.0])
        for r, cr in ((0, 2.0), (1, c)):
            par.t(f"{x}@{r}", [4, 2], "input"), par.t(f"a{k}@{r}", [4, 2])
            par.n(f"op{k}@{r}", "mul", [f"{x}@{r}"], [f"a{k}@{r}"], rank=r, consts=[cr])
        par.t(f"{y}@0", [4, 2])
        par.n(f"ar{k}@0", "all_reduce", [f"a{k}@0", f"a{k}@1"], [f"{y}@0"], pass_=None, rank=0,
              ranks=[0, 1])
        par.lineage(x, [([(0, 4), (0, 2)], [f"{x}@{r}"]) for r in (0, 1)])
        par.lineage(y, [([(0, 4), (0, 2)], [f"{y}@0"])])
    single.d["outputs"] = [f"y{k}" for k in range(len(c1))]
    return single.d, par.d


def test_obligations_that_differ_in_a_constant_are_solved_apart():
    """Two stages that are the same up to names and one constant (3 against 4): canonical
    deduplication must give them two obligations, and the wrong one is a violation."""
    s, p = _split_pair(3.0, 3.0)
    good = verify_plans(plan_from_dict(s, "s"), plan_from_dict(p, "p"), Options(jobs=1))
    assert good.verdict == "equivalent"
    assert good.obligations_total == 2 and good.obligations_unique == 1  # dedup is active
    s, p = _split_pair(3.0, 4.0)
    bad = verify_plans(plan_from_dict(s, "s"), plan_from_dict(p, "p"), Options(jobs=1))
    assert bad.obligations_unique == 2
    assert bad.verdict == "violation"
    assert [f.tensor for f in bad.failures if f.kind == "counterexample"] == ["y1"]


PAIRS = {
    # a stage the solver proved in the correct plan now has another obligation
    "solver-proved-stage": (lambda: _split_pair(3.0), lambda: _split_pair(4.0)),
    # a stage proven by term identity in the correct plan now needs the solver
    "identity-proved-stage": (lambda: (single_mlp(), parallel_mlp()),
                              lambda: (single_mlp(), parallel_mlp(wrong_const_rank=2))),
}


@pytest.mark.parametrize("case", sorted(PAIRS))
def test_a_corpus_never_answers_for_another_obligation(tmp_path, case):
    """The same corpus and the same plan files, first holding a correct plan, then edited into
    a buggy one whose stages have the same ids (the corpus's stage map for this pair still
    points at the old obligations): the changed stage's new obligation must be solved, not
    answered with the verdict recorded for the stage's old obligation."""
    corpus = tmp_path / "corpus"
    good_plans, bad_plans = PAIRS[case]
    good = write_pair_dicts(tmp_path / "plans", *good_plans())
    run = CliRunner().invoke
    first = run(main, ["verify", *good, "--corpus", str(corpus)])
    assert first.exit_code == 0, first.output
    bad = write_pair_dicts(tmp_path / "plans", *bad_plans())  # the same files, edited
    assert bad == good
    out = tmp_path / "bad.json"
    second = run(main, ["verify", *bad, "--corpus", str(corpus), "--report", str(out)])
    assert second.exit_code == 1, second.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "violation"
    assert data["cache_hits"] < data["obligations_unique"]
