"""One unit's records as integer arrays, so that "is this unit a copy?" is a few array
comparisons instead of millions of string operations.

A table holds a unit's tensors (shapes, by local number: units.py), nodes (op, pass, rank,
micro-batch, semantic attributes, inputs, outputs) and lineage parts (lineage, scale, slice,
sum_of), in the order the producer gave them. Tensors are never named: every input, output
and part tensor is a *reference*, four integers (k, replica, micro-batch, kind):

* a tensor of a unit (kind UNIT): k is its local number in that unit; the replica is 0 for
  the table's own replica, else OTHER + d; the micro-batch is SAME for the table's own
  (instance) micro-batch, NO_MB for a replica unit, else the micro-batch itself;
* a global tensor (kind GLOBAL): k is its number among the global tensors;
* an absent slot: NULL everywhere.

So a table is already relative to its unit: a unit is a copy of the representative when,
after renaming ranks (table.rename_ranks) and replacing each sum over units by one row (its
level and the local number every unit contributes), every column is equal, position by
position; the only allowed difference is the translation of slices along the batch (checked
by the folder). A unit listed in another order is simply not recognised as a copy and is
verified itself: never a wrong pass, only less folding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from tvsmt.fold.units import Unit, WorldUnits
from tvsmt.ops import get as get_op
from tvsmt.plan.model import LineagePart, Node, TensorInfo

NULL = -3  # an absent slot (None)
SAME = -2  # micro-batch column: the table's own micro-batch
NO_MB = -1  # micro-batch column: a replica unit
UNIT, GLOBAL, GROUP = 0, 1, 2  # kinds of reference
OTHER = 1 << 40  # added to replica numbers / ranks of other replicas
MAX_DIMS = 8
NULL_REF = (NULL, NULL, NULL, NULL)

Locate = Callable[[str], "tuple[Unit | None, int]"]  # tensor id -> (its unit, local number)


class Interner:
    """Strings (ops, attribute texts, shapes) to small ints, shared by all tables."""

    def __init__(self):
        self.index: dict = {}
        self.values: list = []

    def __call__(self, value) -> int:
        i = self.index.get(value)
        if i is None:
            i = self.index[value] = len(self.values)
            self.values.append(value)
        return i


def reference(unit: Unit, target: Unit | None, k: int) -> tuple[int, int, int, int]:
    """The reference from a table of `unit` to tensor number k of `target` (None: global)."""
    if target is None:
        return (k, 0, 0, GLOBAL)
    d, m = unit
    d2, m2 = target
    dd = 0 if d2 == d else OTHER + d2
    if m2 is None:
        mm = NO_MB
    elif m is not None and dd == 0 and m2 == m:
        mm = SAME
    else:
        mm = m2
    return (k, dd, mm, UNIT)


def absolute_units(refs: np.ndarray, unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    """(replica, micro-batch or -1) of the UNIT references of a table of `unit`."""
    d, m = unit
    d2 = np.where(refs[:, 1] == 0, d, refs[:, 1] - OTHER)
    m2 = np.where(refs[:, 2] == SAME, -1 if m is None else m, refs[:, 2])
    return d2, m2


def _csr(lists: list[list[tuple]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = [row for x in lists for row in x]
    return ptr, np.array(flat, dtype=np.int64).reshape(-1, 4)


_ATTRS_SEEN: dict[tuple[str, str], tuple[str, list[int]]] = {}


def semantic_attrs(node: Node) -> tuple[str, list[int]]:
    """(attribute text with rank numbers taken out, those rank numbers); memoised on the
    attributes' repr (equal reprs are equal attributes; most nodes repeat a few)."""
    key = (node.op, repr(node.attrs))
    hit = _ATTRS_SEEN.get(key)
    if hit is None:
        if len(_ATTRS_SEEN) > 100_000:
            _ATTRS_SEEN.clear()
        hit = _ATTRS_SEEN[key] = _semantic_attrs(node)
    return hit[0], list(hit[1])


def _semantic_attrs(node: Node) -> tuple[str, list[int]]:
    reads = get_op(node.op).semantic_attrs
    attrs = node.attrs if reads is None else reads(node.attrs)
    if not attrs:
        return "", []
    ranks: list[int] = []
    rank_keys = get_op(node.op).rank_attrs
    if isinstance(attrs, dict) and any(k in attrs for k in rank_keys):
        attrs = dict(attrs)
        for k in rank_keys:
            v = attrs.get(k)
            if isinstance(v, int):
                ranks.append(v)
                attrs[k] = "#"
            elif isinstance(v, list) and all(isinstance(r, int) for r in v):
                ranks += v
                attrs[k] = ["#"] * len(v)
    return json.dumps(attrs, sort_keys=True, default=str), ranks


