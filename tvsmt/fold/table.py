"""One unit's records as integer arrays, so that "is this unit a copy?" is a few array
comparisons instead of millions of string operations.

Every id `base@r<r1>[>r<r2>][m<m>]` is stored as four integers (interned base, r1, r2, m), so
the renaming of units.py becomes arithmetic on the rank and micro-batch columns. A table
holds the unit's tensors (id, shape), nodes (id, op, pass, rank, micro-batch, semantic
attributes, inputs, outputs) and lineage parts (lineage, scale, slice, sum_of), in the order
the producer gave them. A unit is a copy of the representative when, after renaming, every
column is equal, position by position; the only allowed difference is the translation of
slices along the batch (checked by the folder). A unit listed in another order is simply not
recognised as a copy and is verified itself: never a wrong pass, only less folding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np

from tvsmt.fold.units import WorldUnits, parse_id
from tvsmt.ops import get as get_op
from tvsmt.plan.model import LineagePart, Node, TensorInfo

NO_RANK = -1  # r2 of an id with one rank; m of an id without micro-batch
GLOBAL = -2  # an id that is not of the unit form (its whole text is the "base")
NULL = -3  # an absent slot (None)
OTHER = 1 << 40  # added to ranks / micro-batches of other units after renaming
MAX_DIMS = 8


class Interner:
    """Strings (id bases, ops, attribute texts, shapes) to small ints, shared by all tables."""

    def __init__(self):
        self.index: dict = {}
        self.values: list = []

    def __call__(self, value) -> int:
        i = self.index.get(value)
        if i is None:
            i = self.index[value] = len(self.values)
            self.values.append(value)
        return i


def encode_id(tid: str | None, intern: Interner) -> tuple[int, int, int, int]:
    if tid is None:
        return (NULL, NULL, NULL, NULL)
    parsed = parse_id(tid)
    if parsed is None or len(parsed[1]) > 2:
        return (intern(tid), GLOBAL, GLOBAL, GLOBAL)
    base, ranks, m = parsed
    return (intern(base), ranks[0], ranks[1] if len(ranks) == 2 else NO_RANK,
            NO_RANK if m is None else m)


def decode_id(row, intern: Interner) -> str | None:
    base, r1, r2, m = row
    if base == NULL:
        return None
    if r1 == GLOBAL:
        return intern.values[base]
    ranks = f"r{r1}" + (f">r{r2}" if r2 != NO_RANK else "")
    return f"{intern.values[base]}@{ranks}" + ("" if m == NO_RANK else f"m{m}")


def _csr(lists: list[list[tuple]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = [row for x in lists for row in x]
    return ptr, np.array(flat, dtype=np.int64).reshape(-1, 4)


def semantic_attrs(node: Node) -> tuple[str, list[int]]:
    """(attribute text with rank numbers taken out, those rank numbers)."""
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
    t_ids: np.ndarray  # (n, 4)
    t_shape: np.ndarray  # interned shape tuple
    n_ids: np.ndarray
    n_op: np.ndarray
    n_pass: np.ndarray
    n_rank: np.ndarray
    n_mb: np.ndarray
    n_attrs: np.ndarray  # interned attribute text
    n_attr_ptr: np.ndarray  # rank numbers inside the attributes (CSR)
    n_attr_ranks: np.ndarray
    n_in_ptr: np.ndarray
    n_in: np.ndarray  # (k, 4)
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


def build_table(tensors: list[TensorInfo], nodes: list[tuple[int, Node]],
                parts: list[tuple[int, int, LineagePart]], intern: Interner) -> UnitTable:
    """A unit's records (as split from a loaded plan) in table form."""
    enc = encode_id
    attrs = [semantic_attrs(n) for _, n in nodes]
    slices = np.full((len(parts), 2 * MAX_DIMS), -1, dtype=np.int64)
    for i, (_, _, p) in enumerate(parts):
        if len(p.slice) > MAX_DIMS:
            raise ValueError(f"a lineage slice with more than {MAX_DIMS} dimensions")
        for k, (a, b) in enumerate(p.slice):
            slices[i, 2 * k], slices[i, 2 * k + 1] = a, b
    ap, ar = _csr([[(r, 0, 0, 0) for r in rs] for _, rs in attrs])
    ip, ins = _csr([[enc(x, intern) for x in n.inputs] for _, n in nodes])
    op_, outs = _csr([[enc(x, intern) for x in n.outputs] for _, n in nodes])
    sp, sums = _csr([[enc(x, intern) for x in p.sum_of] for _, _, p in parts])
    arr = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return UnitTable(
        t_ids=np.array([enc(t.id, intern) for t in tensors], dtype=np.int64).reshape(-1, 4),
        t_shape=arr([intern(t.shape) for t in tensors]),
        n_ids=np.array([enc(n.id, intern) for _, n in nodes], dtype=np.int64).reshape(-1, 4),
        n_op=arr([intern(n.op) for _, n in nodes]),
        n_pass=arr([intern(n.pass_) for _, n in nodes]),
        n_rank=arr([n.rank for _, n in nodes]), n_mb=arr([n.mb for _, n in nodes]),
        n_attrs=arr([intern(a) for a, _ in attrs]), n_attr_ptr=ap, n_attr_ranks=ar[:, 0].copy(),
        n_in_ptr=ip, n_in=ins, n_out_ptr=op_, n_out=outs,
        n_pos=arr([pos for pos, _ in nodes]),
        p_lin=arr([lin for lin, _, _ in parts]), p_pos=arr([pos for _, pos, _ in parts]),
        p_scale=arr([intern(p.scale) for _, _, p in parts]), p_slice=slices,
        p_sum_ptr=sp, p_sum=sums)


