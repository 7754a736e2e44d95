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
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from dataclasses import dataclass, fields
from typing import Callable

import msgspec
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


_ATTRS_SEEN: dict[tuple[str, str | bytes], tuple[str, list[int]]] = {}
_ENCODE = msgspec.json.Encoder().encode


def semantic_attrs(node: Node) -> tuple[str, list[int]]:
    """(attribute text with rank numbers taken out, those rank numbers); memoised on the
    attributes' JSON text (equal texts are equal attributes; most nodes repeat a few)."""
    try:  # JSON text is a faster key than repr; attributes JSON cannot hold use repr
        key = (node.op, _ENCODE(node.attrs))
    except (TypeError, ValueError, OverflowError):
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

    def copy(self, only: tuple[str, ...] | None = None) -> "UnitTable":
        """A copy; with `only`, those columns copied and the others shared (read-only: a
        caller changing only those columns saves copying the references)."""
        return UnitTable(**{f.name: getattr(self, f.name).copy()
                            if only is None or f.name in only else getattr(self, f.name)
                            for f in fields(self)})


def trim_slices(tables) -> None:
    """Slice columns no part of these tables uses (slices are -1 padded to MAX_DIMS
    dimensions) dropped from all of them alike: the same comparisons over a third of the
    columns (a 405B-sized plan's units hold 130k parts each). Only for tables that are all
    a source gives (every unit's table is one of them, moved: moving never writes a column
    a part does not use)."""
    tables = list(tables)
    used = [np.flatnonzero((t.p_slice != -1).any(axis=0)) for t in tables if len(t.p_slice)]
    width = max((int(u[-1]) + 1 for u in used if len(u)), default=0)
    width += width % 2
    for t in tables:
        t.p_slice = np.ascontiguousarray(t.p_slice[:, :width])


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


def instance_table(unit: Unit, tensors: list[TensorInfo], nodes: list[tuple[int, Node]],
                   ins: list[tuple], outs: list[tuple], local: dict[str, int],
                   outside: Callable[[str], tuple], intern: Interner,
                   codes: tuple[np.ndarray, np.ndarray] | None = None) -> UnitTable:
    """`build_table` over columns, for a unit of many nodes (a loaded plan's units,
    `loaded_table`): the same table (tests/test_fold_tables.py compares them), built
    with one dict lookup per name and numpy instead of a Python loop per node. `local`: the
    unit's tensors by local number; `outside(x)`: the reference of any other tensor;
    `codes`: the local numbers of the inputs and of the outputs (-1: not the unit's), when
    the caller has them."""
    ns = [n for _, n in nodes]
    codes_of = dict(zip(("in", "out"), codes or (None, None)))
    refs = {name: reference_rows(unit, col, local, outside, codes_of[name])
            for name, col in (("in", ins), ("out", outs))}
    attrs = _semantic_column(ns)
    ranks = [rs for _, rs in attrs]
    ap = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, ranks), np.int64, len(ns)), out=ap[1:])
    arr = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return UnitTable(
        t_shape=_interned(intern, [t.shape for t in tensors]),
        n_op=_interned(intern, [n.op for n in ns]),
        n_pass=_interned(intern, [n.pass_ for n in ns]),
        n_rank=np.fromiter(map(_RANK, ns), np.int64, len(ns)),
        n_mb=np.fromiter(map(_MB, ns), np.int64, len(ns)),
        n_attrs=_interned(intern, [a for a, _ in attrs]), n_attr_ptr=ap,
        n_attr_ranks=arr(list(chain.from_iterable(ranks))),
        n_in_ptr=refs["in"][0], n_in=refs["in"][1], n_out_ptr=refs["out"][0],
        n_out=refs["out"][1], n_pos=arr([pos for pos, _ in nodes]),
        **part_columns([], None, intern, []))


