"""Stage signatures and the attribute key they share with the shape-rule checks.

Signatures decide which stages share one obligation, and the shape-rule checks evaluate each
distinct node once: a key that merges too much is a missed bug. So the attribute key is
checked for exactness, signatures are checked to split stages exactly as the plain
tensor-by-tensor numbering does (their per-lineage forms are a shortcut), and the shape
checks must still flag a bad node beside identical good ones."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
from conftest import fixture_pair

from tvsmt.frontends import generate_pair
from tvsmt.graph import Graph
from tvsmt.lineage import check_plan_shapes
from tvsmt.ops import attrs_key
from tvsmt.ops import get as get_op
from tvsmt.plan import plan_from_dict
from tvsmt.stages import cut_stages
from tvsmt.stages.signature import stage_signature, stage_signatures

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)


def test_attribute_keys_are_equal_only_for_equal_values_of_equal_types():
    same = [({"a": 1, "b": [1, {"c": "x"}]}, {"a": 1, "b": [1, {"c": "x"}]}),
            ({}, {}), ({"s": Fraction(1, 2)}, {"s": Fraction(1, 2)})]
    for x, y in same:
        assert attrs_key(x) == attrs_key(y)
    differ = [{"a": 1}, {"a": 1.0}, {"a": True}, {"a": "1"}, {"a": [1]}, {"a": (1,)},
              {"a": None}, {"a": 2}, {"b": 1}, {"a": {"b": [1, {"c": 2}]}},
              {"a": {"b": [1, {"c": 3}]}}, {"s": Fraction(1, 2)}, {"s": 0.5}]
    keys = [attrs_key(x) for x in differ]
    assert len(set(keys)) == len(keys)
    # values whose text is not exact (an object, a non-string key) never share a key
    odd = object()
    for attrs in ({"a": odd}, {1: 2}, {"a": [1, [2, odd]]}):
        assert attrs_key(attrs) != attrs_key(attrs)


def _reference_signature(stage, single, parallel):
    """The signature numbered tensor by tensor, with no per-lineage forms (the definition
    `stage_signatures` must agree with)."""
    local: dict = {}
    shapes: list = []

    def tid(side, t):
        if t is None:
            return None
        if (side, t) not in local:
            local[side, t] = len(local)
            shapes.append((single if side == 0 else parallel).shape(t))
        return local[side, t]

    parts = []
    for role, j in [("target", stage.target)] + [("input", j) for j in stage.inputs]:
        lin = parallel.lineages[j]
        parts.append((role, tid(0, lin.single), tuple(
            (p.slice, tuple(tid(1, t) for t in p.sum_of), p.scale) for p in lin.parts)))
    for side, plan, idxs in ((0, single, stage.single_nodes), (1, parallel, stage.parallel_nodes)):
        for i in idxs:
            n = plan.nodes[i]
            reads = get_op(n.op).semantic_attrs
            parts.append((side, n.op, n.pass_, attrs_key(n.attrs if reads is None else
                                                         reads(n.attrs)),
                          tuple(tid(side, t) for t in n.inputs),
                          tuple(tid(side, t) for t in n.outputs)))
    parts.append(("frontier", tuple(tid(0, t) for t in stage.single_frontier),
                  tuple(tid(1, t) for t in stage.parallel_frontier)))
    parts.append(("shapes", tuple(shapes)))
    return tuple(parts)


def _partition(keys) -> list[int]:
    first: dict = {}
    return [first.setdefault(k, i) for i, k in enumerate(keys)]


def _pairs():
    yield "llama3 generated", [plan_from_dict(x, "x") for x in generate_pair(
        "llama3", layers=2, dp=2, tp=2, pp=2, mb=2, **DIMS)]
    yield "moe generated", [plan_from_dict(x, "x") for x in generate_pair(
        "moe", layers=2, dp=2, tp=2, pp=1, mb=2)]


def _real_pair():
    from tvsmt.plan import load_plan

    s, p = fixture_pair("llama3-ly2-dp2pp2tp2mb2")
    return load_plan(s), load_plan(p)


def test_signatures_split_stages_as_the_tensor_by_tensor_numbering_does():
    pairs = list(_pairs()) + [("real llama3 fixture", _real_pair())]
    slow_path_seen = False
    for name, (single, parallel) in pairs:
        stages = cut_stages(single, parallel, Graph(single), Graph(parallel)).stages
        fast = list(stage_signatures(stages, single, parallel))
        ref = [_reference_signature(st, single, parallel) for st in stages]
        assert _partition(fast) == _partition(ref), name
        assert len(set(fast)) < len(stages), name  # stages do share templates
        # one stage at a time gives the same signatures as all at once
        assert [stage_signature(st, single, parallel) for st in stages] == fast, name
        slow_path_seen |= any(e[2] == "parts" for sig in fast for e in sig
                              if e[0] in ("target", "input"))
    assert slow_path_seen  # the real fixture has lineages that share tensors in a stage


def _bad_output_shape(parallel: dict, victims: list[str]) -> dict:
    """The plan with each victim node's first output declared one element longer (a fresh
    tensor, so that no other node's shapes change)."""
    plan = copy.deepcopy(parallel)
    for nid in victims:
        node = next(n for n in plan["nodes"] if n["id"] == nid)
        old = node["outputs"][0]
        shape = list(plan["tensors"][old]["shape"])
        shape[-1] += 1
        new = f"{old}.bad"
        plan["tensors"][new] = {"shape": shape, "role": plan["tensors"][old].get("role",
                                                                                 "activation")}
        node["outputs"] = [new] + node["outputs"][1:]
        for n in plan["nodes"]:  # readers keep reading a tensor of the old shape
            if n is not node:
                n["inputs"] = [old if t == new else t for t in n["inputs"]]
    return plan


@pytest.fixture(scope="module")
def generated():
    return generate_pair("llama3", layers=2, dp=2, tp=2, pp=2, mb=2, **DIMS)


def _twins(parallel: dict, op: str) -> list[str]:
    """Ids of nodes of `op` that the shape checks see as one (same op, pass, attrs, shapes)."""
    groups: dict = {}
    for n in parallel["nodes"]:
        if n["op"] != op:
            continue
        shapes = tuple(tuple(parallel["tensors"][t]["shape"]) if t else None
                       for t in n["inputs"] + n["outputs"])
        key = (n["pass"], repr(n.get("attrs")), shapes)
        groups.setdefault(key, []).append(n["id"])
    return max(groups.values(), key=len)


def test_a_bad_node_beside_identical_good_ones_is_flagged(generated):
    _, parallel = generated
    twins = _twins(parallel, "add")
    assert len(twins) >= 3
    good = plan_from_dict(parallel, "parallel")
    assert check_plan_shapes(good) == []
    # the last of many identical nodes: the checks must not reuse the first one's verdict
    broken = plan_from_dict(_bad_output_shape(parallel, [twins[-1]]), "parallel")
    flagged = {v.node for v in check_plan_shapes(broken)}
    assert flagged == {twins[-1]}
    # two equally bad nodes: each is flagged by its own id
    both = plan_from_dict(_bad_output_shape(parallel, twins[1:3]), "parallel")
    assert {v.node for v in check_plan_shapes(both)} == set(twins[1:3])

