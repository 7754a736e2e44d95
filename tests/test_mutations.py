"""The verifier against the bug zoo: the generated llama3 plan (dp2 tp2 pp2 mb2) verifies as
equivalent, and every injected bug is found and localized (a failure names a mutated node, one
of its outputs, or a tensor computed from them)."""

from __future__ import annotations

import pytest

from tvsmt.frontends.builder import write_plan
from tvsmt.frontends.generator import generate_pair, write_pair_dicts
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply

from tvsmt.errors import TvsmtError
from tvsmt.verify import verify_pair

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
