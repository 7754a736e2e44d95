"""A JSON Lines plan read in one pass straight into integer columns (`PlanColumns`).

`iter_records` (tvsmt.plan.stream) checks a file record by record and builds an object per
record; keeping those objects, or even just the sets of names its checks need, costs several
microseconds and a few hundred bytes per record, which is most of the time of reading a plan
of millions of nodes. The fold (tvsmt/fold/columns.py) needs no record objects: it works on
tensor numbers. So this reader

* decodes each block of lines (16 MiB) with msgspec into small structs whose operators and
  passes are literals and whose attributes, slices and scales stay their JSON text;
* numbers every tensor name in declaration order: names within the block by Arrow's hash
  lookup against the block's own declarations, the rest (weights read by later units,
  lineage tensors) at the end by one Arrow dictionary encoding of every declared name and
  every pending reference;
* keeps per node and tensor only integers (ranks, micro-batches, codes of operators,
  passes, attribute texts, sources, shapes and roles; line numbers), and the names as Arrow
  strings;
* checks at the end, over the whole columns, everything `iter_records` checks (declared
  before named, written once, in topological order, lineages' tensors declared and of their
  slice's shape, node ids distinct, sections, the trailer's counts and checksum).

It only says yes or no: any problem, and anything unusual, raises `NotScanned`, and the
caller runs the record-by-record checks (`stream.check_stream`), which word the error, or,
when those pass, reads the file whole. So this reader can never accept a file
`iter_records` refuses (tests/test_scan.py compares them on damaged files), and every name
is numbered by exact comparison of its bytes (a hash match alone never decides).

Records are built back from the columns only where the fold keeps them (`PlanColumns.nodes`,
`infos`, `parts` are lazy sequences here).
"""

from __future__ import annotations

import os
import zlib
from fractions import Fraction
from itertools import chain, compress, count, filterfalse, repeat
from operator import attrgetter, is_
from typing import Any, Literal, Optional, Union

import msgspec
import numpy as np

from tvsmt.errors import PlanError
from tvsmt.heap import collector_paused
from tvsmt.plan import reader as R
from tvsmt.plan.csr import PartsFromColumns, split_rows
from tvsmt.plan.csr import gather as _gather
from tvsmt.plan.csr import offsets as _ptr
from tvsmt.plan.model import (Dim, LazySequence, Lineage, Node, Plan,
                              PlanColumns, TensorInfo)
from tvsmt.plan.numbering import ABSENT
from tvsmt.plan.schema import HeaderRec, SectionRec, TrailerRec
from tvsmt.plan.stream import StreamHeader, _header, _whole_block, check_line_lengths


class NotScanned(Exception):
    """The one-pass reading does not take this file (malformed, or unusual): the exact
    record-by-record checks decide."""


_NULL = msgspec.Raw(b"null")


def _op_literal():
    """Every operator tvsmt knows, as a literal type: an unknown one fails the decoding (and
    the exact checks name it), a known one decodes to one shared string."""
    from tvsmt.ops import all_ops

    return Literal[tuple(sorted(all_ops()))]


class ScanTensor(msgspec.Struct, tag_field="r", tag="tensor", gc=False):
    id: str
    shape: tuple[Dim, ...]
    role: Any = "activation"


def _node_type():
    class ScanNode(msgspec.Struct, tag_field="r", tag="node", rename={"pass_": "pass"},
                   gc=False):
        id: str
        op: _op_literal()
        inputs: tuple[Optional[str], ...]
        outputs: tuple[Optional[str], ...]
        pass_: Optional[Literal["fw", "bw"]] = None
        rank: int = 0
        mb: int = 0
        attrs: msgspec.Raw = _NULL  # the text; an object or null (checked per distinct text)
        source: Optional[str] = None

    return ScanNode


class ScanPart(msgspec.Struct, gc=False):
    slice: msgspec.Raw  # the texts, decoded once per distinct text
    sum_of: tuple[str, ...]
    scale: msgspec.Raw = _NULL


class ScanLineage(msgspec.Struct, tag_field="r", tag="lineage", gc=False):
    single: str
    parts: list[ScanPart]
    aligned: Any = None
    hypothesis: bool = False


_DECODER: list = []  # (decoder, node type), built on first use (it needs the registry)


def _decoder():
    if not _DECODER:
        node = _node_type()
        _DECODER.append((msgspec.json.Decoder(Union[HeaderRec, SectionRec, ScanTensor, node,
                                                    ScanLineage, TrailerRec]), node))
    return _DECODER[0]

_SCALE_TEXT = msgspec.json.Decoder(Optional[tuple[int, int]])
_ATTRS_TEXT = msgspec.json.Decoder(Optional[dict[str, Any]])
_ID, _OP, _PASS, _RANK, _MB, _INPUTS, _OUTPUTS, _ATTRS, _SOURCE, _SHAPE, _ROLE = (
    attrgetter(k) for k in ("id", "op", "pass_", "rank", "mb", "inputs", "outputs", "attrs",
                            "source", "shape", "role"))
_PARTS, _SUM_OF, _SLICE, _SCALE, _SINGLE = (attrgetter(k) for k in (
    "parts", "sum_of", "slice", "scale", "single"))
