"""Mixture-of-experts plans: the real nnScaler MoE pairs get their verdicts, the MoE bugs of
the catalogue are caught in them and in generated DeepSeek-V3-style plans, and the generated
MoE plans verify `equivalent` across dp / tp (= ep) / pp / mb."""

from __future__ import annotations

import os

import pytest
from conftest import fixture_pair

from tvsmt.frontends import generate_pair
from tvsmt.frontends.builder import read_plan_dict
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

MOE_BUGS = [name for name in MUTATIONS if name.startswith("moe-")]


def _verify(single, parallel, **kw):
    return verify_plans(single, parallel, Options(jobs=1, **kw))


def _real(name):
    s_path, p_path = fixture_pair(name)
    return load_plan(s_path), p_path


@pytest.mark.parametrize("name", ["moe-ly4-dp2pp2tp2mb2", "llama3moe-ly2-dp2pp2tp2mb2"])
def test_real_moe_pairs_are_equivalent(name):
    single, p_path = _real(name)
    report = _verify(single, load_plan(p_path))
    assert report.verdict == "equivalent", report.failures[:2]
    assert report.stages_proven == report.stages_total > 0


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TVSMT_SLOW"), reason="not foldable yet (nnScaler's "
                    "chained per-micro-batch grad_accum); unfolded, 5 weight-gradient stages "
                    "summing 256 units time out in z3 (inconclusive after 840 s): set "
                    "TVSMT_SLOW=1 to run it")
def test_real_moe_128_ranks_is_equivalent():
    single, p_path = _real("moe-ly2-dp16pp2tp4mb16")
    report = verify_plans(single, load_plan(p_path), Options(jobs=2))
    assert report.verdict == "equivalent", report.failures[:2]


# Bugs that fit the real plans (they have no auxiliary loss).
REAL_BUGS = [b for b in MOE_BUGS if b != "moe-aux-grad-scaled-by-tp"]


@pytest.fixture(scope="module")
def llama3moe():
    single, p_path = _real("llama3moe-ly2-dp2pp2tp2mb2")
    return single, read_plan_dict(p_path)


@pytest.mark.parametrize("bug", REAL_BUGS)
def test_bug_in_a_real_moe_plan_is_caught(llama3moe, bug):
    single, parallel = llama3moe
    broken, record = apply(parallel, bug, seed=1)
    report = _verify(single, plan_from_dict(broken, "broken"), timeout=5)
    assert report.verdict == "violation", (record, report.failures[:1])


def test_real_plans_have_no_auxiliary_loss(llama3moe):
    with pytest.raises(NotApplicable):
        apply(llama3moe[1], "moe-aux-grad-scaled-by-tp")


# ----------------------------------------------------------------------------- generated plans

SMALL_MOE = dict(hidden=16, heads=4, ffn=16, vocab=16, seq=4)

# (layers, dp, tp = ep, pp, mb): layer 0 is dense, the others MoE
MOE_CONFIGS = [(2, 1, 1, 1, 1), (2, 2, 2, 1, 2), (2, 1, 4, 2, 1), (3, 2, 2, 2, 2),
               (2, 4, 1, 2, 4), (2, 3, 2, 1, 3)]


@pytest.mark.parametrize("layers,dp,tp,pp,mb", MOE_CONFIGS, ids=lambda v: str(v))
def test_generated_moe_is_equivalent(layers, dp, tp, pp, mb):
    single, parallel = generate_pair("moe", layers=layers, dp=dp, tp=tp, pp=pp, mb=mb,
                                     **SMALL_MOE)
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    check_pair(s, p)
    ops = {n.op for n in p.nodes}
    assert {"gate_fw", "nnscaler_moe_gmm", "moe_aux_loss"} <= ops
    report = _verify(s, p)
    assert report.verdict == "equivalent", report.failures[:2]
    assert report.stages_proven == report.stages_total > 0


