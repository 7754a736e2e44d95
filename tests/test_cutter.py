"""Stage cutting: completeness for copies (multiref / identity) and chains of moves through
pipeline stages that only pass activations on (issue 12 item 0), without losing a bug."""

from __future__ import annotations

import pytest
from conftest import fixture_pair
from handmade import PlanDict

from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.stages import cut_stages
from tvsmt.verify import Options, verify_pair, verify_plans

N = [4, 4]
ALL = [[0, 4], [0, 4]]


def copies_pair(moved: float = 2.0, free_b: bool = False) -> tuple[dict, dict]:
    """single: u = x/2; (a, b) = multiref(u); c = b/3.
    parallel: u computed on rank 0, moved through rank 1 (a pass-through stage), and on
    rank 2
    a = identity(u), b = identity(a) (nnScaler's form of the multiref copies), c = b/3.
    `moved`: the divisor of the tensor actually moved (2.0 = right: u@0 itself is moved). `free_b`: b comes from a
    graph input that no lineage relates (a real gap)."""
    s = PlanDict("single", "copies_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    for t in ("x", "u", "a", "b", "c"):
        s.t(t, N, "input" if t == "x" else "activation")
    s.n("n1", "div", ["x"], ["u"], consts=[2.0])
    s.n("n2", "multiref", ["u"], ["a", "b"], times=2)
    s.n("n3", "div", ["b"], ["c"], consts=[3.0])
    s.d["outputs"] = ["c"]

    p = PlanDict("parallel", "copies_parallel", {"dp": 1, "tp": 1, "pp": 3, "mb": 1,
                                                 "ranks": 3})
    for t in ("x@0", "u@0", "m@0", "m@-1", "m@1", "m@-2", "u@2", "a@2", "b@2", "c@2", "z@2"):
        p.t(t, N, "input" if t in ("x@0", "z@2") else "activation")
    p.n("n1@0", "div", ["x@0"], ["u@0"], rank=0, consts=[2.0])
    if moved == 2.0:
        p.n("cp@0", "identity", ["u@0"], ["m@0"], pass_=None, rank=0)
    else:
        p.n("d@0", "div", ["x@0"], ["m@0"], rank=0, consts=[moved])
    p.n("mv0", "move", ["m@0"], ["m@-1"], pass_=None, rank=0, src=0, dst=1)
    p.n("mv1", "move", ["m@-1"], ["m@1"], pass_=None, rank=1, src=0, dst=1)
    p.n("mv2", "move", ["m@1"], ["m@-2"], pass_=None, rank=1, src=1, dst=2)
    p.n("mv3", "move", ["m@-2"], ["u@2"], pass_=None, rank=2, src=1, dst=2)
    p.n("id1", "identity", ["u@2"], ["a@2"], pass_=None, rank=2)
    p.n("id2", "identity", ["z@2" if free_b else "a@2"], ["b@2"], pass_=None, rank=2)
    p.n("n3@2", "div", ["b@2"], ["c@2"], rank=2, consts=[3.0])
    p.lineage("x", [(ALL, ["x@0"])])
    p.lineage("u", [(ALL, ["u@0"])])
    p.lineage("a", [(ALL, ["a@2"])])
    p.lineage("b", [(ALL, ["b@2"])])
    p.lineage("c", [(ALL, ["c@2"])])
    return s.d, p.d


def plans(s: dict, p: dict):
    single, parallel = plan_from_dict(s, "single.json"), plan_from_dict(p, "parallel.json")
    check_pair(single, parallel)
    return single, parallel


def test_copy_of_a_sibling_copy_is_derived_through_the_moves():
    single, parallel = plans(*copies_pair())
    stages = {st.target: st for st in cut_stages(single, parallel).stages}
    b = stages[3]
    # Narrow, the stage would stop at a@2 (lineage #2 of `a`, which `b` is not computed
    # from); widened, it goes through the identity and the moves back to u@0 (lineage #1).
    assert b.inputs == (1,)
    assert not b.free_single and not b.free_parallel
    ops = {parallel.nodes[i].op for i in b.parallel_nodes}
    assert ops == {"move", "identity"}
    report = verify_plans(single, parallel, Options(jobs=1))
    assert report.verdict == "equivalent", report.failures
    assert report.stages_proven == report.stages_total == 4


def test_widened_stage_still_catches_a_wrong_moved_tensor():
    single, parallel = plans(*copies_pair(moved=3.0))
    report = verify_plans(single, parallel, Options(jobs=1))
    assert report.verdict == "violation"
    bad = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert {"a", "b"} <= bad, report.failures


def test_a_real_gap_stays_underivable():
    single, parallel = plans(*copies_pair(free_b=True))
    report = verify_plans(single, parallel, Options(jobs=1))
    assert report.verdict == "violation"
    f = next(f for f in report.failures if f.tensor == "b")
    assert f.kind == "structural" and "cannot be derived" in f.message
    assert [n["id"] for n in f.parallel_nodes] == ["id2"]


@pytest.mark.fixtures
def test_pp8_fixture_is_derivable_and_equivalent():
    """The reference is right on llama3-ly2-dp2pp8tp2mb2: lineage #153 (t908v1@r0m0, the
    second output of multiref n229) is derived from lineage #130 (t589v1, the multiref's
    input) through the identities and the chunk/move/all_gather chain of pipeline stage 6."""
    single, parallel = fixture_pair("llama3-ly2-dp2pp8tp2mb2")
    s, p = load_plan(single), load_plan(parallel)
    cut = cut_stages(s, p)
    assert not cut.violations
    assert [st.target for st in cut.stages if st.free_single or st.free_parallel] == []
    st153 = next(st for st in cut.stages if st.target == 153)
    assert st153.inputs == (130,)
    report = verify_pair(single, parallel, Options(jobs=1))
    assert report.verdict == "equivalent", report.failures[:2]


@pytest.mark.fixtures
def test_br0_names_the_parallel_nodes_its_underivable_lineage_claims():
    single, parallel = fixture_pair("br0-llama3-ly1-dp2pp2tp2mb2")
    report = verify_pair(single, parallel, Options(jobs=1))
    assert report.verdict == "violation"
    f = next(f for f in report.failures if f.kind == "structural")
    assert f.tensor == "t355v1@r0m0"
    ids = {n["id"] for n in f.parallel_nodes}
    # The BW.float nodes writing t458/t460: the gradient that never got its second branch.
    assert "n195:BW.float@r0m0" in ids and "n194:BW.float@r1m0" in ids
    assert len(ids) == 8
