"""Where units come from, and the driver that folds them.

A *unit source* gives the single plan, a header of the parallel plan (world, lineages' single
tensors, outputs), the records that belong to no unit, and every unit as a table (for the
check) or as records (for the units the fold keeps). Two sources exist:

* `LoadedPlan`: a plan read from a file, split into units node by node; `fold_plans` uses
  `fold.columns.ColumnPlan`, the same split computed over numpy columns (the reference
  `LoadedPlan` is what tests/test_fold_columns.py compares it with, and where a plan the
  columns cannot hold goes);
* `frontends.stream.StreamedPlan`: the generator's plan produced unit by unit, so that a plan
  of 100M nodes is never held in memory.

`fold_source` checks the units: the first replicas and micro-batches in this process (they
fix each lineage's batch dimension), then the rest, in worker processes when `jobs > 1`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import replace
from itertools import chain
from operator import attrgetter
from typing import Protocol

import numpy as np

from tvsmt.errors import InternalError
from tvsmt.fold.folder import (
    SUM_OPS,
    Checker,
    Folded,
    Folder,
    FoldRefused,
    UnitRecords,
    unit_name,
)
from tvsmt.fold.table import Interner, UnitTable, loaded_table
from tvsmt.fold.units import (
    REPRESENTATIVE,
    NoUnits,
    Unit,
    UnitMap,
    WorldUnits,
    assign_units,
    node_units,
    unit_order,
)
from tvsmt.forked import can_fork_workers, cpu_workers, fork_map, worker_count
from tvsmt.heap import collector_paused, plans_frozen
from tvsmt.plan.model import Node, Plan


class UnitSource(Protocol):
    single: Plan
    header: Plan
    intern: Interner

    def global_records(self) -> UnitRecords: ...
    def units(self) -> list[Unit]: ...  # every unit, the two representatives first
    def table(self, unit: Unit) -> UnitTable: ...
    def records(self, unit: Unit) -> UnitRecords: ...
    def worker_view(self) -> "UnitSource": ...  # what worker processes need (picklable)


def flatten_with_units(parallel: Plan, sum_ops: frozenset[str]
                       ) -> tuple[Plan, tuple[list[Unit], dict[str, Unit]] | None]:
    """Chains of two-input sums over units (nnScaler accumulates micro-batch gradients as
    g1 + g2, then (g1 + g2) + g3, ...) rewritten as one sum of all the chain's inputs. Exact
    (addition is associative), and applied only where each intermediate sum is read by the
    next one alone and named by no lineage or output, so nothing else can see the change.
    Sums over units are then one node each, as folding needs (folder.py).

    Also returns `node_units` of the result (None: the plan has no units), computed once: a
    flattened sum reads every unit its chain read, so it stays a sum over units, and no other
    node's unit depends on the dropped ones (only their chain's next sum read them)."""
    wu = WorldUnits.of(parallel.world)
    try:
        node_unit, produced = node_units(parallel, wu, sum_ops)
    except NoUnits:
        return parallel, None
    nodes = parallel.nodes
    spanning = [n.op in sum_ops and u[1] is None for n, u in zip(nodes, node_unit)]
    if not any(spanning):
        return parallel, (node_unit, produced)
    producer = {x: i for i, n in enumerate(nodes) for x in n.outputs}
    producer.pop(None, None)
    readers = Counter(chain.from_iterable(map(attrgetter("inputs"), nodes)))
    named = set(parallel.outputs)
    named.update(chain.from_iterable(p.sum_of for lin in parallel.lineages for p in lin.parts))
    inputs: dict[int, tuple] = {}
    dropped: set[int] = set()
    for i in [i for i, s in enumerate(spanning) if s]:
        n = nodes[i]
        flat: list = []
        changed = False
        for x in n.inputs:
            j = producer.get(x) if x is not None else None
            if (j is not None and spanning[j] and j not in dropped
                    and parallel.nodes[j].op == n.op and parallel.nodes[j].rank == n.rank
                    and len(parallel.nodes[j].outputs) == 1 and readers[x] == 1
                    and x not in named):
                flat += inputs.get(j, parallel.nodes[j].inputs)
                dropped.add(j)
                changed = True
            else:
                flat.append(x)
        if changed:
            inputs[i] = tuple(flat)
    if not dropped:
        return parallel, (node_unit, produced)
    gone = {parallel.nodes[j].outputs[0] for j in dropped}
    nodes = [n if i not in inputs else Node(n.id, n.op, n.pass_, n.rank, n.mb, inputs[i],
                                            n.outputs, n.attrs, n.source)
             for i, n in enumerate(parallel.nodes) if i not in dropped]
    tensors = {t: info for t, info in parallel.tensors.items() if t not in gone}
    kept_units = [u for i, u in enumerate(node_unit) if i not in dropped]
    for x in gone:
        del produced[x]
    return replace(parallel, nodes=nodes, tensors=tensors), (kept_units, produced)


def split_units(parallel: Plan, wu: WorldUnits, sum_ops: frozenset[str], known=None
                ) -> tuple[dict[Unit, UnitRecords], UnitRecords, UnitMap]:
    """Group a loaded plan's records by unit (units.py); records of no unit are global.
    `known`: the plan's `node_units`, when already computed."""
    try:
        umap = assign_units(parallel, wu, sum_ops, known)
    except NoUnits as e:
        raise FoldRefused(str(e)) from None
    units: dict[Unit, UnitRecords] = defaultdict(UnitRecords)
    glob = UnitRecords()
    tu, num = umap.tensor_unit, umap.number
    ids = list(parallel.tensors)
    numbers = np.fromiter(map(num.__getitem__, ids), np.int64, len(ids))
    for u, infos in _grouped(list(map(tu.__getitem__, ids)), list(parallel.tensors.values()),
                             numbers):  # each unit's tensors by local number
        (glob if u is None else units[u]).tensors = infos
    for u, idx in umap.order.items():
        units[u].nodes = list(zip(idx, map(parallel.nodes.__getitem__, idx)))
    parts = [(lin.index, pos, p) for lin in parallel.lineages for pos, p in enumerate(lin.parts)]
    owners = [tu[p.sum_of[0]] if len(p.sum_of) == 1 else _one_unit(p.sum_of, tu)
              for _, _, p in parts]
    for u, group in _grouped(owners, parts):  # each unit's parts in lineage order
        if u is None:
            glob.parts = group
            glob.part_refs = [[umap.locate(x) for x in p.sum_of] for _, _, p in group]
        else:
            units[u].parts = group
    return units, glob, umap


