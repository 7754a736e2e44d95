"""The streamed generator (frontends/stream.py) produces, unit by unit, exactly the plan the
tracer produces, and folding it verifies like folding the traced plan."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

from tvsmt.fold import LoadedPlan, fold_source
from tvsmt.frontends import generate_pair
from tvsmt.frontends.stream import StreamedPlan
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_source

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)


def _records(tensors, nodes, lineage_parts):
    return (Counter((t.id, t.shape) for t in tensors),
            Counter((n.id, n.op, n.pass_, n.rank, n.mb, n.inputs, n.outputs,
                     json.dumps(n.attrs, sort_keys=True, default=str)) for n in nodes),
            Counter((lin, p.slice, p.sum_of, p.scale) for lin, p in lineage_parts))


@pytest.mark.parametrize("world", [dict(dp=3, tp=2, pp=2, mb=4), dict(dp=4, tp=1, pp=2, mb=1),
                                   dict(dp=1, tp=2, pp=1, mb=3)])
def test_streamed_plan_is_the_traced_plan(world):
    _, parallel = generate_pair("llama3", layers=2, **world, **DIMS)
    traced = plan_from_dict(parallel, "p")
    stream = StreamedPlan("llama3", layers=2, **world, **DIMS)
    tensors, nodes, parts = [], [], []
    glob = stream.global_records()
    parts += [(lin, p) for lin, _, p in glob.parts]
    for u in stream.units():
        r = stream.records(u)
        tensors += r.tensors
        nodes += [n for _, n in r.nodes]
        parts += [(lin, p) for lin, _, p in r.parts]
    want = _records(traced.tensors.values(), traced.nodes,
                    [(lin.index, p) for lin in traced.lineages for p in lin.parts])
    got = _records(tensors, nodes, parts)
    for w, g, what in zip(want, got, ("tensors", "nodes", "lineage parts")):
        assert w == g, (what, list((w - g).items())[:3], list((g - w).items())[:3])
    assert stream.header.world == traced.world


def test_streamed_and_loaded_folds_agree():
    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    single, parallel = generate_pair("llama3", **world)
    s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
    loaded = fold_source(LoadedPlan(s, p))
    streamed = fold_source(StreamedPlan("llama3", **world), jobs=2)
    assert loaded.info.checked == streamed.info.checked
    assert {n.id for n in loaded.parallel.nodes} == {n.id for n in streamed.parallel.nodes}
    assert loaded.single.tensors == streamed.single.tensors
    produced: set = set()  # the folded nodes are still in a topological order
    outputs = {o for n in streamed.parallel.nodes for o in n.outputs}
    for n in streamed.parallel.nodes:
        assert all(x is None or x not in outputs or x in produced for x in n.inputs), n.id
        produced.update(n.outputs)


@pytest.mark.parametrize("bug,prefix", [
    ("grad-scale-wrong", "L1.ffn.up:BW.linear@"),
    ("drop-allreduce-keep-dataflow", "L1.attn.out~1:all_reduce@"),
])
def test_streamed_mutation_in_one_unit_is_caught(bug, prefix):
    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    clean = verify_source(StreamedPlan("llama3", **world), Options(jobs=2))
    assert clean.verdict == "equivalent" and clean.fold["exceptions"] == []
    broken = verify_source(StreamedPlan("llama3", **world, mutation=(bug, (3, 2), prefix)),
                           Options(jobs=2))
    assert broken.verdict == "violation"
    assert broken.fold["exceptions"] == ["replica 3 micro-batch 2"]
    in_unit = re.compile(r"@r1[2-5]m2$")  # replica 3 = ranks 12..15, micro-batch 2
    assert any(in_unit.search(t) for f in broken.failures for t in f.parallel_tensors), \
        [f.message for f in broken.failures]


def test_a_streamed_plan_that_cannot_be_folded_is_not_passed():
    """If one streamed unit does not fit folding (here a reducer on replica 3 that misses a
    replica), the plan cannot be verified unfolded either, since it is never held whole: the
    verdict is inconclusive, never equivalent."""

    class Broken(StreamedPlan):
        def table(self, unit):
            tab = super().table(unit)
            if unit == (3, None):
                i = next(i for i in range(len(tab.n_op))
                         if self.intern.values[tab.n_op[i]] == "reducer")
                a = tab.n_in_ptr[i + 1] - 1  # drop the reducer's last input
                tab.n_in = np.delete(tab.n_in, a, axis=0)
                tab.n_in_ptr[i + 1:] -= 1
            return tab

    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    report = verify_source(Broken("llama3", **world), Options(jobs=1))
    assert report.verdict == "inconclusive" and "misses" in report.fold_note
    assert "cannot be verified" in report.failures[0].message