_ONE = Fraction(1)


def _codes(table: dict, values, n: int) -> np.ndarray:
    """Each value's code in `table`: new values get the next codes, in order of first
    occurrence (so `list(table)[code]` is the value)."""
    values = list(values)
    table.update(zip(filterfalse(table.__contains__, dict.fromkeys(values)), count(len(table))))
    return np.fromiter(map(table.__getitem__, values), np.int64, n)


def _arrow():
    from tvsmt.plan.numbering import _arrow as mods

    got = mods()
    if got is None:  # pragma: no cover (pyarrow is a dependency)
        raise NotScanned("no pyarrow")
    return got


def _cat(parts: list, dtype=np.int64) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# ------------------------------------------------------------------------------ the pass


class _Scan:
    """The state of one pass (what the blocks add to)."""

    def __init__(self, path: str, partial: bool = False):
        self.path = path
        self.pa, self.pc = _arrow()
        self.decoder, self.node_type = _decoder()
        # `partial`: the lines from a point inside the file on (the second process's half,
        # `_scan_in_two`): no header, sections counted from the first one met
        self.partial = partial
        self.header: StreamHeader | None = None
        self.trailer: TrailerRec | None = None
        self.crc = 0
        self.crc_len = 0  # the bytes the checksum covers
        self.lines = 0
        self.section = -1
        self.first_section: int | None = None
        self.lineage_line = 0  # line of the first lineage (0: none yet)
        self.has_records = False  # a tensor, node or section record was read
        # tensors
        self.names: list = []  # Arrow chunks of the declared names
        self.t_hash: list = []  # their hashes (declared twice: equal hashes, then names)
        self.window = None  # the names of the last two blocks that declared some (Arrow)
        self.window_first = 0  # the number of its first
        self.last_names = None
        self.t_line: list = []
        self.t_shape: list = []
        self.t_role: list = []
        self.shapes: dict = {}
        self.roles: dict = {}
        self.n_t = 0
        # nodes
        self.ids: list = []  # Arrow chunks of node ids
        self.n_hash: list = []
        self.n_line: list = []
        self.cols: dict[str, list] = {k: [] for k in (
            "in_len", "in_num", "out_len", "out_num", "rank", "mb", "op", "pass", "attr",
            "source")}
        self.ops: dict = {}
        self.passes: dict = {}
        self.attr_texts: dict = {}
        self.sources: dict = {}
        self.n_n = self.n_in = self.n_out = 0
        # references left for the end, per column ("in", "out"): positions, and the names
        self.pending: dict[str, list] = {"in": [], "out": []}
        self.pending_names: dict[str, list] = {"in": [], "out": []}
        # lineages
        self.lineages: list[Lineage] = []
        self.p_per: list = []
        self.p_len: list = []
        self.p_names: list = []  # Arrow chunks
        self.p_slice: list = []
        self.p_scale: list = []
        self.slice_texts: dict = {}
        self.scale_texts: dict = {}

    def read(self, start: int = 0, size: int | None = None) -> None:
        """Read the file's lines (those of `size` bytes from `start`, a line's start) into the
        state."""
        with R.open_binary(self.path) as f:
            if start:
                f.seek(start)
            for base, count, block in _blocks_into(self.path, f, size):
                self.block(base, count, block)

    def absorb(self, part) -> None:
        """Merge the state of the lines that follow (`part`: a partial `_Scan`, or one decoded
        from the second process) into this one: its numbers, lines, positions and lineage
        indices offset by this one's counts, its codes renumbered into this one's tables."""
        if self.trailer is not None:
            raise NotScanned("a record after the trailer")
        if part.first_section is not None:
            if part.first_section != self.section + 1:
                raise NotScanned("sections out of order")
            self.section = part.section
        if self.lineage_line and part.has_records:
            raise NotScanned("a tensor, node or section after the lineages")
        if not self.lineage_line and part.lineage_line:
            self.lineage_line = part.lineage_line + self.lines
        maps = {}
        for k in _TABLES:
            mine = getattr(self, k)
            maps[k] = np.array([mine.setdefault(v, len(mine)) for v in getattr(part, k)],
                               dtype=np.int64)

        def moved(a, table):
            return maps[table][a] if len(a) else a

        def shifted(a, by):  # numbers >= 0 moved; ABSENT and pending marks kept
            return np.where(a >= 0, a + by, a)

        t0, i0, o0, l0 = self.n_t, self.n_in, self.n_out, self.lines
        one = {k: _cat(getattr(part, k)) for k in _ARRAYS}
        cols = {k: _cat(part.cols[k]) for k in _COLS}
        self.t_line.append(one["t_line"] + l0)
        self.t_shape.append(moved(one["t_shape"], "shapes"))
        self.t_role.append(moved(one["t_role"], "roles"))
        self.t_hash.append(one["t_hash"])
        self.n_hash.append(one["n_hash"])
        self.n_line.append(one["n_line"] + l0)
        self.names += part.names
        self.ids += part.ids
        for k in ("in_len", "out_len", "rank", "mb"):
            self.cols[k].append(cols[k])
        self.cols["in_num"].append(shifted(cols["in_num"], t0))
        self.cols["out_num"].append(shifted(cols["out_num"], t0))
        for k, table in (("op", "ops"), ("pass", "passes"), ("attr", "attr_texts"),
                         ("source", "sources")):
            self.cols[k].append(moved(cols[k], table))
        for key, by in (("in", i0), ("out", o0)):
            self.pending[key] += [x + by for x in part.pending[key]]
            self.pending_names[key] += part.pending_names[key]
        base = len(self.lineages)
        self.lineages += [Lineage(base + x.index, x.single, (), x.aligned, x.hypothesis)
                          for x in part.lineages]
        self.p_per.append(one["p_per"])
        self.p_len.append(one["p_len"])
        self.p_names += part.p_names
        self.p_slice.append(moved(one["p_slice"], "slice_texts"))
        self.p_scale.append(moved(one["p_scale"], "scale_texts"))
        from isal.isal_zlib import crc32_combine

        self.crc = crc32_combine(self.crc, part.crc, part.crc_len)
        self.crc_len += part.crc_len
        self.n_t += part.n_t
        self.n_n += part.n_n
        self.n_in += part.n_in
        self.n_out += part.n_out
        self.lines += part.lines
        self.trailer = part.trailer

    # -- blocks

    def block(self, base: int, count: int, block) -> None:
        """One block of whole lines (`count` of them, the first is line `base` + 1): a
        memoryview of the reading's buffer, used only during this call."""
        if self.trailer is not None:
            raise NotScanned("a record after the trailer")
        recs = _whole_block(self.decoder, block, count)
        if recs is None:
            raise NotScanned("a block that does not decode")
        if type(recs[-1]) is TrailerRec:
            self.trailer = recs.pop()
            end = len(block) - (1 if block[-1:] == b"\n" else 0)
            last = bytes(block[max(0, end - 4096):end])  # the trailer line is short
            cut = end - (len(last) - last.rfind(b"\n") - 1)
            self.crc = zlib.crc32(block[:cut], self.crc)
            self.crc_len += cut
        else:
            self.crc = zlib.crc32(block, self.crc)
            self.crc_len += len(block)
        self.lines = base + count
        if self.header is None and not self.partial:
            if not recs or type(recs[0]) is not HeaderRec:
                raise NotScanned("no header first")
            try:
                self.header = _header(recs[0], self.path)
            except PlanError:
                raise NotScanned("a bad header") from None
            recs[0] = None
        kinds = list(map(type, recs))
        tensor = list(map(is_, kinds, repeat(ScanTensor)))
        node = list(map(is_, kinds, repeat(self.node_type)))
        lineage = list(map(is_, kinds, repeat(ScanLineage)))
        section = list(map(is_, kinds, repeat(SectionRec)))
        if kinds.count(type(None)) + sum(tensor) + sum(node) + sum(lineage) + sum(section) \
                != len(recs):
            raise NotScanned("a second header, or a trailer before the end")
        self.has_records = self.has_records or any(tensor) or any(node) or any(section)
        at = np.arange(base + 1, base + 1 + len(recs), dtype=np.int64)  # line numbers
        if any(lineage):
            first = int(at[lineage.index(True)])
            if not self.lineage_line:
                self.lineage_line = first
        if self.lineage_line:
            late = np.flatnonzero(np.array(tensor) | np.array(node) | np.array(section))
            if len(late) and int(at[late[-1]]) > self.lineage_line:
                raise NotScanned("a tensor, node or section after the lineages")
        if any(section):
            idx = [r.index for r in compress(recs, section)]
            if self.first_section is None:
                self.first_section = idx[0]
                if self.partial:  # counted from the first one met (checked when merged)
                    self.section = idx[0] - 1
            if idx != list(range(self.section + 1, self.section + 1 + len(idx))):
                raise NotScanned("sections out of order")
            self.section += len(idx)
        if any(tensor):
            self._tensors(list(compress(recs, tensor)), at[np.array(tensor)])
        if any(node):
            self._nodes(list(compress(recs, node)), at[np.array(node)])
        if any(lineage):
            self._lineages(list(compress(recs, lineage)))

    def _tensors(self, recs: list, lines: np.ndarray) -> None:
        pa = self.pa
        n = len(recs)
        tids = list(map(_ID, recs))
        names = pa.array(tids, pa.large_string())
        self.t_hash.append(np.fromiter(map(hash, tids), np.int64, n))
        self.names.append(names)
        # the names references are looked up in: this block's and the previous one's (a
        # unit's tensors are often declared in the block before its nodes)
        if self.last_names is None:
            self.window, self.window_first = names, self.n_t
        else:  # consecutive numbers
            self.window = pa.concat_arrays([self.last_names, names])
            self.window_first = self.n_t - len(self.last_names)
        self.last_names = names
        self.t_line.append(lines)
        self.t_shape.append(_codes(self.shapes, map(_SHAPE, recs), n))
        try:
            self.t_role.append(_codes(self.roles, map(_ROLE, recs), n))
        except TypeError:  # a role that is a list or an object
            raise NotScanned("an unusual role") from None
        self.n_t += n

    def _nodes(self, recs: list, lines: np.ndarray) -> None:
        pa = self.pa
        n = len(recs)
        nids = list(map(_ID, recs))
        self.n_hash.append(np.fromiter(map(hash, nids), np.int64, n))
        self.ids.append(pa.array(nids, pa.large_string()))
        self.n_line.append(lines)
        cols = self.cols
        for key, get, offset in (("in", _INPUTS, self.n_in), ("out", _OUTPUTS, self.n_out)):
            lists = pa.array(list(map(get, recs)), pa.large_list(pa.large_string()))
            lens = np.diff(lists.offsets.to_numpy())
            flat = lists.flatten()
            cols[key + "_len"].append(lens)
            cols[key + "_num"].append(self._number(flat, key, offset))
            if key == "in":
                self.n_in += len(flat)
            else:
                self.n_out += len(flat)
        try:
            cols["rank"].append(np.fromiter(map(_RANK, recs), np.int64, n))
            cols["mb"].append(np.fromiter(map(_MB, recs), np.int64, n))
        except OverflowError:  # beyond 64 bits: outside any world
            raise NotScanned("a rank or micro-batch beyond 64 bits") from None
        cols["op"].append(_codes(self.ops, map(_OP, recs), n))
        cols["pass"].append(_codes(self.passes, map(_PASS, recs), n))
        cols["attr"].append(_codes(self.attr_texts, map(bytes, map(_ATTRS, recs)), n))
        cols["source"].append(_codes(self.sources, map(_SOURCE, recs), n))
        self.n_n += n

    def _number(self, flat, key: str, offset: int) -> np.ndarray:
        """Tensor numbers of names: declared in this block, by Arrow here; the others left
        for the end (`pending`); ABSENT for a null slot."""
        pc = self.pc
        out = np.full(len(flat), ABSENT, dtype=np.int64)
        if not len(flat):
            return out
        named = ~flat.is_null().to_numpy(zero_copy_only=False)
        if self.window is not None and len(self.window):
            found = pc.index_in(flat, value_set=self.window)
            hit = found.is_valid().to_numpy(zero_copy_only=False)
            out[hit] = found.filter(found.is_valid()).to_numpy() + self.window_first
            named &= ~hit
        rest = np.flatnonzero(named)
        if len(rest):
            self.pending[key].append(rest + offset)
            self.pending_names[key].append(flat.take(self.pa.array(rest)))
            out[rest] = -5  # resolved at the end
        return out

    def _lineages(self, recs: list) -> None:
        pa = self.pa
        for rec in recs:
            index = len(self.lineages)
            aligned = None
            if rec.aligned is not None:
                aligned = R._aligned(rec.aligned, index)
                if aligned is None:
                    raise NotScanned("a bad 'aligned'")
            self.lineages.append(Lineage(index, rec.single, (), aligned, rec.hypothesis))
        per = np.fromiter(map(len, map(_PARTS, recs)), np.int64, len(recs))
        if per.min() == 0:
            raise NotScanned("a lineage without parts")
        parts = list(chain.from_iterable(map(_PARTS, recs)))
        n = len(parts)
        sums = list(map(_SUM_OF, parts))
        lens = np.fromiter(map(len, sums), np.int64, n)
        if lens.min() == 0:
            raise NotScanned("a part without tensors")
        for j in np.flatnonzero(lens > 1).tolist():
            if len(set(sums[j])) != len(sums[j]):
                raise NotScanned("a tensor twice in a part")
        self.p_per.append(per)
        self.p_len.append(lens)
        self.p_names.append(pa.array(list(chain.from_iterable(sums)), pa.large_string()))
        self.p_slice.append(_codes(self.slice_texts, map(bytes, map(_SLICE, parts)), n))
        self.p_scale.append(_codes(self.scale_texts, map(bytes, map(_SCALE, parts)), n))

    # -- the end: the checks over whole columns

    def finish(self) -> "ScannedPlan":
        h, t = self.header, self.trailer
        if h is None or t is None:
            raise NotScanned("no header or no trailer")
        n_lin = len(self.lineages)
        if (t.plan_id != h.plan_id or self.section + 1 != h.sections
                or t.sections != h.sections or t.tensors != self.n_t or t.nodes != self.n_n
                or t.lineages != n_lin or t.crc32 != self.crc):
            raise NotScanned("the trailer does not match")
        if h.kind == "single" and n_lin:
            raise NotScanned("lineages in a single plan")
        for text in self.attr_texts:
            if text[:1] not in (b"{", b"n"):  # decoded JSON: an object, or null
                raise NotScanned("attributes that are no object")
        if self.n_t > np.iinfo(np.int32).max:  # pragma: no cover
            raise NotScanned("too many tensors")
        pa, pc = self.pa, self.pc
        cols = {k: _cat(v) for k, v in self.cols.items()}
        self.cols = {}  # the blocks' pieces, freed
        if len(cols["rank"]) and R.placement_problem(
                (cols["rank"].min(), cols["rank"].max()), (cols["mb"].min(), cols["mb"].max()),
                R.world_extent(h.world)) is not None:
            raise NotScanned("a node outside the world")
        table = (pa.chunked_array(self.names, pa.large_string()).combine_chunks()
                 if self.names else pa.array([], pa.large_string()))
        self._check_distinct(_cat(self.t_hash), table, "a tensor declared twice")
        # every name left for the end, looked up in one hash table of the declared ones
        outputs = pa.array(list(h.outputs), pa.large_string())
        query = pa.chunked_array([outputs, *self.pending_names["in"],
                                  *self.pending_names["out"], *self.p_names],
                                 pa.large_string())
        found = pc.index_in(query, value_set=table)
        if found.null_count:
            raise NotScanned("an undeclared tensor")
        later = found.to_numpy().astype(np.int64)
        out_num = later[:len(outputs)]
        at = len(outputs)
        for key in ("in", "out"):
            for pos in self.pending[key]:
                cols[key + "_num"][pos] = later[at:at + len(pos)]
                at += len(pos)
        s_num = later[at:]
        self._check_dataflow(cols)
        self._check_node_ids()
        p_len = _cat(self.p_len)
        slices, slice_index = self._slices()
        t_shape = _cat(self.t_shape)
        shape_list = list(self.shapes)
        if len(s_num):
            want = np.array([self.shapes.get(tuple(e - s for s, e in key), -1)
                             for key in slices], dtype=np.int64)
            if (t_shape[s_num] != np.repeat(want[slice_index], p_len)).any():
                raise NotScanned("a lineage tensor not of its slice's shape")
        scales = self._scales()
        return ScannedPlan(self, cols, table, t_shape, shape_list, out_num, p_len, s_num,
                           slices, slice_index, scales)

    def _check_dataflow(self, cols: dict) -> None:
        """Declared before named, written once, read after written (topological)."""
        t_line = _cat(self.t_line)
        n_line = _cat(self.n_line)
        for key in ("in", "out"):
            num, lens = cols[key + "_num"], cols[key + "_len"]
            named = num >= 0
            reader_line = np.repeat(n_line, lens)[named]
            if (t_line[num[named]] >= reader_line).any():
                raise NotScanned("a tensor named before its declaration")
        out, in_ = cols["out_num"], cols["in_num"]
        real = out[out >= 0]
        if len(real) and np.bincount(real, minlength=self.n_t).max() > 1:
            raise NotScanned("a tensor written twice")
        writer = np.full(self.n_t, self.n_n, dtype=np.int64)  # n_n: no writer
        writer[out[out >= 0]] = np.repeat(np.arange(self.n_n), cols["out_len"])[out >= 0]
        read = in_ >= 0
        if (writer[in_[read]] < self.n_n).any():
            reader = np.repeat(np.arange(self.n_n), cols["in_len"])[read]
            w = writer[in_[read]]
            if ((w < self.n_n) & (w >= reader)).any():
                raise NotScanned("a tensor read before it is written")

    def _check_node_ids(self) -> None:
        if self.ids:
            ids = self.pa.chunked_array(self.ids, self.pa.large_string())
            self._check_distinct(_cat(self.n_hash), ids, "a node id used twice")

    def _check_distinct(self, hashes: np.ndarray, names, why: str) -> None:
        """No name twice: their hashes all differ, or the names behind equal hashes do."""
        order = np.argsort(hashes)
        sorted_ = hashes[order]
        same = np.flatnonzero(sorted_[1:] == sorted_[:-1])
        if not len(same):
            return
        rows = np.unique(np.concatenate([order[same], order[same + 1]]))
        got = names.take(self.pa.array(rows)).to_pylist()
        if len(set(got)) != len(got):
            raise NotScanned(why)

    def _slices(self) -> tuple[list, np.ndarray]:
        """The distinct slices (tuples of (start, end)), each part's index into them: equal
        slices written alike share a text, and texts that differ but decode alike share an
        index too."""
        try:
            distinct, index_of_text = R.decode_slice_texts(self.slice_texts)
        except ValueError as e:
            raise NotScanned(str(e)) from None
        codes = _cat(self.p_slice)
        index = np.array(index_of_text, dtype=np.int64)[codes] if len(codes) else codes
        return distinct, index

    def _scales(self) -> tuple[list, np.ndarray]:
        values = []
        for text in self.scale_texts:
            try:
                sc = _SCALE_TEXT.decode(text)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise NotScanned("a bad scale") from None
            if sc is None:
                values.append(_ONE)
            elif sc[1] == 0:
                raise NotScanned("a scale with denominator 0")
            else:
                values.append(Fraction(sc[0], sc[1]))
        return values, _cat(self.p_scale)


