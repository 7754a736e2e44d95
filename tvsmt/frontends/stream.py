"""The generator's parallel plan, unit by unit, for worlds too large to hold in memory.

A Llama3-405B plan (126 layers, dp=64, pp=16, tp=8, 16 micro-batches) has about 108M nodes:
as JSON, or as Python objects, it does not fit a laptop. `StreamedPlan` produces the same
plan as `generate_pair` one (replica, micro-batch) unit at a time, as the integer tables the
folder checks (tvsmt/fold/table.py), and as records for the units the fold keeps.

How: the tracer runs on the *representative world* (at most 2 replicas and 2 micro-batches,
the rest of the configuration equal, the same rows per micro-batch). Unit (d, m) of the full
world is then unit (0, 0) of that trace with its ranks moved by d*pp*tp, its micro-batch set
to m and its batch rows moved to piece d*mb + m; replica unit (d, None) is unit (0, None)
moved likewise, with its sums over micro-batches (grad_accum) and over replicas (reducer,
loss all_reduce) widened to the full world; the lineage parts that sum every instance are
widened the same way. `tests/test_stream.py` checks, on worlds small enough to trace, that
this is exactly the plan the tracer gives, record for record.

Folding never reads ids, but the records of the units a fold keeps need them: the stream is
the generator, so it names a moved unit's tensors and nodes with the generator's own id
grammar (`_move_id`: the `@r<rank>[>r<rank>][m<mb>]` suffix that frontends/spmd.py writes),
and nowhere else is that grammar read.

A bug can be injected into one unit (`mutation=(bug, unit, node prefix)`): that unit is then
taken from a trace in which the bug was applied to unit (0, 0).
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from tvsmt.fold.folder import SUM_OPS, Checker, FoldRefused, SumRefs, UnitRecords
from tvsmt.fold.source import split_units
from tvsmt.fold.table import (
    GROUP,
    NO_MB,
    OTHER,
    UNIT,
    GroupError,
    Interner,
    UnitTable,
    build_table,
    canonical_inputs,
    group_level,
    trim_slices,
)
from tvsmt.fold.units import NodeRefused, Unit, WorldUnits, unit_order
from tvsmt.frontends.generator import ModelConfig, _world_dict, build_pair, default_batch
from tvsmt.frontends.mutations import apply as apply_mutation
from tvsmt.frontends.spmd import World
from tvsmt.heap import collector_paused
from tvsmt.plan import plan_from_object
from tvsmt.plan.model import LineagePart, Node, Plan, TensorInfo
from tvsmt.plan.model import replace as replace_struct

_SUFFIX = re.compile(r"@r(\d+)(?:>r(\d+))?(?:m(\d+))?")


def _move_id(tid: str | None, shift: int, mb=None, rank=None) -> str | None:
    """A generator id moved to another unit: ranks + shift (or the rank `rank(r)`), the
    micro-batch replaced by `mb(m)` when given (the generator's own naming). Each id is
    parsed once (`_parse`): the kept units all move the representative trace's ids."""
    if tid is None:
        return None
    parsed = _PARSED.get(tid)
    if parsed is None:
        parsed = _parse(tid)
    if parsed is False:
        return tid
    head, r1, r2, m, tail = parsed
    out = f"{head}@r{rank(r1) if rank is not None else r1 + shift}"
    if r2 is not None:
        out += f">r{r2 + shift}"
    if m is not None:
        out += f"m{mb(m) if mb is not None else m}"
    return out + tail


_PARSED: dict = {}


def _spread_id(tid: str, units: list[tuple[int, int | None]], per: int) -> tuple[str, ...]:
    """`tid` (a tensor of replica 0's unit) moved to each unit (d, m) of `units`: its rank
    into replica d, its micro-batch set to m (as `_move_id` with rank and mb given, for
    the thousands of copies a sum over every instance names; parsed once)."""
    parsed = _parse(tid)
    if parsed is False:
        return tuple(tid for _ in units)
    head, r1, r2, m, tail = parsed
    r0 = r1 % per
    second = "" if r2 is None else f">r{r2}"
    if m is None:
        return tuple(f"{head}@r{r0 + d * per}{second}{tail}" for d, _ in units)
    return tuple(f"{head}@r{r0 + d * per}{second}m{mm}{tail}" for d, mm in units)


def _parse(tid: str):
    """(text before the suffix, rank, second rank or None, micro-batch or None, the rest),
    or False when the id has no `@r` suffix."""
    if len(_PARSED) > 4_000_000:
        _PARSED.clear()
    mt = _SUFFIX.search(tid)
    if mt is None:
        parsed = False
    else:
        g2, g3 = mt.group(2), mt.group(3)
        parsed = (tid[:mt.start()], int(mt.group(1)), None if g2 is None else int(g2),
                  None if g3 is None else int(g3), tid[mt.end():])
    _PARSED[tid] = parsed
    return parsed


class StreamedPlan:
    """A unit source (tvsmt.fold.source.UnitSource) for a generated plan of any size."""

    def __init__(self, model: str = "llama3", layers: int = 2, hidden: int = 64,
                 heads: int = 4, ffn: int = 128, vocab: int = 128, seq: int = 8,
                 dp: int = 1, tp: int = 1, pp: int = 1, mb: int = 1, eps: float = 1e-5,
                 mutation: tuple[str, Unit, str] | None = None, ep: int | None = None):
        # the collector paused: tracing, reading and splitting the representative trace
        # allocate millions of acyclic records (the collections re-scanned them again and
        # again; see generator.build_pair)
        with collector_paused():
            self._represent(model, layers, hidden, heads, ffn, vocab, seq, dp, tp, pp, mb,
                            eps, mutation, ep)

    def _represent(self, model, layers, hidden, heads, ffn, vocab, seq, dp, tp, pp, mb, eps,
                   mutation, ep) -> None:
        """The representative trace (replicas and micro-batches 0 and 1) and its tables."""
        self.world = World(dp, tp, pp, mb, ep)
        batch = default_batch(dp, mb)
        rows = batch // (dp * mb)
        cfg = ModelConfig(model, layers, hidden, heads, ffn, vocab, seq, batch, eps)
        rep_world = World(min(dp, 2), tp, pp, min(mb, 2), ep)
        rep_cfg = replace(cfg, batch=rows * rep_world.dp * rep_world.mb)
        name = f"{model}_dp{dp}_tp{tp}_pp{pp}_mb{mb}_ly{layers}"
        single_full, _ = build_pair(cfg, World())  # the single plan is small at any scale
        self.single = plan_from_object(single_full, f"{name}_single")
        rep_single, rep_parallel = build_pair(rep_cfg, rep_world)
        rep = plan_from_object(rep_parallel, f"{name}_parallel")
        world = _world_dict(cfg, self.world)
        self.header = Plan(f"<generated {name}_parallel>", f"{name}_parallel", "parallel",
                           world, {}, [], list(rep.outputs), rep.lineages)
        self.wu = WorldUnits.of(world)
        self.rep_wu = WorldUnits.of(rep.world)
        self.intern = Interner()
        units, glob, umap = split_units(rep, self.rep_wu, SUM_OPS)
        if glob.tensors or glob.nodes:
            raise FoldRefused("the representative trace has records of no unit")
        self._rep = {u: units[u] for u in ((0, 0), (0, None))}
        self._tables = {u: build_table(u, r.tensors, r.nodes, r.parts, umap.locate,
                                       self.intern) for u, r in self._rep.items()}
        self._global = self._widen_global(glob)
        self._learn_batch_dims(units, umap)
        self._levels = _levels(self._tables[(0, None)], self.rep_wu, self.intern)
        self._pick = _part_pick(self._tables[(0, None)], self.rep_wu.mb, self.wu.mb)
        self.mutated_unit = None
        if mutation is not None:
            bug, unit, prefix = mutation
            self.mutated_unit = unit
            where = next((n.id for _, n in units[(0, 0)].nodes if n.id.startswith(prefix)),
                         None)
            if where is None:
                raise ValueError(f"no node of replica 0, micro-batch 0 starts with {prefix!r}")
            broken, self.mutation_record = apply_mutation(rep_parallel, bug, where=where)
            bunits, _, bmap = split_units(plan_from_object(broken, "mutated"), self.rep_wu,
                                          SUM_OPS)
            kind = (0, 0) if unit[1] is not None else (0, None)
            self._mutated = bunits[kind]
            self._mutated_table = build_table(kind, self._mutated.tensors,
                                              self._mutated.nodes, self._mutated.parts,
                                              bmap.locate, self.intern)
        trim_slices([*self._tables.values()] + ([self._mutated_table] if mutation else []))
        del rep, units, rep_parallel, rep_single

    # -- the representative trace

    def _learn_batch_dims(self, units, umap) -> None:
        """Which dimension of each lineage the micro-batch moves, and by how much: from the
        representative trace's units (0, 0) and (0, 1) (or (1, 0))."""
        chk = Checker(self.rep_wu, np.array([], dtype=np.int64), len(self.header.lineages))
        try:
            chk.set_representative((0, 0), self._tables[(0, 0)])
        except NodeRefused as e:
            raise e.naming(units[(0, 0)].nodes) from None
        for other in ((0, 1), (1, 0)):
            if other in units:
                r = units[other]
                try:
                    ok, _ = chk.compare(other, build_table(other, r.tensors, r.nodes, r.parts,
                                                           umap.locate, self.intern))
                except NodeRefused as e:
                    raise e.naming(r.nodes) from None
                if not ok:
                    raise FoldRefused(f"the representative trace's unit {other} is not a copy")
        self._fold_dim, self._piece_len = chk.fold_dim, chk.piece_len

    def _widen_global(self, glob: UnitRecords) -> UnitRecords:
        """Lineage parts that sum every instance (or every replica) over the full world, as
        `SumRefs`: the units' arrays shared by every part of a level, the names made only
        for those the fold keeps (all of them were 11.8 of the 405B plan's 38 s of tracing)."""
        out = UnitRecords()
        wu, rep_wu = self.wu, self.rep_wu
        per = wu.per_replica
        of_level: dict = {}  # level -> (its units, their replicas, their micro-batches)
        for (lin, pos, p), refs in zip(glob.parts, glob.part_refs):
            pairs = [(u[0], -1 if u[1] is None else u[1]) for u, _ in refs]
            if any(u is None for u, _ in refs) or len({k for _, k in refs}) != 1:
                raise FoldRefused(f"{self.header.lineages[lin].label}: the representative "
                                  "trace has a sum over units that is not one copy per unit")
            level = group_level(pairs, rep_wu, -1)
            if level not in (0, 2):
                raise FoldRefused(f"{self.header.lineages[lin].label}: the representative "
                                  f"trace has a sum of level {level} over units")
            k, first = refs[0][1], p.sum_of[0]
            if level not in of_level:
                units = ([(d, None) for d in range(wu.dp)] if level == 0 else
                         [(d, mm) for mm in range(wu.mb) for d in range(wu.dp)])
                of_level[level] = (units, np.array([u[0] for u in units], dtype=np.int64),
                                   np.array([-1 if u[1] is None else u[1] for u in units],
                                            dtype=np.int64))
            units, ds, ms = of_level[level]

            def names(mask, first=first, units=units):
                return _spread_id(first, [units[i] for i in np.flatnonzero(mask).tolist()],
                                  per)
            out.parts.append((lin, pos, replace_struct(p, sum_of=())))
            out.part_refs.append(SumRefs(ds, ms, np.broadcast_to(np.int64(k), ds.shape),
                                         names))
        return out

    # -- the unit source interface

    def global_records(self) -> UnitRecords:
        return self._global

    def units(self) -> list[Unit]:
        wu = self.wu
        return unit_order([(d, m) for d in range(wu.dp) for m in range(wu.mb)]
                          + [(d, None) for d in range(wu.dp)])

    def worker_view(self) -> "StreamedPlan":
        return self

    def __getstate__(self):  # worker processes need the tables only
        state = dict(self.__dict__)
        for heavy in ("single", "header", "intern", "_rep", "_global", "_mutated"):
            state[heavy] = None
        return state

    def _base(self, unit: Unit) -> UnitTable:
        if unit == self.mutated_unit:
            return self._mutated_table
        return self._tables[(0, 0) if unit[1] is not None else (0, None)]

    def table(self, unit: Unit) -> UnitTable:
        d, m = unit
        # an instance unit changes only its ranks, micro-batches and slices: the rest (the
        # references, most of a table) is shared with the representative's, read only
        tab = self._base(unit).copy(None if m is None else _MOVED)
        shift = d * self.wu.per_replica
        tab.n_rank += shift
        tab.n_attr_ranks += shift
        if m is not None:
            tab.n_mb[:] = m
            piece = d * self.wu.mb + m
            rows = np.flatnonzero(self._fold_dim[tab.p_lin] >= 0)
            k = self._fold_dim[tab.p_lin[rows]]
            move = piece * self._piece_len[tab.p_lin[rows]]
            tab.p_slice[rows, 2 * k] += move
            tab.p_slice[rows, 2 * k + 1] += move
            return tab
        return self._widen_replica(tab, d)

    def _levels_of(self, unit: Unit) -> dict[int, int]:
        if unit == self.mutated_unit:
            return _levels(self._mutated_table, self.rep_wu, self.intern)
        return self._levels

    def _widen_replica(self, tab: UnitTable, d: int) -> UnitTable:
        """A replica unit: sums over micro-batches and replicas widened to the full world,
        the last micro-batch of the trace becomes the last one of the world, and parts listed
        once per micro-batch are listed mb times."""
        wu, rep_wu = self.wu, self.rep_wu
        per = wu.per_replica
        last_rep, last = rep_wu.mb - 1, wu.mb - 1
        if last_rep > 0:
            tab.n_mb[tab.n_mb == last_rep] = last
            for refs in (tab.n_in, tab.n_out, tab.p_sum):
                refs[(refs[:, 3] == UNIT) & (refs[:, 2] == last_rep), 2] = last
        levels = self._levels_of((d, None))
        rows = np.fromiter(levels.keys(), np.int64, len(levels))
        lv = np.fromiter(levels.values(), np.int64, len(levels))
        n = len(tab.n_op)
        in_lens, ar_lens = np.diff(tab.n_in_ptr), np.diff(tab.n_attr_ptr)
        group_k = tab.n_in[tab.n_in_ptr[rows], 0]  # the local number every unit gives
        # a group over every replica (levels 0 and 2) lists each replica's rank
        widen = rows[(lv != 1) & (ar_lens[rows] == rep_wu.dp)]
        ranks_first = tab.n_attr_ranks[tab.n_attr_ptr[widen]]
        new_in_lens = in_lens.copy()
        templates = {level: _group_refs(0, level, d, wu) for level in set(lv.tolist())}
        for level, tpl in templates.items():
            new_in_lens[rows[lv == level]] = len(tpl)
        tab.n_in, tab.n_in_ptr = _respliced(tab.n_in, tab.n_in_ptr, new_in_lens, rows, 4)
        for level, tpl in templates.items():
            sel = lv == level
            dest = (tab.n_in_ptr[rows[sel]][:, None] + np.arange(len(tpl))[None, :]).ravel()
            tab.n_in[dest] = np.tile(tpl, (int(sel.sum()), 1))
            tab.n_in[dest, 0] = np.repeat(group_k[sel], len(tpl))
        new_ar_lens = ar_lens.copy()
        new_ar_lens[widen] = wu.dp
        tab.n_attr_ranks, tab.n_attr_ptr = _respliced(tab.n_attr_ranks, tab.n_attr_ptr,
                                                      new_ar_lens, widen, None)
        dest = tab.n_attr_ptr[widen][:, None] + np.arange(wu.dp)[None, :]
        tab.n_attr_ranks[dest] = (ranks_first % per)[:, None] + per * np.arange(wu.dp)
        assert n == len(tab.n_in_ptr) - 1
        return _take_parts(tab, self._pick)

    def records(self, unit: Unit) -> UnitRecords:
        d, m = unit
        tab = self.table(unit)
        base = self._mutated if unit == self.mutated_unit else \
            self._rep[(0, 0) if m is not None else (0, None)]
        wu, per = self.wu, self.wu.per_replica
        shift = d * per
        if m is not None:
            def mb_of(_):
                return m
        else:
            last_rep, last = self.rep_wu.mb - 1, wu.mb - 1

            def mb_of(mm):
                return last if mm == last_rep else mm
        moved: dict = {None: None}  # a tensor id is named by its record, producer, readers

        def move(x):
            y = moved.get(x)
            if y is None and x is not None:
                y = moved[x] = _move_id(x, shift, mb=mb_of)
            return y
        levels = self._levels_of(unit) if m is None else {}

        def attrs_of(i: int, n: Node) -> dict:
            attrs = n.attrs
            if not _MOVED_ATTRS.intersection(attrs):  # nothing to move: shared, read only
                return attrs
            attrs = dict(attrs)
            if "ranks" in attrs:
                if m is None and levels.get(i) in (0, 2):  # a group over every replica
                    attrs["ranks"] = [attrs["ranks"][0] % per + per * dd for dd in range(wu.dp)]
                else:
                    attrs["ranks"] = [r + shift for r in attrs["ranks"]]
            for key in ("src", "dst"):
                if isinstance(attrs.get(key), int):
                    attrs[key] += shift
            if m is not None and "batch_index" in attrs:
                attrs.update(dp=d, mb=m, num_dp=wu.dp, num_mb=wu.mb,
                             batch_index=d * wu.mb + m, num_batches=wu.dp * wu.mb)
            return attrs

        tensors = [TensorInfo(move(t.id), t.shape, t.role) for t in base.tensors]
        nodes = []
        n_mb = tab.n_mb.tolist()
        for i, (pos, n) in enumerate(base.nodes):
            level = levels.get(i)
            if level is None:
                inputs = tuple(map(move, n.inputs))
            else:
                inputs = tuple(_group_ids(n.inputs[0], level, d, wu))
            nodes.append((pos, Node(move(n.id), n.op, n.pass_, n.rank + shift, n_mb[i],
                                    inputs, tuple(map(move, n.outputs)), attrs_of(i, n),
                                    n.source)))
        picked = range(len(base.parts)) if m is not None else self._pick
        parts = []
        for row, j in enumerate(picked):
            lin, pos, p = base.parts[j]
            srow = tab.p_slice[row].tolist()
            slc = tuple((srow[2 * k], srow[2 * k + 1]) for k in range(len(p.slice)))
            parts.append((lin, pos, LineagePart(slc, tuple(move(x) for x in p.sum_of),
                                                p.scale)))
        return UnitRecords(tensors, nodes, parts)


def _respliced(flat: np.ndarray, ptr: np.ndarray, new_lens: np.ndarray, replaced: np.ndarray,
               width: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A CSR column with the segments of the rows `replaced` resized to `new_lens` (left to
    be filled by the caller), the other segments copied unchanged."""
    new_ptr = np.zeros(len(ptr), dtype=np.int64)
    np.cumsum(new_lens, out=new_ptr[1:])
    out = np.empty((int(new_ptr[-1]),) + (() if width is None else (width,)), dtype=flat.dtype)
    lens = np.diff(ptr)
    keep = np.ones(len(lens), dtype=bool)
    keep[replaced] = False
    node_of = np.repeat(np.arange(len(lens)), lens)
    src = np.flatnonzero(keep[node_of])
    out[new_ptr[node_of[src]] + (src - ptr[node_of[src]])] = flat[src]
    return out, new_ptr


def _group_pairs(level: int, d: int, wu: WorldUnits) -> list[tuple[int, int | None]]:
    if level == 1:
        return [(d, mm) for mm in range(wu.mb)]
    if level == 0:
        return [(dd, None) for dd in range(wu.dp)]
    return [(dd, mm) for dd in range(wu.dp) for mm in range(wu.mb)]


def _group_refs(k: int, level: int, d: int, wu: WorldUnits) -> np.ndarray:
    """The references of a sum over every unit of a level, from a table of replica unit d."""
    return np.array([(k, 0 if dd == d else OTHER + dd, NO_MB if mm is None else mm, UNIT)
                     for dd, mm in _group_pairs(level, d, wu)], dtype=np.int64)


def _group_ids(first: str, level: int, d: int, wu: WorldUnits) -> list[str]:
    per = wu.per_replica
    return [_move_id(first, 0, rank=lambda r, dd=dd: r % per + dd * per,
                     mb=None if mm is None else (lambda _, mm=mm: mm))
            for dd, mm in _group_pairs(level, d, wu)]


def _levels(tab: UnitTable, wu: WorldUnits, intern: Interner) -> dict[int, int]:
    """Per node of a replica unit (0, None) of the trace that sums over units: its level (see
    table.group_level)."""
    sum_ops = np.array([intern(op) for op in sorted(SUM_OPS)], dtype=np.int64)
    try:
        ins, ptr, rows = canonical_inputs(tab, (0, None), wu, sum_ops)
    except GroupError as e:
        raise FoldRefused(f"the representative trace: {e.args[1]}") from None
    out = {}
    for i in rows.tolist():
        row = ins[ptr[i]]
        assert row[3] == GROUP
        level = int(row[1])
        if level == 2 and wu.mb > 1:
            raise FoldRefused("the representative trace has a sum over every instance inside "
                              "a replica")
        out[i] = level
    return out


def _part_pick(tab: UnitTable, rep_mb: int, mb: int) -> list[int]:
    """Parts the trace lists once per micro-batch (rep_mb identical copies) are listed mb
    times; parts listed once stay once: the trace's part rows, in the world's order."""
    if rep_mb == mb or not len(tab.p_lin):
        return list(range(len(tab.p_lin)))
    keys: dict = {}
    order = []
    for i in range(len(tab.p_lin)):
        a, b = tab.p_sum_ptr[i], tab.p_sum_ptr[i + 1]
        key = (int(tab.p_lin[i]), int(tab.p_scale[i]), tab.p_slice[i].tobytes(),
               tab.p_sum[a:b].tobytes())
        if key not in keys:
            keys[key] = []
            order.append(key)
        keys[key].append(i)
    pick = []
    for copy in range(mb):
        for key in order:
            rows = keys[key]
            if len(rows) == rep_mb:
                pick.append(rows[min(copy, rep_mb - 1)])
            elif len(rows) == 1:
                if copy == 0:
                    pick.append(rows[0])
            else:
                raise FoldRefused("the representative trace lists a part neither once nor "
                                  "once per micro-batch")
    return pick


_MOVED = ("n_rank", "n_attr_ranks", "n_mb", "p_slice")
_MOVED_ATTRS = frozenset(("ranks", "src", "dst", "batch_index"))  # what records() moves


def _take_parts(tab: UnitTable, pick: list[int]) -> UnitTable:
    if pick == list(range(len(tab.p_lin))):
        return tab
    pick_arr = np.array(pick, dtype=np.int64)
    lens = (tab.p_sum_ptr[1:] - tab.p_sum_ptr[:-1])[pick_arr]
    new_ptr = np.concatenate([[0], np.cumsum(lens)])
    at = np.repeat(tab.p_sum_ptr[pick_arr] - new_ptr[:-1], lens) + np.arange(int(new_ptr[-1]))
    tab.p_sum = tab.p_sum[at]
    tab.p_sum_ptr = new_ptr
    tab.p_lin, tab.p_pos = tab.p_lin[pick_arr], tab.p_pos[pick_arr]
    tab.p_scale, tab.p_slice = tab.p_scale[pick_arr], tab.p_slice[pick_arr]
    return tab


__all__ = ["StreamedPlan"]
