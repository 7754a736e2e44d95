"""A loaded plan split into units over columns: `source.LoadedPlan`'s units, records and
tables, computed with numpy over the whole plan instead of Python loops per node.

A real plan of 128 ranks holds 300k nodes of which the fold keeps 5k: what every unit needs
is only its table (table.py), the records are needed for the few units kept. So the plan's
dataflow is numbered once (tensor numbers of every node's inputs and outputs, kept by the
reader: `PlanColumns`), the unit rules of units.py and the chain flattening of
source.flatten_with_units are applied to those arrays (fold/split.py, which a forked reader
may have computed already), every reference of every table is
computed in one pass, and a unit's table is a gather of its rows. Node objects are only
touched for their attributes (one encoding each), for the few sums over replica units
(ordered by dataflow, as units.py does) and for the records of the kept units.

It is the same function as `LoadedPlan` (tests/test_fold_columns.py compares units, tables
and records on real and generated plans; scripts/mutate.py breaks it): no new shortcut,
only a faster way to compute the same split. Whatever it cannot represent (a plan whose
ranks, micro-batches or ids are not what the reader guarantees) goes to `LoadedPlan`.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_

import msgspec
import numpy as np

from tvsmt.fold.folder import FoldRefused, SumRefs, UnitRecords
from tvsmt.fold.split import (
    GLOBAL_KEY,
    Misplaced,
    NoColumns,
    Split,
    inputs_digest,
    split_dataflow,
    stable_order,
)
from tvsmt.fold.table import (
    _ATTRS_SEEN,
    GLOBAL,
    MAX_DIMS,
    NO_MB,
    NULL,
    OTHER,
    SAME,
    UNIT,
    Interner,
    UnitTable,
    _interned,
    _interned_objects,
    _semantic_attrs,
    _semantic_column,
)
from tvsmt.fold.units import REPRESENTATIVE, NoUnits, Unit, WorldUnits, unit_order
from tvsmt.plan.csr import gather as _gather
from tvsmt.plan.csr import offsets as _ptr
from tvsmt.plan.model import LazySequence, Node, Plan, PlanColumns
from tvsmt.plan.numbering import UNDECLARED, Numbering, first_use_codes
from tvsmt.timing import span

_INPUTS, _OUTPUTS, _RANK, _MB, _OP = (attrgetter(k) for k in
                                      ("inputs", "outputs", "rank", "mb", "op"))
_PASS, _SHAPE, _SCALE, _SLICE, _SUM_OF, _PARTS = (
    attrgetter(k) for k in ("pass_", "shape", "scale", "slice", "sum_of", "parts"))


def build_columns(plan: Plan) -> PlanColumns:
    """What the reader keeps (PlanColumns), computed from the plan's records."""
    nodes = plan.nodes
    tids = list(plan.tensors)
    number = Numbering(tids)
    ins, outs = list(map(_INPUTS, nodes)), list(map(_OUTPUTS, nodes))
    infos = list(plan.tensors.values())
    parts = list(chain.from_iterable(map(_PARTS, plan.lineages)))
    sums = list(map(_SUM_OF, parts))
    try:
        (in_len, in_num), (out_len, out_num), (s_len, s_num) = number.of_lists(ins, outs,
                                                                               sums)
        rank = np.fromiter(map(_RANK, nodes), np.int64, len(nodes))
        mb = np.fromiter(map(_MB, nodes), np.int64, len(nodes))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise NoColumns from None
    if any(len(x) and x.min() == UNDECLARED for x in (in_num, out_num, s_num)):
        raise NoColumns
    op_first: dict = {}
    op_at = np.fromiter(map(op_first.setdefault, map(_OP, nodes), range(len(nodes))), np.int64,
                        len(nodes))
    first_shape: dict = {}
    t_shape = np.fromiter(map(first_shape.setdefault, map(_SHAPE, infos), range(len(infos))),
                          np.int64, len(infos))
    first: dict = {}
    at = np.fromiter(map(first.setdefault, map(_SLICE, parts), range(len(parts))), np.int64,
                     len(parts))
    index = first_use_codes(first, at)
    return PlanColumns(list(nodes), tids, number, in_len, in_num, out_len, out_num, rank, mb,
                       op_at, infos, t_shape, list(plan.lineages), s_len, s_num, index, list(first))


