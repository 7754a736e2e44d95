"""Replica folding: verify a few replicas and micro-batches, after checking the rest are copies.

A plan with dp replicas and mb micro-batches repeats one unit of work dp*mb times (units.py).
Verifying every copy costs time and memory linear in dp*mb, with nothing new to learn after
the first few. The folder

1. checks every unit (found by structure: units.py) against the representative unit (0, 0)
   (or (0, None) for replica units): relative to its unit (table.py), the unit's tensors
   (shapes, by local number), nodes (op, pass, rank, micro-batch, inputs, outputs as local
   numbers, semantic attributes) and lineage parts (sum_of, scale, slice) must be exactly the
   representative's, except that a part's slice may be
   translated along one dimension: the unit's *piece* of the batch. Every unit must hold the
   same piece index in every lineage, and the units' pieces must tile the batch;
2. keeps the units of the first `2 + extra` replicas and micro-batches, and every unit that is
   not a copy (an *exception*, together with the rest of its replica), and drops the others;
3. restricts every sum that spans units (grad_accum over micro-batches, reducer and loss
   all_reduce over replicas, lineage parts summing every instance) to the kept units. Such a
   sum must take exactly one tensor from every unit of its level, the same one (local
   number) from every unit that is a copy, else nothing is folded;
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
partial sum over units, a rank or micro-batch outside the world, a reference from a kept unit
into a dropped one, an inconsistent piece) makes the folder refuse, and the plan is verified
unfolded. Ids are never read: a unit is compared through local tensor numbers, and two units
are copies when the positional correspondence of their nodes and numbered tensors preserves
every operator, attribute, shape, slice and edge, which is all the SIMD argument needs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import numpy as np

from tvsmt.errors import PlanError
from tvsmt.fold.rebatch import rebatch_single
from tvsmt.fold.table import (
    OTHER,
    GroupError,
    Interner,
    UnitTable,
    canonical_inputs,
    group_level,
    rename_ranks,
)
from tvsmt.fold.units import (
    REPRESENTATIVE,
    REPRESENTATIVE_REPLICA,
    SUM_OPS,
    FoldRefused,
    NodeRefused,
    Unit,
    WorldUnits,
)
from tvsmt.plan.model import Lineage, LineagePart, Node, Plan, TensorInfo
from tvsmt.plan.reader import check_pair



@dataclass(frozen=True)
class SumRefs:
    """Where the tensors of a lineage part that sums over units live, as arrays: per tensor
    its replica (-1: it belongs to no unit), micro-batch (-1: a replica unit) and local
    number. A generator's streamed plan also gives `names(mask)`, the names of the tensors of
    a boolean mask, and leaves the part's `sum_of` empty: a 405B-sized plan's parts summing
    every instance name ten million tensors, of which the fold keeps a few thousand."""

    d: np.ndarray
    m: np.ndarray
    k: np.ndarray
    names: Callable[[np.ndarray], tuple] | None = None

    def pairs(self) -> list[tuple[Unit | None, int]]:
        """The (unit, local number) of each tensor (what `of` takes)."""
        return [(None if d < 0 else (d, None if m < 0 else m), k)
                for d, m, k in zip(self.d.tolist(), self.m.tolist(), self.k.tolist())]

    @classmethod
    def of(cls, refs: list[tuple[Unit | None, int]]) -> "SumRefs":
        d = np.fromiter((-1 if u is None else u[0] for u, _ in refs), np.int64, len(refs))
        m = np.fromiter((-1 if u is None or u[1] is None else u[1] for u, _ in refs),
                        np.int64, len(refs))
        return cls(d, m, np.fromiter((k for _, k in refs), np.int64, len(refs)))


@dataclass
class UnitRecords:
    """Everything one unit owns, with the positions needed to rebuild a plan."""

    tensors: list[TensorInfo] = field(default_factory=list)
    nodes: list[tuple[int, Node]] = field(default_factory=list)  # (position in plan, node)
    parts: list[tuple[int, int, LineagePart]] = field(default_factory=list)  # (lineage, pos, part)
    # global records only: per part, (unit, local number) of each of its tensors, as a list
    # of pairs or as `SumRefs`
    part_refs: list = field(default_factory=list)

    def sum_of(self, j: int) -> tuple:
        """The tensors of part j (named by its `SumRefs` when the part leaves them out)."""
        refs = self.part_refs[j] if j < len(self.part_refs) else None
        if isinstance(refs, SumRefs) and refs.names is not None:
            return refs.names(np.ones(len(refs.d), dtype=bool))
        return self.parts[j][2].sum_of


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


# ----------------------------------------------------------------------------- sums over units


class Canon:
    """Checks the sums over units that global records (lineage parts summing every instance)
    contain; units' own sums are checked in table form (table.canonical_inputs)."""

    def __init__(self, wu: WorldUnits):
        self.wu = wu
        self.deviations: list[tuple[int, int]] = []  # as Checker.deviations
        self._levels: dict = {}  # (id(d), id(m)) -> (d, m, level, keys): arrays shared by parts

    def group(self, refs, where: Callable[[], str]) -> np.ndarray | None:
        """The unit keys (see unit_keys) of a part's tensors (a list of (unit, local number)
        pairs, or `SumRefs`), or None when they all belong to one unit (or to none). A sum
        that does not take one copy of the same tensor from every unit of a level cannot be
        folded (`where()` names the part in the refusal)."""
        if not isinstance(refs, SumRefs):
            refs = SumRefs.of(refs)
        d, m, ks = refs.d, refs.m, refs.k
        key = (id(d), id(m))
        got = self._levels.get(key)
        if got is None:
            got = self._levels[key] = (d, m, *self._level(d, m))
        level, keys = got[2], got[3]
        if level == "one":
            return None
        if level == "none":
            raise FoldRefused(f"{where()}: a sum over tensors that are not one per replica or "
                              "micro-batch")
        if level is None or level < 0:
            raise FoldRefused(f"{where()}: a sum over {len(d)} replicas/micro-batches that "
                              "misses some of them")
        if len(ks) and not (ks == ks[0]).all():
            # the most common number (the first met among the most common) is the sum's
            # tensor; every unit giving another deviates
            values, first, counts = np.unique(ks, return_index=True, return_counts=True)
            best = np.flatnonzero(counts == counts.max())
            k = values[best[np.argmin(first[best])]]
            odd = np.flatnonzero(ks != k)
            self.deviations += list(zip(d[odd].tolist(), m[odd].tolist()))
        return keys

    def _level(self, d: np.ndarray, m: np.ndarray):
        """(group_level of the units, or "one": all in one unit, or "none": a tensor of no
        unit among several units; their unit keys)."""
        keys = self.unit_keys(np.maximum(d, 0), m)
        keys = np.where(d < 0, -1, keys)
        if len(keys) == 0 or (keys == keys[0]).all():
            return "one", None
        if (d < 0).any():
            return "none", None
        return group_level(list(zip(d.tolist(), m.tolist())), self.wu, -1), keys

    def unit_keys(self, d: np.ndarray, m: np.ndarray) -> np.ndarray:
        """One small integer per unit (d, m), m = -1 for a replica unit."""
        return (d * (self.wu.mb + 1) + m + 1).astype(np.int32)