def _one_unit(tensors, tensor_unit: dict) -> Unit | None:
    """The unit of all of `tensors` when they are in one, else None (a global part)."""
    us = set(map(tensor_unit.__getitem__, tensors))
    return us.pop() if len(us) == 1 else None


def _grouped(owners: list, items: list, keys: np.ndarray | None = None) -> list[tuple]:
    """(owner, its items) for each distinct owner: items in `keys` order inside a group (in
    list order when `keys` is None), grouped by one sort instead of a loop of appends."""
    if not items:
        return []
    code = {u: i for i, u in enumerate(dict.fromkeys(owners))}
    codes = np.fromiter(map(code.__getitem__, owners), np.int64, len(owners))
    order = (np.argsort(codes, kind="stable") if keys is None
             else np.lexsort((keys, codes)))
    ordered = list(map(items.__getitem__, order.tolist()))
    sorted_codes = codes[order]
    cuts = [0, *(np.flatnonzero(sorted_codes[1:] != sorted_codes[:-1]) + 1).tolist(),
            len(ordered)]
    who = list(code)
    return [(who[int(sorted_codes[a])], ordered[a:b]) for a, b in zip(cuts, cuts[1:])]


class LoadedPlan:
    """A loaded parallel plan as a unit source."""

    def __init__(self, single: Plan, parallel: Plan):
        parallel, known = flatten_with_units(parallel, SUM_OPS)
        self.single, self.header = single, parallel
        self.intern = Interner()
        self._units, self._global, self._map = split_units(
            parallel, WorldUnits.of(parallel.world), SUM_OPS, known)
        if REPRESENTATIVE not in self._units:
            raise FoldRefused("replica 0 has no node of micro-batch 0")

    def global_records(self) -> UnitRecords:
        return self._global

    def units(self) -> list[Unit]:
        return unit_order(self._units)

    def table(self, unit: Unit) -> UnitTable:
        r = self._units[unit]
        return loaded_table(unit, r.tensors, r.nodes, r.parts, self._map.locate, self.intern)

    def records(self, unit: Unit) -> UnitRecords:
        return self._units[unit]

    def worker_view(self):
        return None  # tables are built from records here: no parallel checking


def _chunk_checker(view, checker: Checker) -> Callable[[list[Unit]], tuple[list[tuple], list]]:
    """The check of one chunk in a forked worker: the source and checker come from the
    parent's memory (copy on write) instead of being pickled once per chunk."""
    return lambda units: _check_chunk(view, checker, units)


def _check_chunk(view, checker: Checker, units: list[Unit]) -> tuple[list[tuple], list]:
    out = []
    start = len(checker.deviations)
    for u in units:
        tab = view.table(u)
        ok, piece = checker.compare(u, tab)
        out.append((u, ok, piece, len(tab.t_shape), len(tab.n_op), len(tab.p_lin)))
    return out, (checker.deviations[start:], np.flatnonzero(checker.nodiff_undecided))


Ahead = Callable[[Folded], None]


