"""One-line bugs in small hand-made plans must turn `equivalent` into `violation` (issue 2),
and the report must point at the right stage, tensor and node."""

from __future__ import annotations

import pytest
from handmade import parallel_mlp, single_mlp

from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans


def verify_dicts(single: dict, parallel: dict):
    s, p = plan_from_dict(single, "single.json"), plan_from_dict(parallel, "parallel.json")
    check_pair(s, p)
    return verify_plans(s, p, Options(jobs=1))


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1), (2, 2), (2, 4)])
def test_correct_plans_are_equivalent(dp, tp):
    report = verify_dicts(single_mlp(), parallel_mlp(dp=dp, tp=tp))
    assert report.verdict == "equivalent", report.failures
    assert report.stages_proven == report.stages_total > 0


@pytest.mark.parametrize("bug,tensor,node", [
    ({"drop_allreduce": True}, "y", "ar@0"),
    ({"wrong_chunk": True}, "x", "c@0"),
    ({"wrong_const_rank": 1}, "hs", "n2@1"),
    ({"wrong_const_rank": 3}, "hs", "n2@3"),
    ({"drop_reducer": True}, "gw1", "red_gw1@0"),
])
def test_one_line_bugs_are_violations(bug, tensor, node):
    report = verify_dicts(single_mlp(), parallel_mlp(**bug))
    assert report.verdict == "violation"
    assert report.exit_code == 1
    first = report.failures[0]
    assert first.kind == "counterexample"
    assert first.tensor == tensor
    assert node in [n["id"] for n in first.parallel_nodes]
    cex = first.counterexample
    assert cex["mismatches"], "a counterexample shows the differing values"
    m = cex["mismatches"][0]
    assert m["single"] != m["parallel"]
    assert cex["inputs"]
    assert first.slice is not None


def test_wrong_constant_on_all_ranks_against_single_is_caught():
    report = verify_dicts(single_mlp(const=2.0), parallel_mlp(const=4.0))
    assert report.verdict == "violation"


def test_final_gradient_left_as_partial_sum_is_a_violation():
    par = parallel_mlp()
    par["lineages"] = [l for l in par["lineages"]
                       if not (l["single"] == "gw1" and len(l["parts"][0]["sum_of"]) == 1)]
    report = verify_dicts(single_mlp(), par)
    assert report.verdict == "violation"
    assert any(f.kind == "structural" and f.tensor == "gw1" and "partial sum" in f.message
               for f in report.failures)


def test_output_slice_nobody_holds_is_a_violation():
    par = parallel_mlp(dp=2, tp=2)
    last = [l for l in par["lineages"] if l["single"] == "gw2"][-1]
    last["parts"] = last["parts"][:1]  # only the first column block is claimed
    report = verify_dicts(single_mlp(), par)
    assert report.verdict == "violation"
    assert any("not fully held" in f.message and f.tensor == "gw2" for f in report.failures)


def test_parallel_input_posing_as_a_computed_tensor_is_a_violation():
    """An assumption is only acceptable on graph inputs of both plans."""
    par = parallel_mlp(dp=1, tp=2)
    # Claim that a fresh parallel input holds the single activation h (which the single plan
    # computes): the parallel plan would be assuming what it should prove.
    par["tensors"]["fake@0"] = {"shape": [8, 8], "role": "input"}
    par["lineages"].insert(0, {"single": "h", "parts": [{"slice": [[0, 8], [0, 8]],
                                                         "sum_of": ["fake@0"]}]})
    report = verify_dicts(single_mlp(), par)
    assert report.verdict == "violation"
    assert any(f.tensor == "h" and "never derives" in f.message for f in report.failures)


