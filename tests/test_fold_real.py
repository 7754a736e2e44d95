"""Replica folding on real nnScaler plans (../shared/plans): units are found by structure
(ranks, micro-batches, dataflow), whatever the producer calls its tensors, and folding keeps
soundness there too: a bug placed in a unit that the fold drops is still caught."""

from __future__ import annotations

import gzip
import json
import random
import re
from tvsmt.plan.model import replace  # Node is a msgspec Struct

import numpy as np
import pytest
from conftest import fixture_pair

from tvsmt.fold import FoldRefused, fold_plans
from tvsmt.fold.folder import SUM_OPS, Folder
from tvsmt.fold.source import LoadedPlan
from tvsmt.fold.units import WorldUnits, assign_units
from tvsmt.frontends.mutations import apply
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_plans

SMALL = "llama3-ly2-dp2pp2tp2mb2"  # 8 ranks: 2 replicas x 2 micro-batches
SMALL_MOE = "moe-ly4-dp2pp2tp2mb2"  # 8 ranks, MoE; replica 1 carries nnScaler's `idx` quirk
BIG = "llama3-ly2-dp16pp4tp1mb8"  # 64 ranks: 16 replicas x 8 micro-batches


def _raw(name: str) -> tuple[dict, dict]:
    return tuple(json.load(gzip.open(p)) for p in fixture_pair(name))


@pytest.fixture(scope="module")
def small():
    return _raw(SMALL)


@pytest.fixture(scope="module")
def big():
    return _raw(BIG)


@pytest.fixture(scope="module")
def big_plans(big):
    return plan_from_dict(big[0], "single"), plan_from_dict(big[1], "parallel")


def _opaque(parallel: dict, seed: int = 0) -> dict:
    """The plan with every tensor and node id replaced by a random string."""
    rng = random.Random(seed)
    names: dict[str, str] = {}

    def new(x):
        if x is None:
            return None
        if x not in names:
            names[x] = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
        return names[x]

    out = dict(parallel)
    out["tensors"] = {new(t): info for t, info in parallel["tensors"].items()}
    out["nodes"] = [dict(n, id=new(n["id"]), inputs=[new(x) for x in n["inputs"]],
                         outputs=[new(x) for x in n["outputs"]]) for n in parallel["nodes"]]
    out["outputs"] = [new(x) for x in parallel.get("outputs") or []]
    out["lineages"] = [dict({k: v for k, v in lin.items() if k != "aligned"},
                            parts=[dict(p, sum_of=[new(x) for x in p["sum_of"]])
                                   for p in lin["parts"]])
                       for lin in parallel["lineages"]]
    return out


def _units_checked(single: dict, parallel: dict):
    """Every unit compared with its representative (the 8-rank plan is below the size at
    which verify folds, so the folder is driven directly)."""
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    src = LoadedPlan(s, p)
    folder = Folder(s, src.header, src.intern)
    folder.add_global(src.global_records())
    copies = {u: folder.add_unit(u, src.table(u), lambda u=u: src.records(u))
              for u in src.units()}
    return copies, folder.finish(src.records).info, len(p.nodes)


@pytest.mark.parametrize("name", [SMALL, SMALL_MOE, "llama3moe-ly2-dp2pp2tp2mb2"])
@pytest.mark.parametrize("opaque", [False, True])
def test_every_unit_of_the_real_8_rank_plan_is_a_copy(name, opaque):
    """Also the MoE plans, whose export writes an `idx` on the all-gather half of fused
    adapters of replica 1 only (an all-gather reads no piece index): those units used to be
    taken for exceptions, which kept 224 of the 256 units of the 128-rank MoE plan."""
    single, parallel = _raw(name)
    parallel = _opaque(parallel) if opaque else parallel
    copies, info, nodes = _units_checked(single, parallel)
    assert set(copies) == {(d, m) for d in (0, 1) for m in (0, 1, None)}
    assert all(copies.values()) and info.exceptions == []
    assert info.checked["nodes"] == nodes  # every node belongs to a unit and was compared