def test_generated_moe_lineages_hold_numerically():
    from numeric_eval import check_pair_numeric

    single, parallel = generate_pair("moe", layers=2, dp=2, tp=2, pp=2, mb=2, **SMALL_MOE)
    assert check_pair_numeric(single, parallel) == []


def test_expert_ranges_follow_the_tp_index():
    _, parallel = generate_pair("moe", layers=2, dp=1, tp=4, pp=1, mb=1, **SMALL_MOE)
    ranges = {(n["rank"], n["pass"]): (n["attrs"]["local_expert_start"],
                                       n["attrs"]["local_expert_end"])
              for n in parallel["nodes"] if n["op"] == "nnscaler_moe_gmm"}
    assert ranges == {(t, ps): (2 * t, 2 * t + 2) for t in range(4) for ps in ("fw", "bw")}


@pytest.fixture(scope="module")
def generated_moe():
    single, parallel = generate_pair("moe", layers=2, dp=2, tp=2, pp=1, mb=2, **SMALL_MOE)
    return plan_from_dict(single, "single"), parallel


@pytest.mark.parametrize("bug", MOE_BUGS)
def test_moe_bug_in_a_generated_plan_is_caught(generated_moe, bug):
    single, parallel = generated_moe
    broken, record = apply(parallel, bug, seed=0)
    report = _verify(single, plan_from_dict(broken, "broken"), timeout=5)
    assert report.verdict == "violation", (record, report.failures[:1])


def test_moe_bugs_that_need_a_partner_are_not_applicable_without_one():
    _, parallel = generate_pair("moe", layers=2, dp=1, tp=1, pp=1, mb=1, **SMALL_MOE)
    for bug in ("moe-expert-grad-wrong-group", "moe-expert-range-shifted",
                "moe-combine-other-microbatch"):
        with pytest.raises(NotApplicable):
            apply(parallel, bug)


def test_cli_generates_moe_and_refuses_a_separate_ep(tmp_path):
    from click.testing import CliRunner

    from tvsmt.cli import main

    args = ["plan", "generate", "--model", "moe", "--hidden", "16", "--heads", "2", "--ffn",
            "16", "--vocab", "16", "--seq", "4", "--tp", "2", "-o", str(tmp_path / "ok")]
    assert CliRunner().invoke(main, args + ["--ep", "2"]).exit_code == 0
    bad = CliRunner().invoke(main, args[:-2] + ["--ep", "4", "-o", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "ep" in bad.output


@pytest.mark.parametrize("bug", MOE_BUGS)
def test_moe_bug_breaks_the_numeric_check(generated_moe, bug):
    """Independently of the verifier: the mutated plan really computes something else."""
    from numeric_eval import check_pair_numeric

    single, parallel = generated_moe
    broken, record = apply(parallel, bug, seed=0)
    assert set(record["nodes"]) <= {n["id"] for n in broken["nodes"]}
    assert check_pair_numeric(single, broken), f"{bug} did not change any lineage"


def test_streamed_moe_plan_folds_and_a_bug_in_a_dropped_unit_is_caught():
    """The generator's MoE plan streamed unit by unit (as the scale benchmark runs it): folded
    and equivalent; an expert gradient scaled by EP in replica 2, micro-batch 2 is caught."""
    from tvsmt.frontends.stream import StreamedPlan
    from tvsmt.verify import verify_source

    world = dict(layers=2, dp=3, tp=2, pp=1, mb=3, **SMALL_MOE)
    report = verify_source(StreamedPlan("moe", **world), Options(jobs=1))
    assert report.verdict == "equivalent", (report.fold_note, report.failures[:1])
    assert report.fold is not None
    bug = ("moe-expert-grad-not-divided", (2, 2), "L1.moe.experts.out:BW.nnscaler_moe_gmm@")
    report = verify_source(StreamedPlan("moe", **world, mutation=bug), Options(jobs=1))
    assert report.verdict == "violation", report.failures[:1]
    assert report.fold["exceptions"]