@dataclass
class UnitTable:
    t_shape: np.ndarray  # interned shape tuple, by local number
    n_op: np.ndarray
    n_pass: np.ndarray
    n_rank: np.ndarray
    n_mb: np.ndarray
    n_attrs: np.ndarray  # interned attribute text
    n_attr_ptr: np.ndarray  # rank numbers inside the attributes (CSR)
    n_attr_ranks: np.ndarray
    n_in_ptr: np.ndarray
    n_in: np.ndarray  # (k, 4) references
    n_out_ptr: np.ndarray
    n_out: np.ndarray
    n_pos: np.ndarray  # position in the plan (ordering of the folded plan)
    p_lin: np.ndarray
    p_pos: np.ndarray  # position in its lineage
    p_scale: np.ndarray  # interned Fraction
    p_slice: np.ndarray  # (n, 2*MAX_DIMS), -1 padded
    p_sum_ptr: np.ndarray
    p_sum: np.ndarray

    def copy(self) -> "UnitTable":
        return UnitTable(**{f.name: getattr(self, f.name).copy() for f in fields(self)})


def build_table(unit: Unit, tensors: list[TensorInfo], nodes: list[tuple[int, Node]],
                parts: list[tuple[int, int, LineagePart]], locate: Locate,
                intern: Interner) -> UnitTable:
    """A unit's records in table form; `tensors` are the unit's own, by local number."""
    cache: dict[str, tuple] = {}

    def ref(x: str | None) -> tuple:
        if x is None:
            return NULL_REF
        r = cache.get(x)
        if r is None:
            r = cache[x] = reference(unit, *locate(x))
        return r

    attrs = [semantic_attrs(n) for _, n in nodes]
    ap, ar = _csr([[(r, 0, 0, 0) for r in rs] for _, rs in attrs])
    ip, ins = _csr([[ref(x) for x in n.inputs] for _, n in nodes])
    op_, outs = _csr([[ref(x) for x in n.outputs] for _, n in nodes])
    arr = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return UnitTable(
        t_shape=arr([intern(t.shape) for t in tensors]),
        n_op=arr([intern(n.op) for _, n in nodes]),
        n_pass=arr([intern(n.pass_) for _, n in nodes]),
        n_rank=arr([n.rank for _, n in nodes]), n_mb=arr([n.mb for _, n in nodes]),
        n_attrs=arr([intern(a) for a, _ in attrs]), n_attr_ptr=ap, n_attr_ranks=ar[:, 0].copy(),
        n_in_ptr=ip, n_in=ins, n_out_ptr=op_, n_out=outs,
        n_pos=arr([pos for pos, _ in nodes]),
        **part_columns(parts, ref, intern))


def part_columns(parts: list[tuple[int, int, LineagePart]], ref: Callable[[str], tuple],
                 intern: Interner) -> dict[str, np.ndarray]:
    """The lineage-part columns of a table (`ref`: tensor id -> reference)."""
    slices = np.full((len(parts), 2 * MAX_DIMS), -1, dtype=np.int64)
    for i, (_, _, p) in enumerate(parts):
        if len(p.slice) > MAX_DIMS:
            raise ValueError(f"a lineage slice with more than {MAX_DIMS} dimensions")
        for k, (a, b) in enumerate(p.slice):
            slices[i, 2 * k], slices[i, 2 * k + 1] = a, b
    sp, sums = _csr([[ref(x) for x in p.sum_of] for _, _, p in parts])
    arr = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return dict(p_lin=arr([lin for lin, _, _ in parts]), p_pos=arr([pos for _, pos, _ in parts]),
                p_scale=arr([intern(p.scale) for _, _, p in parts]), p_slice=slices,
                p_sum_ptr=sp, p_sum=sums)


def attach_parts(tab: UnitTable, unit: Unit, parts: list[tuple[int, int, LineagePart]],
                 locate: Locate, intern: Interner) -> None:
    """Set a table's lineage parts afterwards (a streamed unit's parts come at the end of
    its file, after its nodes were dropped)."""
    cols = part_columns(parts, lambda x: reference(unit, *locate(x)), intern)
    for name, value in cols.items():
        setattr(tab, name, value)


# ----------------------------------------------------------------------------- renaming


