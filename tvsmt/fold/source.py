"""Where units come from, and the driver that folds them.

A *unit source* gives the single plan, a header of the parallel plan (world, lineages' single
tensors, outputs), the records that belong to no unit, and every unit as a table (for the
check) or as records (for the units the fold keeps). Two sources exist:

* `LoadedPlan`: a plan read from a file, split into units;
* `frontends.stream.StreamedPlan`: the generator's plan produced unit by unit, so that a plan
  of 100M nodes is never held in memory.

`fold_source` checks the units: the first replicas and micro-batches in this process (they
fix each lineage's batch dimension), then the rest, in worker processes when `jobs > 1`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from joblib import Parallel, delayed

from tvsmt.fold.folder import Checker, Folded, Folder, FoldRefused, UnitRecords
from tvsmt.fold.table import Interner, UnitTable, build_table
from tvsmt.fold.units import REPRESENTATIVE, REPRESENTATIVE_REPLICA, Unit, WorldUnits
from tvsmt.plan.model import Plan


class UnitSource(Protocol):
    single: Plan
    header: Plan
    intern: Interner

    def global_records(self) -> UnitRecords: ...
    def units(self) -> list[Unit]: ...  # every unit, the two representatives first
    def table(self, unit: Unit) -> UnitTable: ...
    def records(self, unit: Unit) -> UnitRecords: ...
    def worker_view(self) -> "UnitSource": ...  # what worker processes need (picklable)


def split_units(parallel: Plan, wu: WorldUnits) -> tuple[dict[Unit, UnitRecords], UnitRecords]:
    """Group a loaded plan's records by unit (records of no unit are global). A node belongs
    to the unit of its first output, a lineage part to the unit of its tensors."""
    units: dict[Unit, UnitRecords] = defaultdict(UnitRecords)
    glob = UnitRecords()
    unit_of = wu.unit_of
    for t in parallel.tensors.values():
        u = unit_of(t.id)
        (glob if u is None else units[u]).tensors.append(t)
    for pos, n in enumerate(parallel.nodes):
        out = next((x for x in n.outputs if x is not None), None)
        u = unit_of(out)
        (glob if u is None else units[u]).nodes.append((pos, n))
    for lin in parallel.lineages:
        for pos, p in enumerate(lin.parts):
            us = {unit_of(x) for x in p.sum_of}
            u = us.pop() if len(us) == 1 else None
            (glob if u is None else units[u]).parts.append((lin.index, pos, p))
    return units, glob


def unit_order(units) -> list[Unit]:
    """Representatives first, then instance units, then replica units."""
    return sorted(units, key=lambda u: (u not in (REPRESENTATIVE, REPRESENTATIVE_REPLICA),
                                        u[1] is None, u[0], -1 if u[1] is None else u[1]))


class LoadedPlan:
    """A loaded parallel plan as a unit source."""

    def __init__(self, single: Plan, parallel: Plan):
        self.single, self.header = single, parallel
        self.intern = Interner()
        self._units, self._global = split_units(parallel, WorldUnits.of(parallel.world))
        if REPRESENTATIVE not in self._units:
            raise FoldRefused("no tensor is named like an instance of replica 0, "
                              "micro-batch 0")

    def global_records(self) -> UnitRecords:
        return self._global

    def units(self) -> list[Unit]:
        return unit_order(self._units)

    def table(self, unit: Unit) -> UnitTable:
        r = self._units[unit]
        return build_table(r.tensors, r.nodes, r.parts, self.intern)

    def records(self, unit: Unit) -> UnitRecords:
        return self._units[unit]

    def worker_view(self):
        return None  # tables are built from records here: no parallel checking


def _check_chunk(view, checker: Checker, units: list[Unit]) -> list[tuple]:
    out = []
    for u in units:
        tab = view.table(u)
        ok, piece = checker.compare(u, tab)
        out.append((u, ok, piece, len(tab.t_shape), len(tab.n_op), len(tab.p_lin)))
    return out


def fold_source(source: UnitSource, extra: int = 0, jobs: int = 1) -> Folded:
    """Fold a unit source (raises FoldRefused when the plan does not fit)."""
    _check_foldable(source.header, extra)
    folder = Folder(source.single, source.header, source.intern, extra)
    folder.add_global(source.global_records())
    units = source.units()
    first = [u for u in units if folder.is_default_kept(u)]
    rest = [u for u in units if not folder.is_default_kept(u)]
    for u in first:
        folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
    view = source.worker_view() if jobs > 1 and len(rest) >= 8 * jobs else None
    if view is None:
        for u in rest:
            folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
        return folder.finish(source.records)
    checker = folder.checker
    checker.frozen = True
    size = -(-len(rest) // (4 * jobs))
    chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
    results = Parallel(n_jobs=jobs)(delayed(_check_chunk)(view, checker, c) for c in chunks)
    checker.frozen = False
    for u, ok, piece, *counts in (r for chunk in results for r in chunk):
        if ok:
            folder.accept(u, piece, *counts)
        else:  # an exception, or a unit a frozen checker could not decide: check it here
            folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
    return folder.finish(source.records)


def fold_plans(single: Plan, parallel: Plan, extra: int = 0) -> Folded:
    """Fold a loaded pair (raises FoldRefused when the plan does not fit)."""
    _check_foldable(parallel, extra)  # before splitting the plan into units
    return fold_source(LoadedPlan(single, parallel), extra)


def _check_foldable(parallel: Plan, extra: int) -> None:
    wu = WorldUnits.of(parallel.world)
    if wu.dp <= 2 + extra and wu.mb <= 2 + extra:
        raise FoldRefused("nothing to fold: at most 2 replicas and 2 micro-batches")