def columns_of(plan: Plan) -> PlanColumns:
    """The reader's columns when they still describe the plan (the same node, tensor and
    lineage objects, all frozen, and the same tensor ids in the same order), else new ones."""
    cols = getattr(plan, "columns", None)
    if (cols is not None and len(cols.nodes) == len(plan.nodes)
            and len(cols.tids) == len(plan.tensors) and len(cols.lineages) == len(plan.lineages)
            and ((cols.nodes is plan.nodes and isinstance(plan.nodes, LazySequence))  # immutable
                 or all(map(is_, cols.nodes, plan.nodes))) and cols.tids == list(plan.tensors)
            and all(map(is_, cols.infos, plan.tensors.values()))
            and all(map(is_, cols.lineages, plan.lineages))):
        return cols
    return build_columns(plan)


def _first_index_codes(first_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(first_at, return_inverse=True) for a column whose values are the index of
    the first element with the same value (the reader's op and shape columns): the distinct
    values are exactly the elements equal to their own index, found in one pass; a column
    that is not of that form is left to np.unique."""
    n = len(first_at)
    if n and 0 <= int(first_at.min()) and int(first_at.max()) < n:
        firsts = np.flatnonzero(first_at == np.arange(n))
        code = np.full(n, -1, dtype=np.int64)
        code[firsts] = np.arange(len(firsts))
        inv = code[first_at]
        if not (inv < 0).any():
            return firsts, inv
    firsts, inv = np.unique(first_at, return_inverse=True)
    return firsts, inv.reshape(-1)


class ColumnPlan:
    """`source.LoadedPlan` over columns (the same unit source, see the module docstring)."""

    def __init__(self, single: Plan, parallel: Plan, cols: PlanColumns | None = None):
        """`cols`: the plan's columns when a reader gives them (a JSON Lines scan: then
        `parallel` is only the header, its records are the columns' lazy ones)."""
        self.single, self.header = single, parallel
        self.intern = Interner()
        cols = columns_of(parallel) if cols is None else cols
        try:
            self._split(parallel, cols)
        except NoUnits as e:
            raise FoldRefused(str(e)) from None
        if REPRESENTATIVE not in self._order:
            raise FoldRefused("replica 0 has no node of micro-batch 0")

    # -- units of nodes (units.node_units) and chains of sums (source.flatten_with_units)

    def _split(self, plan: Plan, cols: PlanColumns) -> None:
        nodes = cols.nodes
        if cols.op_code is not None:
            opc, op_names = np.asarray(cols.op_code), list(cols.op_names)
        else:
            firsts, opc = _first_index_codes(np.asarray(cols.op))
            op_names = [nodes[i].op for i in firsts.tolist()]
        out_nums = (cols.output_num if cols.output_num is not None
                    else cols.number.of_names(list(plan.outputs)))
        args = (plan.world, cols.rank, cols.mb, opc, op_names, cols.in_len, cols.in_num,
                cols.out_len, cols.out_num, len(cols.tids), out_nums, cols.s_num)
        # what needs no split, computed before waiting for the reader's (a forked process's)
        self._all_attrs = None  # every node's attribute columns (the kept ones taken after)
        text = getattr(cols, "attr_text", None)
        if getattr(cols, "presplit", None) is not None and text is not None:
            self._all_attrs = _attr_columns(nodes, opc, op_names, self.intern, text)
        try:
            split = _precomputed(cols, args)
            if split is None:
                split = split_dataflow(*args)
        except Misplaced as e:
            raise NoUnits(f"node {nodes[e.index].id}: {e.what}") from None
        self.wu, self.stride = WorldUnits.of(plan.world), split.stride
        self._parts = (cols.parts if cols.parts is not None
                       else list(chain.from_iterable(map(_PARTS, plan.lineages))))
        self._p_sum_num = (cols.s_len, cols.s_num)
        keep, changed = split.keep, split.changed
        tids = cols.tids
        replaced = {}
        at = np.searchsorted(keep, list(changed)).tolist()
        for j, nd, v in zip(at, _take(nodes, list(changed)), changed.values()):
            names = _take(tids, [x for x in v if x >= 0])[::-1]
            replaced[j] = Node(nd.id, nd.op, nd.pass_, nd.rank, nd.mb,
                               tuple(names.pop() if x >= 0 else None for x in v), nd.outputs,
                               nd.attrs, nd.source)
        if isinstance(nodes, list):
            fnodes = list(map(nodes.__getitem__, keep.tolist()))
            for j, nd in replaced.items():
                fnodes[j] = nd
        else:  # built on demand (a scan's): only the nodes looked at
            fnodes = _Kept(nodes, keep, replaced)
        self._nodes, self._keep = fnodes, keep
        self._opc, self._op_names = opc[keep], op_names
        self._tunit, self._num, self._order_keys = split.tunit, split.num, split.order_keys
        whole = len(keep) == len(cols.rank)
        self._tables(plan, cols, fnodes, split.f_key, cols.rank if whole else cols.rank[keep],
                     cols.mb if whole else cols.mb[keep], _ptr(split.f_in_len), split.f_in,
                     _ptr(split.f_out_len), split.f_out, split.tensor_alive)

    def unit_of(self, k: int) -> Unit | None:
        if k == GLOBAL_KEY:
            return None
        d, r = divmod(int(k), self.stride)
        return (d, None if r == 0 else r - 1)

    def units_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`unit_of` over an array of keys, as `SumRefs` holds units: (replica or -1 for
        global, micro-batch or -1 for none)."""
        glob, r = keys == GLOBAL_KEY, keys % self.stride
        return np.where(glob, -1, keys // self.stride), np.where(glob | (r == 0), -1, r - 1)

    # -- every table's columns at once (table.loaded_table)

    def _refs(self, reader_key, xs: np.ndarray) -> np.ndarray:
        """(n, 4) references (table.reference) of tensors `xs` from units `reader_key` (one
        key, or one per tensor)."""
        stride, tunit, num = self.stride, self._tunit, self._num
        rows = np.empty((len(xs), 4), dtype=np.int64)
        null = xs < 0
        x = np.maximum(xs, 0)
        tk = tunit[x]
        glob = tk == GLOBAL_KEY
        d, m_r = reader_key // stride, reader_key % stride
        d2, m2r = tk // stride, tk % stride
        dd = np.where(d2 == d, 0, OTHER + d2)
        mm = np.where(m2r == 0, NO_MB,
                      np.where((m_r != 0) & (dd == 0) & (m2r == m_r), SAME, m2r - 1))
        rows[:, 0] = num[x]
        rows[:, 1] = np.where(glob, 0, dd)
        rows[:, 2] = np.where(glob, 0, mm)
        rows[:, 3] = np.where(glob, GLOBAL, UNIT)
        rows[null] = NULL
        return rows

    def _tables(self, plan, cols, fnodes, f_key, f_rank, f_mb, f_in_ptr, f_in, f_out_ptr,
                f_out, tensor_alive):
        intern = self.intern
        # tensor numbers per node; a unit's references are computed with its table (all of
        # them at once would be 32 bytes a reference: 0.6 GB for a 3.6M-node plan)
        self._in, self._out = (f_in_ptr, f_in), (f_out_ptr, f_out)
        opc, names = self._opc, self._op_names
        self._op = np.array([intern(op) for op in names], dtype=np.int64)[opc]
        if cols.pass_code is not None:
            self._pass = np.array([intern(p) for p in cols.pass_names],
                                  dtype=np.int64)[np.asarray(cols.pass_code)[self._keep]]
        else:
            self._pass = _interned_objects(intern, list(map(_PASS, fnodes)))
        self._rank, self._mb = f_rank, f_mb
        if self._all_attrs is not None:  # computed before the split: the kept nodes'
            codes, ptr, ranks = self._all_attrs
            al, self._attr_ranks = _gather(ptr, ranks, self._keep)
            self._attrs, self._attr_ptr = codes[self._keep], _ptr(al)
        else:
            text = getattr(cols, "attr_text", None)  # the reader's codes of attribute texts
            self._attrs, self._attr_ptr, self._attr_ranks = _attr_columns(
                fnodes, opc, names, intern, None if text is None else text[self._keep])
        infos = cols.infos
        self._infos = infos
        # each unit's tensors by local number
        tk = self._tunit
        alive = np.flatnonzero(tensor_alive)
        if cols.shape_code is not None:
            self._t_shape = np.array([intern(sh) for sh in cols.shapes],
                                     dtype=np.int64)[np.asarray(cols.shape_code)]
        else:
            firsts, dense = _first_index_codes(np.asarray(cols.t_shape))
            self._t_shape = np.array([intern(infos[i].shape) for i in firsts.tolist()],
                                     dtype=np.int64)[dense.reshape(-1)]
        by = alive[np.lexsort((self._num[alive], tk[alive]))]
        keys = tk[by]
        cuts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1], [True]]))
        self._tensors = {int(keys[a]): by[a:b] for a, b in zip(cuts[:-1].tolist(),
                                                              cuts[1:].tolist())}
        # lineage parts: owned by the unit of all their tensors, else global
        parts = self._parts
        s_len, s_num = self._p_sum_num
        s_ptr = _ptr(s_len)
        owner = np.full(len(parts), GLOBAL_KEY, dtype=np.int64)
        if len(parts):
            offs = s_ptr[:-1]
            pk = tk[s_num]
            lo, hi = np.minimum.reduceat(pk, offs), np.maximum.reduceat(pk, offs)
            owner = np.where(lo == hi, lo, GLOBAL_KEY)
        self._p_owner = owner
        self._p_sum = (s_ptr, s_num)
        if cols.part_lineage is not None:
            self._p_lin = np.fromiter((lin.index for lin in plan.lineages), np.int64,
                                      len(plan.lineages))[np.asarray(cols.part_lineage)]
            self._p_pos = np.asarray(cols.part_pos)
            self._p_scale = np.array([intern(sc) for sc in cols.scales],
                                     dtype=np.int64)[np.asarray(cols.scale_code)]
        else:
            per_lin = np.fromiter(map(len, map(_PARTS, plan.lineages)), np.int64,
                                  len(plan.lineages))
            self._p_lin = np.repeat(np.fromiter((lin.index for lin in plan.lineages),
                                                np.int64, len(plan.lineages)), per_lin)
            self._p_pos = np.arange(len(parts)) - np.repeat(_ptr(per_lin)[:-1], per_lin)
            self._p_scale = _interned_objects(intern, list(map(_SCALE, parts)))
        # each part's slice as an index into the distinct slices' rows: a unit's table takes
        # its parts' rows from them (all parts' rows at once would be 42 MB for 326k parts)
        self._slice_rows, self._p_slice_at = _slices(cols.slices), np.asarray(cols.slice_index)
        pidx = stable_order(owner)
        ok = owner[pidx]
        cuts = np.flatnonzero(np.concatenate([[True], ok[1:] != ok[:-1], [True]]))
        self._unit_parts = {int(ok[a]): pidx[a:b] for a, b in zip(cuts[:-1].tolist(),
                                                                 cuts[1:].tolist())}
        # a unit is anything owning a node, a tensor or a part (as source.split_units)
        empty = np.zeros(0, dtype=np.int64)
        keys = (set(self._order_keys) | set(self._tensors) | set(self._unit_parts))
        keys.discard(GLOBAL_KEY)
        self._order = {self.unit_of(k): self._order_keys.get(k, empty) for k in keys}

    # -- the unit source

    def _key(self, unit: Unit) -> int:
        d, m = unit
        return d * self.stride + (0 if m is None else m + 1)

    def global_records(self) -> UnitRecords:
        recs = UnitRecords()
        t = self._tensors.get(GLOBAL_KEY)
        if t is not None:
            recs.tensors = _take(self._infos, t.tolist())
        pidx = self._unit_parts.get(GLOBAL_KEY, np.zeros(0, dtype=np.int64)).tolist()
        recs.parts = self._part_records(pidx)
        # where each part's tensors live, as arrays (SumRefs): a 3.6M-node plan's global
        # parts name 336k tensors, a Python pair each cost the fold 2 s
        lens, xs = _gather(*self._p_sum, np.asarray(pidx, dtype=np.int64))
        d, m = self.units_of(self._tunit[xs])
        cuts = np.cumsum(lens)[:-1]
        recs.part_refs = [SumRefs(a, b, c) for a, b, c in zip(
            np.split(d, cuts), np.split(m, cuts), np.split(self._num[xs], cuts))]
        return recs

    def units(self) -> list[Unit]:
        return unit_order(self._order)

    def table(self, unit: Unit) -> UnitTable:
        key = self._key(unit)
        rows = self._order[unit]
        t = self._tensors.get(key, np.zeros(0, dtype=np.int64))
        pidx = self._unit_parts.get(key, np.zeros(0, dtype=np.int64))
        il, ins = _gather(*self._in, rows)
        ol, outs = _gather(*self._out, rows)
        al, ar = _gather(self._attr_ptr, self._attr_ranks, rows)
        sl, sums = _gather(*self._p_sum, pidx)
        ins, outs, sums = (self._refs(key, x) for x in (ins, outs, sums))
        return UnitTable(
            t_shape=self._t_shape[t], n_op=self._op[rows], n_pass=self._pass[rows],
            n_rank=self._rank[rows], n_mb=self._mb[rows], n_attrs=self._attrs[rows],
            n_attr_ptr=_ptr(al), n_attr_ranks=ar, n_in_ptr=_ptr(il), n_in=ins.reshape(-1, 4),
            n_out_ptr=_ptr(ol), n_out=outs.reshape(-1, 4), n_pos=rows.copy(),
            p_lin=self._p_lin[pidx], p_pos=self._p_pos[pidx], p_scale=self._p_scale[pidx],
            p_slice=self._slice_rows[self._p_slice_at[pidx]], p_sum_ptr=_ptr(sl),
            p_sum=sums.reshape(-1, 4))

    def records(self, unit: Unit) -> UnitRecords:
        key = self._key(unit)
        rows = self._order[unit].tolist()
        t = self._tensors.get(key, np.zeros(0, dtype=np.int64)).tolist()
        pidx = self._unit_parts.get(key, np.zeros(0, dtype=np.int64)).tolist()
        return UnitRecords(_take(self._infos, t), list(zip(rows, _take(self._nodes, rows))),
                           self._part_records(pidx))

    def _part_records(self, pidx: list) -> list[tuple]:
        """(lineage, position in it, part) of these parts."""
        return list(zip(self._p_lin[pidx].tolist(), self._p_pos[pidx].tolist(),
                        _take(self._parts, pidx)))

    def worker_view(self):
        return None


def _precomputed(cols: PlanColumns, args: tuple) -> Split | None:
    """The split the reader had computed meanwhile (`PlanColumns.presplit`: the forked
    numbering's, tvsmt/plan/numbering.py), when it was computed from these very inputs
    (`split_dataflow(*args)` would be the same), else None."""
    get = getattr(cols, "presplit", None)
    if get is None:
        return None
    try:  # first: the forked numbering may still be computing its split meanwhile
        digest = inputs_digest(*args)
    except (TypeError, ValueError, OverflowError):  # a world MessagePack cannot hold
        digest = None
    with span("wait for split"):
        split = get()
    if split is None or digest is None:
        return None
    return split if split.digest == digest else None


def _take(seq, idx: list) -> list:
    """seq[i] for each i: in one batch where the sequence builds its items on demand (a
    JSON Lines scan's records, tvsmt/plan/scan.py), else item by item."""
    take = getattr(seq, "take", None)
    return take(idx) if take is not None else list(map(seq.__getitem__, idx))


class _Kept:
    """The nodes that the flattening of sums keeps (positions `keep` of `nodes`), some
    replaced by their flattened sum; built on demand when `nodes` is (a scan's)."""

    def __init__(self, nodes, keep: np.ndarray, replaced: dict[int, Node]):
        self._nodes, self._keep, self._replaced = nodes, keep, replaced

    def __len__(self) -> int:
        return len(self._keep)

    def __getitem__(self, j: int) -> Node:
        got = self._replaced.get(int(j))
        return got if got is not None else self._nodes[int(self._keep[j])]

    def take(self, js: list) -> list:
        out = _take(self._nodes, self._keep[js].tolist()) if len(js) else []
        for k, j in enumerate(js):
            got = self._replaced.get(int(j))
            if got is not None:
                out[k] = got
        return out


def _attr_columns(fnodes, opc: np.ndarray, op_names: list, intern: Interner,
                  text_code: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every node's semantic attributes (table.semantic_attrs): interned text, and the rank
    numbers taken out of it (CSR), computed once per distinct (op, attribute JSON text).
    `text_code`: per node, a code of its attributes' text as the plan file holds it (the
    reader's `PlanColumns.attr_text`: equal codes, equal texts, so equal attributes), else
    they are encoded here."""
    n = len(fnodes)
    lines = None
    if text_code is None or len(text_code) != n:
        try:
            lines = _ENCODE_LINES(list(map(_ATTRS, fnodes))).split(b"\n")  # no raw \n in JSON
        except (TypeError, ValueError, OverflowError):
            attrs = _semantic_column(fnodes)
            ranks = [rs for _, rs in attrs]
            return (_interned(intern, [a for a, _ in attrs]),
                    _ptr(np.fromiter(map(len, ranks), np.int64, n)),
                    np.array(list(chain.from_iterable(ranks)), dtype=np.int64))
        text: dict = {}
        text_code = np.fromiter(map(text.setdefault, lines[:n], range(n)), np.int64, n)
    base = int(text_code.max()) + 1 if n else 1
    _, first, inv = np.unique(opc * base + text_code, return_index=True, return_inverse=True)
    sem = []
    if lines is None:  # the file's text, not the encoded one: not the shared memo's key
        sem = list(map(_semantic_attrs, _take(fnodes, first.tolist())))
    for i in first.tolist() if lines is not None else ():
        key = (op_names[opc[i]], lines[i])
        hit = _ATTRS_SEEN.get(key)
        if hit is None:
            if len(_ATTRS_SEEN) > 100_000:
                _ATTRS_SEEN.clear()
            hit = _ATTRS_SEEN[key] = _semantic_attrs(fnodes[i])
        sem.append(hit)
    codes = np.array([intern(a) for a, _ in sem], dtype=np.int64)
    lens = np.array([len(r) for _, r in sem], dtype=np.int64)
    values = np.array(list(chain.from_iterable(r for _, r in sem)), dtype=np.int64)
    inv = inv.reshape(-1)
    al, ar = _gather(_ptr(lens), values, inv)
    return codes[inv], _ptr(al), ar


_ATTRS = attrgetter("attrs")


_ENCODE_LINES = msgspec.json.Encoder().encode_lines


def _slices(distinct: list) -> np.ndarray:
    """Distinct lineage slices as rows of (start, end) pairs, -1 padded (table.part_columns)."""
    if distinct and max(map(len, distinct)) > MAX_DIMS:
        raise ValueError(f"a lineage slice with more than {MAX_DIMS} dimensions")
    rows = np.full((len(distinct), 2 * MAX_DIMS), -1, dtype=np.int64)
    for i, x in enumerate(distinct):
        for k, (a, b) in enumerate(x):
            rows[i, 2 * k], rows[i, 2 * k + 1] = a, b
    return rows
