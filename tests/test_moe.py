"""Mixture-of-experts plans: the real nnScaler MoE pairs get their verdicts, the MoE bugs of
the catalogue are caught in them and in generated DeepSeek-V3-style plans, and the generated
MoE plans verify `equivalent` across dp / tp (= ep) / pp / mb."""

from __future__ import annotations


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


# Bugs that fit the real plans (no auxiliary loss; expert parallelism without all_to_all).
REAL_BUGS = [b for b in MOE_BUGS if b not in ("moe-aux-grad-scaled-by-tp",
                                              "moe-dispatch-wrong-rank")]


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


def test_real_plans_have_no_auxiliary_loss_nor_all_to_all(llama3moe):
    for bug in ("moe-aux-grad-scaled-by-tp", "moe-dispatch-wrong-rank"):
        with pytest.raises(NotApplicable):
            apply(llama3moe[1], bug)


# ----------------------------------------------------------------------------- generated plans

SMALL_MOE = dict(hidden=16, heads=4, ffn=16, vocab=16, seq=4)

# (layers, dp, tp, pp, mb, ep): layer 0 is dense, the others MoE; ep None = tp
MOE_CONFIGS = [(2, 1, 1, 1, 1, None), (2, 2, 2, 1, 2, None), (2, 1, 4, 2, 1, None),
               (3, 2, 2, 2, 2, None), (2, 4, 1, 2, 4, None), (2, 3, 2, 1, 3, None),
               (2, 2, 4, 1, 2, 2), (2, 1, 4, 2, 1, 1), (2, 2, 2, 2, 1, 1)]


@pytest.mark.parametrize("layers,dp,tp,pp,mb,ep", MOE_CONFIGS, ids=lambda v: str(v))
def test_generated_moe_is_equivalent(layers, dp, tp, pp, mb, ep):
    single, parallel = generate_pair("moe", layers=layers, dp=dp, tp=tp, pp=pp, mb=mb, ep=ep,
                                     **SMALL_MOE)
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    check_pair(s, p)
    ops = {n.op for n in p.nodes}
    assert {"gate_fw", "nnscaler_moe_gmm", "moe_aux_loss"} <= ops
    if tp > 1:  # tokens go through the dispatch, and through all_to_all when ep > 1
        assert {"moe_dispatch", "moe_combine"} <= ops
        assert ("all_to_all" in ops) == ((ep or tp) > 1)
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


def test_expert_parallel_groups_and_expert_data_parallel_reducers():
    """ep = 2 inside tp = 4: ranks t and t + 2 hold the same experts; all_to_all stays inside
    {0, 1} and {2, 3}; an expert gradient is reduced over dp * tp/ep = 4 ranks."""
    _, parallel = generate_pair("moe", layers=2, dp=2, tp=4, pp=1, mb=1, ep=2, **SMALL_MOE)
    ranges = {n["rank"]: (n["attrs"]["local_expert_start"], n["attrs"]["local_expert_end"])
              for n in parallel["nodes"] if n["op"] == "nnscaler_moe_gmm"}
    assert ranges == {r: (0, 4) if r % 2 == 0 else (4, 8) for r in range(8)}
    groups = {tuple(n["attrs"]["ranks"]) for n in parallel["nodes"] if n["op"] == "all_to_all"}
    assert groups == {(0, 1), (2, 3), (4, 5), (6, 7)}
    red = [n for n in parallel["nodes"] if n["op"] == "reducer"
           and n["outputs"][0].startswith("L1.moe.experts.w1.grad")]
    assert {n["rank"]: tuple(n["attrs"]["ranks"]) for n in red} == {
        r: (r % 2, r % 2 + 2, r % 2 + 4, r % 2 + 6) for r in range(8)}
    assert parallel["world"]["model"]["expert_parallel"]["ep"] == 2


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


@pytest.fixture(scope="module")
def generated_moe_ep2_tp4():
    single, parallel = generate_pair("moe", layers=2, dp=2, tp=4, pp=1, mb=2, ep=2,
                                     **SMALL_MOE)
    return plan_from_dict(single, "single"), parallel


@pytest.mark.parametrize("bug", ["moe-expert-grad-wrong-group", "moe-expert-grad-not-divided",
                                 "moe-dispatch-wrong-rank", "moe-combine-other-microbatch"])
