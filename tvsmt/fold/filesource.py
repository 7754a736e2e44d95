"""A JSON Lines plan file as a unit source: units stream from the file into the folder.

`FilePlan` reads the file once with `tvsmt.plan.stream.iter_records` (every record checked
there, as for any read) and never holds the parallel plan whole. What it keeps:

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
import numpy as np

from tvsmt.fold.folder import SUM_OPS, FoldRefused, UnitRecords
from tvsmt.fold.source import unit_order
from tvsmt.fold.table import Interner, UnitTable, attach_parts, build_table
from tvsmt.fold.units import REPRESENTATIVE, Unit, WorldUnits
from tvsmt.plan.mesh import Mesh
from tvsmt.plan.model import Lineage, LineagePart, Node, Plan, TensorInfo
from tvsmt.plan.stream import Section, StreamHeader, iter_records

_SHIFT = 32  # packed location: unit index << _SHIFT | local number


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
        reading for exceptions); None: the first reading, which builds everything."""
        it = iter_records(self.path)
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
            if kind is Node:
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
        self.sec_prod: dict[Unit, set[str]] = {}  # tensors written by each unit of the section
        self.glob_num: dict[str, int] = {}
        self.done_units: set[Unit] = set()
        self.unit_index: dict[Unit, int] = {}
        self.units_by_index: list[Unit] = []
        self.where: dict[str, int] = {}  # instance tensor -> packed (unit index, number)
        self.held_decl: dict[str, TensorInfo] = {}  # graph inputs of no instance unit
        self.held_prod: dict[str, int] = {}  # tensor -> replica whose held node writes it
        self.owner: dict[str, int] = {}  # held graph input -> the replica that reads it
        self.rep_num: dict[int, dict[str, int]] = defaultdict(dict)  # replica tensors
        self.held_nodes: dict[int, list[tuple[int, Node]]] = defaultdict(list)
        self.parts: dict[Unit, list] = defaultdict(list)  # (lin, pos, part) per unit
        self.lineage_index = 0
        self.lineages: list[Lineage] = []
        self.replica_tensors: dict[int, list[TensorInfo]] = {}

    # ---- nodes

    def _unit_of_produced(self, x: str) -> Unit | None:
        loc = self.where.get(x)
        if loc is not None:
            return self.units_by_index[loc >> _SHIFT]
        for u, prod in self.sec_prod.items():
            if x in prod:
                return u
        d = self.held_prod.get(x)
        return None if d is None else (d, None)

    def node(self, n: Node) -> None:
        pos = self.pos
        self.pos += 1
        try:
            d = self.mesh.replica_of(n.rank)
        except ValueError:
            raise FoldRefused(f"node {n.id}: rank {n.rank} outside the world") from None
        held = n.mb == -1
        if not held:
            if not 0 <= n.mb < self.wu.mb:
                raise FoldRefused(f"node {n.id}: micro-batch {n.mb} outside the world")
            if n.op in SUM_OPS and len(n.inputs) > 1:
                units = {self._unit_of_produced(x) for x in n.inputs if x is not None}
                units.discard(None)
                held = len(units) > 1
        if held:
            self.held_nodes[d].append((pos, n))
            for x in n.outputs:
                if x is not None:
                    self.held_prod[x] = d
            return
        u = (d, n.mb)
        if u in self.done_units:
            raise FoldRefused(f"node {n.id}: unit {u} continues after its section ended "
                              "(the file does not group records by unit)")
        nodes = self.sec_nodes.get(u)
        if nodes is None:
            nodes = self.sec_nodes[u] = []
            self.sec_prod[u] = set()
        nodes.append((pos, n))
        prod = self.sec_prod[u]
        for x in n.outputs:
            if x is not None:
                prod.add(x)

    def end_section(self) -> None:
        """Every instance unit with nodes in the section is complete: build its table."""
        alone = len(self.sec_nodes) == 1
        for u, nodes in self.sec_nodes.items():
            self._build_unit(u, nodes, self.sec_tensors if alone else {})
            self.done_units.add(u)
        for tid, info in self.sec_tensors.items():
            if tid not in self.where:
                self.held_decl[tid] = info
        self.sec_nodes = {}
        self.sec_prod = {}
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

    def _build_unit(self, u: Unit, nodes: list[tuple[int, Node]],
                    declared: dict[str, TensorInfo]) -> None:
        d, _ = u
        wanted = self.wanted
        base = d * self.per
        nodes.sort(key=lambda e: (e[1].rank - base, e[0]))
        prod = self.sec_prod.get(u, set())
        local: dict[str, int] = {}
        for _, n in nodes:
            for x in n.inputs:
                if x is not None and x not in local and (x in prod or x in declared):
                    local[x] = len(local)
            for x in n.outputs:
                if x is not None and x not in local:
                    local[x] = len(local)
        index = self.unit_index.get(u)
        if index is None:
            index = self.unit_index[u] = len(self.units_by_index)
            self.units_by_index.append(u)
        packed = index << _SHIFT
        self.where.update(zip(local, range(packed, packed + len(local))))
        infos = []
        for x in local:
            info = declared.get(x)
            if info is None:
                info = self.sec_tensors.get(x) or self.held_decl.get(x)
            if info is None:
                raise FoldRefused(f"tensor {x} of unit {u} was not declared in its section")
            infos.append(info)

        def locate(x: str) -> tuple[Unit | None, int]:
            k = local.get(x)
            if k is not None:
                return u, k
            return self._outside(x, d)

        if wanted is None:
            self.src._tables[u] = build_table(u, infos, nodes, [], locate, self.src.intern)
        if self._retained(u):
            self.src._records[u] = UnitRecords(infos, list(nodes), [])

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
        for lev in range(max(level.values(), default=-1) + 1):
            def key(e, nums=nums):
                pos, n = e
                read = sorted(nums.get(x, -1) if x not in self.where else
                              self.where[x] & ((1 << _SHIFT) - 1)
                              for x in n.inputs if x is not None)
                return (n.rank - base, n.op, read, pos)
            batch = sorted((e for e in members if level[e[0]] == lev), key=key)
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

        def locate(x: str) -> tuple[Unit | None, int]:
            k = nums.get(x)
            if k is not None and (x in mine or self.owner.get(x) == d):
                return u, k
            return self._outside(x, d)

        self.src._tables[u] = build_table(u, infos, ordered, [], locate, self.src.intern)
        self.src._records[u] = UnitRecords(infos, ordered, [])  # small: every one is kept

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
                self.src._global.tensors.append(info)
        return k

    def lineage(self, lin: Lineage) -> None:
        self.lineage_index += 1
        self.lineages.append(Lineage(lin.index, lin.single, (), None, lin.hypothesis))
        if lin.hypothesis:
            raise FoldRefused("lineages that are hypotheses are verified from the whole plan")
        for pos, p in enumerate(lin.parts):
            refs = [self.locate(x) for x in p.sum_of]
            us = {r[0] for r in refs}
            if len(us) == 1 and None not in us:
                u = us.pop()
                if self.wanted is None or u[0] in self.wanted:
                    self.parts[u].append((lin.index, pos, p))
            elif self.wanted is None:
                self.src._global.parts.append((lin.index, pos, p))
                self.src._global.part_refs.append(refs)

    def finish(self) -> None:
        src = self.src
        for u, parts in self.parts.items():
            if self.wanted is None and u not in src._tables:
                raise FoldRefused(f"lineage parts name unit {u}, which has no node")
            if self.wanted is None:
                attach_parts(src._tables[u], u, parts, self.locate, src.intern)
            recs = src._records.get(u)
            if recs is not None and (self.wanted is None or u[1] is not None):
                recs.parts = list(parts)
        if self.wanted is None:
            if REPRESENTATIVE not in src._tables:
                raise FoldRefused("replica 0 has no node of micro-batch 0")
            h = src.header_rec
            src.header = Plan(h.path, h.name, h.kind, h.world, {}, [], list(h.outputs),
                              self.lineages)


__all__ = ["FilePlan"]
