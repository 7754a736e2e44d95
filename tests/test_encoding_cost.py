"""Shortcuts that make encoding cheap, each next to the check that keeps it honest:

* the symbolic node memo (`SymbolicBackend.node_memo`, encoding/interpreter.py): stages of
  one multi-output node re-run it on the same terms, and the tensor-parallel ranks of a stage
  run the same norm on the same replicated terms; the memo must give byte-identical
  obligations, and a bug in a memoised node, or in one rank's copy of a shared computation,
  must still be caught;
* the points evaluator (encoding/evaluate.py `PointsEvaluator`): every point in one walk; it
  must agree with the one-point FloatEvaluator element by element, on MoE stages (ite,
  uninterpreted functions, top-k) too.
"""

from __future__ import annotations

import math
import random

import numpy as np

import pytest
from conftest import fixture_pair

from tvsmt.encoding.concrete import _point, evaluate_at_random
from tvsmt.encoding.evaluate import FloatEvaluator, PointsEvaluator
from tvsmt.encoding.obligations import encode_one
from tvsmt.frontends.builder import read_plan_dict
from tvsmt.frontends.mutations import apply
from tvsmt.ops import SymbolicBackend
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.stages import cut_stages
from tvsmt.timing import Timer
from tvsmt.verify import Options, verify_plans

REAL_MOE = "llama3moe-ly2-dp2pp2tp2mb2"


@pytest.fixture(scope="module")
def moe_pair():
    s_path, p_path = fixture_pair(REAL_MOE)
    return load_plan(s_path), load_plan(p_path)


def _digests(single, parallel, memo: bool):
    stages = cut_stages(single, parallel).stages
    be = SymbolicBackend.fresh()
    if not memo:
        be.node_memo = None
    out = []
    for st in stages:
        o = encode_one(st, single, parallel, be, Timer())
        out.append(o.obligation.digest if o.obligation else
                   ("failure", o.failure.kind) if o.failure else None)
    return out, be


def test_node_memo_gives_byte_identical_obligations(moe_pair):
    single, parallel = moe_pair
    with_memo, be = _digests(single, parallel, memo=True)
    without, _ = _digests(single, parallel, memo=False)
    assert with_memo == without
    assert any(d is not None for d in with_memo)
    # the memo was used: the MoE backward nodes have several outputs, one stage each
    executed = sum(len(st.single_nodes) + len(st.parallel_nodes)
                   for st in cut_stages(single, parallel).stages)
    assert 0 < len(be.node_memo) < executed


def test_a_bug_in_a_memoised_multi_output_node_is_still_caught():
    """Expert gradients not divided by the expert-parallel size: a bug in one output of the
    expert GEMM's backward, whose other outputs' stages hit the memo first."""
    s_path, p_path = fixture_pair(REAL_MOE)
    broken, record = apply(read_plan_dict(p_path), "moe-expert-grad-not-divided",
                           seed=1)
    report = verify_plans(load_plan(s_path), plan_from_dict(broken, "broken"),
                          Options(jobs=1, timeout=5))
    assert report.verdict == "violation", (record, report.failures[:1])


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))


def test_points_evaluator_agrees_with_the_one_point_evaluator(moe_pair):
    single, parallel = moe_pair
    be = SymbolicBackend.fresh()
    checked = 0
    for st in cut_stages(single, parallel).stages:
        o = encode_one(st, single, parallel, be, Timer())
        f = o.formula
        if f is None or not f.comparisons:
            continue
        envs = [_point(f, random.Random(k), bound) for k, bound in
                enumerate([None, None, 4, 16])]
        envs = [e for e in envs if e is not None]
        assert envs
        vec = PointsEvaluator({n: np.array([e[n] for e in envs]) for n in envs[0]}, len(envs))
        for c in f.comparisons[:64]:
            for side in (c.lhs, c.rhs):
                got = vec.vector(side)
                for k, env in enumerate(envs):
                    want = FloatEvaluator(env).walk(side)
                    assert _same(float(got[k]), float(want)), (st.id, k, got[k], want)
                    checked += 1
    assert checked > 100