def test_moe_bug_with_ep_smaller_than_tp_is_caught(generated_moe_ep2_tp4, bug):
    """ep = 2 inside tp = 4: the expert-data-parallel group (4 ranks) differs from the
    data-parallel one (2 ranks), and the wrong-group bug is the data-parallel reducer."""
    single, parallel = generated_moe_ep2_tp4
    broken, record = apply(parallel, bug, seed=0)
    if bug == "moe-expert-grad-wrong-group":
        assert record["split_into"] == "data-parallel reducers"
    report = _verify(single, plan_from_dict(broken, "broken"), timeout=5)
    assert report.verdict == "violation", (record, report.failures[:1])


def test_moe_bugs_that_need_a_partner_are_not_applicable_without_one():
    _, parallel = generate_pair("moe", layers=2, dp=1, tp=1, pp=1, mb=1, **SMALL_MOE)
    for bug in ("moe-expert-grad-wrong-group", "moe-expert-range-shifted",
                "moe-combine-other-microbatch", "moe-dispatch-wrong-rank"):
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
    bug = ("moe-expert-grad-not-divided", (2, 2),
           "L1.moe.experts.tokens_out:BW.nnscaler_moe_gmm@")
    report = verify_source(StreamedPlan("moe", **world, mutation=bug), Options(jobs=1))
    assert report.verdict == "violation", report.failures[:1]
    assert report.fold["exceptions"]


# ----------------------------------------------------------------------------- folding

FOLD_WORLD = dict(layers=2, dp=3, tp=2, pp=1, mb=3, **SMALL_MOE)  # ep = tp = 2, all_to_all


@pytest.fixture(scope="module")
def foldable_moe():
    single, parallel = generate_pair("moe", **FOLD_WORLD)
    return plan_from_dict(single, "single"), parallel


def test_generated_moe_with_three_replicas_and_micro_batches_folds(foldable_moe):
    single, parallel = foldable_moe
    report = _verify(single, plan_from_dict(parallel, "parallel"))
    assert report.verdict == "equivalent", (report.fold_note, report.failures[:1])
    assert report.fold is not None, report.fold_note
    assert report.fold["kept_replicas"] == [0, 1] and report.fold["exceptions"] == []


# the node each MoE bug is placed at (trying every node copies the plan once per node)
_BUG_SITE = {"moe-expert-grad-wrong-group": ("reducer", None),
             "moe-expert-grad-not-divided": ("nnscaler_moe_gmm", "bw"),
             "moe-aux-grad-scaled-by-tp": ("moe_aux_loss", "bw"),
             "moe-dispatch-wrong-rank": ("all_to_all", None),
             "moe-expert-range-shifted": ("nnscaler_moe_gmm", "fw"),
             "moe-combine-other-microbatch": ("moe_dispatch", "fw")}


def _in_last_unit(parallel: dict, bug: str) -> tuple[dict, dict]:
    """The bug placed at a node of replica 2, micro-batch 2 (or, for a bug on a reducer, of
    replica 2): a unit that folding drops."""
    per_replica = FOLD_WORLD["tp"] * FOLD_WORLD["pp"]
    op, pass_ = _BUG_SITE[bug]
    for n in parallel["nodes"]:
        if n["op"] != op or n["pass"] != pass_ or n["rank"] // per_replica != 2:
            continue
        if n["mb"] == 2 or op == "reducer":
            try:
                return apply(parallel, bug, where=n["id"])
            except NotApplicable:
                continue
    raise AssertionError(f"{bug}: no placement in replica 2")


@pytest.mark.parametrize("bug", MOE_BUGS)
def test_moe_bug_in_a_folded_away_unit_is_caught(foldable_moe, bug):
    single, parallel = foldable_moe
    broken, record = _in_last_unit(parallel, bug)
    report = _verify(single, plan_from_dict(broken, "broken"), timeout=5)
    assert report.verdict == "violation", (record, report.fold_note, report.failures[:1])
    if report.fold is not None:  # folded: the mutated unit was verified as an exception
        assert report.fold["exceptions"], record
    else:  # refused, with a reason, and verified unfolded
        assert report.fold_note


def test_streamed_moe_plan_with_ep_smaller_than_tp_is_refused_not_misfolded():
    """The streamed generator carries ep, but ep < tp is not streamable yet: an expert
    gradient's lineage sums several tp ranks of each replica (the expert-data-parallel
    group), which the stream's widening of the representative trace does not do. It refuses,
    naming the lineage, instead of guessing; ep = tp streams (the test above)."""
    from tvsmt.fold.folder import FoldRefused
    from tvsmt.frontends.stream import StreamedPlan

    with pytest.raises(FoldRefused, match=r"^lineage #\d+ of L1\.moe\.experts\.w1\.grad: .*"
                       "not one copy per unit"):
        StreamedPlan("moe", layers=2, dp=3, tp=2, pp=1, mb=3, ep=1, **SMALL_MOE)