def rename_ranks(ranks: np.ndarray, d: int, per: int) -> np.ndarray:
    """Ranks of replica d relative to it; ranks of other replicas marked OTHER."""
    inrep = (ranks >= d * per) & (ranks < (d + 1) * per)
    return np.where(inrep, ranks - d * per, ranks + OTHER)


class GroupError(Exception):
    """A sum over units that does not take one copy from every unit of a level."""


def group_level(pairs: list[tuple[int, int]], wu: WorldUnits, d_self: int) -> int | None:
    """Level of a sum over the units `pairs` ((replica, micro-batch or -1)): 0 one per replica
    (replica units); 1 one per micro-batch of the summing node's own replica d_self; 2 one per
    (replica, micro-batch); None all in one unit; -1 anything else."""
    units = set(pairs)
    if len(units) == 1:
        return None
    if len(units) != len(pairs):
        return -1
    ds = [d for d, _ in pairs]
    ms = [m for _, m in pairs]
    if any(not 0 <= d < wu.dp for d in ds):
        return -1
    if all(m == -1 for m in ms):
        return 0 if sorted(ds) == list(range(wu.dp)) else -1
    if any(not 0 <= m < wu.mb for m in ms):
        return -1
    if set(ds) == {d_self} and sorted(ms) == list(range(wu.mb)):
        return 1
    if (len(set(ds)) > 1 or wu.dp == 1) and len(units) == wu.dp * wu.mb:
        return 2
    return -1


def group_rows(tab: UnitTable, unit: Unit, sum_ops: np.ndarray, wu: WorldUnits) -> np.ndarray:
    """Nodes whose op is a sum (grad_accum, reducer, all_reduce) over more than one unit
    (found without a Python loop over the nodes)."""
    rows = np.flatnonzero(np.isin(tab.n_op, sum_ops))
    ptr = tab.n_in_ptr
    rows = rows[ptr[rows + 1] - ptr[rows] >= 2]
    if not len(rows):
        return rows
    lens = ptr[rows + 1] - ptr[rows]
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    idx = np.repeat(ptr[rows] - offsets, lens) + np.arange(lens.sum())
    refs = tab.n_in[idx]
    d2, m2 = absolute_units(refs, unit)
    key = np.where(refs[:, 3] == UNIT, d2 * (wu.mb + 2) + m2 + 1, -1)
    lo = np.minimum.reduceat(key, offsets)
    hi = np.maximum.reduceat(key, offsets)
    return rows[lo != hi]


def group_row(refs: np.ndarray, unit: Unit, wu: WorldUnits
              ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The one row standing for a sum over units, (k, level, 0, GROUP), k the local number
    most units contribute, and the units (replica, micro-batch or -1) that contribute another
    tensor: those must turn out not to be copies (the folder checks). GroupError when the sum
    does not take one tensor from every unit of a level."""
    if (refs[:, 3] != UNIT).any():
        raise GroupError("a sum over units that also reads a tensor of no unit")
    d2, m2 = absolute_units(refs, unit)
    level = group_level(list(zip(d2.tolist(), m2.tolist())), wu, unit[0])
    if level is None or level < 0:
        raise GroupError("a sum over replicas/micro-batches that misses some of them")
    ks = refs[:, 0]
    values, counts = np.unique(ks, return_counts=True)
    k = int(values[counts.argmax()])
    odd = np.flatnonzero(ks != k)
    deviations = [(int(d2[i]), int(m2[i])) for i in odd.tolist()]
    return np.array([k, level, 0, GROUP], dtype=np.int64), deviations


def canonical_inputs(tab: UnitTable, unit: Unit, wu: WorldUnits, sum_ops: np.ndarray,
                     deviations: list | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The input column with every sum over units replaced by its group row; also the rows
    (nodes) that are such sums. Units contributing an odd tensor go to `deviations`."""
    ins = tab.n_in.copy()
    ptr = tab.n_in_ptr
    keep = np.ones(len(ins), dtype=bool)
    rows = group_rows(tab, unit, sum_ops, wu)
    for i in rows.tolist():
        a, b = ptr[i], ptr[i + 1]
        try:
            ins[a], odd = group_row(tab.n_in[a:b], unit, wu)
            if deviations is not None:
                deviations += odd
        except GroupError as e:
            raise GroupError(i, str(e)) from None
        keep[a + 1:b] = False
    new_ptr = np.concatenate([[0], np.cumsum(keep)])[ptr]
    return ins[keep], new_ptr, rows