def fold_source(source: UnitSource, extra: int = 0, jobs: int = 1,
                ahead: Ahead | None = None) -> Folded:
    """Fold a unit source (raises FoldRefused when the plan does not fit). The source's
    records are frozen for the cyclic collector (tvsmt/heap.py): the fold allocates enough
    to trigger many collections, and a forked worker's collection would write to (so copy)
    every page of them.

    `ahead(folded)`: called with the pair this fold will give if every unit not yet checked
    turns out a copy, as soon as the kept units are checked (`Folder.finish(complete=False)`),
    so that a caller may start encoding it while the other units are checked. A guess, never
    a result: only the pair returned is one (tvsmt/fold_child.py uses the guess only when
    the returned pair is the same, byte for byte)."""
    with plans_frozen():
        return _fold_source(source, extra, jobs, ahead)


def _fold_source(source: UnitSource, extra: int, jobs: int, ahead: Ahead | None) -> Folded:
    _check_foldable(source.header, extra)
    folder = Folder(source.single, source.header, source.intern, extra)
    folder.add_global(source.global_records())
    units = source.units()
    first = [u for u in units if folder.is_default_kept(u)]
    rest = [u for u in units if not folder.is_default_kept(u)]
    for u in first:
        folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
    if ahead is not None and rest:
        try:
            guess = folder.finish(source.records, complete=False)
        except FoldRefused:
            pass  # no guess: the whole check will say why, or refuse it later
        else:
            ahead(guess)
    jobs = cpu_workers(jobs)
    view = source.worker_view() if jobs > 1 and len(rest) >= 8 * jobs else None
    if view is None:
        for u in rest:
            folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
        return _finish_checked(folder, source, units)
    checker = folder.checker
    checker.frozen = True
    size = -(-len(rest) // (4 * jobs))
    chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
    before = list(checker.deviations)
    # the kept units' records are built here while the workers check the others
    results = _check_parallel(view, checker, chunks, jobs, meanwhile=folder.build_records)
    checker.frozen = False
    checker.deviations = before + [x for _, (dev, _) in results for x in dev]
    for _, (_, undecided) in results:
        # lineages a worker saw unmoved before their batch dimension was known: the units
        # re-checked below may not learn one for them (as if checked after the workers')
        checker.nodiff_undecided[undecided] = True
    for u, ok, piece, *counts in (r for chunk, _ in results for r in chunk):
        if ok:
            folder.accept(u, piece, *counts)
        else:  # an exception, or a unit a frozen checker could not decide: check it here
            folder.add_unit(u, source.table(u), lambda u=u: source.records(u))
    return _finish_checked(folder, source, units)


def _finish_checked(folder: Folder, source: UnitSource, units: list[Unit]) -> Folded:
    """The folded pair, once every unit of the source has been compared with its
    representative (here or by a worker): a unit that no check answered for would be
    folded away unseen, so it is a bug in tvsmt, never a pass."""
    unchecked = [u for u in units if u not in folder.seen]
    if unchecked:
        raise InternalError(f"the fold never checked {len(unchecked)} of its {len(units)} "
                            f"units (the first: {unit_name(unchecked[0])})")
    return folder.finish(source.records)


def _check_parallel(view, checker: Checker, chunks: list[list[Unit]], jobs: int,
                    meanwhile=None) -> list:
    """Check chunks of units in worker processes: forked where the platform can fork (the
    workers inherit the source, nothing big is pickled; `meanwhile()` runs here while they
    work), else loky workers that receive the source pickled. Forked workers die with this
    process (lifeline's fork hook) and are terminated when this call ends, however."""
    if not can_fork_workers():
        if meanwhile is not None:
            meanwhile()
        from joblib import Parallel, delayed

        return Parallel(n_jobs=worker_count(jobs, len(chunks)))(
            delayed(_check_chunk)(view, checker, c) for c in chunks)
    return fork_map(_chunk_checker(view, checker), chunks, jobs, meanwhile)


def fold_plans(single: Plan, parallel: Plan, extra: int = 0,
               ahead: Ahead | None = None) -> Folded:
    """Fold a loaded pair (raises FoldRefused when the plan does not fit); `ahead`: see
    `fold_source`."""
    _check_foldable(parallel, extra)  # before splitting the plan into units
    with plans_frozen(), collector_paused():
        return fold_source(loaded_source(single, parallel), extra, ahead=ahead)


def loaded_source(single: Plan, parallel: Plan) -> "UnitSource":
    """A loaded pair as a unit source: split over columns (tvsmt/fold/columns.py), or node by
    node (`LoadedPlan`, the same split) when the plan holds what columns cannot represent."""
    from tvsmt.fold.columns import ColumnPlan, NoColumns

    try:
        return ColumnPlan(single, parallel)
    except NoColumns:
        return LoadedPlan(single, parallel)


def _check_foldable(parallel: Plan, extra: int) -> None:
    if WorldUnits.of(parallel.world).nothing_to_fold(extra):
        raise FoldRefused("nothing to fold: at most 2 replicas and 2 micro-batches")
