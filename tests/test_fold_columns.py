"""The loaded plan split over columns (tvsmt/fold/columns.py `ColumnPlan`, what fold_plans
uses) is exactly the node-by-node split (`LoadedPlan`): the same units, the same tables
(interned values compared as values), the same records, the same global records; on real
nnScaler plans, generated ones, and plans whose reader columns went stale."""

from __future__ import annotations

import gzip
import json
from dataclasses import fields

import numpy as np
import pytest
from conftest import fixture_pair
from test_fold_tables import DIMS, GENERATED

from tvsmt import forked as forked_policy
from tvsmt.fold.columns import ColumnPlan, columns_of
from tvsmt.fold.folder import FoldRefused
from tvsmt.fold.source import LoadedPlan, loaded_source
from tvsmt.frontends import generate_pair
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.plan.model import replace

INTERNED = ("t_shape", "n_op", "n_pass", "n_attrs", "p_scale")


def _pairs(recs) -> list:
    """Global parts' tensors as (unit, local number) pairs, whatever their form."""
    from tvsmt.fold.folder import SumRefs

    return [r.pairs() if isinstance(r, SumRefs) else r for r in recs.part_refs]


def _same_split(single, parallel) -> int:
    old, new = LoadedPlan(single, parallel), ColumnPlan(single, parallel)
    assert new.units() == old.units()
    for u in old.units():
        a, b = old.table(u), new.table(u)
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if f.name in INTERNED:
                x = [old.intern.values[i] for i in x.tolist()]
                y = [new.intern.values[i] for i in y.tolist()]
                assert x == y, (u, f.name)
                continue
            assert x.dtype == y.dtype and x.shape == y.shape, (u, f.name, x.shape, y.shape)
            assert np.array_equal(x, y), (u, f.name)
        ra, rb = old.records(u), new.records(u)
        assert ra.tensors == rb.tensors, u
        assert [(p, n, n.attrs) for p, n in ra.nodes] == [(p, n, n.attrs) for p, n in rb.nodes]
        assert ra.parts == rb.parts, u
    ga, gb = old.global_records(), new.global_records()
    assert (ga.tensors, ga.nodes, ga.parts, _pairs(ga)) == (gb.tensors, gb.nodes, gb.parts,
                                                            _pairs(gb))
    return len(old.units())


@pytest.mark.parametrize("name", ["llama3-ly2-dp2pp2tp2mb2", "moe-ly4-dp2pp2tp2mb2",
                                  "llama3moe-ly2-dp2pp2tp2mb2", "mlp-ly2-dp2pp2tp2mb2",
                                  "llama3-ly2-dp16pp4tp1mb8", "llama3adpt-ly2-dp64pp2tp2mb1"])
def test_column_split_equals_the_node_by_node_split_on_real_plans(name):
    s, p = (load_plan(x) for x in fixture_pair(name))
    assert p.columns is not None and columns_of(p) is p.columns  # the reader's, still valid
    assert _same_split(s, p) >= 6


@pytest.mark.parametrize("model,world,dims", GENERATED)
def test_column_split_equals_the_node_by_node_split_on_generated_plans(model, world, dims):
    single, parallel = generate_pair(model, **world, **dims)
    s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
    assert p.columns is None  # built by the fold itself
    assert _same_split(s, p) == world["dp"] * (world["mb"] + 1)


def test_stale_reader_columns_are_not_used():
    """A node replaced in place (as the bug-injecting tests do) or a renamed tensor table
    makes the reader's columns stale: the fold numbers the plan afresh."""
    s, p = (load_plan(x) for x in fixture_pair("llama3-ly2-dp16pp4tp1mb8"))
    cols = p.columns
    i = next(k for k, n in enumerate(p.nodes) if n.mb == 3 and n.inputs and n.inputs[0])
    n = p.nodes[i]
    other = next(x for x in p.tensors if x not in n.inputs and p.tensors[x].shape
                 == p.tensors[n.inputs[0]].shape and x != n.inputs[0])
    p.nodes[i] = replace(n, inputs=(other,) + n.inputs[1:])
    fresh = columns_of(p)
    assert fresh is not cols
    k = int(fresh.in_len[:i].sum())
    assert fresh.in_num[k] == fresh.number[other] != cols.in_num[k]
    _same_split(s, p)
    p.tensors = dict(reversed(list(p.tensors.items())))
    assert columns_of(p) is not cols