# ------------------------------------------------------------------ two processes, two halves

# Files at least this large, uncompressed, are read in two processes when a core is idle
# (tvsmt.forked.use_second_core): this one reads the first half, a forked one the second,
# and this one merges the second half's state into its own before the checks over whole
# columns (nothing of the checks depends on where the file was cut: numbers, lines and codes
# are offset and renumbered, names the second half could not find are left for the end).
SPLIT_MIN_BYTES = 64 << 20
SPLIT_ENV = "TVSMT_SCAN_SPLIT_BYTES"  # that size, from outside (benchmarks, tests)
# The forked process reads this fraction of the file (the first part): this one reads the
# rest and then merges and checks the whole (scripts/bench_stream.py measures it).
SPLIT_AT = 0.46


def _split_point(path: str) -> int | None:
    """Where this process starts reading (a line's start, about `SPLIT_AT` into the file)
    while a forked one reads what comes before, or None: one process reads the file."""
    from tvsmt.forked import use_second_core

    try:
        if not os.path.isfile(path):
            return None
        size = os.path.getsize(path)
        if size < R.byte_limit(SPLIT_ENV, SPLIT_MIN_BYTES) or not use_second_core():
            return None
        with open(path, "rb") as f:
            if f.read(2) == R.GZIP_MAGIC:
                return None
            f.seek(int(size * SPLIT_AT))
            head = f.read(1 << 20)
    except OSError:
        return None
    nl = head.find(b"\n")
    mid = int(size * SPLIT_AT) + nl + 1
    return mid if nl >= 0 and mid < size else None


