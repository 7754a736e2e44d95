"""What a verdict means (tvsmt/policy.py): never a pass that was not proven (issue 9)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import fake_solver_profile, fixture_pair
from handmade import PlanDict, parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.encoding.concrete import evaluate_at_random
from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans


def _write(tmp_path, single: dict, parallel: dict) -> tuple[str, str]:
    s, p = tmp_path / "single.json", tmp_path / "parallel.json"
    s.write_text(json.dumps(single))
    p.write_text(json.dumps(parallel))
    return str(s), str(p)


def _verify(single: dict, parallel: dict, **opts):
    s, p = plan_from_dict(single, "single.json"), plan_from_dict(parallel, "parallel.json")
    check_pair(s, p)
    return verify_plans(s, p, Options(jobs=1, **opts))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_pair_with_nothing_to_verify_is_an_input_error():
    """The real export whose single plan lists no outputs and whose parallel plan has no
    lineages: the reference reports success; tvsmt refuses it (exit 2, one line)."""
    single, parallel = fixture_pair("llama3-ly2-dp2pp1tp2mb2-nolineage")
    r = run("verify", single, parallel, "--no-corpus")
    assert r.exit_code == 2, r.output
    assert "nothing to verify" in r.output and "Traceback" not in r.output


def test_a_pair_whose_lineages_are_all_assumptions_is_never_equivalent():
    """Every lineage relates graph inputs: no stage, no claim, so nothing is proven."""
    s = PlanDict("single", "s", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    s.t("x", [2, 2], "input")
    s.d["outputs"] = ["x"]
    p = PlanDict("parallel", "p", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    p.t("x@0", [2, 2], "input")
    p.lineage("x", [([(0, 2), (0, 2)], ["x@0"])])
    report = _verify(s.d, p.d)
    assert report.stages_total == 0
    assert report.verdict == "inconclusive" and report.exit_code == 3
    assert "nothing was claimed" in report.failures[0].message


def test_unclaimed_parallel_results_are_listed_and_fail_with_strict(tmp_path):
    """The parallel MLP computes the input gradient gx on every rank and nothing claims it."""
    report = _verify(single_mlp(), parallel_mlp())
    assert report.verdict == "equivalent"
    assert report.unclaimed == 4 and all(t.startswith("gx@") for t in report.unclaimed_tensors)
    strict = _verify(single_mlp(), parallel_mlp(), strict=True)
    assert strict.verdict == "inconclusive"
    assert [f.kind for f in strict.failures] == ["unclaimed"]
    pair = _write(tmp_path, single_mlp(), parallel_mlp())
    assert run("verify", *pair, "--no-corpus", "--strict").exit_code == 3
    r = run("verify", *pair, "--no-corpus")
    assert r.exit_code == 0 and "unclaimed" in r.output


def test_a_lying_solver_cannot_pass_a_buggy_plan(tmp_path):
    """Belt and braces: a solver that answers unsat to everything 'proves' the missing
    all-reduce; the stage's concrete evaluation contradicts it, so the run is inconclusive
    with a solver failure named prominently, never a pass."""
    liar = fake_solver_profile(tmp_path, "liar", "unsat")
    pair = _write(tmp_path, single_mlp(), parallel_mlp(drop_allreduce=True))
    out = tmp_path / "r.json"
    r = run("verify", *pair, "--no-corpus", "--solver", liar, "--report", out)
    assert r.exit_code == 3, r.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "inconclusive"
    failures = [f for f in data["failures"] if f["kind"] == "solver-failure"]
    assert failures and failures[0]["tensor"] == "y"
    assert failures[0]["counterexample"]["mismatches"]
    assert "SOLVER OR ENCODING FAILURE" in r.output
    # the same liar on the correct plan: every evaluation agrees with its (true) answers
    good = _write(tmp_path, single_mlp(), parallel_mlp())
    assert run("verify", *good, "--no-corpus", "--solver", liar).exit_code == 0


def test_a_solver_run_that_answers_fewer_obligations_than_asked_is_never_a_pass(tmp_path,
                                                                              monkeypatch):
    """Answers are matched to obligations by position (tvsmt/solving/dispatch.py): a run that
    returns one answer fewer than it was asked must stop the verification as an internal
    error (exit 4), never leave an obligation without its answer and the plan passed."""
    from tvsmt.solving import runner

    asked = []
    real = runner.solve_all

    def one_short(obligations, *args, **kwargs):
        obligations = list(obligations)
        asked.append(len(obligations))
        return real(obligations, *args, **kwargs)[:-1]

    monkeypatch.setattr(runner, "solve_all", one_short)
    pair = _write(tmp_path, single_mlp(), parallel_mlp())
    r = run("verify", *pair, "--no-corpus")
    assert asked and asked[0] > 0
    assert r.exit_code == 4, r.output


def test_a_stage_never_judged_is_never_a_pass():
    """The verdict policy (tvsmt/policy.py `decide`) says equivalent only when every stage
    was judged proven: a stage with neither a proof nor a failure was lost on the way (a
    bug in tvsmt), and the plan is then inconclusive, saying so; an export, which solves
    nothing, is never equivalent either."""
    from tvsmt.policy import decide
    from tvsmt.report.report import EQUIVALENT, INCONCLUSIVE, Report

    def decided(proven: int, solved: bool = True) -> Report:
        report = Report(EQUIVALENT, "s.json", "p.json", stages_total=3, stages_proven=proven)
        decide(report, [], solved=solved)
        return report

    assert decided(3).verdict == EQUIVALENT and not decided(3).failures
    lost = decided(2)
    assert lost.verdict == INCONCLUSIVE
    assert [f.kind for f in lost.failures] == ["error"]
    assert "1 of 3 stages were never judged" in lost.failures[0].message
    exported = decided(0, solved=False)
    assert exported.verdict == INCONCLUSIVE and not exported.failures


def test_a_verification_that_loses_a_stage_s_outcome_is_inconclusive(tmp_path, monkeypatch):
    """End to end: the encoding hands back one stage outcome fewer than there are stages
    (as a bug in it could): `tvsmt verify` exits 3 and names the lost stage count."""
    from tvsmt import pipeline

    real = pipeline.build_obligations

    def one_lost(*args, **kwargs):
        built = real(*args, **kwargs)
        built.outcomes.pop()
        return built

    monkeypatch.setattr(pipeline, "build_obligations", one_lost)
    pair = _write(tmp_path, single_mlp(), parallel_mlp())
    out = tmp_path / "r.json"
    r = run("verify", *pair, "--no-corpus", "--report", out)
    assert r.exit_code == 3, r.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "inconclusive"
    assert any("stages were never judged" in f["message"] for f in data["failures"])


@pytest.mark.parametrize("bug", [{"drop_allreduce": True}, {"wrong_const_rank": 3},
                                 {"drop_reducer": True}, {"wrong_chunk": True}])
def test_evaluation_finds_each_one_line_bug_and_no_difference_on_the_correct_plan(bug):
    """The evaluator itself (with assumptions solved as linear equalities) sees every bug
    and never a false difference."""
    from tvsmt.encoding.obligations import build_obligations
    from tvsmt.stages import cut_stages
    from tvsmt.timing import Timer

    def evaluations(parallel):
        s, p = plan_from_dict(single_mlp(), "s"), plan_from_dict(parallel, "p")
        built = build_obligations(s, p, cut_stages(s, p).stages, Timer(), jobs=1)
        return [o for o in built.outcomes if o.obligation is not None]

    clean = evaluations(parallel_mlp())
    assert clean and all(o.evaluation.points == 2 and o.evaluation.counterexample is None
                         for o in clean if o.template is None)
    broken = evaluations(parallel_mlp(**bug))
    assert any(o.evaluation.counterexample for o in broken if o.evaluation)


def test_evaluation_points_satisfy_the_stage_assumptions():
    """A stage assuming a partial sum (y = yp@0 + yp@1): the random point keeps it exact."""
    from tvsmt.encoding.concrete import _point
    from tvsmt.encoding.obligations import encode_one
    from tvsmt.ops import SymbolicBackend
    from tvsmt.stages import cut_stages
    from tvsmt.timing import Timer
    import random

    s, p = plan_from_dict(single_mlp(), "s"), plan_from_dict(parallel_mlp(), "p")
    stages = [st for st in cut_stages(s, p).stages]
    with_constraints = []
    for st in stages:
        out = encode_one(st, s, p, SymbolicBackend.fresh(), Timer())
        if out.formula is not None and out.formula.constraints:
            with_constraints.append(out.formula)
    assert with_constraints, "expected a stage with assumption equalities"
    from tvsmt.encoding.evaluate import FloatEvaluator

    for f in with_constraints:
        env = _point(f, random.Random(1))
        assert env is not None
        ev = FloatEvaluator(env)
        assert all(ev.walk(c) for c in f.constraints)
        assert evaluate_at_random(f).points == 2


def _with_hypothesis(parallel: dict, wrong: bool) -> dict:
    """The parallel MLP with an inferred lineage of `hs` on rank 0 (a hypothesis): the right
    slice, or rows it does not hold."""
    from handmade import B, H

    par = json.loads(json.dumps(parallel))
    b, h = B // 2, H // 2
    rows = (b, 2 * b) if wrong else (0, b)
    idx = next(i for i, lin in enumerate(par["lineages"]) if lin["single"] == "hs")
    par["lineages"].insert(idx, {"single": "hs", "hypothesis": True, "parts": [
        {"slice": [list(rows), [0, h]], "sum_of": ["hs@0"]}]})
    return par


@pytest.mark.parametrize("wrong", [False, True])
def test_a_wrong_hypothesis_never_changes_the_verdict_of_verify(tmp_path, wrong):
    """`tvsmt verify` on a pair carrying hypotheses runs the hypothesis driver: a wrong one is
    dropped (the pair stays equivalent), and it never hides a real bug."""
    good = _write(tmp_path, single_mlp(), _with_hypothesis(parallel_mlp(), wrong))
    out = tmp_path / "good.json"
    r = run("verify", *good, "--no-corpus", "--report", out)
    assert r.exit_code == 0, r.output
    notes = json.loads(out.read_text())["notes"]
    # a wrong hypothesis fails its own stage; a right one here is dropped too, because the
    # claim of the whole `hs` cut at it cannot be derived (the stages merge instead)
    assert any(n.startswith("hypotheses: 1 proposed, 1 dropped") for n in notes), notes
    (tmp_path / "bad").mkdir()
    bad = _write(tmp_path / "bad", single_mlp(),
                 _with_hypothesis(parallel_mlp(wrong_const_rank=0), wrong))
    assert run("verify", *bad, "--no-corpus").exit_code == 1


def test_answers_remembered_in_a_run_are_asked_once_per_solver_and_timeout(monkeypatch):
    """The hypothesis rounds of a capture (capture/driver.py) verify one pair again and
    again: within `answers_remembered` a script already answered is not asked again under
    the same solver and timeout (a timeout neither: the corpus reuses decisive answers
    only), under another timeout or solver it is, and outside it every run asks. A remembered
    counterexample is judged on the plan again: still a violation."""
    from tvsmt.solving import dispatch, runner

    asked: list[int] = []
    real = runner.solve_all

    def counting(obligations, *args, **kwargs):
        obligations = list(obligations)
        if obligations:
            asked.append(len(obligations))
        return real(obligations, *args, **kwargs)

    monkeypatch.setattr(runner, "solve_all", counting)
    good, bad = (single_mlp(), parallel_mlp()), (single_mlp(), parallel_mlp(wrong_chunk=True))
    assert _verify(*good).verdict == "equivalent" and asked
    assert _verify(*good).verdict == "equivalent" and len(asked) == 2  # no memo: asked again
    with dispatch.answers_remembered():
        assert _verify(*good).verdict == "equivalent"
        first = len(asked)
        for pair in (good, good):
            assert _verify(*pair).verdict == "equivalent"
        assert len(asked) == first  # remembered
        assert _verify(*bad).verdict == "violation"
        after_bad = len(asked)
        assert _verify(*bad).verdict == "violation"
        assert len(asked) == after_bad
        assert _verify(*good, timeout=30).verdict == "equivalent"
        assert len(asked) == after_bad + 1  # another timeout: asked again
        assert _verify(*good, solver="cvc5").verdict == "equivalent"
        assert len(asked) == after_bad + 2  # another solver: asked again, never z3's answer
    assert _verify(*good).verdict == "equivalent" and len(asked) == after_bad + 3


def test_the_settled_budget_is_for_stages_that_only_prove_hypotheses():
    """Once a confirmed bug decides a capture's verdict, the driver gives the stages that
    prove hypotheses a short budget (`Options.hypothesis_budget`); a script that a claim's
    stage shares with a hypothesis's keeps the run's timeout, as every claim does."""
    from types import SimpleNamespace as NS

    from tvsmt.solving.dispatch import _hypotheses_only

    lins = [NS(hypothesis=True), NS(hypothesis=True), NS(hypothesis=False),
            NS(hypothesis=False)]
    stage = [("a", 0), ("a", 1), ("b", 1), ("b", 2), ("c", 3), (None, 0)]
    outcomes = [NS(obligation=None if dg is None else NS(digest=dg), stage=NS(target=t))
                for dg, t in stage]
    assert _hypotheses_only(outcomes, NS(lineages=lins)) == {"a"}