def test_a_plan_the_columns_cannot_hold_goes_node_by_node():
    """An undeclared tensor (plan_from_dict refuses it; a hand-built plan may hold one) is
    split by `LoadedPlan`."""
    single, parallel = generate_pair("llama3", layers=1, dp=3, tp=1, pp=1, mb=3, **DIMS)
    s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
    gone = next(x for x in p.tensors if any(x in n.inputs for n in p.nodes))
    del p.tensors[gone]
    try:
        src = loaded_source(s, p)
    except FoldRefused:
        return
    assert isinstance(src, LoadedPlan)


def test_a_rank_outside_the_world_is_refused_with_the_node():
    single, parallel = generate_pair("llama3", layers=1, dp=3, tp=1, pp=1, mb=3, **DIMS)
    s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
    p.nodes[5] = replace(p.nodes[5], rank=99)
    for cls in (LoadedPlan, ColumnPlan):
        with pytest.raises(FoldRefused, match=f"node {p.nodes[5].id}: rank 99 outside"):
            cls(s, p)


@pytest.mark.parametrize("bug,op,pass_", [("bw-wrong-input", "silu", "bw")])
def test_a_bug_put_into_a_loaded_real_plan_in_place_is_caught(bug, op, pass_):
    """The reader's columns describe the plan as read; a node replaced in the loaded plan's
    list afterwards (here: a bug in a unit the fold drops) must be seen by the fold, which
    keeps that unit as an exception and finds the violation."""
    from tvsmt.frontends.mutations import apply
    from tvsmt.verify import Options, verify_plans

    single_path, parallel_path = fixture_pair("llama3-ly2-dp16pp4tp1mb8")
    s, p = load_plan(single_path), load_plan(parallel_path)
    raw = json.load(gzip.open(parallel_path))
    per = p.world["pp"] * p.world["tp"]
    i = max(k for k, n in enumerate(p.nodes) if n.op == op and n.pass_ == pass_
            and n.rank // per >= 2 and n.mb >= 2)
    node = p.nodes[i]
    broken, _ = apply(raw, bug, where=node.id)
    new = next(n for n in broken["nodes"] if n["id"] == node.id)
    assert set(broken["tensors"]) == set(raw["tensors"])  # the bug only rewires the node
    p.nodes[i] = replace(node, inputs=tuple(new["inputs"]), attrs=new.get("attrs") or {})
    assert p.nodes[i] != node
    report = verify_plans(s, p, Options(jobs=1))
    assert report.verdict == "violation"
    assert f"replica {node.rank // per} micro-batch {node.mb}" in report.fold["exceptions"]


@pytest.fixture
def forked_reader(monkeypatch):
    """Plans read with their names numbered (and attribute texts coded) in a forked child,
    whatever their size and the load (tvsmt/plan/numbering.py ForkedNumbering)."""
    import os

    from tvsmt.plan import numbering

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(forked_policy, "PARALLEL", True)
    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 0)


@pytest.mark.parametrize("name", ["llama3-ly2-dp2pp2tp2mb2", "moe-ly4-dp2pp2tp2mb2",
                                  "llama3-ly2-dp16pp4tp1mb8"])
def test_the_split_over_the_forked_readers_columns_is_the_node_by_node_split(
        forked_reader, name):
    """With the attribute-text codes of the file (the fold groups nodes by them instead of
    encoding the attributes)."""
    s, p = (load_plan(x) for x in fixture_pair(name))
    assert p.columns.attr_text is not None and len(p.columns.attr_text) == len(p.nodes)
    assert _same_split(s, p) >= 6


@pytest.mark.parametrize("lazy", [False, True])
def test_the_codes_a_forked_read_computes_give_the_node_by_node_split(
        forked_reader, tmp_path, lazy):
    """The codes a forked read computes while it waits for the numbers (reader._fold_codes:
    each node's op and pass, each tensor's shape, each lineage part's lineage, position and
    scale) are the ones the fold would compute itself: the split over them is the node-by-node
    split, on a plan whose lineage parts carry several scales (every real plan's are 1)."""
    single_path, parallel_path = fixture_pair("llama3-ly2-dp2pp2tp2mb2")
    raw = json.load(gzip.open(parallel_path))
    for k, part in enumerate(q for lin in raw["lineages"] for q in lin["parts"]):
        if k % 3:
            part["scale"] = [1 + k % 5, 2 + k % 3]
    path = tmp_path / "parallel.json"
    path.write_text(json.dumps(raw))
    s, p = load_plan(single_path), load_plan(path, lazy=lazy)
    cols = p.columns
    assert all(code is not None for code in (cols.op_code, cols.pass_code, cols.shape_code,
                                             cols.part_lineage, cols.scale_code))
    assert len(set(cols.scales)) >= 8 and len(cols.parts) == len(cols.scale_code)
    assert _same_split(s, p) >= 6