# ----------------------------------------------------------------------------- the folder


def _canonical(tab: UnitTable, unit: Unit, wu: WorldUnits, sum_ops: np.ndarray,
               deviations: list) -> dict:
    """The table relative to its unit (everything but the slices)."""
    per = wu.per_replica
    d, m_u = unit
    try:
        ins, in_ptr, _ = canonical_inputs(tab, unit, wu, sum_ops, deviations)
    except GroupError as e:
        n, why = e.args
        raise NodeRefused(int(tab.n_pos[n]), why) from None
    mb = tab.n_mb if m_u is None else np.where(tab.n_mb == m_u, 0, tab.n_mb + OTHER)
    return {
        "t_shape": tab.t_shape, "n_op": tab.n_op, "n_pass": tab.n_pass,
        "n_rank": rename_ranks(tab.n_rank, d, per), "n_mb": mb, "n_attrs": tab.n_attrs,
        "n_attr_ptr": tab.n_attr_ptr, "n_attr_ranks": rename_ranks(tab.n_attr_ranks, d, per),
        "n_in": ins, "n_in_ptr": in_ptr, "n_out": tab.n_out,
        "n_out_ptr": tab.n_out_ptr, "p_lin": tab.p_lin, "p_scale": tab.p_scale,
        "p_sum_ptr": tab.p_sum_ptr, "p_sum": tab.p_sum,
    }