def table_records(tab: UnitTable, intern: Interner, attrs_of) -> tuple[list, list, list]:
    """Records back from a table (for units the fold keeps). `attrs_of(row)` gives a node's
    attribute dict (tables keep only the semantic text)."""
    def ids(block: np.ndarray) -> list:
        return [decode_id(r, intern) for r in block.tolist()]

    vals = intern.values
    tensors = [TensorInfo(t, vals[s]) for t, s in zip(ids(tab.t_ids), tab.t_shape.tolist())]
    ins, outs, sums = ids(tab.n_in), ids(tab.n_out), ids(tab.p_sum)
    ip, op_, sp = tab.n_in_ptr.tolist(), tab.n_out_ptr.tolist(), tab.p_sum_ptr.tolist()
    nodes = []
    for i, (nid, o, pa, r, mb, pos) in enumerate(zip(
            ids(tab.n_ids), tab.n_op.tolist(), tab.n_pass.tolist(), tab.n_rank.tolist(),
            tab.n_mb.tolist(), tab.n_pos.tolist())):
        nodes.append((pos, Node(nid, vals[o], vals[pa], r, mb, tuple(ins[ip[i]:ip[i + 1]]),
                                tuple(outs[op_[i]:op_[i + 1]]), attrs_of(i))))
    parts = []
    for i, (lin, pos, sc, row) in enumerate(zip(tab.p_lin.tolist(), tab.p_pos.tolist(),
                                                tab.p_scale.tolist(), tab.p_slice.tolist())):
        slc = tuple((row[2 * k], row[2 * k + 1]) for k in range(MAX_DIMS) if row[2 * k] >= 0)
        parts.append((lin, pos, LineagePart(slc, tuple(sums[sp[i]:sp[i + 1]]), vals[sc])))
    return tensors, nodes, parts


# ----------------------------------------------------------------------------- renaming


