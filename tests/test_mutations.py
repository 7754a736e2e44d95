"""The verifier against the bug zoo: the generated llama3 plan (dp2 tp2 pp2 mb2) verifies as
equivalent, and every injected bug is found and localized (a failure names a mutated node, one
of its outputs, or a tensor computed from them)."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import fixture_pair

from tvsmt.frontends.builder import write_plan
from tvsmt.frontends.generator import generate_pair, write_pair_dicts
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, PlanView, apply

from tvsmt.errors import TvsmtError
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_pair, verify_plans

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)


def _get(f, key, default=None):
    return f.get(key, default) if isinstance(f, dict) else getattr(f, key, default)


def _ids(items):
    return {i["id"] if isinstance(i, dict) else i for i in items or []}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    single, parallel = generate_pair("llama3", layers=2, dp=2, tp=2, pp=2, mb=2, **DIMS)
    folder = tmp_path_factory.mktemp("llama3")
    s_path, p_path = write_pair_dicts(folder, single, parallel)
    return s_path, p_path, parallel, folder


def _downstream(plan: dict, record: dict) -> tuple[set[str], set[str]]:
    """Nodes and tensors reachable from what the mutation changed."""
    nodes, tensors = set(record["nodes"]), set(record["tensors"])
    for n in plan["nodes"]:
        if n["id"] in nodes or any(t in tensors for t in n["inputs"] if t):
            nodes.add(n["id"])
            tensors |= {t for t in n["outputs"] if t}
    return nodes, tensors


def test_generated_llama3_is_equivalent(pair):
    s_path, p_path, _, _ = pair
    report = verify_pair(s_path, p_path, jobs=1)
    assert report.verdict == "equivalent", [_get(f, "message") for f in report.failures][:5]


def test_generated_mlp_is_equivalent(tmp_path):
    single, parallel = generate_pair("mlp", layers=4, dp=2, tp=2, pp=2, mb=2, hidden=8)
    s_path, p_path = write_pair_dicts(tmp_path, single, parallel)
    report = verify_pair(s_path, p_path, jobs=1)
    assert report.verdict == "equivalent", [_get(f, "message") for f in report.failures][:5]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_found_and_localized(name, pair, tmp_path):
    s_path, _, parallel, _ = pair
    try:
        mutated, record = apply(parallel, name, seed=0)
    except NotApplicable:  # e.g. a mixture-of-experts bug in a dense model
        pytest.skip(f"{name} does not fit this plan")
    p_path = write_plan(tmp_path / "parallel.json.gz", mutated)
    try:
        report = verify_pair(s_path, p_path, jobs=1)
    except TvsmtError as e:
        # a plan the verifier refuses outright: only acceptable for a broken graph
        assert MUTATIONS[name].breaks_graph, f"{name}: {e}"
        return
    if MUTATIONS[name].breaks_graph:
        # a refusal (error) or a structural violation naming the dangling tensor
        assert report.verdict in ("error", "violation"), report.verdict
        if report.verdict == "violation":
            assert any(_get(f, "kind") == "structural" for f in report.failures)
    else:
        assert report.verdict == "violation", (name, report.verdict,
                                               [_get(f, "message") for f in report.failures])
    nodes, tensors = _downstream(mutated, record)
    hits = []
    for f in report.failures:
        named_nodes = _ids(_get(f, "parallel_nodes")) | ({_get(f, "node")} - {None})
        named_tensors = set(_get(f, "parallel_tensors") or [])
        if named_nodes & nodes or named_tensors & tensors:
            hits.append(f)
    assert hits, (name, record, [(_get(f, "message"), _get(f, "parallel_tensors"))
                                 for f in report.failures])


def _read_plan(path: str) -> dict:
    with gzip.open(path) as f:
        return json.load(f)


def _mask_tensors(plan: dict) -> set[str]:
    """The causal mask and every tensor computed from it alone (nnScaler's pipeline messages
    of it): found forwards from `create_mask`'s outputs."""
    masks: set[str] = set()
    grew = True
    while grew:
        grew = False
        for n in plan["nodes"]:
            ins = [t for t in n["inputs"] if t]
            if n["op"] == "create_mask" or (ins and all(t in masks for t in ins)):
                new = {t for t in n["outputs"] if t} - masks
                masks |= new
                grew = grew or bool(new)
    return masks


def test_a_rerouted_pipeline_message_of_a_real_plan_is_an_activation_not_the_mask():
    """nnScaler's pipeline messages carry no lineage, and some are chunks of the causal mask,
    which every replica computes alike (`create_mask`, operator fact `shape_only`): drawn at
    random, `pp-wrong-stage` re-routes a message that differs between replicas, so the plan it
    makes is a violation (before this, 4 of these 16 seeds re-routed the mask: equivalent)."""
    single, parallel = map(_read_plan, fixture_pair("llama3-ly2-dp2pp2tp2mb2"))
    masks = _mask_tensors(parallel)
    received = {n["inputs"][0] for n in parallel["nodes"] if n["op"] == "move"}
    assert masks & received, "the fixture's pipeline carries the mask: the test means something"
    records = [apply(parallel, "pp-wrong-stage", seed=seed) for seed in range(16)]
    assert not [r["by"] for _, r in records if r["by"] in masks]
    plan = plan_from_dict(single, "single")
    for broken, record in records[:2]:
        report = verify_plans(plan, plan_from_dict(broken, "broken"), Options(jobs=1))
        assert report.verdict == "violation", record


def test_shape_only_follows_the_mask_through_copies_and_stops_at_plan_inputs():
    def node(i, op, ins, outs):
        return {"id": f"n{i}", "op": op, "inputs": ins, "outputs": outs}

    plan = {"tensors": {}, "nodes": [
        node(0, "create_mask", ["ids", "h"], ["mask"]),
        node(1, "identity", ["mask"], ["mask1"]),
        node(2, "move", ["mask1"], ["mask2"]),
        node(3, "apply_mask", ["h", "mask2"], ["x"]),
        node(4, "add", ["y", "z"], ["z"]),  # a cycle: no plan, but must end
        node(5, "add", ["mask1", "mask2"], ["both"]),
    ]}
    v = PlanView(plan)
    assert [v.shape_only(t) for t in ("mask", "mask1", "mask2", "both")] == [True] * 4
    assert [v.shape_only(t) for t in ("x", "h", "z")] == [False] * 3
