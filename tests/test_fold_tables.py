"""The loaded plan's unit tables built over columns (table.loaded_table, what LoadedPlan gives
the folder) are exactly `build_table`'s, the node-by-node construction the fold's checks were
written against: on real nnScaler plans (../shared/plans) and on generated ones."""

from __future__ import annotations

import gzip
import json
from dataclasses import fields

import numpy as np
import pytest
from conftest import fixture_pair

from tvsmt.fold.source import LoadedPlan
from tvsmt.fold.table import Interner, build_table, loaded_table
from tvsmt.frontends import generate_pair
from tvsmt.plan import plan_from_dict

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)
MOE = dict(hidden=16, heads=4, ffn=16, vocab=16, seq=4)
# generated pairs whose loaded fold is compared with a reference (here and test_fold_columns)
GENERATED = [
    ("llama3", dict(layers=2, dp=3, tp=2, pp=2, mb=3), DIMS),
    ("llama3", dict(layers=1, dp=4, tp=1, pp=1, mb=1), DIMS),
    ("moe", dict(layers=2, dp=2, tp=2, pp=2, mb=3), MOE),
]


def _same_tables(loaded: LoadedPlan) -> int:
    """Compare every unit's two tables column by column (one interner: the old table is
    built first, so the new one finds every value already numbered); returns the units."""
    intern = Interner()
    units = loaded.units()
    for u in units:
        r = loaded.records(u)
        old = build_table(u, r.tensors, r.nodes, r.parts, loaded._map.locate, intern)
        new = loaded_table(u, r.tensors, r.nodes, r.parts, loaded._map.locate, intern)
        for f in fields(old):
            a, b = getattr(old, f.name), getattr(new, f.name)
            assert a.dtype == b.dtype and a.shape == b.shape, (u, f.name, a.shape, b.shape)
            assert np.array_equal(a, b), (u, f.name)
    return len(units)


@pytest.mark.parametrize("name", ["llama3-ly2-dp2pp2tp2mb2", "moe-ly4-dp2pp2tp2mb2",
                                  "llama3moe-ly2-dp2pp2tp2mb2", "mlp-ly2-dp2pp2tp2mb2"])
def test_loaded_tables_equal_build_table_on_real_plans(name):
    single, parallel = (json.load(gzip.open(p)) for p in fixture_pair(name))
    loaded = LoadedPlan(plan_from_dict(single, "s"), plan_from_dict(parallel, "p"))
    assert _same_tables(loaded) >= 6  # 2 x 2 instance units and 2 replica units


@pytest.mark.parametrize("model,world,dims", GENERATED)
def test_loaded_tables_equal_build_table_on_generated_plans(model, world, dims):
    single, parallel = generate_pair(model, **world, **dims)
    loaded = LoadedPlan(plan_from_dict(single, "s"), plan_from_dict(parallel, "p"))
    assert _same_tables(loaded) == world["dp"] * (world["mb"] + 1)


@pytest.mark.parametrize("name", ["llama3-ly2-dp16pp4tp1mb8"])  # 8 micro-batches: chains
def test_flattened_plans_units_are_computed_afresh(name):
    """flatten_with_units hands split_units the node units of the flattened plan without
    computing them again: they are the ones `node_units` finds on that plan."""
    from tvsmt.fold.folder import SUM_OPS
    from tvsmt.fold.source import flatten_with_units
    from tvsmt.fold.units import WorldUnits, node_units

    _, parallel = (json.load(gzip.open(p)) for p in fixture_pair(name))
    plan = plan_from_dict(parallel, "p")
    flat, known = flatten_with_units(plan, SUM_OPS)
    assert len(flat.nodes) < len(plan.nodes)  # chains of accumulations were flattened
    assert known == node_units(flat, WorldUnits.of(flat.world), SUM_OPS)


def _canonical_reference(tab, unit, wu, sum_ops):
    """canonical_inputs as it was written first: every sum over units one by one through
    group_row (its level from group_level, its deviations)."""
    from tvsmt.fold import table as T

    ins, keep, devs = tab.n_in.copy(), np.ones(len(tab.n_in), dtype=bool), []
    ptr = tab.n_in_ptr
    for i in T.group_rows(tab, unit, sum_ops, wu).tolist():
        a, b = int(ptr[i]), int(ptr[i + 1])
        ins[a], odd = T.group_row(tab.n_in[a:b], unit, wu)
        devs += odd
        keep[a + 1:b] = False
    return ins[keep], np.concatenate([[0], np.cumsum(keep)])[ptr], devs


@pytest.mark.parametrize("weights", ["random", "all zero"])
def test_sums_over_units_are_grouped_by_pattern_exactly(weights, monkeypatch):
    """canonical_inputs judges the sums of a unit by their pattern of units, the rows found
    alike by a hash of it; a row unlike its group's first goes through group_row. With every
    hash equal (all weights zero) every row is in one group: the result is still the
    row-by-row one, for replica units (sums over replicas and over micro-batches side by
    side) and instance units of a streamed plan."""
    from tvsmt.fold import table as T
    from tvsmt.fold.folder import SUM_OPS
    from tvsmt.frontends.stream import StreamedPlan

    # as many replicas as micro-batches: sums over replicas and over micro-batches have one
    # length, so they meet in one group of rows
    src = StreamedPlan("llama3", layers=2, dp=3, tp=2, pp=2, mb=3, **DIMS)
    if weights == "all zero":  # (after the plan is traced: its widening uses the levels)
        monkeypatch.setattr(T, "_WEIGHTS", np.zeros(512, dtype=np.uint64))
    sum_ops = np.array([src.intern(op) for op in sorted(SUM_OPS)], dtype=np.int64)
    seen = 0
    for u in [(0, None), (1, None), (2, None), (1, 2)]:
        tab = src.table(u)
        got_devs: list = []
        got = T.canonical_inputs(tab, u, src.wu, sum_ops, got_devs)
        want = _canonical_reference(tab, u, src.wu, sum_ops)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), u
        assert got_devs == want[2]
        seen += len(got[2])
    assert seen > 20  # sums there were