def _mismatches_one_by_one(f, seed: int = 0):
    """evaluate_at_random's answer computed the plain way: each comparison at each point,
    one `close` at a time (its points made as it makes them, first `point_kinds`, then
    `mixed_kinds` when those found nothing, its terms' values the points evaluator's, which
    the test above holds to the one-point evaluator)."""
    from tvsmt.encoding.concrete import ABS, REL, mixed_kinds, point_kinds
    from tvsmt.encoding.evaluate import close

    kinds = point_kinds(f, 2)
    points = compared = 0
    for batch in range(2):
        envs = [_point(f, random.Random(seed + points + k), b, only)
                for k, (b, only) in enumerate(kinds)]
        if any(e is None for e in envs):
            return None
        ev = PointsEvaluator({n: np.array([e[n] for e in envs]) for n in envs[0]}, len(envs))
        first, int_failed = None, False
        for k in range(len(envs)):
            found = []
            for c in f.comparisons:
                x, y = float(ev.vector(c.lhs)[k]), float(ev.vector(c.rhs)[k])
                if not (math.isfinite(x) and math.isfinite(y)):
                    int_failed |= kinds[k][0] is not None and kinds[k][1] is None
                    continue
                compared += 1
                if not close(x, y, rel=REL, abs_=ABS):
                    found.append((c.part, list(c.single_index), list(c.index), repr(x),
                                  repr(y)))
            if found and first is None:
                first = (k, found)
        points += len(envs)
        if first is not None or batch == 1:
            return points, compared, first
        kinds = mixed_kinds(f, int_failed)
        if not kinds:
            return points, compared, None


def test_random_evaluation_finds_what_the_element_by_element_check_finds():
    """evaluate_at_random compares whole arrays of (comparison x point) values; on every
    stage of a real MoE plan with a bug in its experts' gradients it must count the same
    comparisons and report the same first mismatches as a check one element at a time."""
    s_path, p_path = fixture_pair(REAL_MOE)
    broken, _ = apply(read_plan_dict(p_path), "moe-expert-grad-not-divided", seed=1)
    single, parallel = load_plan(s_path), plan_from_dict(broken, "broken")
    be = SymbolicBackend.fresh()
    checked = refuted = 0
    for st in cut_stages(single, parallel).stages:
        f = encode_one(st, single, parallel, be, Timer()).formula
        if f is None or not f.comparisons:
            continue
        want = _mismatches_one_by_one(f)
        if want is None:
            continue
        got = evaluate_at_random(f)
        first = got.counterexample and (got.point, [
            (m["part"], m["index"], m["part_index"], m["single"], m["parallel"])
            for m in got.counterexample["mismatches"]])
        assert (got.points, got.compared) == want[:2], st.id
        if want[2] is None:
            assert first is None, st.id
        else:
            assert first[1] == want[2][1], st.id
            refuted += 1
        checked += 1
    assert checked > 20 and refuted > 0


def test_points_evaluator_sees_a_difference_at_one_point_only():
    """One point of several disagreeing (an integer point hitting an index) is found."""
    from pysmt.shortcuts import Equals, Ite, Real, Symbol
    from pysmt.typing import REAL

    x = Symbol("x", REAL)
    term = Ite(Equals(x, Real(4)), Real(1), Real(0))
    ev = PointsEvaluator({"x": np.array([0.7, 4.0, 3.0])}, 3)
    assert ev.vector(term).tolist() == [0.0, 1.0, 0.0]


def _formula(lhs, rhs, names):
    from tvsmt.encoding.stage import Comparison, StageFormula

    return StageFormula(stage=None, constraints=[], comparisons=[Comparison(0, (), (), lhs, rhs)],
                        inputs={n: ("s:x", (i,)) for i, n in enumerate(names)})


def test_stages_with_the_same_points_share_term_values_and_still_see_their_own_mismatch():
    """The stages of one node's outputs draw the same points, and evaluate_at_random walks
    a term they share once (`concrete._evaluator_for`); a stage whose own comparison differs
    is still refuted after a sibling that matched, with its own values."""
    from pysmt.shortcuts import Plus, Symbol, Times
    from pysmt.typing import REAL

    from tvsmt.encoding import concrete

    x, y = Symbol("x", REAL), Symbol("y", REAL)
    shared = Times(Plus(x, y), x)
    right, wrong = _formula(shared, shared, "xy"), _formula(Plus(shared, y), shared, "xy")
    assert evaluate_at_random(right).counterexample is None
    walked = concrete._EVALUATORS[next(reversed(concrete._EVALUATORS))]
    assert any(t is shared for t, _ in walked._values.values())
    got = evaluate_at_random(wrong)
    assert concrete._EVALUATORS[next(reversed(concrete._EVALUATORS))] is walked  # reused
    point, mismatch = got.point, got.counterexample["mismatches"][0]
    want = (point["x"] + point["y"]) * point["x"]
    assert float(mismatch["parallel"]) == pytest.approx(want)
    assert float(mismatch["single"]) == pytest.approx(want + point["y"])


