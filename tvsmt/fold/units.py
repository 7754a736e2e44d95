"""Replica units, recognised from the plan's structure (never from tensor or node names).

A parallel plan with dp data-parallel replicas and mb micro-batches repeats the same work
dp*mb times. tvsmt names each repetition a *unit*:

* the instance unit (d, m): what replica d does for micro-batch m (forward, backward, the
  tensor- and pipeline-parallel communication inside the replica, in-flight messages);
* the replica unit (d, None): what replica d holds across micro-batches (its weights, the
  accumulated gradients, the reducers).

Which unit a record belongs to is read from the nodes' `rank` and `mb` fields (through the
world's `Mesh`) and from the dataflow:

* a node's unit is (Mesh.replica_of(rank), mb), except that it is the replica unit
  (replica_of(rank), None) when its mb is -1 or when it is a sum over units: an operator whose
  registry entry says `unit_sum` (grad_accum, reducer, all_reduce) reading tensors of more
  than one unit;
* a tensor's unit is its producer's (an in-flight message is its sender's); a graph input's
  is its consumers' unit when they are all in one, the replica unit when they are all in one
  replica, else it belongs to no unit (a global tensor);
* a lineage part belongs to the unit of its tensors when they are all in one, else it is
  global.

Inside a unit, tensors are numbered by first use (scanning the plan's nodes in order, inputs
then outputs): first uses by the unit's own nodes, then by nodes of its replica, then by any
node; those no node uses follow in the plan's tensor order. A unit is compared with its
representative through these numbers (table.py), so a producer's naming never matters. Nothing
relies on this for soundness: a record that does not fit simply fails to match its
representative, and its unit is then verified as it is (see folder.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain, repeat

from tvsmt.ops import all_ops
from tvsmt.plan.mesh import Mesh
from tvsmt.plan.model import Plan

Unit = tuple[int, "int | None"]  # (replica d, micro-batch m or None for the replica unit)
REPRESENTATIVE: Unit = (0, 0)
REPRESENTATIVE_REPLICA: Unit = (0, None)
# the ops whose nodes may sum over units (a gradient reducer; OpSpec.unit_sum)
SUM_OPS = frozenset(name for name, spec in all_ops().items() if spec.unit_sum)


class NoUnits(Exception):
    """The plan's records cannot be put into units (a rank or micro-batch outside the world)."""


class FoldRefused(Exception):
    """The plan does not have the structure folding needs; verify it unfolded."""


class NodeRefused(FoldRefused):
    """A refusal about one node of a unit, which the check knows by its position only: its
    callers name it by its id (`naming`) from the unit's records."""

    def __init__(self, pos: int, why: str):
        super().__init__(f"node #{pos}: {why}")
        self.pos, self.why = pos, why

    def naming(self, nodes) -> FoldRefused:
        """The same refusal with the node's id, found among a unit's (position, node)
        records (its position, if they do not hold it)."""
        name = next((n.id for pos, n in nodes if pos == self.pos), f"#{self.pos}")
        return FoldRefused(f"node {name}: {self.why}")


def unit_order(units) -> list[Unit]:
    """Representatives first, then instance units, then replica units."""
    return sorted(units, key=lambda u: (u not in (REPRESENTATIVE, REPRESENTATIVE_REPLICA),
                                        u[1] is None, u[0], -1 if u[1] is None else u[1]))


@dataclass(frozen=True)
class WorldUnits:
    """The unit grid of one parallel plan."""

    dp: int
    mb: int
    per_replica: int  # ranks per replica = pp * tp

    @classmethod
    def of(cls, world: dict) -> "WorldUnits":
        def get(key: str) -> int:
            value = world.get(key, 1)
            return value if isinstance(value, int) and value > 0 else 1
        mesh = Mesh(get("dp"), get("pp"), get("tp"))
        return cls(mesh.dp, get("mb"), mesh.per_replica)

    def nothing_to_fold(self, extra: int = 0) -> bool:
        """At most 2 (+ `extra`) replicas and micro-batches: a fold would keep them all."""
        return self.dp <= 2 + extra and self.mb <= 2 + extra

    def instance_units(self) -> list[Unit]:
        return [(d, m) for d in range(self.dp) for m in range(self.mb)]


@dataclass
class UnitMap:
    """Where every record of a plan belongs (see the module docstring)."""

    node_unit: list[Unit]  # per node, in plan order
    tensor_unit: dict[str, Unit | None]  # None: a global tensor
    number: dict[str, int]  # local number inside its unit (global tensors: among globals)
    order: dict[Unit, list[int]]  # each unit's nodes (plan positions) in canonical order

    def locate(self, tid: str) -> tuple[Unit | None, int]:
        return self.tensor_unit[tid], self.number[tid]


