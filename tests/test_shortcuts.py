"""Every shortcut keeps soundness (issue 5): stage templates, obligation dedup, shape
reduction and the term-identity fast path are all active on a generated plan with many
identical layers, replicas and micro-batches, and a bug placed in ONE layer of ONE replica in
ONE micro-batch is still caught at that place."""

from __future__ import annotations

import pytest

from tvsmt.frontends import generate_pair
from tvsmt.frontends.mutations import apply
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_plans

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)
WORLD = dict(layers=4, dp=2, tp=2, pp=2, mb=2)


@pytest.fixture(scope="module")
def pair():
    return generate_pair("llama3", **WORLD, **DIMS)


def _verify(single, parallel):
    return verify_plans(plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel"),
                        Options(jobs=1))


def test_shortcuts_are_active_on_the_correct_plan(pair):
    report = _verify(*pair)
    assert report.verdict == "equivalent"
    assert report.stage_templates < report.stages_total / 3  # layers/replicas share templates
    assert report.obligations_unique < report.obligations_total
    assert report.proven_without_solver > 0


def _last(parallel, op, layer_prefix, pred=lambda n: True):
    """The node of `op` in the given layer on the last rank and the last micro-batch."""
    last_rank = parallel["world"]["ranks"] - 1
    last_mb = parallel["world"]["mb"] - 1
    cands = [n for n in parallel["nodes"] if n["op"] == op and n["rank"] == last_rank
             and n["mb"] == last_mb and n["id"].startswith(layer_prefix) and pred(n)]
    assert cands, (op, layer_prefix)
    return cands[0]["id"]


@pytest.mark.parametrize("bug,op,pred", [
    ("wrong-constant-one-rank", "add", lambda n: bool(n["attrs"].get("consts"))),
    ("drop-allreduce-keep-dataflow", "all_reduce", lambda n: n["pass"] is None),
])
def test_bug_in_one_layer_replica_and_microbatch_is_caught(pair, bug, op, pred):
    single, parallel = pair
    where = _last(parallel, op, "L3.", pred)  # last layer, last replica, last micro-batch
    broken, record = apply(parallel, bug, where=where)
    report = _verify(single, broken)
    assert report.verdict == "violation", record
    changed = set(record["nodes"]) | set(record["tensors"])
    hit = [f for f in report.failures
           if changed & ({n["id"] for n in f.parallel_nodes} | set(f.parallel_tensors))]
    assert hit, [f.message for f in report.failures]


def test_parallel_encoding_gives_the_same_obligations_and_catches_the_bug(pair):
    from tvsmt.verify import PARALLEL_TEMPLATES, Timer, prepare

    single, parallel = pair
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    serial = prepare(s, p, Options(jobs=1), Timer())
    forked = prepare(s, p, Options(jobs=2), Timer())
    assert serial[0].stage_templates >= PARALLEL_TEMPLATES  # the parallel path is taken
    assert list(serial[3]) == list(forked[3])  # same unique obligations, same order
    assert [o.obligation and o.obligation.digest for o in serial[2]] == \
        [o.obligation and o.obligation.digest for o in forked[2]]
    where = _last(parallel, "add", "L2.", lambda n: bool(n["attrs"].get("consts")))
    broken, _ = apply(parallel, "wrong-constant-one-rank", where=where)
    report = verify_plans(s, plan_from_dict(broken, "parallel"), Options(jobs=2))
    assert report.verdict == "violation"
