"""Replica folding: verify a few replicas and micro-batches, after checking the rest are copies.

A plan with dp replicas and mb micro-batches repeats one unit of work dp*mb times (units.py).
Verifying every copy costs time and memory linear in dp*mb, with nothing new to learn after
the first few. The folder

1. checks every unit against the representative unit (0, 0) (or (0, None) for replica
   units): after renaming (units.Renaming), the unit's tensors (id, shape), nodes (id, op,
   pass, rank, micro-batch, inputs, outputs, semantic attributes) and lineage parts (sum_of,
   scale, slice) must be exactly the representative's, except that a part's slice may be
   translated along one dimension: the unit's *piece* of the batch. Every unit must hold the
   same piece index in every lineage, and the units' pieces must tile the batch;
2. keeps the units of the first `2 + extra` replicas and micro-batches, and every unit that is
   not a copy (an *exception*, together with the rest of its replica), and drops the others;
3. restricts every sum that spans units (grad_accum over micro-batches, reducer and loss
   all_reduce over replicas, lineage parts summing every instance) to the kept units. Such a
   sum must take exactly one copy of the same tensor from every unit of its level, else
   nothing is folded;
4. shrinks the single plan's batch accordingly (rebatch.py): the kept pieces are packed.

Why this is sound. The operators are SIMD-like along the batch, which shape reduction already
relies on: a dropped unit computes, on its own rows, exactly what its representative computes
on its rows, so every claim about it is a translated copy of a claim that is proven. For the
sums over units, a proof for all inputs of `sum_k f_k(x_k) == sum_k g(x_k)` over the kept units
gives `f_k = g + c_k` with constants c_k summing to zero. All uniform units share one f, so
when there are no exceptions the kept count times c is zero and c = 0. When there are
exceptions, the verifier proves a second fold with one more uniform replica and micro-batch
kept (`extra=1`): two different counts of the uniform class make c = 0, and the exceptions'
constants then sum to zero too. So a proof of the fold (both folds when there are
exceptions) is a proof of the whole plan. Everything that does not fit this pattern (a
partial sum over units, an unrecognised id, a reference from a kept unit into a dropped one,
an inconsistent piece) makes the folder refuse, and the plan is verified unfolded.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable

from tvsmt.fold.rebatch import rebatch_single
from tvsmt.fold.units import (REPRESENTATIVE, REPRESENTATIVE_REPLICA, Renaming, Unit,
                              WorldUnits)
from tvsmt.ops import get as get_op
from tvsmt.plan.model import Lineage, LineagePart, Node, Plan, TensorInfo

SUM_OPS = frozenset({"grad_accum", "reducer", "all_reduce"})


class FoldRefused(Exception):
    """The plan does not have the structure folding needs; verify it unfolded."""


@dataclass
class UnitRecords:
    """Everything one unit owns, with the positions needed to rebuild a plan."""

    tensors: list[TensorInfo] = field(default_factory=list)
    nodes: list[tuple[int, Node]] = field(default_factory=list)  # (position in plan, node)
    parts: list[tuple[int, int, LineagePart]] = field(default_factory=list)  # (lineage, pos, part)


@dataclass
class FoldInfo:
    replicas: int
    micro_batches: int
    kept_replicas: list[int]
    kept_units: int  # instance units kept
    exceptions: list[str]  # units that are not copies of the representative
    checked: dict[str, int]  # records compared with the representative
    batch_factor: str  # new batch / old batch
    extra: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Folded:
    single: Plan
    parallel: Plan
    info: FoldInfo


# ----------------------------------------------------------------------------- canonical forms


def _attrs_key(node: Node, ren: Renaming) -> str:
    reads = get_op(node.op).semantic_attrs
    attrs = node.attrs if reads is None else reads(node.attrs)
    if not attrs:
        return ""
    if isinstance(attrs, dict) and any(k in attrs for k in ("ranks", "src", "dst")):
        attrs = dict(attrs)
        if isinstance(attrs.get("ranks"), list):
            attrs["ranks"] = [ren.rank(r) if isinstance(r, int) else r for r in attrs["ranks"]]
        for k in ("src", "dst"):
            if isinstance(attrs.get(k), int):
                attrs[k] = ren.rank(attrs[k])
    return json.dumps(attrs, sort_keys=True, default=str)


class Canon:
    """Canonical forms of records, relative to the representative unit."""

    def __init__(self, wu: WorldUnits):
        self.wu = wu
        self._ren: dict[Unit, Renaming] = {}

    def renaming(self, unit: Unit) -> Renaming:
        ren = self._ren.get(unit)
        if ren is None:
            ren = self._ren[unit] = Renaming(unit, self.wu.per_replica)
        return ren

    def group(self, ids: Iterable[str | None], where: str) -> tuple | None:
        """A sum over units: ("group", level, representative id), or None when the ids all
        belong to one unit. A sum that does not take one copy from every unit of a level
        cannot be folded."""
        ids = list(ids)
        units = [self.wu.unit_of(x) for x in ids]
        if len(set(units)) <= 1:
            return None
        if None in units or len(set(units)) != len(units):
            raise FoldRefused(f"{where}: a sum over {len(ids)} tensors that are not one per "
                              "replica or micro-batch")
        reps = {self.renaming(u).id(x) for u, x in zip(units, ids)}
        ds = {u[0] for u in units}
        ms = {u[1] for u in units}
        wu = self.wu
        if ms == {None} and ds == set(range(wu.dp)):
            level = "d"
        elif None not in ms and len(ds) == 1 and ms == set(range(wu.mb)):
            level = "m"
        elif None not in ms and len(units) == wu.dp * wu.mb:
            level = "dm"
        else:
            raise FoldRefused(f"{where}: a sum over {len(ids)} replicas/micro-batches that "
                              "misses some of them")
        if len(reps) != 1:
            raise FoldRefused(f"{where}: a sum over units that do not contribute the same "
                              "tensor")
        return ("group", level, reps.pop())

    def node(self, n: Node, ren: Renaming) -> tuple:
        ins = self.group(n.inputs, f"node {n.id}") if n.op in SUM_OPS else None
        if ins is None:
            ins = tuple(ren.id(x) for x in n.inputs)
        return ("n", ren.id(n.id), n.op, n.pass_, ren.rank(n.rank), ren.mb(n.mb), ins,
                tuple(ren.id(x) for x in n.outputs), _attrs_key(n, ren))

    def part_key(self, lin: int, p: LineagePart, ren: Renaming) -> tuple:
        ids = self.group(p.sum_of, f"lineage #{lin}")
        if ids is None:
            ids = tuple(ren.id(x) for x in p.sum_of)
        return ("p", lin, ids, p.scale)


# ----------------------------------------------------------------------------- the folder


class Folder:
    """Feed units (representative first), then `finish()` builds the folded pair.

    `add_unit` returns whether the unit is a copy of its representative. The records of units
    that are kept (first replicas and micro-batches, exceptions) are retained; the others are
    only compared and counted, so a caller may stream them (frontends/stream.py)."""

    def __init__(self, single: Plan, parallel_header: Plan, extra: int = 0):
        self.single = single
        self.header = parallel_header  # world, name, path, lineage singles (records unused)
        self.wu = WorldUnits.of(parallel_header.world)
        self.canon = Canon(self.wu)
        self.extra = extra
        self.kept_d = set(range(min(self.wu.dp, 2 + extra)))
        self.kept_m = set(range(min(self.wu.mb, 2 + extra)))
        self.rep_keys: dict[Unit, Counter] = {}
        self.rep_parts: dict[Unit, dict[tuple, tuple]] = {}  # part key -> slice
        self.fold_dim: dict[int, int] = {}  # lineage -> dimension of the batch pieces
        self.piece_len: dict[int, int] = {}
        self.nodiff_undecided: set[int] = set()
        self.piece: dict[Unit, int] = {}
        self.records: dict[Unit, UnitRecords] = {}  # retained units
        self.global_records = UnitRecords()
        self.exceptions: list[Unit] = []
        self.seen: set[Unit] = set()
        self.checked = Counter()

    # -- units

    def is_default_kept(self, unit: Unit) -> bool:
        d, m = unit
        return d in self.kept_d and (m is None or m in self.kept_m)

    def add_global(self, recs: UnitRecords) -> None:
        g = self.global_records
        g.tensors += recs.tensors
        g.nodes += recs.nodes
        g.parts += recs.parts
        for _, n in recs.nodes:  # validate the sums now (raises FoldRefused)
            if n.op in SUM_OPS:
                self.canon.group(n.inputs, f"node {n.id}")
        for lin, _, p in recs.parts:
            self.canon.group(p.sum_of, f"lineage #{lin}")

    def add_unit(self, unit: Unit, recs: UnitRecords) -> bool:
        rep = REPRESENTATIVE if unit[1] is not None else REPRESENTATIVE_REPLICA
        ren = self.canon.renaming(unit)
        self.seen.add(unit)
        keys, parts = self.keys_of(recs, ren)
        self.checked.update(tensors=len(recs.tensors), nodes=len(recs.nodes),
                            parts=len(recs.parts))
        if unit == rep:
            self.rep_keys[unit], self.rep_parts[unit] = keys, parts
            ok = True
        else:
            if rep not in self.rep_keys:
                raise FoldRefused(f"unit {unit} arrived before its representative {rep}")
            ok = self._same_parts(unit, parts, self.rep_parts[rep])
            ok = keys == self.rep_keys[rep] and ok
        if not ok:
            self._exception_piece(unit, parts)
            self.exceptions.append(unit)
        if not ok or self.is_default_kept(unit):
            self.records[unit] = recs
        return ok

    def keys_of(self, recs: UnitRecords, ren: Renaming) -> tuple[Counter, dict]:
        keys: Counter = Counter()
        for t in recs.tensors:
            keys[("t", ren.id(t.id), t.shape)] += 1
        for _, n in recs.nodes:
            keys[self.canon.node(n, ren)] += 1
        parts: dict[tuple, tuple] = {}
        for lin, _, p in recs.parts:
            key = self.canon.part_key(lin, p, ren)
            keys[key] += 1
            if parts.setdefault(key, p.slice) != p.slice:
                parts[key] = None  # duplicates must be identical
        return keys, parts

    def _same_parts(self, unit: Unit, parts: dict, rep_parts: dict) -> bool:
        """Slices equal the representative's up to a translation along the lineage's batch
        dimension; record the unit's piece."""
        pieces = set()
        for key, slc in parts.items():
            ref = rep_parts.get(key)
            if slc is None or ref is None:
                return False
            lin = key[1]
            diff = [k for k, (a, b) in enumerate(zip(slc, ref)) if a != b]
            if len(diff) > 1:
                return False
            if not diff:
                if lin in self.fold_dim:
                    k = self.fold_dim[lin]
                    pieces.add(ref[k][0] // self.piece_len[lin])
                else:
                    self.nodiff_undecided.add(lin)
                continue
            k = diff[0]
            length = slc[k][1] - slc[k][0]
            if length != ref[k][1] - ref[k][0] or length <= 0 or unit[1] is None:
                return False
            if self.fold_dim.setdefault(lin, k) != k:
                return False
            if lin in self.nodiff_undecided:
                raise FoldRefused(f"lineage #{lin}: some units hold the representative's "
                                  "piece of the batch, others another one")
            self.piece_len[lin] = length
            if slc[k][0] % length or ref[k][0] % length:
                return False
            pieces.add(slc[k][0] // length)
        if len(pieces) > 1:
            raise FoldRefused(f"unit {unit} holds different pieces of the batch in different "
                              "lineages")
        if pieces:
            self.piece[unit] = pieces.pop()
        return True

    def _exception_piece(self, unit: Unit, parts: dict) -> None:
        """An exception keeps its own slices; it still needs one piece of the batch."""
        pieces = {slc[self.fold_dim[key[1]]][0] // self.piece_len[key[1]]
                  for key, slc in parts.items() if key[1] in self.fold_dim and slc is not None}
        if len(pieces) > 1:
            raise FoldRefused(f"unit {unit} holds different pieces of the batch in different "
                              "lineages")
        if pieces:
            self.piece.setdefault(unit, pieces.pop())

    # -- the folded pair

    def kept_units(self) -> tuple[set[int], set[Unit]]:
        replicas = set(self.kept_d) | {u[0] for u in self.exceptions}
        units = {(d, m) for d in replicas for m in self.kept_m}
        units |= {(d, None) for d in replicas}
        units |= set(self.exceptions)
        return replicas, units

    def finish(self, fetch: Callable[[Unit], UnitRecords] | None = None) -> Folded:
        """Build the folded pair. Units kept only because their replica holds an exception
        were compared and dropped earlier; `fetch` gives their records again."""
        wu = self.wu
        replicas, kept = self.kept_units()
        for u in sorted((u for u in kept if u not in self.records and u in self.seen),
                        key=str):
            if fetch is None:
                raise FoldRefused(f"unit {u} was not retained")
            self.records[u] = fetch(u)
        kept = {u for u in kept if u in self.records}
        instance_kept = sorted(u for u in kept if u[1] is not None)
        pieces = self._pieces(instance_kept)
        kept_tensors: dict[str, TensorInfo] = {}
        for recs in [self.global_records] + [self.records[u] for u in kept]:
            for t in recs.tensors:
                kept_tensors[t.id] = t

        def keep_sum(ids, where):
            group = self.canon.group(ids, where)
            if group is None:
                return tuple(ids)
            return tuple(x for x in ids if wu.unit_of(x) in kept)

        nodes: list[tuple[int, Node]] = []
        parts: dict[int, list[tuple[int, LineagePart]]] = defaultdict(list)
        for recs in [self.global_records] + [self.records[u] for u in kept]:
            for pos, n in recs.nodes:
                if n.op in SUM_OPS:
                    n = _replace_inputs(n, keep_sum(n.inputs, f"node {n.id}"))
                for x in n.inputs:
                    if x is not None and x not in kept_tensors:
                        raise FoldRefused(f"node {n.id} of a kept unit reads {x}, which "
                                          "belongs to a folded-away unit")
                nodes.append((pos, n))
            for lin, pos, p in recs.parts:
                sum_of = keep_sum(p.sum_of, f"lineage #{lin}")
                if not sum_of:
                    continue
                for x in sum_of:
                    if x not in kept_tensors:
                        raise FoldRefused(f"lineage #{lin} names {x}, which belongs to a "
                                          "folded-away unit")
                parts[lin].append((pos, LineagePart(p.slice, sum_of, p.scale)))
        nodes.sort(key=lambda e: e[0])
        factor = Fraction(len(instance_kept), wu.dp * wu.mb)
        single, new_slices = rebatch_single(self.single, self.header, self.fold_dim,
                                            self.piece_len, pieces, wu.dp * wu.mb)
        lineages = []
        for lin in self.header.lineages:
            lp = sorted(parts.get(lin.index, ()), key=lambda e: e[0])
            if not lp:
                raise FoldRefused(f"lineage #{lin.index} names only folded-away units")
            lineages.append(Lineage(lin.index, lin.single,
                                    tuple(new_slices(lin.index, p) for _, p in lp)))
        parallel = Plan(self.header.path, self.header.name, self.header.kind,
                        self.header.world, kept_tensors, [n for _, n in nodes],
                        list(self.header.outputs), lineages)
        info = FoldInfo(wu.dp, wu.mb, sorted(replicas), len(instance_kept),
                        [_unit_name(u) for u in self.exceptions], dict(self.checked),
                        str(factor), self.extra)
        return Folded(single, parallel, info)

    def _pieces(self, instance_kept: list[Unit]) -> dict[int, int]:
        """Old piece index -> new (packed) index, after checking that pieces tile the batch."""
        wu = self.wu
        if not self.fold_dim:
            raise FoldRefused("no lineage slices the batch by replica and micro-batch")
        self.piece.setdefault(REPRESENTATIVE, self._rep_piece())
        allp = [self.piece.get(u) for u in wu.instance_units()]
        if None in allp or sorted(allp) != list(range(wu.dp * wu.mb)):
            raise FoldRefused("the replicas' and micro-batches' pieces of the batch do not "
                              "tile it")
        old = sorted(self.piece[u] for u in instance_kept)
        return {p: i for i, p in enumerate(old)}

    def _rep_piece(self) -> int:
        seen = {slc[self.fold_dim[key[1]]][0] // self.piece_len[key[1]]
                for key, slc in self.rep_parts[REPRESENTATIVE].items()
                if key[1] in self.fold_dim and slc is not None}
        if len(seen) != 1:
            raise FoldRefused("the representative unit holds several pieces of the batch")
        return seen.pop()


def _replace_inputs(n: Node, inputs: tuple) -> Node:
    return Node(n.id, n.op, n.pass_, n.rank, n.mb, inputs, n.outputs, n.attrs)


def _unit_name(u: Unit) -> str:
    return f"replica {u[0]}" + ("" if u[1] is None else f" micro-batch {u[1]}")


# ----------------------------------------------------------------------------- materialized plans


def split_units(parallel: Plan, wu: WorldUnits) -> tuple[dict[Unit, UnitRecords], UnitRecords]:
    """Group a loaded plan's records by unit (records of no unit are global)."""
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


def fold_plans(single: Plan, parallel: Plan, extra: int = 0) -> Folded:
    """Fold a loaded pair (raises FoldRefused when the plan does not fit)."""
    wu = WorldUnits.of(parallel.world)
    if wu.dp <= 2 + extra and wu.mb <= 2 + extra:
        raise FoldRefused("nothing to fold: at most 2 replicas and 2 micro-batches")
    units, glob = split_units(parallel, wu)
    order = sorted(units, key=lambda u: (u not in (REPRESENTATIVE, REPRESENTATIVE_REPLICA),
                                         u[1] is None, u[0], -1 if u[1] is None else u[1]))
    if REPRESENTATIVE not in units:
        raise FoldRefused("no tensor is named like an instance of replica 0, micro-batch 0")
    folder = Folder(single, parallel, extra)
    folder.add_global(glob)
    for u in order:
        folder.add_unit(u, units[u])
    return folder.finish(units.__getitem__)