def _scan_in_two(path: str, mid: int) -> "ScannedPlan":
    """The file's lines before `mid` read by a forked process, those after it here (the
    lineages, whose names are the most to send, stay here); the first half's state comes back
    through an in-memory file (`memfd`, mapped here: no copy of its arrays) and this half's
    is merged into it. When the process fails or dies, its half is read here."""
    from tvsmt.forked import ForkedCall

    fd = os.memfd_create("tvsmt-scan", getattr(os, "MFD_CLOEXEC", 0))
    try:
        call = ForkedCall(lambda: _first_half(path, mid, fd))
        try:
            part = _Scan(path, partial=True)
            part.read(mid)
            answer = call.answer()
        except BaseException:  # an error in this half, or Ctrl-C: the other one ends now
            call.stop()
            raise
        if answer == _REFUSED:
            raise NotScanned("the first half")
        first = _Part.load(path, fd) if answer == _DONE else None
        if first is None:
            first = _Scan(path)
            first.read(0, mid)
        first.absorb(part)
        return first.finish()
    finally:
        os.close(fd)


_REFUSED, _DONE = b"refused", b"done"


def _first_half(path: str, mid: int, fd: int) -> bytes:
    """In the forked process: the lines before `mid` read, the state written to `fd`."""
    from tvsmt.heap import leave_to_exit

    sc = _Scan(path)
    leave_to_exit(sc)  # freed with the process, after the answer
    try:
        sc.read(0, mid)
    except (NotScanned, PlanError):
        return _REFUSED
    _Part.save(sc, fd)
    return _DONE