def test_other_points_of_the_same_symbols_are_not_served_old_values():
    """The evaluator is shared by points, names and values, never by names alone: the same
    stage at another seed is evaluated at its own points."""
    from pysmt.shortcuts import Plus, Real, Symbol
    from pysmt.typing import REAL

    x = Symbol("x", REAL)
    f = _formula(x, Plus(x, Real(1)), "x")  # every point a mismatch
    for seed in (0, 7, 0, 7):
        got = evaluate_at_random(f, seed=seed)
        mismatch = got.counterexample["mismatches"][0]
        assert float(mismatch["single"]) == got.point["x"]
        assert float(mismatch["parallel"]) == got.point["x"] + 1


# ----------------------------------------------------------------------------- expert axis
SMALL_MOE = dict(hidden=16, heads=4, ffn=16, vocab=16, seq=4)


def _moe(tp=2, **kw):
    from tvsmt.frontends import generate_pair

    return generate_pair("moe", layers=2, dp=1, tp=tp, pp=1, mb=1, **SMALL_MOE, **kw)


def _gmm_stage_shapes(single, parallel):
    """(original, reduced) expert-weight rows of every stage ending at a routed GEMM."""
    from tvsmt.shapes import reduce_stage

    out = []
    for st in cut_stages(single, parallel).stages:
        if not any(single.nodes[i].op == "nnscaler_moe_gmm" for i in st.single_nodes):
            continue
        shapes = reduce_stage(st, single, parallel)
        for t, shape in shapes.single.items():
            if single.shape(t)[0] == 8 and len(shape) == 3:  # the (E, D, H) expert weights
                out.append((single.shape(t)[0], shape[0]))
    return out


def test_the_expert_axis_is_reduced_with_its_ranges():
    """8 experts over 2 expert-parallel ranks (4 each, 4 router groups of 2): E -> 4."""
    s, p = (plan_from_dict(d, n) for d, n in zip(_moe(), ("s", "p")))
    rows = _gmm_stage_shapes(s, p)
    assert rows and all(r == (8, 4) for r in rows), rows


def _shift_first_range(parallel: dict, by: int) -> dict:
    import copy

    plan = copy.deepcopy(parallel)
    shifted = 0
    for n in plan["nodes"]:
        a = n["attrs"]
        if n["op"] == "nnscaler_moe_gmm" and a.get("local_expert_start") == 0:
            a["local_expert_start"] += by
            a["local_expert_end"] += by
            shifted += 1
    assert shifted
    return plan


@pytest.mark.parametrize("by", [1, 2])
def test_an_expert_range_off_by_part_of_a_range_is_caught(by):
    """Rank 0 computes experts [by, 4 + by) with the weights of [0, 4): off by one expert, a
    position the reduction cannot keep (the expert axis then stays unreduced), or by two,
    which the reduction by 2 keeps (the reduced range is off by one)."""
    single, parallel = _moe()
    s = plan_from_dict(single, "s")
    p = plan_from_dict(_shift_first_range(parallel, by), "p")
    if by == 1:
        rows = _gmm_stage_shapes(s, p)
        assert rows and any(r == (8, 8) for r in rows), rows
    # the stages through the shifted GEMM: their (reduced) obligations have a concrete
    # counterexample, a plain evaluation of both plans (the full run says "violation": the
    # bug zoo's moe-expert-range-shifted in tests/test_moe.py)
    shifted = {i for i, n in enumerate(p.nodes) if n.op == "nnscaler_moe_gmm"
               and n.attrs.get("local_expert_start") == by}
    be, found = SymbolicBackend.fresh(), 0
    for st in cut_stages(s, p).stages:
        if shifted & set(st.parallel_nodes):
            o = encode_one(st, s, p, be, Timer())
            found += bool(o.evaluation and o.evaluation.counterexample)
    assert found


def test_chunks_cover_every_template_once_and_keep_node_sharing_stages_together(moe_pair):
    from tvsmt.encoding.obligations import _chunks

    single, parallel = moe_pair
    stages = cut_stages(single, parallel).stages
    reps = list(range(len(stages)))
    chunks = _chunks(stages, reps, 8)
    assert sorted(i for c in chunks for i in c) == reps
    where = {i: k for k, c in enumerate(chunks) for i in c}
    seen: dict = {}
    shared = 0
    for i, st in enumerate(stages):
        for node in [("s", x) for x in st.single_nodes] + [("p", x) for x in st.parallel_nodes]:
            if node in seen:
                shared += 1
                assert where[seen[node]] == where[i], node
            seen.setdefault(node, i)
    assert shared and len(chunks) > 1