class Checker:
    """Is a unit a copy of its representative? Small and picklable, so that worker processes
    can check units in parallel (source.fold_source). Frozen copies never learn a lineage's
    batch dimension: a unit that would teach one is reported "not a copy" and re-checked by
    the main process, so parallel checking cannot weaken the check. The lineages they see
    unmoved while undecided (`nodiff_undecided`) go back to the main process, which then
    refuses to learn a dimension for them, as a serial check in that order would."""

    def __init__(self, wu: WorldUnits, sum_ops: np.ndarray, lineages: int):
        self.wu = wu
        self.sum_ops = sum_ops
        self.rep: dict[Unit, tuple[dict, np.ndarray]] = {}  # canonical arrays, slices
        self.fold_dim = np.full(lineages, -1, dtype=np.int64)  # lineage -> batch dimension
        self.piece_len = np.zeros(lineages, dtype=np.int64)
        self.nodiff_undecided = np.zeros(lineages, dtype=bool)
        self.frozen = False
        # units (replica, micro-batch or -1) that give a sum over units another tensor than
        # the other units do: each must be an exception (Folder.finish checks)
        self.deviations: list[tuple[int, int]] = []

    def set_representative(self, unit: Unit, tab: UnitTable) -> None:
        self.rep[unit] = (_canonical(tab, unit, self.wu, self.sum_ops, self.deviations),
                          tab.p_slice)

    def compare(self, unit: Unit, tab: UnitTable) -> tuple[bool, int | None]:
        """(is a copy, its piece of the batch)."""
        rep = REPRESENTATIVE if unit[1] is not None else REPRESENTATIVE_REPLICA
        if rep not in self.rep:
            raise FoldRefused(f"unit {unit} arrived before its representative {rep}")
        ref, ref_slices = self.rep[rep]
        canon = _canonical(tab, unit, self.wu, self.sum_ops, self.deviations)
        if not all(np.array_equal(canon[k], ref[k]) for k in ref):
            return False, None
        return self._translated(unit, tab, ref_slices)

    def _translated(self, unit: Unit, tab: UnitTable, ref: np.ndarray
                    ) -> tuple[bool, int | None]:
        """Slices equal the representative's up to a translation along the lineage's batch
        dimension, by a whole number of pieces, the same piece in every lineage."""
        slc = tab.p_slice
        if slc.shape != ref.shape:
            return False, None
        diff = slc != ref
        dims = diff[:, 0::2] | diff[:, 1::2]
        count = dims.sum(axis=1)
        if (count > 1).any():
            return False, None
        lins = tab.p_lin
        moved = count == 1
        if moved.any() and unit[1] is None:
            return False, None  # replica units hold no piece of the batch
        k = dims[moved].argmax(axis=1)
        ml = lins[moved]
        rows = np.flatnonzero(moved)
        start, end = slc[rows, 2 * k], slc[rows, 2 * k + 1]
        length = end - start
        if ((length != ref[rows, 2 * k + 1] - ref[rows, 2 * k]).any() or (length <= 0).any()
                or (start % np.maximum(length, 1)).any()):
            return False, None
        known = self.fold_dim[ml]
        if ((known >= 0) & (known != k)).any():
            return False, None
        fresh = known < 0
        if fresh.any():
            if self.frozen:
                return False, None
            if self.nodiff_undecided[ml[fresh]].any():
                raise FoldRefused("some units hold the representative's piece of the batch "
                                  "in a lineage where others hold another one")
            self.fold_dim[ml[fresh]] = k[fresh]
            self.piece_len[ml[fresh]] = length[fresh]
        if (self.fold_dim[ml] != k).any() or (self.piece_len[ml] != length).any():
            return False, None
        pieces = start // length
        still = ~moved
        undecided = still & (self.fold_dim[lins] < 0)
        if undecided.any():  # a frozen copy marks them too: its marks go back to the
            self.nodiff_undecided[lins[undecided]] = True  # parent (source.fold_source)
        same = still & (self.fold_dim[lins] >= 0)
        if same.any():
            pieces = np.concatenate([pieces, self.pieces_at(ref[same], lins[same])])
        if len(pieces) and (pieces != pieces[0]).any():  # one piece in every lineage
            return False, None
        return True, (int(pieces[0]) if len(pieces) else None)

    def pieces_at(self, slices: np.ndarray, lins: np.ndarray) -> np.ndarray:
        k = self.fold_dim[lins]
        return slices[np.arange(len(lins)), 2 * k] // self.piece_len[lins]

    def exception_piece(self, unit: Unit, tab: UnitTable) -> int | None:
        """An exception keeps its own slices; it still needs one piece of the batch."""
        sel = self.fold_dim[tab.p_lin] >= 0
        pieces = set(self.pieces_at(tab.p_slice[sel], tab.p_lin[sel]).tolist())
        if len(pieces) > 1:
            raise FoldRefused(f"unit {unit} holds different pieces of the batch in different "
                              "lineages")
        return pieces.pop() if pieces else None