_ARRAYS = ("t_line", "t_shape", "t_role", "t_hash", "n_hash", "n_line", "p_per", "p_len",
           "p_slice", "p_scale")
_COLS = ("in_len", "in_num", "out_len", "out_num", "rank", "mb", "op", "pass", "attr",
         "source")
_TABLES = ("shapes", "roles", "ops", "passes", "attr_texts", "sources", "slice_texts",
           "scale_texts")
_COUNTS = ("n_t", "n_n", "n_in", "n_out", "lines", "crc", "crc_len", "section",
           "first_section", "lineage_line", "has_records")
_I32 = np.iinfo(np.int32)


class _Part:
    """A `_Scan`'s state written to a file descriptor and read back: counts, header, tables
    and lineages as msgpack, then its numpy arrays (as int32 where they fit) and Arrow
    strings as raw buffers."""

    @staticmethod
    def save(sc: _Scan, fd: int) -> None:
        pa = sc.pa
        arrays = [_cat(getattr(sc, k)) for k in _ARRAYS] + [_cat(sc.cols[k]) for k in _COLS]
        arrays += [_cat(sc.pending["in"]), _cat(sc.pending["out"])]
        arrays = [a.astype(np.int32) if a.dtype == np.int64 and len(a) and
                  _I32.min <= a.min() and a.max() <= _I32.max else a for a in arrays]
        strings = [pa.chunked_array(x, pa.large_string()).combine_chunks() for x in (
            sc.names, sc.ids, sc.pending_names["in"], sc.pending_names["out"], sc.p_names)]
        h = sc.header
        meta = msgspec.msgpack.encode({
            "header": None if h is None else [h.path, h.kind, h.name, h.world,
                                              list(h.outputs), h.plan_id, h.sections],
            "counts": [getattr(sc, k) for k in _COUNTS],
            "trailer": None if sc.trailer is None else msgspec.structs.asdict(sc.trailer),
            "tables": [list(getattr(sc, k)) for k in _TABLES],
            "lineages": [[x.single, None if x.aligned is None else
                          [x.aligned.single, x.aligned.parallel, x.aligned.inputs],
                          x.hypothesis] for x in sc.lineages],
            "arrays": [[str(a.dtype), len(a)] for a in arrays],
            "strings": [[len(x), x.buffers()[1].size, x.buffers()[2].size] for x in strings],
        })
        parts = [len(meta).to_bytes(8, "little"), meta]
        parts += [memoryview(a).cast("B") for a in arrays]
        for x in strings:
            parts += [memoryview(x.buffers()[1]), memoryview(x.buffers()[2])]
        for data in parts:
            while data:
                data = data[os.write(fd, data):]

    @staticmethod
    def load(path: str, fd: int) -> "_Scan | None":
        """The state written to `fd` (mapped, not copied), or None when it is not whole."""
        import mmap

        import pyarrow as pa

        from tvsmt.plan.model import Aligned

        try:
            size = os.fstat(fd).st_size
            data = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(
                mmap, "MAP_POPULATE", 0), mmap.PROT_READ))
            n = int.from_bytes(data[:8], "little")
            meta = msgspec.msgpack.decode(data[8:8 + n])
            at = 8 + n
            arrays = []
            for dtype, length in meta["arrays"]:
                a = np.frombuffer(data, np.dtype(dtype), length, at)
                arrays.append(a)
                at += a.nbytes
            strings = []
            for length, n_off, n_data in meta["strings"]:
                bufs = [None, pa.py_buffer(data[at:at + n_off]),
                        pa.py_buffer(data[at + n_off:at + n_off + n_data])]
                strings.append(pa.Array.from_buffers(pa.large_string(), length, bufs))
                at += n_off + n_data
            if at != size:
                return None
        except (ValueError, KeyError, TypeError, OSError, msgspec.DecodeError,
                pa.ArrowException):
            return None
        sc = _Scan(path)
        for k, v in zip(_COUNTS, meta["counts"]):
            setattr(sc, k, v)
        if meta["header"] is not None:
            p, kind, name, world, outputs, plan_id, sections = meta["header"]
            sc.header = StreamHeader(p, kind, name, world, tuple(outputs), plan_id, sections)
        for k, a in zip(_ARRAYS, arrays):
            setattr(sc, k, [a])
        sc.cols = {k: [a] for k, a in zip(_COLS, arrays[len(_ARRAYS):])}
        sc.pending = {"in": [arrays[-2]], "out": [arrays[-1]]}
        names, ids, pin, pout, p_names = strings
        sc.names, sc.ids, sc.p_names = [names], [ids], [p_names]
        sc.pending_names = {"in": [pin], "out": [pout]}
        tables = meta["tables"]
        tables[0] = [tuple(x) for x in tables[0]]  # shapes
        for k, values in zip(_TABLES, tables):
            setattr(sc, k, dict(zip(values, count())))
        sc.trailer = None if meta["trailer"] is None else TrailerRec(**meta["trailer"])
        sc.lineages = [Lineage(i, single, (), None if al is None else Aligned(
            tuple(al[0]), tuple(al[1]), tuple(al[2])), hyp)
            for i, (single, al, hyp) in enumerate(meta["lineages"])]
        return sc