def reference_rows(unit: Unit, col: list, local: dict[str, int],
                   outside: Callable[[str], tuple], codes: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The references of lists of tensor ids (CSR: pointers, (n, 4) rows): the unit's own
    tensors (`local`, or their numbers already looked up: `codes`, -1 for another's) in
    numpy, each other name once through `outside`."""
    own = np.array(reference(unit, unit, 0), dtype=np.int64)
    lens = np.fromiter(map(len, col), np.int64, len(col))
    flat = list(chain.from_iterable(col))
    if codes is None:
        codes = np.fromiter(map(local.get, flat, repeat(-1)), np.int64, len(flat))
    rows = np.empty((len(flat), 4), dtype=np.int64)
    mine = codes >= 0
    rows[mine] = own
    rows[mine, 0] = codes[mine]
    other = np.flatnonzero(~mine)
    if len(other):
        seen: dict = {None: NULL_REF}
        rows[other] = [seen[x] if x in seen else seen.setdefault(x, outside(x))
                       for x in map(flat.__getitem__, other.tolist())]
    ptr = np.zeros(len(col) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    return ptr, rows


_RANK, _MB = attrgetter("rank"), attrgetter("mb")
_INPUTS, _OUTPUTS = attrgetter("inputs"), attrgetter("outputs")


def loaded_table(unit: Unit, tensors: list[TensorInfo], nodes: list[tuple[int, Node]],
                 parts: list[tuple[int, int, LineagePart]], locate: Locate,
                 intern: Interner) -> UnitTable:
    """`build_table` for a loaded plan's unit (tvsmt/fold/source.py `LoadedPlan`), built over
    columns by `instance_table`: the unit's own tensors are its `tensors` by local number
    (units.py numbers each unit's tensors 0, 1, ...), every other one goes through `locate`.
    The same table as `build_table` (tests/test_fold_tables.py compares them)."""
    if tensors and locate(tensors[-1].id)[1] != len(tensors) - 1:
        # not numbered 0.. in list order (a tensor missing from the plan's table)
        return build_table(unit, tensors, nodes, parts, locate, intern)
    local = {t.id: k for k, t in enumerate(tensors)}
    ns = [n for _, n in nodes]

    def outside(x: str) -> tuple:
        return reference(unit, *locate(x))

    tab = instance_table(unit, tensors, nodes, list(map(_INPUTS, ns)), list(map(_OUTPUTS, ns)),
                         local, outside, intern)
    if parts:
        sums = reference_rows(unit, [p.sum_of for _, _, p in parts], local, outside)
        for name, value in part_columns(parts, None, intern, sums=sums).items():
            setattr(tab, name, value)
    return tab


def _interned(intern: Interner, values: list) -> np.ndarray:
    for v in set(values) - intern.index.keys():
        intern(v)
    return np.fromiter(map(intern.index.__getitem__, values), np.int64, len(values))


def _semantic_column(ns: list[Node]) -> list[tuple[str, list[int]]]:
    """`semantic_attrs` of many nodes: memo hits found by one lookup each."""
    try:
        keys = list(zip(map(attrgetter("op"), ns), map(_ENCODE, map(attrgetter("attrs"), ns))))
    except (TypeError, ValueError, OverflowError):
        return [semantic_attrs(n) for n in ns]
    hits = list(map(_ATTRS_SEEN.get, keys))
    if None in hits:  # each distinct missing key computed once (from its last node)
        node_of = dict(zip(keys, ns))
        done = {k: _semantic_attrs(node_of[k])
                for k in dict.fromkeys(k for k, h in zip(keys, hits) if h is None)}
        if len(_ATTRS_SEEN) + len(done) > 100_000:
            _ATTRS_SEEN.clear()
        _ATTRS_SEEN.update(done)
        hits = [h if h is not None else done[k] for k, h in zip(keys, hits)]
    return hits


def part_columns(parts: list[tuple[int, int, LineagePart]], ref: Callable[[str], tuple] | None,
                 intern: Interner, refs: list[list[tuple]] | None = None,
                 sums: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The lineage-part columns of a table (`ref`: tensor id -> reference; or `refs`, the
    references of each part's tensors, already known; or `sums`, those in CSR form)."""
    raw = [p.slice for _, _, p in parts]
    ranks = set(map(len, raw))
    if ranks and max(ranks) > MAX_DIMS:
        raise ValueError(f"a lineage slice with more than {MAX_DIMS} dimensions")
    slices = np.full((len(parts), 2 * MAX_DIMS), -1, dtype=np.int64)
    if len(ranks) == 1:  # one rank (the usual case): one numpy call
        rank = len(raw[0])
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(raw)), np.int64,
                           2 * rank * len(raw)).reshape(len(parts), 2 * rank)
        slices[:, :flat.shape[1]] = flat
    else:
        for i, x in enumerate(raw):
            for k, (a, b) in enumerate(x):
                slices[i, 2 * k], slices[i, 2 * k + 1] = a, b
    if sums is not None:
        sp, sums = sums
    else:
        if refs is None:
            refs = [[ref(x) for x in p.sum_of] for _, _, p in parts]
        sp, sums = _csr(refs)
    return dict(p_lin=np.fromiter(map(itemgetter(0), parts), np.int64, len(parts)),
                p_pos=np.fromiter(map(itemgetter(1), parts), np.int64, len(parts)),
                p_scale=_interned_objects(intern, [p.scale for _, _, p in parts]),
                p_slice=slices, p_sum_ptr=sp, p_sum=sums)


def _interned_objects(intern: Interner, values: list) -> np.ndarray:
    """Interned ids of values that are mostly a few shared objects (passes, lineage scales):
    each distinct object (found by its id, in numpy) interned once, in order of first
    occurrence."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    ids = np.fromiter(map(id, values), np.int64, len(values))
    _, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # intern in order of first occurrence
    codes = np.empty(len(first), dtype=np.int64)
    codes[order] = [intern(values[i]) for i in first[order].tolist()]
    return codes[inv.reshape(-1)]


def merge_part_columns(a: dict[str, np.ndarray], b: dict[str, np.ndarray]
                       ) -> dict[str, np.ndarray]:
    """Two sets of part columns as one, ordered by (lineage, position in it)."""
    lin = np.concatenate([a["p_lin"], b["p_lin"]])
    pos = np.concatenate([a["p_pos"], b["p_pos"]])
    order = np.lexsort((pos, lin))
    lens = np.concatenate([np.diff(a["p_sum_ptr"]), np.diff(b["p_sum_ptr"])])[order]
    starts = np.concatenate([a["p_sum_ptr"][:-1], b["p_sum_ptr"][:-1] + len(a["p_sum"])])
    sums = np.concatenate([a["p_sum"], b["p_sum"]])
    ptr = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    take = np.repeat(starts[order] - ptr[:-1], lens) + np.arange(ptr[-1])
    return dict(p_lin=lin[order], p_pos=pos[order],
                p_scale=np.concatenate([a["p_scale"], b["p_scale"]])[order],
                p_slice=np.concatenate([a["p_slice"], b["p_slice"]])[order],
                p_sum_ptr=ptr, p_sum=sums[take].reshape(-1, 4))


def attach_parts(tab: UnitTable, parts: list[tuple[int, int, LineagePart]],
                 refs: list[list[tuple]], intern: Interner) -> None:
    """Set a table's lineage parts afterwards (a streamed unit's parts come at the end of
    its file, after its nodes were dropped); `refs`: each part's tensor references."""
    for name, value in part_columns(parts, None, intern, refs).items():
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