def test_a_changed_attribute_in_a_folded_away_unit_is_seen_through_the_text_codes(
        forked_reader, tmp_path):
    """One node's semantic attribute changed in the file, in a unit the fold drops: its
    text code differs, so its table holds the changed attribute (as the node-by-node split
    says) and the fold keeps the unit as an exception."""
    from tvsmt.fold.source import fold_plans
    from tvsmt.fold.table import semantic_attrs

    single_path, parallel_path = fixture_pair("llama3-ly2-dp16pp4tp1mb8")
    raw = json.load(gzip.open(parallel_path))
    s, p = load_plan(single_path), load_plan(parallel_path)
    per = p.world["pp"] * p.world["tp"]
    i = max(k for k, n in enumerate(p.nodes) if n.rank // per >= 2 and n.mb >= 2
            and any(type(v) is int and type(v) is not bool and k2 in semantic_attrs(n)[0]
                    for k2, v in n.attrs.items()))
    key = next(k2 for k2, v in p.nodes[i].attrs.items()
               if type(v) is int and k2 in semantic_attrs(p.nodes[i])[0])
    raw["nodes"][i]["attrs"][key] += 1
    path = tmp_path / "parallel.json"
    path.write_text(json.dumps(raw))
    changed = load_plan(path)
    assert changed.columns.attr_text is not None
    assert changed.columns.attr_text[i] not in set(p.columns.attr_text.tolist())
    _same_split(s, changed)
    folded = fold_plans(s, changed, 0)
    node = changed.nodes[i]
    assert any(f"replica {node.rank // per} micro-batch {node.mb}" in e
               for e in folded.info.exceptions), folded.info.exceptions


def _split_args(plan) -> tuple:
    """What ColumnPlan gives `split_dataflow` for this plan (the reader's columns)."""
    cols = plan.columns
    return (plan.world, cols.rank, cols.mb, np.asarray(cols.op_code), list(cols.op_names),
            cols.in_len, cols.in_num, cols.out_len, cols.out_num, len(cols.tids),
            cols.number.of_names(list(plan.outputs)), cols.s_num)


@pytest.fixture
def split_calls(monkeypatch):
    """How many times ColumnPlan computed the split itself (not the forked reader's)."""
    from tvsmt.fold import columns

    calls = []
    plain = columns.split_dataflow

    def counted(*args):
        calls.append(1)
        return plain(*args)

    monkeypatch.setattr(columns, "split_dataflow", counted)
    return calls


@pytest.mark.parametrize("name", ["llama3-ly2-dp16pp4tp1mb8", "moe-ly4-dp2pp2tp2mb2"])
def test_the_split_a_forked_read_computes_is_the_one_computed_here(
        forked_reader, split_calls, name):
    """A plan read for the fold (lazy): the forked numbering also computes the fold's split,
    from its numbers and the inputs this process gives it. It is the split computed here,
    array by array, and the fold uses it (the node-by-node split again)."""
    from tvsmt.fold.split import inputs_digest, split_dataflow

    single_path, parallel_path = fixture_pair(name)
    s, p = load_plan(single_path), load_plan(parallel_path, lazy=True)
    got = p.columns.presplit()
    assert got is not None  # the child computed it
    want = split_dataflow(*_split_args(p))
    split_calls.clear()
    assert got.digest == inputs_digest(*_split_args(p))
    for f in fields(want):
        x, y = getattr(want, f.name), getattr(got, f.name)
        if f.name == "digest":
            continue
        if isinstance(x, dict):
            assert sorted(x) == sorted(y), f.name
            assert all(np.array_equal(x[k], y[k]) for k in x), f.name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and (x.dtype == bool) == (y.dtype == bool), f.name
        else:
            assert x == y, f.name
    assert _same_split(s, p) >= 6
    assert split_calls == []  # ColumnPlan took the child's


def test_a_forked_split_of_other_inputs_is_not_used(forked_reader, split_calls, monkeypatch):
    """The child computes its split from the inputs it is given; one computed from others
    (here two nodes of different replicas given each other's ranks) has another digest: the
    fold computes the split itself, and it is the node-by-node split."""
    from tvsmt.plan import numbering

    give = numbering.ForkedNumbering.give_split_inputs

    def swapped(self, world, rank, mb, *rest):
        rank = rank.copy()
        a, b = int(np.argmin(rank)), int(np.argmax(rank))
        rank[a], rank[b] = rank[b], rank[a]
        return give(self, world, rank, mb, *rest)

    monkeypatch.setattr(numbering.ForkedNumbering, "give_split_inputs", swapped)
    single_path, parallel_path = fixture_pair("llama3-ly2-dp16pp4tp1mb8")
    s, p = load_plan(single_path), load_plan(parallel_path, lazy=True)
    assert p.columns.presplit() is not None  # computed, from the swapped ranks
    assert _same_split(s, p) >= 6
    assert split_calls == [1]


