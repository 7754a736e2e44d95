"""The split of a plan into units computed from its numbered dataflow alone: which unit
each node belongs to, the chains of sums over units flattened (source.flatten_with_units),
each tensor's unit and its number inside it, and each unit's nodes in canonical order
(units.py). `fold.columns.ColumnPlan` builds its tables on it.

A pure function of arrays: every node's rank, micro-batch and op, and the tensor numbers of
its inputs and outputs (the reader's `PlanColumns`). No record object is read, so the
process that numbers a large document's names (`plan.numbering.ForkedNumbering`) computes it
too, on the second core, while the reader finishes (`Split.to_bytes`); the fold uses that
one only when the inputs it was computed from are the fold's own (`Split.digest`, the
`inputs_digest` of its inputs), and computes it itself otherwise. Either way it is this
function's result (tests/test_fold_columns.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import chain

import msgspec
import numpy as np

from tvsmt.fold.units import SUM_OPS, NoUnits, WorldUnits
from tvsmt.plan.csr import gather as _gather
from tvsmt.plan.csr import offsets as _ptr
from tvsmt.plan.mesh import Mesh

GLOBAL_KEY = -1  # the unit key of a tensor of no unit


class NoColumns(Exception):
    """The plan holds something the reader would have refused (an undeclared tensor, a rank
    that is not an int): the node-by-node `LoadedPlan` handles it."""


class Misplaced(Exception):
    """Node `index` has a rank or micro-batch outside the world (`what`); the caller names
    the node (NoUnits)."""

    def __init__(self, index: int, what: str):
        super().__init__(index, what)
        self.index, self.what = index, what


@dataclass
class Split:
    """Units of a plan's nodes and tensors, by unit key (replica * stride + micro-batch + 1,
    0 for no micro-batch; GLOBAL_KEY for a tensor of no unit). Columns prefixed `f_` are
    over the nodes kept by the chain flattening (`keep`, plan positions in plan order)."""

    stride: int
    keep: np.ndarray
    changed: dict[int, list[int]]  # kept node (plan position) -> its flattened inputs
    f_key: np.ndarray
    f_in_len: np.ndarray
    f_in: np.ndarray
    f_out_len: np.ndarray
    f_out: np.ndarray
    tensor_alive: np.ndarray  # bool per tensor: not the output of a dropped sum
    tunit: np.ndarray  # per tensor: its unit key
    num: np.ndarray  # per tensor: its number inside its unit (-1: a dropped one)
    order_keys: dict[int, np.ndarray]  # unit key -> its nodes (f_ positions), canonical order
    digest: bytes = b""  # `inputs_digest` of what it was computed from

    _ARRAYS = ("keep", "f_key", "f_in_len", "f_in", "f_out_len", "f_out", "tensor_alive",
               "tunit", "num")

    def to_bytes(self) -> bytes:
        changed_at = sorted(self.changed)
        order_at = sorted(self.order_keys)
        arrays = [_packed(getattr(self, k)) for k in self._ARRAYS]
        return msgspec.msgpack.encode((
            self.stride, self.digest, arrays, changed_at,
            [len(self.changed[i]) for i in changed_at],
            list(chain.from_iterable(self.changed[i] for i in changed_at)),
            order_at, _packed(np.concatenate([self.order_keys[k] for k in order_at]
                                             or [np.zeros(0, np.int64)])),
            [len(self.order_keys[k]) for k in order_at]))

    @classmethod
    def from_bytes(cls, data: bytes) -> Split | None:
        """None when `data` is not a whole `to_bytes`."""
        try:
            (stride, digest, arrays, changed_at, changed_len, changed_flat, order_at,
             order_flat, order_len) = msgspec.msgpack.decode(
                data, type=tuple[int, bytes, list[bytes], list[int], list[int], list[int],
                                 list[int], bytes, list[int]])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        unpacked = [_unpacked(a) for a in arrays + [order_flat]]
        if (len(arrays) != len(cls._ARRAYS) or len(changed_len) != len(changed_at)
                or sum(changed_len) != len(changed_flat) or len(order_len) != len(order_at)
                or any(a is None for a in unpacked) or len(unpacked[-1]) != sum(order_len)):
            return None
        cols = dict(zip(cls._ARRAYS, unpacked))
        cols["tensor_alive"] = cols["tensor_alive"].astype(bool)
        cuts = np.cumsum(changed_len).tolist()
        changed = {i: changed_flat[a:b] for i, a, b in zip(changed_at, [0] + cuts, cuts)}
        flat = unpacked[-1]
        cuts = np.cumsum(order_len).tolist()
        order = {k: flat[a:b] for k, a, b in zip(order_at, [0] + cuts, cuts)}
        return cls(stride, changed=changed, order_keys=order, digest=digest, **cols)


def _packed(a: np.ndarray) -> bytes:
    """An integer array as bytes: a width byte (4 or 8), then its values (int32 where they
    fit: half the bytes through the pipe)."""
    a = np.asarray(a)
    if a.dtype == bool or not len(a) or (int(a.min()) >= -(1 << 31) and int(a.max()) < 1 << 31):
        return b"\x04" + a.astype(np.int32).tobytes()
    return b"\x08" + a.astype(np.int64).tobytes()


def _unpacked(data: bytes) -> np.ndarray | None:
    """`_packed`'s array as int64 (None: not one)."""
    width = data[:1]
    if width not in (b"\x04", b"\x08") or (len(data) - 1) % width[0]:
        return None
    return np.frombuffer(data, np.int32 if width == b"\x04" else np.int64,
                         offset=1).astype(np.int64)