# --------------------------------------------------------------------------- the result


class ScannedPlan:
    """What one pass read: the header and lineages (their parts left to the columns), and
    the plan's columns, whose `nodes`, `infos`, `tids` and `parts` are built on demand (from
    `_Records`, which holds no reference back: nothing here is a cycle, so all of it is
    freed as soon as the fold lets it go)."""

    def __init__(self, sc: _Scan, cols: dict, table, t_shape, shape_list, out_num, p_len,
                 s_num, slices, slice_index, scales):
        self.header, self.lineages, self.crc = sc.header, sc.lineages, sc.crc
        rec = _Records(sc, cols, table, t_shape, shape_list, p_len, s_num, slices,
                       slice_index, scales)
        per = _cat(sc.p_per)
        n_t, n_n, n_p = len(t_shape), len(cols["rank"]), len(p_len)
        self.columns = PlanColumns(
            nodes=LazySequence(n_n, rec.nodes), tids=LazySequence(n_t, rec.names), number=None,
            in_len=cols["in_len"], in_num=cols["in_num"], out_len=cols["out_len"],
            out_num=cols["out_num"], rank=cols["rank"], mb=cols["mb"], op=None,
            infos=LazySequence(n_t, rec.infos), t_shape=None, lineages=sc.lineages,
            s_len=p_len, s_num=s_num, slice_index=slice_index, slices=slices,
            attr_text=cols["attr"], op_code=cols["op"], op_names=rec.op_names,
            pass_code=cols["pass"], pass_names=rec.pass_names, shape_code=t_shape,
            shapes=shape_list, parts=LazySequence(n_p, rec.parts), part_lineage=np.repeat(
                np.arange(len(per)), per), part_pos=np.arange(n_p) - np.repeat(
                _ptr(per)[:-1], per), scale_code=rec.scale_code, scales=rec.scales,
            output_num=out_num)

    def header_plan(self) -> Plan:
        """The plan without its records (world, outputs, lineages' single tensors) and its
        columns: what the fold needs, and what `reader.check_pair` checks against the single
        plan (lineage targets, every part's slice inside its target)."""
        h = self.header
        return Plan(h.path, h.name, h.kind, h.world, {}, [], list(h.outputs), self.lineages,
                    self.columns)