def _weights(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(1, 1 << 63, n, dtype=np.uint64) | np.uint64(1)


_WEIGHTS = _weights(512)


def _no_level(level: int | None) -> int:
    return -1 if level is None else level


def _ptr0(lens: np.ndarray) -> np.ndarray:
    """Each segment's start in a concatenation of segments of these lengths."""
    out = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1], out=out[1:])
    return out


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
    # The common case in columns: a sum that reads only tensors of units, the same local
    # number from each, over a pattern of units already seen in this table (replica units
    # hold one such sum per weight). Anything else goes through group_row.
    starts, ends = ptr[rows], ptr[rows + 1]
    refs = tab.n_in
    d2, m2 = absolute_units(refs, unit) if len(rows) else (refs[:0, 0], refs[:0, 0])
    levels = np.full(len(rows), -1, dtype=np.int64)  # -1: through group_row
    if len(rows):
        lens = ends - starts
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
        idx = np.repeat(starts - offsets, lens) + np.arange(lens.sum())
        sub = refs[idx]
        lo, hi = np.minimum.reduceat(sub, offsets), np.maximum.reduceat(sub, offsets)
        plain = (lo[:, 0] == hi[:, 0]) & (lo[:, 3] == UNIT) & (hi[:, 3] == UNIT)
        # the plain sums' levels, once per distinct pattern of units (rows of one length
        # side by side: a replica unit holds thousands of sums over a few patterns)
        for n in np.unique(lens[plain]).tolist():
            these = np.flatnonzero(plain & (lens == n))
            at = starts[these][:, None] + np.arange(n)[None, :]
            pattern = np.concatenate([d2[at], m2[at]], axis=1)
            # rows grouped by a hash of their pattern; a row unlike its group's first (a
            # collision) is left to group_row, so no row is judged by another's pattern
            weights = _WEIGHTS[:2 * n] if 2 * n <= len(_WEIGHTS) else _weights(2 * n)
            h = (pattern.astype(np.uint64) * weights).sum(axis=1)
            _, first, which = np.unique(h, return_index=True, return_inverse=True)
            which = which.reshape(-1)
            same = (pattern == pattern[first[which]]).all(axis=1)
            level_of = np.array([_no_level(group_level(
                list(zip(pattern[i, :n].tolist(), pattern[i, n:].tolist())), wu, unit[0]))
                for i in first.tolist()], dtype=np.int64)
            levels[these] = np.where(same, level_of[which], -1)
    good = levels >= 0
    if good.any():
        a = starts[good]
        ins[a, 0], ins[a, 1], ins[a, 2], ins[a, 3] = refs[a, 0], levels[good], 0, GROUP
        span = ends[good] - a - 1
        drop = np.repeat(a + 1 - _ptr0(span), span) + np.arange(int(span.sum()))
        keep[drop] = False
    for j in np.flatnonzero(~good).tolist():  # the others, one by one
        a, b = int(starts[j]), int(ends[j])
        try:
            ins[a], odd = group_row(refs[a:b], unit, wu)
            if deviations is not None:
                deviations += odd
        except GroupError as e:
            raise GroupError(int(rows[j]), str(e)) from None
        keep[a + 1:b] = False
    new_ptr = np.concatenate([[0], np.cumsum(keep)])[ptr]
    return ins[keep], new_ptr, rows