def test_a_forked_read_whose_split_fails_folds_all_the_same(forked_reader, split_calls,
                                                            monkeypatch):
    """The child's split raises (or the child dies): no split comes back, the fold computes
    it here."""
    from tvsmt.fold import split

    def fails(*args):
        raise MemoryError

    monkeypatch.setattr(split, "split_dataflow", fails)  # what the child imports
    single_path, parallel_path = fixture_pair("llama3-ly2-dp16pp4tp1mb8")
    s, p = load_plan(single_path), load_plan(parallel_path, lazy=True)
    assert p.columns.presplit() is None
    assert _same_split(s, p) >= 6
    assert split_calls == [1]


def test_first_seen_is_the_distinct_values_in_order_of_first_occurrence():
    from tvsmt.fold.split import _first_seen

    rng = np.random.default_rng(3)
    for n, k in ((0, 1), (1, 1), (7, 2), (1000, 30), (5000, 6000)):
        v = rng.integers(0, k, n)
        want = list(dict.fromkeys(v.tolist()))
        assert _first_seen(v).tolist() == want


def test_cumcount_counts_earlier_elements_of_the_same_group_sorted_or_not():
    """`_cumcount`: for each element, how many earlier elements have its group, in whatever
    order the groups come."""
    from tvsmt.fold.split import _cumcount

    rng = np.random.default_rng(7)
    for n, k in ((0, 1), (1, 1), (9, 3), (2000, 40), (3000, 70000)):
        groups = rng.integers(-1, k, n)
        for g in (groups, np.sort(groups), np.sort(groups)[::-1].copy()):
            count: dict = {}
            want = []
            for x in g.tolist():
                want.append(count.get(x, 0))
                count[x] = want[-1] + 1
            assert _cumcount(g).tolist() == want


def test_first_index_codes_and_stable_order_are_numpys():
    from tvsmt.fold.columns import _first_index_codes
    from tvsmt.fold.split import stable_order as _stable_order

    rng = np.random.default_rng(5)
    for n in (0, 1, 9, 3000):
        vals = rng.integers(0, 7, n)
        first = np.array([list(vals).index(v) for v in vals], dtype=np.int64)
        for col in (first, vals, first[::-1].copy(), first + 1):  # the form, and not
            want_f, want_i = np.unique(col, return_inverse=True)
            got_f, got_i = _first_index_codes(col)
            assert np.array_equal(got_f, want_f) and np.array_equal(got_i, want_i.reshape(-1))
        for keys in (vals - 3, rng.integers(-5, 1 << 20, n)):
            assert np.array_equal(_stable_order(keys), np.argsort(keys, kind="stable"))


def test_swapped_slices_in_a_folded_away_unit_are_caught(tmp_path):
    """Each part's slice reaches a unit's table through the distinct slices' rows
    (ColumnPlan's `_slice_rows`): two parts of units the fold would drop, with their slices
    swapped, are seen by the fold (the unit holds another piece of the batch than its
    other lineages say, so the fold is refused, naming it) and the plan, verified whole, is
    a violation."""
    from tvsmt.verify import Options, verify_pair

    single_path, parallel_path = fixture_pair("llama3-ly2-dp16pp4tp1mb8")
    raw = json.load(gzip.open(parallel_path))
    per = raw["world"]["pp"] * raw["world"]["tp"]
    writer = {t: n for n in raw["nodes"] for t in n["outputs"] if t is not None}

    def unit(part):
        n = writer.get(part["sum_of"][0])
        return None if n is None else (n["rank"] // per, n["mb"])

    lin, a, b = next((lin, a, b) for lin in raw["lineages"]
                     for a, b in zip(lin["parts"], lin["parts"][1:])
                     if len(a["sum_of"]) == 1 and len(b["sum_of"]) == 1
                     and unit(a) and unit(b) and unit(a)[0] == unit(b)[0] >= 2
                     and unit(a)[1] >= 2 and unit(b)[1] >= 2 and a["slice"] != b["slice"])
    a["slice"], b["slice"] = b["slice"], a["slice"]
    broken = tmp_path / "parallel.json.gz"
    with gzip.open(broken, "wt") as f:
        json.dump(raw, f)
    report = verify_pair(single_path, str(broken), Options(jobs=1))
    assert report.verdict == "violation"
    assert report.fold is None
    assert f"unit {unit(a)}" in report.fold_note or f"unit {unit(b)}" in report.fold_note, \
        report.fold_note