def inputs_digest(world: dict, rank, mb, opc, op_names: list, in_len, in_num, out_len,
                  out_num, n_tensors: int, out_nums, s_num) -> bytes:
    """A digest of everything `split_dataflow` reads: two splits with the same digest were
    computed from the same inputs."""
    h = hashlib.sha256()  # 14 ms for the 128-rank MoE plan's 3M numbers
    h.update(msgspec.msgpack.encode((world, op_names, n_tensors)))
    for a in (rank, mb, opc, in_len, in_num, out_len, out_num, out_nums, s_num):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.data)
    return h.digest()


def split_dataflow(world: dict, rank, mb, opc, op_names: list, in_len, in_num, out_len,
                   out_num, n_tensors: int, out_nums, s_num) -> Split:
    """The split of the plan these columns describe (see the module docstring): `opc` the
    nodes' ops as indices into `op_names`, `out_nums` the numbers of the plan's outputs,
    `s_num` those of every lineage part's tensors (both named outside the plan's nodes, so
    never flattened away). Raises Misplaced, NoUnits (the world) or NoColumns."""
    wu = WorldUnits.of(world)
    try:
        mesh = Mesh.of({k: v for k, v in world.items() if k in ("dp", "pp", "tp")})
    except (TypeError, ValueError) as e:
        raise NoUnits(f"the plan's world: {e}") from None
    n = len(rank)
    size, per, mbs = mesh.dp * mesh.pp * mesh.tp, mesh.per_replica, wu.mb
    stride = mbs + 1  # unit key: d * stride + (m + 1), 0 for m None
    bad = np.flatnonzero((rank < 0) | (rank >= size) | ((mb != -1) & ((mb < 0) | (mb >= mbs))))
    if len(bad):
        i = int(bad[0])
        r, m = int(rank[i]), int(mb[i])
        if not 0 <= r < size:
            raise Misplaced(i, f"rank {r} outside the world")
        raise Misplaced(i, f"micro-batch {m} outside the world")
    d = rank // per
    key = d * stride + np.where(mb == -1, 0, mb + 1)
    op_code = {op: k for k, op in enumerate(op_names)}
    sum_codes = np.array([op_code[o] for o in SUM_OPS if o in op_code], dtype=np.int64)
    is_sum = np.isin(opc, sum_codes)
    in_ptr, out_ptr = _ptr(in_len), _ptr(out_len)
    n_t = n_tensors
    writer = np.full(n_t + 1, -1, dtype=np.int64)  # tensor -> its producer (index -1: None)
    out_node = np.repeat(np.arange(n), out_len)
    real = out_num >= 0
    writer[out_num[real]] = out_node[real]
    writer[-1] = -1
    # a sum over units belongs to its replica: applied until nothing changes (each sum's
    # unit depends on earlier nodes only, so the fixed point is node_units' result)
    cand = np.flatnonzero(is_sum & (in_len > 1) & (mb != -1))
    if len(cand):
        lens, xs = _gather(in_ptr, in_num, cand)
        w = writer[xs]
        has = w >= 0
        offsets = _ptr(lens)[:-1]
        base = key[cand]
        for _ in range(n + 1):
            pk = np.where(has, key[np.maximum(w, 0)], -1)
            hi = np.maximum.reduceat(pk, offsets)
            lo = np.minimum.reduceat(np.where(has, pk, np.iinfo(np.int64).max), offsets)
            spans = (hi >= 0) & (lo != hi)
            new = np.where(spans, d[cand] * stride, base)
            if np.array_equal(new, key[cand]):
                break
            key[cand] = new
    # chains of two-input sums over units, flattened (source.flatten_with_units)
    spanning = is_sum & (key % stride == 0)
    readers = np.bincount(in_num[in_num >= 0], minlength=n_t)
    named = np.zeros(n_t, dtype=bool)
    if len(out_nums) and out_nums.min() < 0:  # not a declared tensor
        raise NoColumns
    named[out_nums] = True
    named[s_num] = True
    rows = np.flatnonzero(spanning)
    dropped = np.zeros(n, dtype=bool)
    new_inputs: dict[int, list] = {}
    if len(rows):
        lens, xs = _gather(in_ptr, in_num, rows)
        j = writer[xs]
        jj = np.maximum(j, 0)
        at = np.repeat(rows, lens)
        merge = ((j >= 0) & spanning[jj] & (opc[jj] == opc[at]) & (rank[jj] == rank[at])
                 & (out_len[jj] == 1) & (readers[np.maximum(xs, 0)] == 1)
                 & ~named[np.maximum(xs, 0)] & (xs >= 0))
        if merge.any():
            has = np.add.reduceat(merge.astype(np.int64), _ptr(lens)[:-1]) > 0
            # over Python lists (a numpy slice per row cost twice the loop)
            ptr = _ptr(lens).tolist()
            xs_l, j_l, m_l, rows_l = xs.tolist(), j.tolist(), merge.tolist(), rows.tolist()
            row_of = dict(zip(rows_l, range(len(rows_l))))  # a merged producer is a row
            gone: list = []
            for r in np.flatnonzero(has).tolist():
                a, b = ptr[r], ptr[r + 1]
                flat: list = []
                for x, jx, mg in zip(xs_l[a:b], j_l[a:b], m_l[a:b]):
                    if mg:
                        got = new_inputs.get(jx)
                        if got is None:  # a producer not flattened itself: its inputs
                            q = row_of[jx]
                            got = xs_l[ptr[q]:ptr[q + 1]]
                        flat += got
                        gone.append(jx)
                    else:
                        flat.append(x)
                new_inputs[rows_l[r]] = flat
            dropped[gone] = True
    alive = ~dropped
    keep = np.flatnonzero(alive)
    tensor_alive = np.ones(n_t, dtype=bool)
    if dropped.any():
        gone = out_num[out_ptr[np.flatnonzero(dropped)]]
        tensor_alive[gone[gone >= 0]] = False
    # the flattened plan's columns
    changed = {i: v for i, v in new_inputs.items() if alive[i]}
    nk = len(keep)
    if nk == n and not changed:  # nothing flattened: the columns as they are
        f_in_len, f_in, f_out_len, f_out, f_key = in_len, in_num, out_len, out_num, key
    else:
        # nodes kept with their own inputs, and the flattened sums' new ones, in node
        # order (masks over the concatenated columns, not gathers: half the time)
        pos_of = np.full(n, -1, dtype=np.int64)
        pos_of[keep] = np.arange(nk)
        changed_at = sorted(changed)
        plain_all = alive.copy()
        plain_all[changed_at] = False
        f_in_len = in_len[keep]
        f_in_len[pos_of[changed_at]] = [len(changed[i]) for i in changed_at]
        f_in = np.empty(int(f_in_len.sum()), dtype=np.int64)
        own = np.repeat(plain_all[keep], f_in_len)
        f_in[own] = in_num[np.repeat(plain_all, in_len)]
        if changed_at:
            f_in[~own] = list(chain.from_iterable(map(changed.__getitem__, changed_at)))
        del own
        f_out_len = out_len[keep]
        f_out = out_num[np.repeat(alive, out_len)]
        f_key = key[keep]
    opc_kept = opc[keep]
    tunit = _tensor_units(stride, n_t, f_key, f_in_len, f_in, f_out, f_out_len)
    num, order = _canonical_numbers(wu, stride, per, tunit, tensor_alive, f_key, rank[keep],
                                    opc_kept, op_names, _ptr(f_in_len), f_in, _ptr(f_out_len),
                                    f_out)
    return Split(stride, keep, changed, f_key, f_in_len, f_in, f_out_len, f_out,
                 tensor_alive, tunit, num, order)