class _Records:
    """Records built back from the columns, for the few the fold keeps."""

    def __init__(self, sc: _Scan, cols: dict, table, t_shape, shape_list, p_len, s_num,
                 slices, slice_index, scales):
        pa = sc.pa
        self._table = table
        self._ids = (pa.chunked_array(sc.ids, pa.large_string()).combine_chunks() if sc.ids
                     else None)
        self._t_role = _cat(sc.t_role)
        self._roles = [r if type(r) is str else str(r) for r in sc.roles]
        self._shapes = shape_list
        self._t_shape = t_shape
        self._cols = cols
        self._in_ptr = _ptr(cols["in_len"])
        self._out_ptr = _ptr(cols["out_len"])
        self.op_names = list(sc.ops)
        self.pass_names = list(sc.passes)
        self._attr_texts = list(sc.attr_texts)
        self._sources = list(sc.sources)
        self.scales, self.scale_code = scales
        self.parts = PartsFromColumns(self.names, p_len, s_num, slices, slice_index,
                                      *scales)

    # -- records on demand

    def names(self, idx: list) -> list:
        if not idx:
            return []
        return self._table.take(self._arrow_idx(idx)).to_pylist()

    def _arrow_idx(self, idx):
        import pyarrow as pa

        return pa.array(np.asarray(idx, dtype=np.int64))

    def _names_or_none(self, nums: np.ndarray) -> list:
        names = self.names(np.maximum(nums, 0).tolist())
        return [None if k < 0 else x for k, x in zip(nums.tolist(), names)]

    def infos(self, idx: list) -> list:
        names = self.names(idx)
        shapes, roles = self._shapes, self._roles
        return [TensorInfo(x, shapes[s], roles[r]) for x, s, r in zip(
            names, self._t_shape[idx].tolist(), self._t_role[idx].tolist())]

    def nodes(self, idx: list) -> list:
        if not idx:
            return []
        c = self._cols
        rows = np.asarray(idx, dtype=np.int64)
        ids = self._ids.take(self._arrow_idx(idx)).to_pylist()
        il, ins = _gather(self._in_ptr, c["in_num"], rows)
        ol, outs = _gather(self._out_ptr, c["out_num"], rows)
        ins_names = split_rows(self._names_or_none(ins), il)
        outs_names = split_rows(self._names_or_none(outs), ol)
        ops, passes, texts, sources = (self.op_names, self.pass_names, self._attr_texts,
                                       self._sources)
        return [Node(i, ops[o], passes[p], r, m, a, b,
                     _ATTRS_TEXT.decode(texts[t]) or {}, sources[s])
                for i, o, p, r, m, a, b, t, s in zip(
                    ids, c["op"][rows].tolist(), c["pass"][rows].tolist(),
                    c["rank"][rows].tolist(), c["mb"][rows].tolist(), ins_names, outs_names,
                    c["attr"][rows].tolist(), c["source"][rows].tolist())]


