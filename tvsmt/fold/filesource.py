"""A JSON Lines plan file as a unit source: units stream from the file into the folder.

`FilePlan` reads the file once through `tvsmt.plan.stream.read_checked`: every record is
checked as for any read (`iter_records`' checks, in a forked second process when a core is
idle, while this one folds the unchecked reading; the checks' verdict comes before anything
is used), and the parallel plan is never held whole. What it keeps:

* every unit's *table* (integer arrays, tvsmt/fold/table.py), which is what the folder
  compares; a unit's nodes and tensors are dropped as soon as its table is built;
* the records of the units a fold may keep (the first `retain` replicas and micro-batches)
  and of the replica units (weights, gradient accumulation, reducers: small);
* for every tensor of an instance unit, its unit and local number (one packed int), because
  the replica units' sums and the lineages, which come later in the file, name them.

Units are recognised as in tvsmt/fold/units.py: a node belongs to (Mesh.replica_of(rank), mb),
or to the replica unit when its mb is -1 or when it sums over units. What a streaming reader
cannot know before the end, it takes from the file's grouping and checks afterwards:

* an instance unit's nodes come in one section (the writer's sections, `tvsmt.plan.stream`);
  a graph input declared in the section of exactly one instance unit that reads it is that
  unit's own (its data); every other graph input belongs to the replica of the units that
  read it, and two replicas reading it make the fold refuse;
* inside a unit, tensors are numbered by first use in the unit's canonical order (nodes by
  rank relative to the replica, then file order); a replica unit's tensors by first use by its
  instance units in file order, then by its own nodes level by level (as units.py does).

Nothing relies on this for soundness. The folder compares every unit's table with its
representative's, and a record that does not fit makes its unit an exception or the fold
refuse (`FoldRefused`), never a wrong pass; a refused fold is verified from the whole file.
An exception's records were dropped with its table: `records` reads the file again for that
replica (the plan id and checksum must be the same).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain, compress, count, filterfalse, repeat
from operator import add, attrgetter, itemgetter
import numpy as np

from tvsmt.fold.folder import SUM_OPS, FoldRefused, UnitRecords
from tvsmt.fold.source import unit_order
from tvsmt.fold.table import (
    MAX_DIMS,
    Interner,
    UnitTable,
    attach_parts,
    build_table,
    instance_table,
    merge_part_columns,
    part_columns,
    reference,
)
from tvsmt.fold.units import REPRESENTATIVE, Unit, WorldUnits
from tvsmt.heap import collector_paused
from tvsmt.plan.mesh import Mesh
from tvsmt.plan.model import Lineage, LineagePart, Node, Plan, TensorInfo
from tvsmt.plan.stream import (Batch, Section, StreamHeader, as_model, iter_records,
                               read_checked)

_SHIFT = 32  # packed location: unit index << _SHIFT | local number
_LOW = (1 << _SHIFT) - 1
_RANK, _MB, _OP, _INPUTS, _OUTPUTS, _SUM_OF, _SLICE, _SCALE = (attrgetter(k) for k in (
    "rank", "mb", "op", "inputs", "outputs", "sum_of", "slice", "scale"))
_FIRST, _ID = itemgetter(0), attrgetter("id")


class FilePlan:
    """A unit source (tvsmt.fold.source.UnitSource) read from a JSON Lines plan file."""

    def __init__(self, single: Plan, path: str, retain: int = 3):
        self.single = single
        self.path = path
        self.intern = Interner()
        self.retain = retain
        self._scan()

    # -- the unit source interface

    def global_records(self) -> UnitRecords:
        return self._global

    def units(self) -> list[Unit]:
        return unit_order(self._tables)

    def table(self, unit: Unit) -> UnitTable:
        return self._tables[unit]

    def records(self, unit: Unit) -> UnitRecords:
        recs = self._records.get(unit)
        if recs is None:
            self._reread(unit[0])
            recs = self._records[unit]
        return recs

    def worker_view(self):
        return None  # tables are already built: nothing left to do in parallel

    # -- the pass over the file

    def _scan(self, wanted: set[int] | None = None) -> None:
        """Read the file once. `wanted`: only collect the records of these replicas (a second
        reading for exceptions); None: the first reading, which builds everything.

        The cyclic collector is paused throughout: the scan allocates millions of acyclic
        records and keeps many of them (tables, retained units), and every collection of the
        oldest generation re-scanned them all (over 40% of a 4-layer file's scan). What the
        scan keeps is frozen after it (`freeze_after`): else the first collection after it
        traverses every table and retained record once more."""
        with collector_paused(freeze_after=True):
            self._scan_paused(wanted)

    def _scan_paused(self, wanted: set[int] | None) -> None:
        if wanted is None:  # the checks perhaps in a second process (stream.read_checked)
            read_checked(self.path, lambda it: self._consume(it, None))
        else:
            self._consume(iter_records(self.path), wanted)

    def _consume(self, it, wanted: set[int] | None) -> None:
        header: StreamHeader = next(it)
        first = wanted is None
        if first:
            self._plan_id = header.plan_id
            self._init_state(header)
        elif header.plan_id != self._plan_id:
            raise FoldRefused(f"{self.path} changed while it was being folded")
        sc = _Scan(self, wanted)
        for obj in it:
            kind = type(obj)
            if kind is Batch:  # the unchecked reading's tensors and nodes
                sc.batch += obj.nodes
                sc.sec_tensors.update(zip(map(_ID, obj.tensors), obj.tensors))
            elif kind is Node:
                sc.node(obj)
            elif kind is TensorInfo:
                sc.sec_tensors[obj.id] = obj
            elif kind is Section:
                sc.end_section()
            elif kind is Lineage:
                if sc.lineage_index == 0:
                    sc.end_section()
                    sc.end_nodes()
                sc.lineage(obj)
            # the header came first; nothing else is yielded
        if sc.lineage_index == 0:
            sc.end_section()
            sc.end_nodes()
        sc.finish()

    def _init_state(self, header: StreamHeader) -> None:
        self.wu = WorldUnits.of(header.world)
        try:
            self.mesh = Mesh.of({k: v for k, v in header.world.items()
                                 if k in ("dp", "pp", "tp")})
        except (TypeError, ValueError) as e:
            raise FoldRefused(f"the plan's world: {e}") from None
        self.header_rec = header
        self._tables: dict[Unit, UnitTable] = {}
        self._records: dict[Unit, UnitRecords] = {}
        self._global = UnitRecords()

    def _reread(self, replica: int) -> None:
        self._scan({replica})
        if not any(u[0] == replica for u in self._records):
            raise FoldRefused(f"replica {replica} was not found again in {self.path}")


class _Scan:
    """The state of one pass (see FilePlan)."""

    def __init__(self, src: FilePlan, wanted: set[int] | None):
        self.src = src
        self.wanted = wanted
        self.wu = src.wu
        self.mesh = src.mesh
        self.per = src.wu.per_replica
        self.pos = 0
        self.sec_tensors: dict[str, TensorInfo] = {}
        self.sec_nodes: dict[Unit, list[tuple[int, Node]]] = {}
        self.batch: list[Node] = []  # the section's nodes, classified at its end
        self.glob_num: dict[str, int] = {}
        self.done_units: set[Unit] = set()
        self.unit_index: dict[Unit, int] = {}
        self.units_by_index: list[Unit] = []
        self.where: dict[str, int] = {}  # instance tensor -> packed (unit index, number)
        self.held_decl: dict[str, TensorInfo] = {}  # graph inputs of no instance unit
        self.held_prod: dict[str, int] = {}  # tensor -> replica whose held node writes it
        self.owner: dict[str, int] = {}  # held graph input -> the replica that reads it
        self.rep_num: dict[int, dict[str, int]] = defaultdict(dict)  # replica tensors
        # replica d -> references of tensors outside every instance unit (_outside_ref)
        self.replica_refs: dict[int, dict[str, tuple]] = defaultdict(dict)
        self.held_nodes: dict[int, list[tuple[int, Node]]] = defaultdict(list)
        self.parts: dict[Unit, list] = defaultdict(list)  # (lin, pos, part) per unit
        self.part_refs: dict[Unit, list] = defaultdict(list)  # their tensors' references
        self.chunks: list[tuple] = []  # lineage parts over columns (_fast_parts)
        self.retained_idx = np.zeros(0, dtype=bool)
        self.lineage_index = 0
        self.lineages: list[Lineage] = []
        self.replica_tensors: dict[int, list[TensorInfo]] = {}

    # ---- nodes

    def node(self, n: Node) -> None:
        self.batch.append(n)

    def _unit_of_produced(self, x: str) -> Unit | None:
        loc = self.where.get(x)
        if loc is not None:
            return self.units_by_index[loc >> _SHIFT]
        d = self.held_prod.get(x)
        return None if d is None else (d, None)

    def _classify(self) -> dict[Unit, list[tuple[int, Node]]]:
        """The section's nodes by unit (columns in numpy; only sums are looked at one by
        one), replica-unit nodes to `held_nodes`."""
        batch, self.batch = self.batch, []
        pos0, n_nodes = self.pos, len(batch)
        self.pos += n_nodes
        if not n_nodes:
            return {}
        ranks = np.fromiter(map(_RANK, batch), np.int64, n_nodes)
        mbs = np.fromiter(map(_MB, batch), np.int64, n_nodes)
        if ranks.min() < 0 or ranks.max() >= self.mesh.size:
            i = int(np.flatnonzero((ranks < 0) | (ranks >= self.mesh.size))[0])
            raise FoldRefused(f"node {batch[i].id}: rank {batch[i].rank} outside the world")
        if mbs.min() < -1 or mbs.max() >= self.wu.mb:
            i = int(np.flatnonzero((mbs < -1) | (mbs >= self.wu.mb))[0])
            raise FoldRefused(f"node {batch[i].id}: micro-batch {batch[i].mb} outside the "
                              "world")
        reps = ranks // self.per
        held = mbs == -1
        held_l, reps_l, mbs_l = held.tolist(), reps.tolist(), mbs.tolist()
        sums = [i for i in compress(range(n_nodes), map(SUM_OPS.__contains__, map(_OP, batch)))
                if len(batch[i].inputs) > 1 and not held_l[i]]
        if sums:  # a sum over units belongs to its replica (units.py)
            outs = list(map(_OUTPUTS, batch))
            writer = dict(zip(chain.from_iterable(outs), np.repeat(
                np.arange(n_nodes), np.fromiter(map(len, outs), np.int64, n_nodes)).tolist()))
            where, by_index = self.where, self.units_by_index
            for i in sums:
                units = set()
                for x in batch[i].inputs:
                    j = writer.get(x)
                    if j is not None and j < i:
                        units.add((reps_l[j], None if held_l[j] else mbs_l[j]))
                    elif x is not None:
                        loc = where.get(x)
                        units.add(by_index[loc >> _SHIFT] if loc is not None
                                  else self._unit_of_produced(x))
                units.discard(None)
                if len(units) > 1:
                    held_l[i] = True
            held = np.array(held_l, dtype=bool)
        held_prod = self.held_prod
        for i in compress(range(n_nodes), held_l):
            n = as_model(batch[i])  # kept to the end: not a view of the block read
            d = reps_l[i]
            self.held_nodes[d].append((pos0 + i, n))
            held_prod.update(zip(n.outputs, repeat(d)))
        held_prod.pop(None, None)
        inst = np.flatnonzero(~held)
        key = reps[inst] * self.wu.mb + mbs[inst]
        rel = ranks[inst] - reps[inst] * self.per
        order = inst[np.lexsort((inst, rel, key))]  # by unit, then relative rank, then file
        keys = reps[order] * self.wu.mb + mbs[order]
        cuts = np.flatnonzero(np.diff(keys)) + 1
        out: dict[Unit, list[tuple[int, Node]]] = {}
        for idx in np.split(order, cuts) if len(order) else []:
            i0 = int(idx[0])
            u = (int(reps[i0]), int(mbs[i0]))
            out[u] = list(zip((idx + pos0).tolist(), map(batch.__getitem__, idx.tolist())))
        return out

    def end_section(self) -> None:
        """Every instance unit with nodes in the section is complete: build its table."""
        units = self._classify()
        alone = len(units) == 1
        numbered = []  # the tensors the section's units numbered (now in `where`)
        for u, nodes in units.items():
            if u in self.done_units:
                raise FoldRefused(f"node {nodes[0][1].id}: unit {u} continues after its "
                                  "section ended (the file does not group records by unit)")
            numbered.append(self._build_unit(u, nodes, self.sec_tensors if alone else {}))
            self.done_units.add(u)
        sec = self.sec_tensors
        # The section's tensors that are in `where` are those its units numbered: a tensor is
        # declared before any record names it and only once (the checks), so no unit of an
        # earlier section numbered it. Looked up in the units' own small tables, not in
        # `where` (every tensor of the file so far: a cache miss per lookup).
        mine = numbered[0] if len(numbered) == 1 else set().union(*numbered)
        for tid in filterfalse(mine.__contains__, sec):
            self.held_decl[tid] = sec[tid]
        self.sec_tensors = {}

    def _replica_number(self, x: str, d: int) -> int:
        """Number of tensor x in the replica unit of replica d (assigned at first use)."""
        nums = self.rep_num[d]
        k = nums.get(x)
        if k is None:
            k = nums[x] = len(nums)
        return k

    def _outside(self, x: str, d: int) -> tuple[Unit | None, int]:
        """Where a tensor that is not the reading unit's own lives, seen from replica d."""
        loc = self.where.get(x)
        if loc is not None:
            return self.units_by_index[loc >> _SHIFT], loc & ((1 << _SHIFT) - 1)
        if x in self.held_prod:
            d2 = self.held_prod[x]
            return (d2, None), self._replica_number(x, d2)
        if x in self.held_decl or x in self.sec_tensors:
            d2 = self.owner.setdefault(x, d)
            if d2 != d:
                raise FoldRefused(f"tensor {x} is read by replicas {d2} and {d}: a graph "
                                  "input of no replica cannot be streamed")
            return (d, None), self._replica_number(x, d)
        raise FoldRefused(f"tensor {x} belongs to no unit that has been read")

    def _outside_ref(self, u: Unit, d: int):
        """`x -> reference(u, *self._outside(x, d))` in one function: a tensor of an instance
        unit (nearly every one) costs one lookup in `where`, and the unit part of its
        reference is computed once per unit it lives in. A tensor of a replica unit (a
        weight, an accumulated gradient) is looked up once per replica, not once per unit
        reading it: its reference from any unit of replica d is the same (a replica unit
        has no micro-batch), and it stays where it is (a tensor is declared once, written
        once, and never written after it is read: the checks). Not one declared in the
        section being read, which a unit built after the reading one may yet number."""
        where_get, by_index, heads = self.where.get, self.units_by_index, {}
        replica_refs = self.replica_refs[d]
        cached, sec = replica_refs.get, self.sec_tensors

        def ref(x: str) -> tuple:
            loc = where_get(x)
            if loc is None:
                r = cached(x)
                if r is None:
                    r = reference(u, *self._outside(x, d))
                    if x not in sec:
                        replica_refs[x] = r
                return r
            i = loc >> _SHIFT
            head = heads.get(i)
            if head is None:
                head = heads[i] = reference(u, by_index[i], 0)[1:]
            return (loc & _LOW, *head)
        return ref

    def _build_unit(self, u: Unit, nodes: list[tuple[int, Node]],
                    declared: dict[str, TensorInfo]) -> dict[str, int]:
        """Number the unit's tensors (into `where`), build its table, keep its records if
        it is retained; returns its tensors by local number."""
        d, _ = u
        wanted = self.wanted
        ns = [n for _, n in nodes]  # already in canonical order (_classify)
        ins, outs = list(map(_INPUTS, ns)), list(map(_OUTPUTS, ns))
        prod = set(chain.from_iterable(outs))
        prod.discard(None)
        own = prod.union(declared)  # the unit's tensors: written by it, or its inputs
        # numbered by first use, inputs then outputs, node by node: every name's first use
        # (one lookup a name), the unit's own among them (one a distinct name), then every
        # input's and output's number (one a name; the table's columns take them, not a
        # lookup again)
        local = dict(zip(filter(own.__contains__,
                                dict.fromkeys(chain.from_iterable(map(add, ins, outs)))),
                         count()))
        codes = [np.fromiter(map(local.get, chain.from_iterable(col), repeat(-1)), np.int64)
                 for col in (ins, outs)]
        index = self.unit_index.get(u)
        if index is None:
            index = self.unit_index[u] = len(self.units_by_index)
            self.units_by_index.append(u)
        packed = index << _SHIFT
        self.where.update(zip(local, range(packed, packed + len(local))))
        infos = list(map(declared.get, local))
        if None in infos:
            for k, x in enumerate(local):
                if infos[k] is None:
                    infos[k] = self.sec_tensors.get(x) or self.held_decl.get(x)
                    if infos[k] is None:
                        raise FoldRefused(f"tensor {x} of unit {u} was not declared in its "
                                          "section")

        if wanted is None:  # instance_table asks `outside` only for names not in `local`
            self.src._tables[u] = instance_table(u, infos, nodes, ins, outs, local,
                                                 self._outside_ref(u, d), self.src.intern,
                                                 tuple(codes))
        if self._retained(u):
            self.src._records[u] = UnitRecords(list(map(as_model, infos)),
                                               [(pos, as_model(n)) for pos, n in nodes], [])
        return local

    def _retained(self, u: Unit) -> bool:
        if self.wanted is not None:
            return u[0] in self.wanted
        r = self.src.retain
        return u[0] < r and (u[1] is None or u[1] < r)

    # ---- the end of the nodes: replica units

    def end_nodes(self) -> None:
        """Replica units: their nodes ordered level by level (as units.py), their tensors
        numbered after what their instance units read."""
        for d in sorted(self.held_nodes):
            self._build_replica(d, self.held_nodes[d])

    def _build_replica(self, d: int, members: list[tuple[int, Node]]) -> None:
        if self.wanted is not None:  # every replica unit was retained by the first reading
            return
        u: Unit = (d, None)
        base = d * self.per
        mine = {x for _, n in members for x in n.outputs if x is not None}
        level: dict[int, int] = {}
        producer: dict[str, int] = {}
        for pos, n in members:
            level[pos] = 1 + max((level[producer[x]] for x in n.inputs
                                  if x is not None and x in producer), default=-1)
            for x in n.outputs:
                if x is not None:
                    producer[x] = pos
        nums = self.rep_num[d]

        def owned(x: str) -> bool:
            if x in mine:
                return True
            if x in self.where or x in self.held_prod:
                return False
            d2 = self.owner.setdefault(x, d)
            if d2 != d:
                raise FoldRefused(f"tensor {x} is read by replicas {d2} and {d}: a graph "
                                  "input of no replica cannot be streamed")
            return True

        ordered: list[tuple[int, Node]] = []
        by_level: dict[int, list[tuple[int, Node]]] = defaultdict(list)
        for e in members:  # members in file order, each level's too
            by_level[level[e[0]]].append(e)
        for lev in range(max(level.values(), default=-1) + 1):
            def key(e, nums=nums):
                pos, n = e
                read = sorted(nums.get(x, -1) if x not in self.where else
                              self.where[x] & ((1 << _SHIFT) - 1)
                              for x in n.inputs if x is not None)
                return (n.rank - base, n.op, read, pos)
            batch = sorted(by_level[lev], key=key)
            ordered += batch
            for _, n in batch:
                for x in (*n.inputs, *n.outputs):
                    if x is not None and x not in nums and owned(x):
                        nums[x] = len(nums)
        infos = []
        for x in nums:
            info = self.held_decl.get(x)
            if info is None:
                info = self._held_info(x)
            infos.append(info)
        self.replica_tensors[d] = infos

        # the replica's own tensors by number, every other one through `_outside` (what a
        # `locate` for build_table would answer, name by name), over columns
        owner = self.owner
        own = {x: k for x, k in nums.items() if x in mine or owner.get(x) == d}
        ns = [n for _, n in ordered]
        self.src._tables[u] = instance_table(
            u, infos, ordered, list(map(_INPUTS, ns)), list(map(_OUTPUTS, ns)), own,
            self._outside_ref(u, d), self.src.intern)
        self.src._records[u] = UnitRecords(  # small: every one is kept
            list(map(as_model, infos)), [(pos, as_model(n)) for pos, n in ordered], [])

    def _held_info(self, x: str) -> TensorInfo:
        info = self.held_decl.get(x)
        if info is None:
            raise FoldRefused(f"tensor {x} written by a replica unit was not declared "
                              "before the lineages")
        return info

    # ---- lineages

    def locate(self, x: str) -> tuple[Unit | None, int]:
        loc = self.where.get(x)
        if loc is not None:
            return self.units_by_index[loc >> _SHIFT], loc & ((1 << _SHIFT) - 1)
        d = self.held_prod.get(x)
        if d is None:
            d = self.owner.get(x)
        if d is not None:
            k = self.rep_num[d].get(x)
            if k is not None:
                return (d, None), k
        return None, self._global_number(x)

    def _global_number(self, x: str) -> int:
        nums = self.glob_num
        k = nums.get(x)
        if k is None:
            info = self.held_decl.get(x)
            if info is None:
                raise FoldRefused(f"lineage tensor {x} belongs to no unit")
            k = nums[x] = len(nums)
            if self.wanted is None:
                self.src._global.tensors.append(as_model(info))
        return k

    def lineage(self, lin: Lineage) -> None:
        self.lineage_index += 1
        self.lineages.append(Lineage(lin.index, lin.single, (), None, lin.hypothesis))
        if lin.hypothesis:
            raise FoldRefused("lineages that are hypotheses are verified from the whole plan")
        parts = lin.parts
        if self.wanted is None and self._fast_parts(lin):
            return
        for pos, p in enumerate(parts):
            refs = list(map(self.locate, p.sum_of))
            us = {r[0] for r in refs}
            if len(us) == 1 and None not in us:
                u = us.pop()
                if self.wanted is None or u[0] in self.wanted:
                    self.parts[u].append((lin.index, pos, p))
                    self.part_refs[u].append([reference(u, *r) for r in refs])
            elif self.wanted is None:
                self.src._global.parts.append((lin.index, pos, p))
                self.src._global.part_refs.append(refs)

    def _fast_parts(self, lin: Lineage) -> bool:
        """A lineage whose every part is one tensor of an instance unit, over columns: its
        parts of units whose records are not retained go to `chunks` (numpy), the others
        through `lineage`'s loop. False (nothing done) for any other lineage."""
        parts = lin.parts
        sums = list(map(_SUM_OF, parts))
        if set(map(len, sums)) != {1}:
            return False
        locs = np.fromiter(map(self.where.get, map(_FIRST, sums), repeat(-1)), np.int64,
                           len(sums))
        if locs.min() < 0:
            return False
        uidx = locs >> _SHIFT
        if len(self.retained_idx) < len(self.units_by_index):
            self.retained_idx = np.array([self._retained(u) for u in self.units_by_index])
        keep = self.retained_idx[uidx]
        rest = np.flatnonzero(~keep)
        rest_parts = [parts[i] for i in rest.tolist()]
        raw = list(map(_SLICE, rest_parts))  # (start, stop) pairs (the records' type)
        ranks = set(map(len, raw))
        if len(ranks) > 1:  # every slice of one lineage has its single tensor's rank
            return False
        rank = ranks.pop() if ranks else 0
        if rank > MAX_DIMS:
            return False
        slc = np.fromiter(chain.from_iterable(chain.from_iterable(raw)), np.int64,
                          2 * rank * len(raw)).reshape(len(raw), 2 * rank)
        for pos in np.flatnonzero(keep).tolist():
            p = parts[pos]
            u = self.units_by_index[int(uidx[pos])]
            self.parts[u].append((lin.index, pos, p))
            self.part_refs[u].append([reference(u, u, int(locs[pos] & _LOW))])
        if not len(rest):
            return True
        scales = list(map(_SCALE, rest_parts))
        intern = self.src.intern
        if len(set(map(id, scales))) == 1:
            scale = np.full(len(rest), intern(scales[0]), dtype=np.int64)
        else:
            scale = np.array([intern(x) for x in scales], dtype=np.int64)
        # slices as wide as this lineage's (2 * its rank), not table.MAX_DIMS: on a 32-layer
        # dp16 plan these columns are most of what the lineages leave behind
        self.chunks.append((uidx[rest], np.full(len(rest), lin.index, dtype=np.int64), rest,
                            scale, slc, locs[rest] & _LOW))
        return True

    def _chunk_columns(self) -> dict[int, dict[str, np.ndarray]]:
        """The fast parts, per unit index, as table columns."""
        if not self.chunks:
            return {}
        # column by column, each chunk's piece freed as soon as it is copied (the chunks
        # are the largest thing left at the end of the file)
        cols = [list(c) for c in zip(*self.chunks)]
        self.chunks = []
        width = max(s.shape[1] for s in cols[4])
        for i, pieces in enumerate(cols):
            if i == 4:  # slices: -1 padded to the widest lineage's
                whole = np.full((sum(map(len, pieces)), width), -1, dtype=np.int64)
                at = 0
                for s in pieces:
                    whole[at:at + len(s), :s.shape[1]] = s
                    at += len(s)
            else:
                whole = np.concatenate(pieces)
            pieces.clear()
            cols[i] = whole
        u, lin, pos = cols[0], cols[1], cols[2]
        order = np.lexsort((pos, lin, u))
        for i in range(len(cols)):
            cols[i] = cols[i][order]
        u, lin, pos, scale, slices, k = cols
        del cols
        bounds = [0, *(np.flatnonzero(np.diff(u)) + 1).tolist(), len(u)]
        out = {}
        for a, b in zip(bounds, bounds[1:]):  # each unit's rows: contiguous, so views
            unit = self.units_by_index[int(u[a])]
            sums = np.empty((b - a, 4), dtype=np.int64)
            sums[:] = reference(unit, unit, 0)
            sums[:, 0] = k[a:b]
            out[int(u[a])] = dict(p_lin=lin[a:b], p_pos=pos[a:b], p_scale=scale[a:b],
                                  p_slice=slices[a:b],
                                  p_sum_ptr=np.arange(b - a + 1, dtype=np.int64), p_sum=sums)
        return out

    def finish(self) -> None:
        src = self.src
        fast = self._chunk_columns() if self.wanted is None else {}
        for index, cols in fast.items():
            u = self.units_by_index[index]
            if u in self.parts:  # also parts through the loop: merged in (lineage, position)
                slow = part_columns(self.parts.pop(u), None, src.intern,
                                    self.part_refs.pop(u))
                cols = merge_part_columns(dict(cols, p_slice=_padded(cols["p_slice"],
                                                                      slow["p_slice"].shape[1])),
                                          slow)
            for name, value in cols.items():
                setattr(src._tables[u], name, value)
        for u, parts in self.parts.items():
            if self.wanted is None and u not in src._tables:
                raise FoldRefused(f"lineage parts name unit {u}, which has no node")
            if self.wanted is None:
                attach_parts(src._tables[u], parts, self.part_refs[u], src.intern)
            recs = src._records.get(u)
            if recs is not None and (self.wanted is None or u[1] is not None):
                recs.parts = list(parts)
        if self.wanted is None:
            _trim_slices(src._tables.values())
            if REPRESENTATIVE not in src._tables:
                raise FoldRefused("replica 0 has no node of micro-batch 0")
            h = src.header_rec
            src.header = Plan(h.path, h.name, h.kind, h.world, {}, [], list(h.outputs),
                              self.lineages)


def _trim_slices(tables) -> None:
    """Slice columns no part uses (the tables pad slices to table.MAX_DIMS dimensions) are
    dropped from every table of the file alike: the same comparisons, less memory."""
    tables = list(tables)
    used = [np.flatnonzero((t.p_slice != -1).any(axis=0)) for t in tables if len(t.p_slice)]
    width = max((int(u[-1]) + 1 for u in used if len(u)), default=0)
    width += width % 2
    for t in tables:
        t.p_slice = np.ascontiguousarray(_padded(t.p_slice[:, :width], width))


def _padded(slices: np.ndarray, width: int) -> np.ndarray:
    """Slice rows -1 padded to `width` columns (the lineage parts read over columns are only
    as wide as their lineage's)."""
    if slices.shape[1] >= width:
        return slices
    out = np.full((len(slices), width), -1, dtype=np.int64)
    out[:, :slices.shape[1]] = slices
    return out


__all__ = ["FilePlan"]