def node_units(plan: Plan, wu: WorldUnits, sum_ops: frozenset[str]
               ) -> tuple[list[Unit], dict[str, Unit]]:
    """Each node's unit, and the unit of each tensor a node produces."""
    try:
        mesh = Mesh.of({k: v for k, v in plan.world.items() if k in ("dp", "pp", "tp")})
    except (TypeError, ValueError) as e:
        raise NoUnits(f"the plan's world: {e}") from None
    produced: dict[str, Unit] = {}
    node_unit: list[Unit] = []
    size, per, mbs = mesh.dp * mesh.pp * mesh.tp, mesh.per_replica, wu.mb
    same: dict[tuple[int, int], Unit] = {}  # (rank, mb) -> unit, one tuple each
    for n in plan.nodes:
        r, m = n.rank, n.mb
        u = same.get((r, m))
        if u is None:
            if not (isinstance(r, int) and 0 <= r < size):
                raise NoUnits(f"node {n.id}: rank {r} outside the world")
            if m == -1:
                u = (r // per, None)
            elif not 0 <= m < mbs:
                raise NoUnits(f"node {n.id}: micro-batch {m} outside the world")
            else:
                u = (r // per, m)
            same[(r, m)] = u
        if u[1] is not None and n.op in sum_ops and len(n.inputs) > 1:
            units = {produced.get(x) for x in n.inputs if x is not None}
            units.discard(None)
            if len(units) > 1:
                u = (u[0], None)  # a sum over units belongs to its replica
        node_unit.append(u)
        produced.update(zip(n.outputs, repeat(u)))
    produced.pop(None, None)  # an absent output slot
    return node_unit, produced


def assign_units(plan: Plan, wu: WorldUnits, sum_ops: frozenset[str],
                 known: "tuple[list[Unit], dict[str, Unit]] | None" = None) -> UnitMap:
    """Units of a loaded plan's nodes and tensors, from ranks, micro-batches and dataflow
    (`known`: the plan's `node_units`, when the caller has them)."""
    node_unit, produced = known if known is not None else node_units(plan, wu, sum_ops)
    reads: dict[Unit, list] = {}  # each unit's inputs
    for n, u in zip(plan.nodes, node_unit):
        r = reads.get(u)
        if r is None:
            r = reads[u] = []
        r += n.inputs
    # the graph inputs each unit and each replica reads, in set operations: an input read by
    # one unit is that unit's, by units of one replica that replica unit's, else global
    first: dict[str, Unit] = {}  # input -> the first unit found reading it
    shared: set[str] = set()  # inputs read by more than one unit
    by_replica: dict[int, set] = {}
    for u, xs in reads.items():
        unproduced = set(xs).difference(produced)
        unproduced.discard(None)
        fresh = unproduced.difference(first)
        first.update(dict.fromkeys(fresh, u))
        shared.update(unproduced.difference(fresh))
        by_replica.setdefault(u[0], set()).update(unproduced)
    replicas = Counter(chain.from_iterable(by_replica.values()))
    tensor_unit: dict[str, Unit | None] = dict(produced)
    tensor_unit.update(first)
    for x in shared:
        tensor_unit[x] = (first[x][0], None) if replicas[x] == 1 else None
    for x in plan.tensors:
        tensor_unit.setdefault(x, None)
    order, number = _canonical_order(plan, wu, node_unit, tensor_unit)
    return UnitMap(node_unit, tensor_unit, number, order)


def _canonical_order(plan: Plan, wu: WorldUnits, node_unit: list[Unit],
                     tensor_unit: dict[str, Unit | None]
                     ) -> tuple[dict[Unit, list[int]], dict[str, int]]:
    """Each unit's nodes in a canonical order and its tensors' local numbers.

    The plan's order is one topological order of the whole world, so it may interleave
    replicas differently (nnScaler lists a replica's reducers among its accumulations in
    another order on each replica). Instance units keep their nodes' plan order per rank
    relative to the replica. Replica units are ordered by dataflow: level by level (a node's
    level is 1 + the highest level of its producers inside the unit), and inside a level by
    (relative rank, op, the local numbers it reads, plan order); a replica unit's tensors that
    its instance units read first (weights) are numbered first, in those units' order."""
    per = wu.per_replica
    nodes = plan.nodes
    members: dict[Unit, list[int]] = {}
    for i, u in enumerate(node_unit):
        members.setdefault(u, []).append(i)
    counters: dict[Unit | None, int] = {}
    number: dict[str, int] = {}

    def num_all(xs: list, want: Unit | None) -> None:
        """Number, in the order of `xs`, those of its tensors of unit `want` not numbered yet
        (each tensor's first occurrence)."""
        new = [x for x in dict.fromkeys(xs)
               if x is not None and x not in number and tensor_unit[x] == want]
        if new:
            k = counters.get(want, 0)
            number.update(zip(new, range(k, k + len(new))))
            counters[want] = k + len(new)

    def reads_and_writes(idx) -> list:
        flat: list = []
        for i in idx:
            flat += nodes[i].inputs
            flat += nodes[i].outputs
        return flat

    order: dict[Unit, list[int]] = {}
    for u, idx in members.items():
        if u[1] is None:
            continue
        idx.sort(key=lambda i: (nodes[i].rank - u[0] * per, i))
        order[u] = idx
        num_all(reads_and_writes(idx), u)
    replicas = sorted(u for u in members if u[1] is None)
    for u in replicas:  # what the replica's instance units read first (its weights)
        num_all([x for m in range(wu.mb) for i in order.get((u[0], m), ())
                 for x in nodes[i].inputs], u)
    level: dict[int, int] = {}
    producer: dict[str, int] = {}
    for u in replicas:
        for i in members[u]:
            n = nodes[i]
            level[i] = 1 + max((level[producer[x]] for x in n.inputs
                                if x is not None and x in producer), default=-1)
            for x in n.outputs:
                if x is not None:
                    producer[x] = i
    top = max(level.values(), default=-1)
    for u in replicas:
        order[u] = []
    for lev in range(top + 1):
        for u in replicas:
            def key(i: int, u=u):
                n = nodes[i]
                read = sorted(number.get(x, -1) for x in n.inputs if x is not None)
                return (n.rank - u[0] * per, n.op, read, i)
            idx = sorted((i for i in members[u] if level[i] == lev), key=key)
            order[u] += idx
            num_all(reads_and_writes(idx), u)
    num_all([x for n in nodes for x in n.inputs], None)  # global tensors
    for x in plan.tensors:  # then whatever no node touches
        if x not in number:
            want = tensor_unit[x]
            k = counters.get(want, 0)
            number[x] = k
            counters[want] = k + 1
    return order, number