def _rsqrt_square_pair(parallel_op: str):
    """single: y = rsqrt(x) * rsqrt(x); parallel (1 rank): y = pow(x, -1) or the same as
    single. Equal for the real functions, not provable with uninterpreted ones."""
    from handmade import PlanDict

    s = PlanDict("single", "s", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    for t in ("x", "r", "y"):
        s.t(t, [2, 2], "input" if t == "x" else "activation")
    s.n("n1", "rsqrt", ["x"], ["r"])
    s.n("n2", "mul", ["r", "r"], ["y"])
    s.d["outputs"] = ["y"]
    p = PlanDict("parallel", "p", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    for t in ("x@0", "r@0", "y@0"):
        p.t(t, [2, 2], "input" if t == "x@0" else "activation")
    if parallel_op == "pow":
        p.n("m1", "pow", ["x@0"], ["y@0"], consts=[-1])
    else:
        p.n("m1", "rsqrt", ["x@0"], ["r@0"])
        p.n("m2", "mul", ["r@0", "r@0"], ["y@0"])
    p.lineage("x", [([(0, 2), (0, 2)], ["x@0"])])
    p.lineage("y", [([(0, 2), (0, 2)], ["y@0"])])
    return s.d, p.d


def test_counterexample_relying_on_the_abstraction_is_inconclusive_not_a_pass():
    report = verify_dicts(*_rsqrt_square_pair("pow"))
    assert report.verdict == "inconclusive"
    assert report.exit_code == 3
    assert "abstraction" in report.failures[0].message


def test_same_computation_with_uninterpreted_functions_is_proven():
    assert verify_dicts(*_rsqrt_square_pair("same")).verdict == "equivalent"


def test_operator_whose_declared_shapes_cannot_hold_is_a_violation():
    par = parallel_mlp(dp=1, tp=1)
    node = next(n for n in par["nodes"] if n["id"] == "n3@0")
    node["inputs"][1] = "w1@0"  # [16, 8] where the layer needs w2's [8, 16]
    report = verify_dicts(single_mlp(), par)
    assert report.verdict == "violation"
    assert any(f.kind == "structural" and f.node == "n3@0" and "shape" in f.message
               for f in report.failures)


def _scaled_pair(scale, final: bool):
    """single y = 3x; the parallel plan computes y@0 = 6x (twice y). With `final`, y is the
    single plan's output; otherwise z = y is, and the parallel plan halves y@0 into z@0."""
    from handmade import PlanDict

    s = PlanDict("single", "s", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    s.t("x", [2, 2], "input"), s.t("y", [2, 2]), s.t("z", [2, 2])
    s.n("n1", "mul", ["x"], ["y"], consts=[3])
    p = PlanDict("parallel", "p", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    p.t("x@0", [2, 2], "input"), p.t("y@0", [2, 2]), p.t("z@0", [2, 2])
    p.n("m1", "mul", ["x@0"], ["y@0"], consts=[6])
    p.lineage("x", [([(0, 2), (0, 2)], ["x@0"])])
    p.lineage("y", [([(0, 2), (0, 2)], ["y@0"], scale)])
    if final:
        s.d["outputs"] = ["y"]
    else:
        s.n("n2", "mul", ["y"], ["z"], consts=[1])
        p.n("m2", "div", ["y@0"], ["z@0"], consts=[2])
        p.lineage("z", [([(0, 2), (0, 2)], ["z@0"])])
        s.d["outputs"] = ["z"]
    return s.d, p.d


@pytest.mark.parametrize("scale,verdict", [([1, 2], "equivalent"), ([1, 1], "violation"),
                                           ([2, 1], "violation")])
def test_lineage_scale_is_honoured_on_intermediate_lineages(scale, verdict):
    """`scale: [num, den]` means single[slice] == num/den * sum(sum_of): a parallel tensor
    that holds twice the value is the single tensor only with scale 1/2."""
    assert verify_dicts(*_scaled_pair(scale, final=False)).verdict == verdict


def test_a_scaled_final_output_is_a_violation():
    """What the optimizer reads must be the result: a final gradient held at twice its value
    is wrong even if a lineage with scale 1/2 describes it exactly (issue 9, item 2)."""
    report = verify_dicts(*_scaled_pair([1, 2], final=True))
    assert report.verdict == "violation"
    f = [f for f in report.failures if f.kind == "structural" and "scaled" in f.message]
    assert f and f[0].tensor == "y" and f[0].lineage == 1