class Folder:
    """Feed units (representatives first), then `finish()` builds the folded pair.

    A unit comes as a table (table.py) for the comparison, with its records (or a function
    giving them) for the case it is kept. Units that are dropped are only compared and
    counted, so a caller may stream them (source.py, frontends/stream.py)."""

    def __init__(self, single: Plan, parallel_header: Plan, intern: Interner, extra: int = 0):
        self.single = single
        self.header = parallel_header  # world, name, path, lineage singles (records unused)
        self.wu = WorldUnits.of(parallel_header.world)
        self.intern = intern
        sum_ops = np.array([intern(op) for op in sorted(SUM_OPS)], dtype=np.int64)
        self.checker = Checker(self.wu, sum_ops, len(parallel_header.lineages))
        self.canon = Canon(self.wu)
        self.extra = extra
        self.kept_d = set(range(min(self.wu.dp, 2 + extra)))
        self.kept_m = set(range(min(self.wu.mb, 2 + extra)))
        self.piece: dict[Unit, int] = {}
        self.records: dict[Unit, UnitRecords] = {}  # retained units
        self.global_records = UnitRecords()
        self.global_part_units: list[np.ndarray | None] = []  # unit keys of their ids
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
        g.part_refs += recs.part_refs
        if recs.nodes:
            raise FoldRefused(f"node {recs.nodes[0][1].id} belongs to no unit")
        if len(recs.part_refs) != len(recs.parts):
            raise FoldRefused("global lineage parts without the units of their tensors")
        for (lin, _, _), refs in zip(recs.parts, recs.part_refs):
            # validate the sums now (raises FoldRefused), and remember their units
            self.global_part_units.append(
                self.canon.group(refs, lambda lin=lin: self.header.lineages[lin].label))

    def add_unit(self, unit: Unit, tab: UnitTable,
                 records: UnitRecords | Callable[[], UnitRecords]) -> bool:
        """Compare one unit with its representative; keep its records if it stays."""
        try:
            if unit in (REPRESENTATIVE, REPRESENTATIVE_REPLICA):
                self.checker.set_representative(unit, tab)
                ok, piece = True, None
            else:
                ok, piece = self.checker.compare(unit, tab)
        except NodeRefused as e:  # named by its id, which the unit's records hold
            raise e.naming((records() if callable(records) else records).nodes) from None
        if not ok:
            self.exceptions.append(unit)
            piece = self.checker.exception_piece(unit, tab)
        self.accept(unit, piece, len(tab.t_shape), len(tab.n_op), len(tab.p_lin))
        if not ok or self.is_default_kept(unit):
            self.records[unit] = records  # a function giving them: built when needed
        return ok

    def build_records(self) -> None:
        """Build the records of the units kept so far that were given as functions (a
        caller may do it while workers check the other units)."""
        for u, recs in list(self.records.items()):
            if callable(recs):
                self.records[u] = recs()

    def accept(self, unit: Unit, piece: int | None, tensors: int, nodes: int,
               parts: int) -> None:
        """Count a unit found (here or by a worker) to be a copy, or an exception."""
        self.seen.add(unit)
        if piece is not None:
            self.piece[unit] = piece
        self.checked.update(tensors=tensors, nodes=nodes, parts=parts)

    # -- the folded pair

    def kept_units(self) -> tuple[set[int], set[Unit]]:
        replicas = set(self.kept_d) | {u[0] for u in self.exceptions}
        units = {(d, m) for d in replicas for m in self.kept_m}
        units |= {(d, None) for d in replicas}
        units |= set(self.exceptions)
        return replicas, units

    def finish(self, fetch: Callable[[Unit], UnitRecords] | None = None,
               complete: bool = True) -> Folded:
        """Build the folded pair. Units kept only because their replica holds an exception
        were compared and dropped earlier; `fetch` gives their records again.
        `complete=False`: before every unit has been added, the pair these units give if
        the others turn out copies (source.fold_source's `ahead`); the check that the units'
        pieces tile the batch, which needs them all, is left out. Calling it changes nothing
        a later `finish()` computes."""
        wu = self.wu
        odd = {(d, None if m < 0 else m)
               for d, m in self.checker.deviations + self.canon.deviations}
        for u in sorted(odd - set(self.exceptions), key=str):
            raise FoldRefused(f"unit {u} gives a sum over units another tensor than the "
                              "other units, yet is a copy of its representative")
        self.build_records()
        replicas, kept = self.kept_units()
        for u in sorted((u for u in kept if u not in self.records and u in self.seen),
                        key=str):
            if fetch is None:
                raise FoldRefused(f"unit {u} was not retained")
            self.records[u] = fetch(u)
        kept = sorted((u for u in kept if u in self.records),
                      key=lambda u: (u[0], -1 if u[1] is None else u[1]))
        instance_kept = sorted(u for u in kept if u[1] is not None)
        pieces = self._pieces(instance_kept, complete)
        kept_tensors: dict[str, TensorInfo] = {}
        for recs in [self.global_records] + [self.records[u] for u in kept]:
            for t in recs.tensors:
                kept_tensors[t.id] = t

        kept_keys = self.canon.unit_keys(
            np.array([u[0] for u in kept]), np.array([-1 if u[1] is None else u[1] for u in kept]))

        def keep_sum(ids):
            """A sum over units restricted to the kept ones. Every sum over units was checked
            (table.group_row) to take one copy from every unit of its level, and a tensor
            belongs to one unit, so its kept inputs are exactly those of the kept units."""
            return tuple(x for x in ids if x is None or x in kept_tensors)

        def keep_global_sum(ids, keys):
            if keys is None:
                return tuple(ids)
            return tuple(x for x, k in zip(ids, np.isin(keys, kept_keys).tolist()) if k)

        nodes: list[tuple[int, Node]] = []
        parts: dict[int, list[tuple[int, LineagePart]]] = defaultdict(list)
        for recs in [self.global_records] + [self.records[u] for u in kept]:
            glob = recs is self.global_records
            for pos, n in recs.nodes:
                if n.op in SUM_OPS and len(n.inputs) > 1:
                    ins = keep_sum(n.inputs)
                    if not ins:
                        raise FoldRefused(f"node {n.id} sums only folded-away units")
                    n = _replace_inputs(n, ins)
                for x in n.inputs:
                    if x is not None and x not in kept_tensors:
                        raise FoldRefused(f"node {n.id} of a kept unit reads {x}, which "
                                          "belongs to a folded-away unit")
                nodes.append((pos, n))
            for j, (lin, pos, p) in enumerate(recs.parts):
                refs = recs.part_refs[j] if glob else None
                if isinstance(refs, SumRefs) and refs.names is not None:
                    keys = self.global_part_units[j]
                    sum_of = refs.names(np.ones(len(refs.d), dtype=bool) if keys is None
                                        else np.isin(keys, kept_keys))
                elif glob:
                    sum_of = keep_global_sum(p.sum_of, self.global_part_units[j])
                else:
                    sum_of = tuple(p.sum_of)
                if not sum_of:
                    continue
                for x in sum_of:
                    if x not in kept_tensors:
                        raise FoldRefused(f"{self.header.lineages[lin].label} names {x}, "
                                          "which belongs to a folded-away unit")
                parts[lin].append((pos, LineagePart(p.slice, sum_of, p.scale)))
        nodes.sort(key=lambda e: e[0])
        factor = Fraction(len(instance_kept), wu.dp * wu.mb)
        chk = self.checker
        fold_dim = {int(i): int(k) for i, k in enumerate(chk.fold_dim) if k >= 0}
        piece_len = {i: int(chk.piece_len[i]) for i in fold_dim}
        single, new_slices = rebatch_single(self.single, self.header, fold_dim, piece_len,
                                            pieces, wu.dp * wu.mb)
        lineages = []
        for lin in self.header.lineages:
            lp = sorted(parts.get(lin.index, ()), key=lambda e: e[0])
            if not lp:
                raise FoldRefused(f"{lin.label} names only folded-away units")
            # without its `aligned` hint, which names nodes of folded-away units too: stage
            # cutting does not read hints (stages/cutter.py), and a folded pair is never written
            lineages.append(Lineage(lin.index, lin.single,
                                    tuple(new_slices(lin.index, p) for _, p in lp),
                                    hypothesis=lin.hypothesis))
        parallel = Plan(self.header.path, self.header.name, self.header.kind,
                        self.header.world, kept_tensors, [n for _, n in nodes],
                        list(self.header.outputs), lineages)
        _check_folded(single, parallel)
        info = FoldInfo(wu.dp, wu.mb, sorted(replicas), len(instance_kept),
                        [unit_name(u) for u in self.exceptions], dict(self.checked),
                        str(factor), self.extra)
        return Folded(single, parallel, info)

    def _pieces(self, instance_kept: list[Unit], complete: bool = True) -> dict[int, int]:
        """Old piece index -> new (packed) index, after checking that pieces tile the batch
        (`complete`; else only the kept units' pieces are known)."""
        wu = self.wu
        chk = self.checker
        if not (chk.fold_dim >= 0).any():
            raise FoldRefused("no lineage slices the batch by replica and micro-batch")
        _, slices = chk.rep[REPRESENTATIVE]
        lins = np.array([lin for lin, _, _ in self.records[REPRESENTATIVE].parts],
                        dtype=np.int64)
        sel = chk.fold_dim[lins] >= 0
        rep_pieces = set(chk.pieces_at(slices[sel], lins[sel]).tolist())
        if len(rep_pieces) != 1:
            raise FoldRefused("the representative unit holds several pieces of the batch")
        self.piece[REPRESENTATIVE] = rep_pieces.pop()
        allp = [self.piece.get(u) for u in wu.instance_units()]
        if complete and (None in allp or sorted(allp) != list(range(wu.dp * wu.mb))):
            raise FoldRefused("the replicas' and micro-batches' pieces of the batch do not "
                              "tile it")
        old = sorted(self.piece[u] for u in instance_kept)
        return {p: i for i, p in enumerate(old)}


def _check_folded(single: Plan, parallel: Plan) -> None:
    """The reader's cross-plan checks, and every kept part's tensors have its shape."""
    try:
        check_pair(single, parallel)
    except PlanError as e:
        raise FoldRefused(f"the folded pair is malformed: {e}") from None
    for lin in parallel.lineages:
        for p in lin.parts:
            for t in p.sum_of:
                if parallel.tensors[t].shape != p.shape:
                    raise FoldRefused(f"{lin.label}: {t} does not have the shape of "
                                      "its folded slice")


def _replace_inputs(n: Node, inputs: tuple) -> Node:
    return Node(n.id, n.op, n.pass_, n.rank, n.mb, inputs, n.outputs, n.attrs, n.source)


def unit_name(u: Unit) -> str:
    return f"replica {u[0]}" + ("" if u[1] is None else f" micro-batch {u[1]}")