def _tensor_units(stride, n_t, f_key, f_in_len, f_in, f_out, f_out_len) -> np.ndarray:
    """Each tensor's unit key (units.assign_units): its producer's, else its readers' one
    unit, their replica when they span micro-batches, else global."""
    tunit = np.full(n_t, -2, dtype=np.int64)  # -2: not yet known
    out_key = np.repeat(f_key, f_out_len)
    real = f_out >= 0
    tunit[f_out[real]] = out_key[real]
    in_key = np.repeat(f_key, f_in_len)
    sel = f_in >= 0
    xs, ks = f_in[sel], in_key[sel]
    sel = tunit[xs] == -2  # graph inputs
    xs, ks = xs[sel], ks[sel]
    if len(xs):
        order = np.lexsort((ks, xs))
        xs, ks = xs[order], ks[order]
        starts = np.flatnonzero(np.concatenate([[True], xs[1:] != xs[:-1]]))
        lo = ks[starts]
        hi = np.maximum.reduceat(ks, starts)
        t = xs[starts]
        tunit[t] = np.where(lo == hi, lo, np.where(lo // stride == hi // stride,
                                                   (lo // stride) * stride, GLOBAL_KEY))
    tunit[tunit == -2] = GLOBAL_KEY
    return tunit


def _first_seen(values: np.ndarray) -> np.ndarray:
    """The distinct values (numbers >= 0) in order of first occurrence, without sorting:
    each value's first position (a minimum per value), marked."""
    n = len(values)
    if not n:
        return values
    first = np.full(int(values.max()) + 1, n, dtype=np.int64)
    np.minimum.at(first, values, np.arange(n))
    mark = np.zeros(n, dtype=bool)
    mark[first[first < n]] = True
    return values[mark]


def stable_order(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), by numpy's radix sort when the keys span fewer than
    2**15 values (unit keys, ranks within a replica): linear instead of a merge sort."""
    if len(keys):
        lo = int(keys.min())
        if int(keys.max()) - lo < 1 << 15:
            return np.argsort((keys - lo).astype(np.int16), kind="stable")
    return np.argsort(keys, kind="stable")


def _cumcount(groups: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements have its group (any order of groups)."""
    n = len(groups)
    if not n:
        return groups.copy()
    order = stable_order(groups)
    g = groups[order]
    idx = np.arange(n)
    start = np.where(np.concatenate([[True], g[1:] != g[:-1]]), idx, 0)
    out = np.empty(n, dtype=np.int64)
    out[order] = idx - np.maximum.accumulate(start)
    return out


def _canonical_numbers(wu, stride, per, tunit, tensor_alive, f_key, f_rank, opc, op_of,
                       f_in_ptr, f_in, f_out_ptr, f_out
                       ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Canonical order and local numbers (units._canonical_order): each tensor's number in
    its unit, and each unit's nodes in canonical order."""
    num = np.full(len(tunit), -1, dtype=np.int64)
    d = f_key // stride
    inst = f_key % stride != 0
    idx = np.flatnonzero(inst)
    # by unit, then rank within the replica (0 <= rank - d*per < per), then position
    idx = idx[stable_order(f_key[idx] * per + (f_rank[idx] - d[idx] * per))]
    order: dict[int, np.ndarray] = {}
    if len(idx):
        ukeys = f_key[idx]
        cuts = np.flatnonzero(np.concatenate([[True], ukeys[1:] != ukeys[:-1], [True]]))
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            order[int(ukeys[a])] = idx[a:b]
    # inputs then outputs of each node, in canonical order, first uses by the unit's own
    in_lens, ins = _gather(f_in_ptr, f_in, idx)
    out_lens, outs = _gather(f_out_ptr, f_out, idx)
    io_len = in_lens + out_lens
    io = np.empty(int(io_len.sum()), dtype=np.int64)
    io_ptr = _ptr(io_len)
    in_dst = np.repeat(io_ptr[:-1] - _ptr(in_lens)[:-1], in_lens) + np.arange(len(ins))
    out_dst = (np.repeat(io_ptr[:-1] + in_lens - _ptr(out_lens)[:-1], out_lens)
               + np.arange(len(outs)))
    io[in_dst] = ins
    io[out_dst] = outs
    io_key = np.repeat(f_key[idx], io_len)
    counters = np.zeros(wu.dp * stride + 2, dtype=np.int64)  # by unit key + 1

    def number_first(xs: np.ndarray) -> None:
        """Number the (already filtered) tensors of `xs`, grouped by unit, in order of
        first occurrence, after the unit's tensors numbered so far."""
        t = _first_seen(xs)
        if not len(t):
            return
        u = tunit[t]
        num[t] = counters[u + 1] + _cumcount(u)
        np.add.at(counters, u + 1, 1)

    sel = (io >= 0)
    if len(tunit):  # an absent slot (-1) reads the last tensor's unit, masked out after
        sel &= tunit[io] == io_key
    number_first(io[sel])
    # a replica unit's tensors its instance units read first (weights), in their order
    replicas = sorted(set((f_key[~inst]).tolist()))
    in_key = np.repeat((f_key[idx] // stride) * stride, in_lens)
    sel = ins >= 0
    sel[sel] = (tunit[ins[sel]] == in_key[sel]) & np.isin(in_key[sel], replicas)
    number_first(ins[sel])
    # replica units by dataflow (few nodes: the sums over units and what follows them)
    members = {u: np.flatnonzero(f_key == u).tolist() for u in replicas}
    tlist = tunit.tolist()
    # each member's input and output numbers (f_in/f_out: its inputs' and outputs' ids)
    m_rows = np.array(sorted(chain.from_iterable(members.values())), dtype=np.int64)
    m_il, m_ins = _gather(f_in_ptr, f_in, m_rows)
    m_ol, m_outs = _gather(f_out_ptr, f_out, m_rows)
    m_ins, m_outs = m_ins.tolist(), m_outs.tolist()
    m_ip, m_op = _ptr(m_il).tolist(), _ptr(m_ol).tolist()
    rows_l = m_rows.tolist()
    ins_of = {i: m_ins[m_ip[k]:m_ip[k + 1]] for k, i in enumerate(rows_l)}
    outs_of = {i: m_outs[m_op[k]:m_op[k + 1]] for k, i in enumerate(rows_l)}
    # per member, the first two parts of its sort key below, as Python values
    key_of = {i: (r, op_of[c]) for i, r, c in zip(rows_l, f_rank[m_rows].tolist(),
                                                   opc[m_rows].tolist())}
    numl = num.tolist()  # `num` as a list, kept equal to it below (read element by element)
    level: dict[int, int] = {}
    producer: dict[int, int] = {}
    for u in replicas:
        for i in members[u]:
            level[i] = 1 + max((level[producer[x]] for x in ins_of[i]
                                if x >= 0 and x in producer), default=-1)
            for x in outs_of[i]:
                if x >= 0:
                    producer[x] = i
    top = max(level.values(), default=-1)
    r_order: dict[int, list] = {u: [] for u in replicas}
    for lev in range(top + 1):
        for u in replicas:
            def sort_key(i: int, base=(u // stride) * per):
                rank, op = key_of[i]
                return (rank - base, op, sorted(numl[x] for x in ins_of[i] if x >= 0), i)
            got = sorted((i for i in members[u] if level[i] == lev), key=sort_key)
            r_order[u] += got
            new = [x for x in dict.fromkeys(chain.from_iterable(
                chain(ins_of[i], outs_of[i]) for i in got))
                if x >= 0 and numl[x] < 0 and tlist[x] == u]
            if new:
                k = int(counters[u + 1])
                num[new] = np.arange(k, k + len(new))
                for x, v in zip(new, range(k, k + len(new))):
                    numl[x] = v
                counters[u + 1] = k + len(new)
    for u, got in r_order.items():
        order[u] = np.array(got, dtype=np.int64)
    # global tensors: first read by any node, in plan order
    sel = f_in >= 0
    sel[sel] = tunit[f_in[sel]] == GLOBAL_KEY
    number_first(f_in[sel])
    # then whatever no node touches, in the plan's tensor order
    rest = np.flatnonzero((num < 0) & tensor_alive)
    if len(rest):
        u = tunit[rest]
        num[rest] = counters[u + 1] + _cumcount(u)
        np.add.at(counters, u + 1, 1)
    return num, order