def test_a_node_run_on_other_input_terms_is_not_served_from_the_memo():
    """The memo key holds the input terms: the same node run on other terms (another stage's
    frontier, another reduction) computes afresh instead of returning the first result."""
    from handmade import single_mlp
    from pysmt.typing import REAL

    from tvsmt.encoding.interpreter import Interpreter

    plan = plan_from_dict(single_mlp(), "s")
    node = next(n for n in plan.nodes if n.op == "linear")
    be = SymbolicBackend.fresh()
    interp = Interpreter(plan, be)
    results = []
    with be.active():
        for tag in ("first", "second"):
            env = {}
            for t in node.inputs:
                shape = plan.shape(t)
                env[t] = np.array([be.mgr.Symbol(f"{tag}|{t}|{k}", REAL)
                                   for k in range(int(np.prod(shape)))],
                                  dtype=object).reshape(shape)
            interp.run_node(node, env)
            results.append(env[node.outputs[0]])
        interp.run_node(node, env)  # the second inputs again: now served from the memo
    assert len(be.node_memo) == 2
    assert results[0].flat[0] is not results[1].flat[0]
    assert env[node.outputs[0]].flat[0] is results[1].flat[0]


def test_nodes_with_other_attributes_on_the_same_terms_are_not_served_from_the_memo():
    """The memo key is what a rule reads: another node with the same operator, attributes and
    input terms is served the first one's result; one with another constant is not."""
    from handmade import single_mlp
    from msgspec.structs import replace
    from pysmt.typing import REAL

    from tvsmt.encoding.interpreter import Interpreter

    plan = plan_from_dict(single_mlp(const=2.0), "s")
    div = next(n for n in plan.nodes if n.op == "div" and not n.is_backward)
    twin = replace(div, id="twin")
    other = replace(div, id="other", attrs=dict(div.attrs, consts=[3.0]))
    be = SymbolicBackend.fresh()
    interp = Interpreter(plan, be)
    (x,), (y,) = div.inputs, div.outputs
    shape = plan.shape(x)
    with be.active():
        env = {x: np.array([be.mgr.Symbol(f"x{k}", REAL) for k in range(int(np.prod(shape)))],
                           dtype=object).reshape(shape)}
        results = []
        for node in (div, twin, other):
            interp.run_node(node, env)
            results.append(env[y])
    assert len(be.node_memo) == 2
    assert all(a is b for a, b in zip(results[0].flat, results[1].flat))
    assert not any(a is c for a, c in zip(results[0].flat, results[2].flat))


def test_a_wrong_constant_on_one_tensor_parallel_rank_is_caught(monkeypatch):
    """In the real Llama3 fixture both tensor-parallel ranks run each RMSNorm on the same
    replicated terms, so the memo serves one rank's norm from the other's. An epsilon made
    wrong on the last rank's copy only (last micro-batch) must still be reported there."""
    from tvsmt.encoding import interpreter

    s_path, p_path = fixture_pair("llama3-ly2-dp2pp2tp2mb2")
    single, parallel = load_plan(s_path), load_plan(p_path)
    runs = set()  # (node, input terms): what a memo of each node alone would hold
    keyed = interpreter._memo_key

    def spy(node, ins, shapes, plan):
        runs.add((id(node), tuple(None if a is None else tuple(map(id, a.flat)) for a in ins)))
        return keyed(node, ins, shapes, plan)

    monkeypatch.setattr(interpreter, "_memo_key", spy)
    _, be = _digests(single, parallel, memo=True)
    monkeypatch.undo()
    assert len(be.node_memo) < 0.8 * len(runs)  # distinct nodes share entries
    last_rank = max(n.rank for n in parallel.nodes)
    last_mb = max(n.mb for n in parallel.nodes)
    eps = [n.id for n in parallel.nodes if n.op == "add" and n.pass_ == "fw"
           and n.attrs.get("consts") and sum(t is not None for t in n.inputs) == 1
           and n.rank == last_rank and n.mb == last_mb]
    assert eps
    broken, record = apply(read_plan_dict(p_path), "wrong-constant-one-rank", where=eps[-1])
    report = verify_plans(single, plan_from_dict(broken, "broken"), Options(jobs=1, timeout=5))
    assert report.verdict == "violation", record
    assert any(record["nodes"][0] in {n["id"] for n in f.parallel_nodes}
               for f in report.failures), [f.message for f in report.failures]