def rename_ids(ids: np.ndarray, unit, per: int) -> np.ndarray:
    """The renaming onto the representative (units.py) on a block of encoded ids: this unit's
    ids (and, for an instance unit, its replica's) move to the representative; every other
    rank-bearing id is marked OTHER."""
    d, m_u = unit
    out = ids.copy()
    r1, r2, m = ids[:, 1], ids[:, 2], ids[:, 3]
    has = r1 >= 0
    inrep = has & (r1 // per == d) & ((r2 < 0) | (r2 // per == d))
    mine = inrep if m_u is None else inrep & ((m == m_u) | (m == NO_RANK))
    out[mine, 1] -= d * per
    out[mine & (r2 >= 0), 2] -= d * per
    if m_u is not None:
        out[mine & (m == m_u), 3] = 0
    out[has & ~mine, 1] += OTHER
    return out


def rename_ranks(ranks: np.ndarray, d: int, per: int) -> np.ndarray:
    inrep = (ranks >= d * per) & (ranks < (d + 1) * per)
    return np.where(inrep, ranks - d * per, ranks + OTHER)


def group_rows(tab: UnitTable, sum_ops: np.ndarray, wu: WorldUnits) -> np.ndarray:
    """Nodes whose op is a sum (grad_accum, reducer, all_reduce) and whose inputs are all
    unit ids of more than one unit (found without a Python loop over the nodes)."""
    rows = np.flatnonzero(np.isin(tab.n_op, sum_ops))
    ptr = tab.n_in_ptr
    rows = rows[ptr[rows + 1] - ptr[rows] >= 2]
    if not len(rows):
        return rows
    lens = ptr[rows + 1] - ptr[rows]
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    idx = np.repeat(ptr[rows] - offsets, lens) + np.arange(lens.sum())
    ids = tab.n_in[idx]
    key = np.where(ids[:, 1] >= 0,
                   (ids[:, 1] // wu.per_replica) * (wu.mb + 2) + ids[:, 3] + 1, -1)
    lo = np.minimum.reduceat(key, offsets)
    hi = np.maximum.reduceat(key, offsets)
    return rows[(lo >= 0) & (lo != hi)]


def canonical_inputs(tab: UnitTable, unit, wu: WorldUnits, sum_ops: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The renamed input column, with every sum over units replaced by one row
    (base, position, position2, -10 - level): the folder's ("group", level, id)."""
    per = wu.per_replica
    ins = rename_ids(tab.n_in, unit, per)
    ptr = tab.n_in_ptr
    keep = np.ones(len(ins), dtype=bool)
    for i in group_rows(tab, sum_ops, wu):
        a, b = ptr[i], ptr[i + 1]
        raw = tab.n_in[a:b]
        level = group_level(raw, wu)
        if level is None:
            continue  # within one unit: an ordinary node
        rep = group_representative(raw, level, wu) if level >= 0 else None
        if rep is None:
            raise GroupError(i)
        ins[a] = rep
        ins[a, 3] = -10 - level
        keep[a + 1:b] = False
    new_ptr = np.concatenate([[0], np.cumsum(keep)])[ptr]
    return ins[keep], new_ptr


def group_representative(raw: np.ndarray, level: int, wu: WorldUnits) -> np.ndarray | None:
    """The one tensor every unit of a sum contributes, renamed to the representative's, or
    None when the units contribute different tensors."""
    per = wu.per_replica
    rel = raw.copy()
    rel[:, 1] %= per
    rel[:, 2] = np.where(rel[:, 2] >= 0, rel[:, 2] % per, rel[:, 2])
    if level != 0:  # instance ids: the micro-batch goes to the representative's
        rel[:, 3] = np.where(rel[:, 3] >= 0, 0, rel[:, 3])
    return rel[0] if (rel == rel[0]).all() else None


class GroupError(Exception):
    """A sum over units that does not take one copy from every unit of a level."""


def group_level(raw: np.ndarray, wu: WorldUnits) -> int | None:
    """0: one per replica (replica ids); 1: one per micro-batch of one replica; 2: one per
    (replica, micro-batch); None: all in one unit; -1: anything else."""
    per = wu.per_replica
    d = raw[:, 1] // per
    if ((raw[:, 2] >= 0) & (raw[:, 2] // per != d)).any():
        return -1
    m = raw[:, 3]
    units = set(zip(d.tolist(), m.tolist()))
    if len(units) == 1:
        return None
    if len(units) != len(raw) or (d >= wu.dp).any():
        return -1
    if (m == NO_RANK).all():
        return 0 if sorted(d.tolist()) == list(range(wu.dp)) else -1
    if (m < 0).any() or (m >= wu.mb).any():
        return -1
    if len(set(d.tolist())) == 1:
        return 1 if sorted(m.tolist()) == list(range(wu.mb)) else -1
    return 2 if len(units) == wu.dp * wu.mb else -1