def scan_plan(path: str | os.PathLike) -> ScannedPlan:
    """Read a JSON Lines plan in one pass into columns; `NotScanned` when it does not take
    the file (the caller runs `stream.check_stream` to word the error, or reads the file
    whole). One-line `PlanError`s for what the reading itself meets (a file that cannot be
    read, a record over the length limit) are the ones `iter_records` gives."""
    path = os.fspath(path)
    with collector_paused():
        mid = _split_point(path)
        if mid is not None:
            return _scan_in_two(path, mid)
        sc = _Scan(path)
        sc.read()
        return sc.finish()


def _blocks_into(path: str, f, size: int | None = None):
    """(lines before, line count, a memoryview of whole lines) per chunk of the file (of its
    next `size` bytes), read into one reused buffer (a new 16 MiB buffer per chunk costs its
    page faults again: 4 s on a 1.5 GB file here). The view is valid until the next item is
    asked for. The record length limit and its one-line error are `stream._blocks`'."""
    limit = R.byte_limit(R.RECORD_LIMIT_ENV, R.DEFAULT_RECORD_LIMIT)
    buf = bytearray(R._CHUNK)
    start, lineno = 0, 0  # bytes carried over (the start of a line) at the buffer's front
    left = size
    while True:
        if start == len(buf):  # one line longer than the buffer (within the limit)
            buf = buf + bytearray(len(buf))
        view = memoryview(buf)
        want = len(buf) if left is None else min(len(buf), start + left)
        try:
            n = f.readinto(view[start:want]) if want > start else 0
            if left is not None:
                left -= n or 0
        except R.READ_ERRORS as e:
            raise PlanError(f"cannot read plan after line {lineno}: {R.os_reason(e)}",
                            file=path) from None
        end = start + (n or 0)
        if not n:  # the end: what is left is a last line without its newline
            if start:
                yield lineno, 1, view[:start]
            return
        cut = buf.rfind(b"\n", 0, end) + 1
        if cut:
            if cut > limit:  # a line of it may be longer than the limit
                count = check_line_lengths(view[:cut], limit, lineno, path)
            else:
                count = buf.count(b"\n", 0, cut)
            yield lineno, count, view[:cut]
            lineno += count
        start = end - cut
        if start > limit:
            raise PlanError(f"line {lineno + 1}: record longer than the limit of {limit} bytes "
                            f"(set {R.RECORD_LIMIT_ENV} to raise it)", file=path)
        view.release()
        buf[:start] = buf[cut:end]


__all__ = ["NotScanned", "ScannedPlan", "scan_plan"]