def test_units_of_a_real_plan(big_plans):
    """nnScaler's fields: every node has mb >= 0; the accumulation chains and reducers are
    sums over units (replica units); weights are read by one replica's micro-batches; an
    in-flight message (a negative rank in its id) belongs to its sender's unit."""
    _, p = big_plans
    wu = WorldUnits.of(p.world)
    umap = assign_units(p, wu, SUM_OPS)
    per = wu.per_replica
    for n, u in zip(p.nodes, umap.node_unit):
        assert u[0] == n.rank // per
        if n.op == "reducer":
            assert u[1] is None
    sends = [(n, u) for n, u in zip(p.nodes, umap.node_unit)
             if n.op == "move" and n.rank == n.attrs.get("src") != n.attrs.get("dst")]
    assert sends
    for n, u in sends:  # the message in flight is its sender's
        assert u == (n.rank // per, n.mb) and umap.tensor_unit[n.outputs[0]] == u


def test_a_big_real_plan_with_opaque_ids_folds_the_same_and_is_equivalent(big, big_plans):
    single, parallel = big_plans
    plain = fold_plans(single, parallel).info
    assert plain.replicas == 16 and plain.micro_batches == 8 and plain.exceptions == []
    renamed = plan_from_dict(_opaque(big[1], seed=3), "opaque")
    report = verify_plans(single, renamed, Options(jobs=1))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert report.fold == plain.to_json()


def _dropped_node(parallel: dict, op: str, pass_: str) -> str:
    """A node of a unit that folding drops (replica >= 2, micro-batch >= 2)."""
    per = parallel["world"]["pp"] * parallel["world"]["tp"]
    return next(n["id"] for n in reversed(parallel["nodes"])
                if n["op"] == op and n["pass"] == pass_ and n["rank"] // per >= 2
                and n["mb"] >= 2)


@pytest.mark.parametrize("bug,op,pass_", [("grad-scale-wrong", "linear", "bw"),
                                          ("bw-wrong-input", "silu", "bw")])
def test_a_bug_in_a_folded_away_unit_of_a_real_plan_is_caught(big, big_plans, bug, op, pass_):
    where = _dropped_node(big[1], op, pass_)
    node = next(n for n in big[1]["nodes"] if n["id"] == where)
    broken, _ = apply(big[1], bug, where=where)
    report = verify_plans(big_plans[0], plan_from_dict(broken, "broken"), Options(jobs=1))
    assert report.verdict == "violation"
    per = big[1]["world"]["pp"] * big[1]["world"]["tp"]
    unit = f"replica {node['rank'] // per} micro-batch {node['mb']}"
    assert report.fold is not None and unit in report.fold["exceptions"], report.fold_note


def test_a_reducer_of_a_real_plan_missing_a_replica_is_not_folded(big_plans):
    single, parallel = big_plans
    per = parallel.world["pp"] * parallel.world["tp"]
    i = next(i for i, n in enumerate(parallel.nodes)
             if n.op == "reducer" and n.rank // per == 5)
    nodes = list(parallel.nodes)
    nodes[i] = replace(nodes[i], inputs=nodes[i].inputs[:-1])
    # the refusal names the reducer by its id (the check itself knows only its position)
    with pytest.raises(FoldRefused, match=f"^node {re.escape(nodes[i].id)}: .* misses"):
        fold_plans(single, replace(parallel, nodes=nodes))


def test_a_lineage_summing_all_but_one_unit_is_not_folded_and_is_named(big_plans):
    """A gradient's lineage part that sums every replica and micro-batch but one: refused,
    the lineage named by its index and its single tensor (lineages have no id)."""
    single, parallel = big_plans
    lin = next(lin for lin in parallel.lineages if any(len(p.sum_of) > 8 for p in lin.parts))
    j = next(j for j, p in enumerate(lin.parts) if len(p.sum_of) > 8)
    parts = list(lin.parts)
    parts[j] = replace(parts[j], sum_of=parts[j].sum_of[:-1])
    lineages = list(parallel.lineages)
    lineages[lin.index] = replace(lin, parts=tuple(parts))
    with pytest.raises(FoldRefused, match=f"^lineage #{lin.index} of {re.escape(lin.single)}: "
                                          "a sum over .* misses some"):
        fold_plans(single, replace(parallel, lineages=lineages))


def _quirk_gather(parallel: dict) -> dict:
    """An all-gather of replica 1 that carries the export's `idx` (see above)."""
    per = parallel["world"]["pp"] * parallel["world"]["tp"]
    return next(n for n in parallel["nodes"] if n["op"] == "all_gather" and "idx" in n["attrs"]
                and n["rank"] // per == 1 and n["mb"] == 1 and len(set(n["inputs"])) > 1)


def test_a_bug_in_an_all_gather_whose_index_folding_ignores_is_caught():
    """Folding now ignores an all-gather's `idx`; gathering the shards in the wrong order on
    such a node must still make its unit an exception, and the plan a violation."""
    single, parallel = _raw(SMALL_MOE)
    broken = json.loads(json.dumps(parallel))
    node = _quirk_gather(broken)
    ins = node["inputs"]
    ins[0], ins[1] = ins[1], ins[0]  # shards concatenated in the wrong order
    copies, info, _ = _units_checked(single, broken)
    unit = (1, node["mb"])
    assert copies[unit] is False and info.exceptions == [f"replica 1 micro-batch {node['mb']}"]
    assert [u for u, ok in copies.items() if not ok] == [unit]
    report = verify_plans(plan_from_dict(single, "single"), plan_from_dict(broken, "broken"),
                          Options(jobs=1))
    assert report.verdict == "violation", report.failures[:2]
    assert any(f.kind == "counterexample" for f in report.failures)


BIG_MOE = "moe-ly2-dp16pp2tp4mb16"  # 128 ranks: 16 replicas x 16 micro-batches, 327k nodes


@pytest.fixture(scope="module")
def big_moe():
    from tvsmt.plan import load_plan

    single, parallel = fixture_pair(BIG_MOE)
    return load_plan(single), load_plan(parallel)


def _shift_experts_in_a_dropped_unit(parallel):
    """moe-expert-range-shifted (tokens dispatched to the wrong expert rank) placed on a
    forward expert GEMM of a unit the fold drops (replica >= 2, micro-batch >= 2), done on
    the loaded plan (the 327k-node dict would not fit the suite's memory twice)."""
    per = parallel.world["pp"] * parallel.world["tp"]
    i, n = next((i, n) for i, n in enumerate(parallel.nodes)
                if n.op == "nnscaler_moe_gmm" and n.pass_ == "fw" and n.rank // per == 9
                and n.mb == 11)
    a = dict(n.attrs)
    s, e, total = a["local_expert_start"], a["local_expert_end"], a["n_routed_experts"]
    a["local_expert_start"], a["local_expert_end"] = (e % total), (e % total) + (e - s)
    nodes = list(parallel.nodes)
    nodes[i] = replace(n, attrs=a)
    return replace(parallel, nodes=nodes), n


@pytest.mark.slow
def test_the_128_rank_moe_plan_folds_and_a_bug_in_a_dropped_unit_is_kept(big_moe):
    """Every unit of the real MoE plan is a copy (no exception: before the all-gather fix,
    224 were not), and the same plan with a wrong expert range in a unit the fold drops has
    exactly that unit as an exception, kept (with its node) in the folded plan, where it is
    verified (the 8-rank tests above show such a unit's bug is then a violation)."""
    single, parallel = big_moe
    plain = fold_plans(single, parallel).info
    assert (plain.replicas, plain.micro_batches, plain.exceptions) == (16, 16, [])
    assert plain.checked["nodes"] > 300_000 and plain.kept_units == 4
    broken, node = _shift_experts_in_a_dropped_unit(parallel)
    folded = fold_plans(single, broken)
    assert folded.info.exceptions == ["replica 9 micro-batch 11"]
    kept = next(n for n in folded.parallel.nodes if n.id == node.id)
    assert kept.attrs["local_expert_start"] != node.attrs["local_expert_start"]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("TVSMT_SLOW"),
                    reason="about 2 minutes: run with TVSMT_SLOW=1")
def test_a_bug_in_a_dropped_unit_of_the_128_rank_moe_plan_is_a_violation(big_moe):
    single, parallel = big_moe
    broken, node = _shift_experts_in_a_dropped_unit(parallel)
    report = verify_plans(single, broken, Options(jobs=2))
    assert report.verdict == "violation", report.failures[:2]
    assert "replica 9 micro-batch 11" in report.fold["exceptions"]


def test_an_all_gather_reads_no_piece_index_so_folding_may_ignore_it():
    """Why the fold (and the stage templates) may ignore an all-gather's `idx`: its result is
    the same with any idx or none, while its axis and its inputs' order do change it."""
    from tvsmt.ops import NodeCtx, NumericBackend, get

    spec = get("all_gather")
    xs = [np.arange(6.0).reshape(2, 3), np.arange(6.0, 12.0).reshape(2, 3)]
    out = lambda ins, **a: spec.forward(NumericBackend(), ins, dict(a, ranks=[4, 5]),  # noqa: E731
                                        NodeCtx())[0]
    base = out(xs, dim=1)
    for idx in (0, 1):
        assert np.array_equal(out(xs, dim=1, idx=idx), base)
        assert spec.semantic_attrs({"dim": 1, "ranks": [4, 5], "idx": idx}) == \
            spec.semantic_attrs({"dim": 1, "ranks": [12, 13]})
    assert not np.array_equal(out(xs[::-1], dim=1), base)
    assert out(xs, dim=0).shape != base.shape
    assert spec.semantic_attrs({"dim": 0, "ranks": [4, 5]}) != spec.semantic_attrs(
        {"dim": 1, "ranks": [4, 5]})


def test_a_real_plan_read_for_the_fold_folds_as_when_read_whole(big, monkeypatch):
    """The 64-rank plan read as the fold's forked process reads a large document (nodes and
    lineage parts built on demand, the names numbered and the split computed by a forked
    process, the attribute columns computed while waiting for that split): the same folded
    pair as the plan read whole. Its split flattens chains of sums (2016 nodes dropped), so
    the kept nodes are not the first ones."""
    from tvsmt import forked
    from tvsmt.fold_child import _FoldAnswer
    from tvsmt.plan import numbering
    from tvsmt.plan.reader import decode_document

    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 0)
    monkeypatch.setattr(forked, "PARALLEL", True)
    single = plan_from_dict(big[0], "single")
    lazy = decode_document(json.dumps(big[1]).encode(), "parallel", lazy=True)
    assert lazy.columns is not None and lazy.columns.presplit is not None
    whole = plan_from_dict(big[1], "parallel")
    folded, expected = fold_plans(single, lazy), fold_plans(single, whole)
    assert folded.info == expected.info
    assert _FoldAnswer.encode_pair(folded) == _FoldAnswer.encode_pair(expected)
