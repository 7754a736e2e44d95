"""Replica folding (tvsmt/fold) is a shortcut, so it must keep soundness: every bug of the
catalogue placed in a folded-away replica or micro-batch (and a single layer) is still
caught, a sum that misses a replica is refused, and units that are not copies are verified
themselves."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tvsmt.fold import FoldRefused, fold_plans
from tvsmt.fold.folder import SUM_OPS
from tvsmt.fold.table import OTHER, rename_ranks
from tvsmt.fold.units import WorldUnits, assign_units
from tvsmt.frontends import generate_pair
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply
from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)
WORLD = dict(layers=2, dp=4, tp=2, pp=2, mb=4)
PER_REPLICA = WORLD["tp"] * WORLD["pp"]


@pytest.fixture(scope="module")
def pair():
    return generate_pair("llama3", **WORLD, **DIMS)


@pytest.fixture(scope="module")
def single(pair):
    return plan_from_dict(pair[0], "single")


def _verify(single, parallel: dict, fold: bool = True):
    return verify_plans(single, plan_from_dict(parallel, "parallel"), Options(jobs=1, fold=fold))


def test_units_come_from_ranks_micro_batches_and_dataflow(pair):
    """Units are read from node fields and dataflow, never from ids: a node's unit is
    (replica of its rank, mb); a sum over units (grad_accum, reducer) is its replica's; a
    weight (a graph input read by one replica's micro-batches) is its replica's; an in-flight
    message is its sender's."""
    p = plan_from_dict(pair[1], "p")
    umap = assign_units(p, WorldUnits.of(p.world), SUM_OPS)
    by_id = {n.id: (n, u) for n, u in zip(p.nodes, umap.node_unit)}
    for n, u in by_id.values():
        assert u[0] == n.rank // PER_REPLICA, n.id
        if n.op in ("reducer", "grad_accum") and len(n.inputs) > 1:
            assert u[1] is None, n.id
        elif n.mb >= 0 and u[1] is None:  # e.g. the loss all_reduce over every instance
            assert n.op in SUM_OPS and len({umap.tensor_unit[x] for x in n.inputs}) > 1, n.id
        elif n.mb >= 0:
            assert u[1] == n.mb, n.id
    produced = {x for n in p.nodes for x in n.outputs}
    readers: dict = {}
    for n in p.nodes:
        for x in n.inputs:
            readers.setdefault(x, set()).add((n.rank // PER_REPLICA, n.mb))
    weights = [x for x, us in readers.items() if x not in produced and len(us) > 1
               and {d for d, _ in us} == {3}]
    assert weights and all(umap.tensor_unit[x] == (3, None) for x in weights)
    move = next(n for n in p.nodes if n.op == "move" and n.rank // PER_REPLICA == 2
                and n.mb == 1 and ">" in n.outputs[0])
    assert umap.tensor_unit[move.outputs[0]] == (2, 1)
    assert list(rename_ranks(np.array([14, 2]), 3, 4)) == [2, 2 + OTHER]


def test_correct_plan_is_folded_and_equivalent(pair, single):
    folded = fold_plans(single, plan_from_dict(pair[1], "parallel"))
    check_pair(folded.single, folded.parallel)
    assert folded.info.kept_replicas == [0, 1] and folded.info.kept_units == 4
    assert folded.info.exceptions == []
    assert folded.info.checked["nodes"] == len(pair[1]["nodes"])  # every node was compared
    assert len(folded.parallel.nodes) < len(pair[1]["nodes"]) / 3
    batch = pair[0]["tensors"]["tokens"]["shape"][0]
    assert folded.single.shape("tokens")[0] == batch // 4  # 4 of 16 pieces kept
    report = _verify(single, pair[1])
    assert report.verdict == "equivalent" and report.fold is not None


def test_a_hypothesis_stays_one_through_the_fold(pair, single):
    """An inferred lineage (a hypothesis: it only cuts stages, never makes a violation by
    itself) is still a hypothesis in the folded pair, and the hypothesis driver verifies the
    folded plan as it does the whole one."""
    from tvsmt.capture.driver import verify_with_hypotheses

    par = copy.deepcopy(pair[1])
    plan = plan_from_dict(par, "parallel")
    computed = {x for n in plan.nodes for x in n.outputs}
    claims = [i for i, lin in enumerate(plan.lineages)
              if any(t in computed for p in lin.parts for t in p.sum_of)]
    k = claims[len(claims) // 2]
    par["lineages"][k]["hypothesis"] = True
    hyp = plan_from_dict(par, "parallel")
    folded = fold_plans(single, hyp)
    assert [lin.hypothesis for lin in folded.parallel.lineages] == \
        [lin.hypothesis for lin in hyp.lineages]
    report, counts = verify_with_hypotheses(single, hyp, Options(jobs=1))
    assert report.verdict == "equivalent" and report.fold is not None
    assert counts["proposed"] == 1


_PLACED: dict[str, tuple[dict, dict]] = {}


def _dropped_placement(parallel: dict, bug: str) -> tuple[dict, dict]:
    """The bug injected at a node of a unit that folding drops (replica >= 2 or micro-batch
    >= 2), preferring the last replica and micro-batch (computed once per bug)."""
    if bug not in _PLACED:
        _PLACED[bug] = _place(parallel, bug)
    return _PLACED[bug]


def _place(parallel: dict, bug: str) -> tuple[dict, dict]:
    found = []
    for seed in range(60):
        if found and seed >= 8:  # each try copies the plan: a dropped unit found early will
            break                # do (a reducer's micro-batch is 0: never both dropped)
        try:
            broken, record = apply(parallel, bug, seed=seed)
        except NotApplicable:
            break
        target = next((n for n in parallel["nodes"] if n["id"] == record["target"]), None)
        if target is None:  # the target node may have been deleted
            continue
        d, m = target["rank"] // PER_REPLICA, target["mb"]
        m = None if m < 0 else m
        if d >= 2 and (m is None or m >= 2):
            return broken, record
        if d >= 2 or (m or 0) >= 2:
            found.append((broken, record))
    if not found:  # no seed landed there: force the target onto each dropped unit's nodes
        for n in parallel["nodes"]:
            if n["rank"] >= 2 * PER_REPLICA and (n.get("mb") or 0) >= 2:
                try:
                    return apply(parallel, bug, where=n["id"])
                except NotApplicable:
                    continue
    # A bug that cannot be placed in a dropped unit would make the test prove nothing.
    assert found, f"{bug}: no placement in a folded-away unit"
    return found[0]


# the Llama3 plan's catalogue (the MoE bugs need MoE layers: tests/test_moe.py folds those)
LLAMA_BUGS = sorted(b for b, m in MUTATIONS.items() if m.category != "mixture of experts")


@pytest.mark.parametrize("bug", LLAMA_BUGS)
def test_bug_in_a_folded_away_unit_is_caught(pair, single, bug):
    broken, record = _dropped_placement(pair[1], bug)
    report = _verify(single, broken)
    assert report.verdict == "violation", (record, report.fold_note)
    if report.fold is not None:  # folded: the mutated unit was verified as an exception
        assert report.fold["exceptions"], record
    else:  # refused, with a reason, and verified unfolded
        assert report.fold_note


def test_most_bugs_are_caught_through_the_fold(pair, single):
    """The test above must exercise folding, not only its fallback."""
    folded = 0
    for bug in ("drop-allreduce-keep-dataflow", "bw-wrong-input", "grad-scale-wrong",
                "loss-scale-wrong", "wrong-constant-one-rank"):
        broken, _ = _dropped_placement(pair[1], bug)
        folded += fold_plans(single, plan_from_dict(broken, "p")).info.exceptions != []
    assert folded == 5


def test_a_reducer_missing_a_replica_is_not_folded(pair, single):
    broken = copy.deepcopy(pair[1])
    for n in broken["nodes"]:
        if n["op"] == "reducer":
            n["inputs"] = n["inputs"][:-1]  # every reducer forgets the last replica
            n["attrs"]["ranks"] = n["attrs"]["ranks"][:-1]
    with pytest.raises(FoldRefused, match="misses"):
        fold_plans(single, plan_from_dict(broken, "p"))
    report = _verify(single, broken)
    assert report.verdict == "violation" and "misses" in report.fold_note


def test_a_benign_difference_is_verified_twice(pair, single):
    """A unit that is not a copy (here: one residual add with its operands swapped) is kept
    and verified; the plan is still equivalent, and the second fold (one more uniform
    replica) was run. Renaming a node is not a difference: ids are never compared."""
    broken = copy.deepcopy(pair[1])
    node = next(n for n in broken["nodes"] if n["op"] == "add" and n["pass"] == "fw"
                and n["rank"] // PER_REPLICA == 3 and n["mb"] == 3
                and len(set(n["inputs"])) == 2)
    node["inputs"] = node["inputs"][::-1]
    renamed = next(n for n in broken["nodes"] if n["op"] == "linear"
                   and n["rank"] // PER_REPLICA == 2 and n["mb"] == 2)
    renamed["id"] += "~renamed"
    report = _verify(single, broken)
    assert report.verdict == "equivalent"
    assert report.fold["exceptions"] == ["replica 3 micro-batch 3"]
    assert report.fold["kept_replicas"] == [0, 1, 3]
    second = report.fold["second_fold"]
    assert second["extra"] == 1 and second["kept_replicas"] == [0, 1, 2, 3]


def test_small_plans_are_not_folded():
    s, p = generate_pair("mlp", layers=1, dp=2, tp=2, pp=1, mb=2)
    report = _verify(plan_from_dict(s, "s"), p)
    assert report.verdict == "equivalent" and report.fold is None
    assert "nothing to fold" in report.fold_note


def test_folding_can_be_turned_off(pair, single):
    broken, _ = _dropped_placement(pair[1], "grad-scale-wrong")
    report = _verify(single, broken, fold=False)
    assert report.verdict == "violation" and report.fold is None and report.fold_note is None


def test_two_units_claiming_the_same_rows_are_not_folded(pair, single):
    """Replica 3, micro-batch 3 reads and writes the rows of micro-batch 2 (every one of its
    lineage parts moved there): each unit alone looks like a translated copy, but the pieces
    no longer tile the batch, so nothing is folded, and the plan is wrong (the rows of
    micro-batch 3 are never used)."""
    broken = copy.deepcopy(pair[1])
    rows = pair[0]["tensors"]["tokens"]["shape"][0] // (WORLD["dp"] * WORLD["mb"])
    moved = 0
    p = plan_from_dict(broken, "p")
    umap = assign_units(p, WorldUnits.of(p.world), SUM_OPS)
    for lin in broken["lineages"]:
        for part in lin["parts"]:
            units = {umap.tensor_unit[t] for t in part["sum_of"]}
            if units == {(3, 3)} and part["slice"] and part["slice"][0][0] == 15 * rows:
                part["slice"][0] = [14 * rows, 15 * rows]
                moved += 1
    assert moved > 10
    with pytest.raises(FoldRefused, match="tile"):
        fold_plans(single, plan_from_dict(broken, "p"))
    report = _verify(single, broken)
    assert report.verdict == "violation" and "tile" in report.fold_note


def test_a_replica_giving_a_reducer_another_tensor_is_not_folded(pair, single):
    """Every reducer of one weight takes replica 3's gradient of another weight (same shape):
    each replica unit alone still looks like a copy, but the sum over replicas does not take
    the same tensor from every replica, so nothing is folded."""
    broken = copy.deepcopy(pair[1])
    shape = {t: tuple(i["shape"]) for t, i in broken["tensors"].items()}
    reducers = [n for n in broken["nodes"] if n["op"] == "reducer"]
    first = reducers[0]
    other = next(n for n in reducers if n["rank"] == first["rank"]
                 and n["inputs"] != first["inputs"]
                 and shape[n["inputs"][3]] == shape[first["inputs"][3]])
    old, new = first["inputs"][3], other["inputs"][3]
    group = [n for n in reducers if n["inputs"] == first["inputs"]]
    assert len(group) == WORLD["dp"]
    for n in group:
        n["inputs"][3] = new
    with pytest.raises(FoldRefused, match="another tensor"):
        fold_plans(single, plan_from_dict(broken, "p"))
    assert old != new
