"""The streaming form of the plan format: JSON Lines, one record per line (docs/format.md).

    {"r":"header","format":"tvsmt.execplan","version":1,"kind":...,"plan_id":...,"sections":K}
    {"r":"section","index":0,"name":"unit 0,0"}          (optional grouping, numbered 0..K-1)
    {"r":"tensor","id":...,"shape":[...],"role":...}    (before any record that names it)
    {"r":"node","id":...,"op":...,"pass":...,...}        (in topological order)
    {"r":"lineage","single":...,"parts":[...]}          (after every node)
    {"r":"trailer","plan_id":...,"tensors":N,"nodes":N,"lineages":N,"sections":K,"crc32":C}

`iter_records(path)` checks every record as it goes (the checks of `reader.plan_from_dict`,
plus order, sections and the trailer) and yields model objects one at a time, so that a
consumer (the folder) never needs the whole plan; what it keeps is up to it. The reader keeps
only the sets the checks need (tensor shapes, written and read tensor ids, node ids). The
stream is complete only when iteration ends without an error: the trailer, checked last,
proves that nothing was cut off, left out or spliced in. `read_stream` builds a `Plan`.

`StreamWriter` writes the form atomically: into a hidden temporary file beside the target,
renamed over it after the trailer is written and synced, so a killed write leaves no file that
reads as complete.
"""

from __future__ import annotations

import gc
import gzip
import os
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter
from typing import Any, Optional

import msgspec
import numpy as np

from tvsmt.atomic import atomic_file
from tvsmt.errors import PlanError, UnsupportedOperator
from tvsmt.heap import collector_paused, collector_running
from tvsmt.plan import reader as R
from tvsmt.plan.model import Lineage, Node, Plan, TensorInfo
from tvsmt.plan.schema import (
    HeaderRec,
    LineageRec,
    NodeRec,
    Record,
    SectionRec,
    TensorRec,
    TrailerRec,
)

_LINES = msgspec.json.Decoder(Record)


class _AnyObject(msgspec.Struct, frozen=True, gc=False):
    """Any JSON object, its contents skipped (a struct without fields ignores every key)."""


class NodeText(NodeRec, tag_field="r", tag="node", gc=False):
    """A node record as the checks alone read it (`check_stream`): its attributes are checked
    to be an object or null, as `NodeRec` checks them, and not built (building them was half
    of decoding a node, and the checks never look inside)."""

    attrs: Optional[_AnyObject] = None


_CHECK_LINES = msgspec.json.Decoder(
    HeaderRec | SectionRec | TensorRec | NodeText | LineageRec | TrailerRec)
_TRAILER = b'{"r":"trailer"'


@dataclass(frozen=True)
class StreamHeader:
    path: str
    kind: str
    name: str
    world: dict[str, Any]
    outputs: tuple[str, ...]
    plan_id: str
    sections: int


@dataclass(frozen=True)
class Section:
    """A writer's grouping of the records that follow (e.g. one unit of replica folding)."""

    index: int
    name: str


@dataclass
class _State:
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)  # read before any node wrote them
    # Node ids are not kept (3.6M strings and their set are 0.4 GB on a 32-layer dp16 plan):
    # their hashes are, one array per block, and `_check_node_ids` finds equal hashes at the
    # end (equal ids have equal hashes; equal hashes are then compared as ids, from the file).
    node_hashes: list = field(default_factory=list)
    block_ids: set[str] = field(default_factory=set)  # the record-by-record path's block
    ops: set[str] = field(default_factory=set)
    slices: dict = field(default_factory=dict)  # slice -> shape, each distinct slice once
    shape_pool: dict = field(default_factory=dict)  # one tuple per distinct shape
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("tensor", "node", "lineage", "section"), 0))
    extent: tuple[int, int] = (0, 0)  # the header's world: ranks, micro-batches

    def shapes_of(self, ids) -> list:
        """The declared shapes of these tensor ids (None: undeclared), for
        `reader._fast_lineage`."""
        return list(map(self.shapes.get, ids))


def iter_records(path: str | os.PathLike, f=None) -> Iterator[Any]:
    """The records of a JSON Lines plan: first a `StreamHeader`, then `Section`,
    `TensorInfo`, `Node` and `Lineage` objects in file order. Raises a one-line `PlanError`
    naming the file and line at the first malformed record, and at the end if the trailer
    does not match what was read."""
    path = os.fspath(path)
    if f is None:
        with R.open_binary(path) as f:
            yield from _records(path, f)
    else:
        yield from _records(path, f)


def check_stream(path: str | os.PathLike) -> tuple[str, int]:
    """Every check of `iter_records` on a file, no objects built: (plan id, checksum) of the
    file that passed them. Raises what `iter_records` raises."""
    path = os.fspath(path)
    summary: dict = {}
    with R.open_binary(path) as f:
        for _ in _records(path, f, build=False, summary=summary):
            pass
    return summary["plan_id"], summary["crc"]


class _Lines:
    """A block's lines, split only when asked: a block that decodes whole (nearly every one)
    needs only their number and the last one (splitting a 16 MB block copied every line:
    2 s a side on a 1.5 GB file)."""

    __slots__ = ("block", "count", "_split")

    def __init__(self, block: bytes, count: int):
        self.block, self.count, self._split = block, count, None

    def __len__(self) -> int:
        return self.count

    def _lines(self) -> list[bytes]:
        if self._split is None:
            self._split = self.block.split(b"\n")
            if self.block.endswith(b"\n"):
                self._split.pop()
        return self._split

    def __iter__(self):
        return iter(self._lines())

    def __getitem__(self, k: int) -> bytes:
        if k == -1:  # the last line (the trailer's), found from the end
            block = self.block
            end = len(block) - block.endswith(b"\n")
            return block[block.rfind(b"\n", 0, end) + 1:end]
        return self._lines()[k]


def check_line_lengths(body, limit: int, lineno: int, path: str) -> int:
    """The number of lines of `body` (whole lines, each ending in a newline), or the one-line
    error naming the first longer than `limit` bytes (`lineno`: the lines before `body`)."""
    ends = np.flatnonzero(np.frombuffer(body, np.uint8) == 10)
    lengths = np.diff(ends, prepend=-1) - 1
    if len(lengths) and int(lengths.max()) > limit:
        k = int(np.flatnonzero(lengths > limit)[0])
        raise PlanError(f"line {lineno + k + 1}: record longer than the limit of {limit} bytes "
                        f"(set {R.RECORD_LIMIT_ENV} to raise it)", file=path)
    return len(ends)


def _blocks(path: str, f) -> Iterator[tuple[int, _Lines, bytes]]:
    """(number of lines before, the lines, their bytes with newlines) per chunk read,
    refusing over-long lines (their lengths from the newlines' offsets, in numpy)."""
    limit = R.byte_limit(R.RECORD_LIMIT_ENV, R.DEFAULT_RECORD_LIMIT)
    carry, lineno = b"", 0
    while True:
        try:
            chunk = f.read(R._CHUNK)
        except R.READ_ERRORS as e:
            raise PlanError(f"cannot read plan after line {lineno}: {R.os_reason(e)}",
                            file=path) from None
        if not chunk:
            break
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut:
            body = data[:cut] if carry else data
            if len(body) <= limit:  # no line of it can be longer: only count them
                count = body.count(b"\n")
            else:
                count = check_line_lengths(body, limit, lineno, path)
            yield lineno, _Lines(body, count), body
            lineno += count
        if len(carry) > limit:
            raise PlanError(f"line {lineno + 1}: record longer than the limit of {limit} bytes "
                            f"(set {R.RECORD_LIMIT_ENV} to raise it)", file=path)
    if carry:
        yield lineno, _Lines(carry, 1), carry


def _decode_block(path: str, base: int, lines: list[bytes], block: bytes) -> list:
    """The records of a block: one decoder call, or line by line to name a bad line."""
    recs = _whole_block(_LINES, block, len(lines))
    if recs is not None:
        return recs
    out = []
    for k, line in enumerate(lines):
        where = f"line {base + k + 1}"
        try:
            out.append(_LINES.decode(line))
        except msgspec.ValidationError as e:
            raise PlanError(f"{where}: malformed record: {e}", file=path) from None
        except msgspec.DecodeError as e:
            if not line.strip():
                raise PlanError(f"{where}: empty line", file=path) from None
            raise PlanError(f"{where}: not valid JSON: {e}", file=path) from None
        except RecursionError:
            raise PlanError(f"{where}: not valid JSON: nested too deeply", file=path) from None
    return out


def _decode_checks(path: str, base: int, lines, block: bytes) -> list:
    """`_decode_block` for the checks alone: nodes as `NodeText`s, or, when the block does
    not decode so, the records `_decode_block` gives (and its errors)."""
    recs = _whole_block(_CHECK_LINES, block, len(lines))
    return recs if recs is not None else _decode_block(path, base, lines, block)


def _whole_block(decoder: msgspec.json.Decoder, block: bytes, n_lines: int) -> list | None:
    """A block's records in one decoder call; None when it does not decode so (a line the
    type refuses, an empty line, bad JSON): the caller then decodes line by line or by
    another type, which names the bad line."""
    try:
        recs = decoder.decode_lines(block)
    except (msgspec.DecodeError, RecursionError):
        return None
    return recs if len(recs) == n_lines else None


def _records(path: str, f, build: bool = True, summary: dict | None = None) -> Iterator[Any]:
    """The collector is paused while a block is checked (millions of new objects, no
    garbage) and runs as usual while the consumer handles the records. `build=False`: the
    checks only (the objects of the usual blocks are not built); `summary` gets the plan id
    and checksum of a stream that passed every check."""
    gc_was = gc.isenabled()
    with collector_paused():
        yield from _records_unguarded(path, f, gc_was, build, summary)


def _records_unguarded(path: str, f, gc_was: bool, build: bool = True,
                       summary: dict | None = None) -> Iterator[Any]:
    from tvsmt.ops import get as get_op

    st = _State()
    crc = 0
    header: StreamHeader | None = None
    trailer: TrailerRec | None = None
    phase = 0  # 0 tensors/nodes/sections, 1 lineages
    section = -1
    lineno = 0
    for base, lines, block in _blocks(path, f):
        if trailer is not None:
            raise PlanError(f"line {base + 1}: a record after the trailer", file=path)
        recs = (_decode_block(path, base, lines, block) if build else
                _decode_checks(path, base, lines, block))
        st.block_ids.clear()
        end = len(recs)
        if type(recs[-1]) is TrailerRec:
            trailer, end = recs[-1], end - 1
            crc = zlib.crc32(block[:len(block) - len(lines[-1]) - 1]
                             if block.endswith(b"\n") else block[:len(block) - len(lines[-1])],
                             crc)
        else:
            crc = zlib.crc32(block, crc)
        start = 0
        if header is None and end and type(recs[0]) is HeaderRec:
            header = _header(recs[0], path)
            st.extent = R.world_extent(header.world)
            yield header
            start = 1
        if header is not None and not phase:
            # the block's run of tensor, node and section records (all of it, but for the
            # first block's header and the last blocks' lineages) is checked over columns
            stop = next((k for k, t in enumerate(map(type, recs[start:end]), start)
                         if t not in _BULK), end)
            done = _fast_block(recs[start:stop], stop - start, st, section, get_op, build) \
                if stop > start else None
            if done is not None:
                objs, section = done
                with collector_running(gc_was):
                    yield from objs
                start = stop
        for k in range(start, end):
            rec = recs[k]
            kind = type(rec)
            if header is None:
                if kind is not HeaderRec:
                    name = "node" if kind is NodeText else kind.__name__[:-3].lower()
                    raise PlanError(f"line {base + k + 1}: the first record must be the "
                                    f"header, not {name}", file=path)
                header = _header(rec, path)
                st.extent = R.world_extent(header.world)
                yield header
            elif kind is NodeRec or kind is NodeText:
                if phase:
                    raise PlanError(f"line {base + k + 1}: a node after the lineages (records "
                                    "out of order)", file=path, node=rec.id)
                yield _node(rec, st, path, base + k + 1, get_op)
            elif kind is TensorRec:
                if phase:
                    raise PlanError(f"line {base + k + 1}: a tensor after the lineages (records "
                                    "out of order)", file=path, tensor=rec.id)
                yield _tensor(rec, st, path, base + k + 1)
            elif kind is LineageRec:
                phase = 1
                if header.kind == "single":
                    raise PlanError(f"line {base + k + 1}: a single plan carries no lineages",
                                    file=path)
                yield _lineage(rec, st, path, f"line {base + k + 1}")
            elif kind is SectionRec:
                if rec.index != section + 1:
                    raise PlanError(f"line {base + k + 1}: section #{rec.index} ({rec.name}) "
                                    f"where #{section + 1} was expected: a section is missing "
                                    "or out of order", file=path)
                section = rec.index
                st.counts["section"] += 1
                yield Section(rec.index, rec.name)
            elif kind is TrailerRec:
                raise PlanError(f"line {base + k + 1}: a record after the trailer", file=path)
            else:
                raise PlanError(f"line {base + k + 1}: a second header (records from another "
                                "plan)", file=path)
        lineno = base + len(lines)
    if header is None:
        raise PlanError("empty file: no header record", file=path)
    if trailer is None:
        raise PlanError(f"truncated after line {lineno}: no trailer record (the write did "
                        "not finish)", file=path)
    _check_trailer(header, trailer, st, crc, path)
    _check_node_ids(st, path)
    if st.pending & st.written:
        t = sorted(st.pending & st.written)[0]
        raise PlanError("read before the node that writes it (nodes out of topological "
                        "order)", file=path, tensor=t)
    for t in header.outputs:
        if t not in st.shapes:
            raise PlanError("output is not a declared tensor", file=path, tensor=t)
    if summary is not None:
        summary.update(plan_id=header.plan_id, crc=crc)


_ID, _OP, _PASS, _RANK, _MB, _INPUTS, _OUTPUTS, _ATTRS, _SOURCE, _SHAPE, _ROLE, _INDEX, _NAME = (
    attrgetter(k) for k in ("id", "op", "pass_", "rank", "mb", "inputs", "outputs", "attrs",
                            "source", "shape", "role", "index", "name"))


def _fast_block(recs: list, end: int, st: _State, section: int, get_op, build: bool = True):
    """Check a block of tensor, node and section records over flat columns (as
    `reader._build` does) and build its objects in file order (`build=False`: none); None
    when anything is off or unusual, and nothing is changed then: the record-by-record path
    will say what."""
    kinds = list(map(type, recs[:end]))
    if not set(kinds) <= _BULK:
        return None
    pos = {TensorRec: [], NodeRec: [], NodeText: [], SectionRec: []}
    for k, kind in enumerate(kinds):
        pos[kind].append(k)
    if pos[NodeText]:  # a block's nodes are all of one kind (one decoder decoded them)
        pos[NodeRec] = pos.pop(NodeText)
    trecs = [recs[k] for k in pos[TensorRec]]
    nrecs = [recs[k] for k in pos[NodeRec]]
    srecs = [recs[k] for k in pos[SectionRec]]
    if [r.index for r in srecs] != list(range(section + 1, section + 1 + len(srecs))):
        return None
    shapes = st.shapes
    # tensors: new ids, sane dimensions
    tids = list(map(_ID, trecs))
    tshapes = list(map(tuple, map(_SHAPE, trecs)))
    dims = list(chain.from_iterable(tshapes))
    if dims and (min(dims) < 0 or max(dims) > R.MAX_DIM):
        return None
    if len(set(tids)) != len(tids) or not shapes.keys().isdisjoint(tids):
        return None
    declared_at = dict(zip(tids, pos[TensorRec]))
    # nodes: new unique ids, known operators and passes
    nids = list(map(_ID, nrecs))
    if len(set(nids)) != len(nids):
        return None
    ops = set(map(_OP, nrecs)) - st.ops
    if any(get_op(op) is None for op in ops) or not set(map(_PASS, nrecs)) <= _PASS_SET:
        return None
    if R.placement_problem(map(_RANK, nrecs), map(_MB, nrecs), st.extent) is not None:
        return None
    ins_col = list(map(_INPUTS, nrecs))
    outs_col = list(map(_OUTPUTS, nrecs))
    npos = np.array(pos[NodeRec], dtype=np.int64)
    flat_in = list(chain.from_iterable(ins_col))
    flat_out = list(chain.from_iterable(outs_col))
    in_node = np.repeat(npos, np.fromiter(map(len, ins_col), np.int64, len(nrecs)))
    out_node = np.repeat(npos, np.fromiter(map(len, outs_col), np.int64, len(nrecs)))
    # every tensor named is declared before the node: earlier in the block, or before it
    for flat, at in ((flat_in, in_node), (flat_out, out_node)):
        decl = np.fromiter(map(declared_at.get, flat, repeat(-1)), np.int64, len(flat))
        if bool((decl >= at).any()):
            return None
        old = list(compress(flat, (decl < 0).tolist()))
        if not all(map(shapes.__contains__, (t for t in old if t is not None))):
            return None  # (an id may be "": only null is no tensor)
    # outputs: SSA, and nothing written that an earlier node (in any block) read
    writer = dict(zip(flat_out, out_node.tolist()))
    writer.pop(None, None)
    if (len(writer) != len(flat_out) - flat_out.count(None)
            or not st.written.isdisjoint(writer) or not st.pending.isdisjoint(writer)):
        return None
    written_at = np.fromiter(map(writer.get, flat_in, repeat(-1)), np.int64, len(flat_in))
    if bool((written_at >= in_node).any()):
        return None
    # all good: commit the state, build the objects
    unwritten = set(compress(flat_in, (written_at < 0).tolist())) - st.written
    unwritten.discard(None)
    st.pending |= unwritten
    st.node_hashes.append(np.fromiter(map(hash, nids), np.int64, len(nids)))
    st.ops |= ops
    pool = st.shape_pool
    tshapes = [pool.setdefault(sh, sh) for sh in tshapes]
    shapes.update(zip(tids, tshapes))
    if build:
        # a written tensor's shape is kept under the writing node's copy of its id (the
        # string the written set and the consumers keep too): the tensor record's copy is
        # freed
        st.written.update(writer)
        shapes.update(zip(writer, list(map(shapes.pop, writer))))
    else:
        # only the checks keep ids: the written set keeps the tensor record's copy (the
        # shapes' key) of an id declared in this block, found in the block's small dict,
        # instead of moving every shape to the node's copy (two lookups in the large dict)
        record_id = dict(zip(tids, tids))
        st.written.update(map(record_id.get, writer, writer))
    c = st.counts
    c["tensor"] += len(trecs)
    c["node"] += len(nrecs)
    c["section"] += len(srecs)
    if not build:
        return [], section + len(srecs)
    out: list = [None] * end
    roles = [r if type(r) is str else str(r) for r in map(_ROLE, trecs)]
    for k, obj in zip(pos[TensorRec], map(TensorInfo, tids, tshapes, roles)):
        out[k] = obj
    attrs = [a if a is not None else {} for a in map(_ATTRS, nrecs)]
    for k, obj in zip(pos[NodeRec], map(Node, nids, map(_OP, nrecs), map(_PASS, nrecs),
                                        map(_RANK, nrecs), map(_MB, nrecs), ins_col, outs_col,
                                        attrs, map(_SOURCE, nrecs))):
        out[k] = obj
    for k, r in zip(pos[SectionRec], srecs):
        out[k] = Section(r.index, r.name)
    return out, section + len(srecs)


_BULK = {TensorRec, NodeRec, NodeText, SectionRec}
_PASS_SET = set(R.PASSES)


def _header(rec: HeaderRec, path: str) -> StreamHeader:
    if rec.format != R.FORMAT:
        raise PlanError(f"unknown format {rec.format!r} (expected {R.FORMAT!r})", file=path)
    if rec.version != R.VERSION or type(rec.version) is not int:
        raise PlanError(f"unsupported version {rec.version!r} (this reader knows {R.VERSION})",
                        file=path)
    if rec.kind not in R.KINDS or type(rec.kind) is not str:
        raise PlanError(f"kind must be 'single' or 'parallel', not {rec.kind!r}", file=path)
    world = R._or_default(rec.world, {})
    if not isinstance(world, dict):
        raise PlanError("'world' must be an object", file=path)
    problem = R.world_problem(world, (), ())
    if problem is not None:
        raise PlanError(f"line 1: {problem}", file=path)
    if type(rec.plan_id) is not str or not rec.plan_id:
        raise PlanError("line 1: the header needs a string 'plan_id'", file=path)
    if type(rec.sections) is not int or rec.sections < 0:
        raise PlanError("line 1: the header needs 'sections', a count >= 0", file=path)
    name = os.path.basename(path) if rec.name is None else str(rec.name)
    return StreamHeader(path, rec.kind, name, world, tuple(rec.outputs or ()), rec.plan_id,
                        rec.sections)


def _tensor(rec: TensorRec, st: _State, path: str, lineno: int) -> TensorInfo:
    tid = rec.id
    if tid in st.shapes:
        raise PlanError(f"line {lineno}: tensor declared twice", file=path, tensor=tid)
    shape = tuple(rec.shape)
    if shape and (min(shape) < 0 or max(shape) > R.MAX_DIM):
        return _bad_tensor(shape, tid, path, f"line {lineno}")
    st.shapes[tid] = shape
    st.counts["tensor"] += 1
    return TensorInfo(tid, shape, rec.role if type(rec.role) is str else str(rec.role))


def _bad_tensor(shape, tid: str, path: str, where: str):
    if min(shape) < 0:
        raise PlanError(f"{where}: negative dimension", file=path, tensor=tid)
    if shape and max(shape) > R.MAX_DIM:
        raise PlanError(f"{where}: dimension larger than 2**53 (the largest size tvsmt "
                        "handles exactly)", file=path, tensor=tid)
    raise AssertionError("unreachable")  # pragma: no cover


def _node(rec: NodeRec, st: _State, path: str, lineno: int, get_op) -> Node:
    nid, op = rec.id, rec.op
    if nid in st.block_ids:
        raise PlanError(f"line {lineno}: node id used twice", file=path, node=nid)
    st.block_ids.add(nid)
    st.node_hashes.append(np.array([hash(nid)], dtype=np.int64))
    if op not in st.ops:
        if get_op(op) is None:
            raise UnsupportedOperator(f"line {lineno}: unknown operator {op!r}", file=path,
                                      node=nid)
        st.ops.add(op)
    if rec.pass_ not in R.PASSES:
        raise PlanError(f"line {lineno}: 'pass' must be fw, bw or null, not {rec.pass_!r}",
                        file=path, node=nid)
    problem = R.placement_problem((rec.rank,), (rec.mb,), st.extent)
    if problem is not None:
        raise PlanError(f"line {lineno}: {problem}", file=path, node=nid)
    shapes, written = st.shapes, st.written
    for t in rec.inputs:
        if t is not None and t not in written:
            if t not in shapes:
                raise PlanError(f"line {lineno}: reads an undeclared tensor (tensor records "
                                "come before the records naming them)", file=path, node=nid,
                                tensor=t)
            st.pending.add(t)
    for t in rec.outputs:
        if t is None:
            continue
        if t not in shapes:
            raise PlanError(f"line {lineno}: writes an undeclared tensor (tensor records come "
                            "before the records naming them)", file=path, node=nid, tensor=t)
        if t in written:
            raise PlanError(f"line {lineno}: tensor written twice: the plan is not SSA",
                            file=path, node=nid, tensor=t)
        if t in st.pending:
            raise PlanError(f"line {lineno}: writes a tensor that an earlier node read (nodes "
                            "out of topological order)", file=path, node=nid, tensor=t)
        written.add(t)
    st.counts["node"] += 1
    return Node(nid, op, rec.pass_, rec.rank, rec.mb, rec.inputs, rec.outputs, rec.attrs or {},
                rec.source)


class _Shapes(dict):
    """`reader._lineage` wants TensorInfo by id; the stream keeps only shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self._shapes = shapes

    def get(self, key, default=None):
        shape = self._shapes.get(key)
        return default if shape is None else TensorInfo(key, shape)


def _lineage(rec: LineageRec, st: _State, path: str, where: str) -> Lineage:
    index = st.counts["lineage"]
    st.counts["lineage"] += 1
    try:
        return R._fast_lineage(rec, index, st.shapes_of, st.slices)
    except R._Reject:
        pass
    try:  # explain it with the reference validator's words
        R._lineage(msgspec.json.decode(msgspec.json.encode(rec)), index, _Shapes(st.shapes),
                   path, {})
    except PlanError as e:
        raise PlanError(f"{where}: {e.detail}", file=path, node=e.node, tensor=e.tensor) \
            from None
    raise PlanError(f"{where}: malformed lineage #{index}", file=path)  # pragma: no cover


def _check_trailer(h: StreamHeader, t: TrailerRec, st: _State, crc: int, path: str) -> None:
    if t.plan_id != h.plan_id:
        raise PlanError(f"the trailer belongs to plan {t.plan_id!r}, the header to "
                        f"{h.plan_id!r} (records from another plan)", file=path)
    c = st.counts
    if c["section"] != h.sections or t.sections != h.sections:
        raise PlanError(f"{c['section']} sections read, the header announces {h.sections}: "
                        "a section is missing", file=path)
    for kind in ("tensor", "node", "lineage"):
        if getattr(t, kind + "s") != c[kind]:
            raise PlanError(f"{c[kind]} {kind} records read, the trailer counts "
                            f"{getattr(t, kind + 's')}: records are missing or were added",
                            file=path)
    if t.crc32 != crc:
        raise PlanError("checksum mismatch: the file was changed after it was written",
                        file=path)


def _check_node_ids(st: _State, path: str) -> None:
    """No node id is used twice: no two hashes are equal, or the ids behind equal hashes
    (read again from the file) differ."""
    if not st.node_hashes:
        return
    hashes = np.sort(np.concatenate(st.node_hashes))
    st.node_hashes = [hashes]
    same = hashes[1:][hashes[1:] == hashes[:-1]]
    if not len(same):
        return
    suspects = set(same.tolist())
    if not os.path.isfile(path):  # a pipe cannot be read again
        raise PlanError(f"{len(suspects)} node ids may be used twice (equal hashes); the "
                        "stream cannot be read again to tell", file=path)
    seen: set[str] = set()
    with R.open_binary(path) as f:  # every record decoded again (the first pass read them)
        for base, lines, block in _blocks(path, f):
            for k, rec in enumerate(_decode_block(path, base, lines, block)):
                if type(rec) is NodeRec and hash(rec.id) in suspects:
                    if rec.id in seen:
                        raise PlanError(f"line {base + k + 1}: node id used twice",
                                        file=path, node=rec.id)
                    seen.add(rec.id)


def read_stream(path: str, f=None) -> Plan:
    """A whole JSON Lines plan as a `Plan` (the checks of `iter_records`)."""
    with collector_paused():
        tensors: dict[str, TensorInfo] = {}
        nodes: list[Node] = []
        lineages: list[Lineage] = []
        it = iter_records(path, f)
        header = next(it)
        for obj in it:
            kind = type(obj)
            if kind is Node:
                nodes.append(obj)
            elif kind is TensorInfo:
                tensors[obj.id] = obj
            elif kind is Lineage:
                lineages.append(obj)
        return Plan(path, header.name, header.kind, header.world, tensors, nodes,
                    list(header.outputs), lineages)


# ---------------------------------------------------------------------------- writing


class StreamWriter:
    """Writes a JSON Lines plan atomically (gzip-compressed, level 1, when the name ends in
    .gz). Records are JSON-ready dicts in the execplan's own keys; call `close()` (or use it as
    a context manager) to write the trailer and publish the file."""

    def __init__(self, path: str | os.PathLike, kind: str, name: str, world: dict,
                 outputs=(), sections: int = 0):
        self.path = os.fspath(path)
        self._file = atomic_file(self.path)  # the project's one atomic write
        self._raw = self._file.__enter__()
        self._out = (gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=1)
                     if self.path.endswith(".gz") else self._raw)
        self._enc = msgspec.json.Encoder()
        self._buf: list[bytes] = []
        self._size = 0
        self._crc = 0
        self.plan_id = uuid.uuid4().hex
        self.sections = sections
        self.counts = dict.fromkeys(("tensors", "nodes", "lineages", "sections"), 0)
        self._emit({"r": "header", "format": R.FORMAT, "version": R.VERSION, "kind": kind,
                    "name": name, "world": world, "outputs": list(outputs),
                    "plan_id": self.plan_id, "sections": sections})

    def _emit(self, rec: dict, checksum: bool = True) -> None:
        line = self._enc.encode(rec) + b"\n"
        if checksum:
            self._crc = zlib.crc32(line, self._crc)
        self._buf.append(line)
        self._size += len(line)
        if self._size > (8 << 20):
            self._flush()

    def _flush(self) -> None:
        self._out.write(b"".join(self._buf))
        self._buf, self._size = [], 0

    def section(self, name: str) -> None:
        self._emit({"r": "section", "index": self.counts["sections"], "name": name})
        self.counts["sections"] += 1

    def tensor(self, tid: str, shape, role: str = "activation") -> None:
        self._emit({"r": "tensor", "id": tid, "shape": list(shape), "role": role})
        self.counts["tensors"] += 1

    def node(self, node: dict) -> None:
        self._emit({"r": "node", **node})
        self.counts["nodes"] += 1

    def lineage(self, lineage: dict) -> None:
        self._emit({"r": "lineage", **lineage})
        self.counts["lineages"] += 1

    def close(self) -> str:
        if self.counts["sections"] != self.sections:
            self.abort()
            raise ValueError(f"{self.counts['sections']} sections written, "
                             f"{self.sections} announced")
        self._emit({"r": "trailer", "plan_id": self.plan_id, **self.counts,
                    "crc32": self._crc}, checksum=False)
        self._flush()
        if self._out is not self._raw:
            self._out.close()
        self._file.__exit__(None, None, None)  # fsync, then publish under the name
        return self.path

    def abort(self) -> None:
        """Drop the partial file (nothing is published)."""
        if self._out is not self._raw:
            try:
                self._out.close()
            except OSError:
                pass
        stop = RuntimeError("aborted")
        self._file.__exit__(type(stop), stop, None)  # removes the temporary file

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_stream(path: str | os.PathLike, plan: dict) -> str:
    """A plan dict (the execplan document) written in the JSON Lines form."""
    with StreamWriter(path, plan["kind"], plan.get("name", ""), plan.get("world", {}),
                      plan.get("outputs", ()) if plan["kind"] == "single" else ()) as w:
        for tid, info in plan["tensors"].items():
            w.tensor(tid, info["shape"], info.get("role", "activation"))
        for n in plan["nodes"]:
            w.node(n)
        for lin in plan.get("lineages", ()):
            w.lineage(lin)
    return os.fspath(path)


def node_dict(n: Node) -> dict:
    """A model `Node` as its JSON record fields (the inverse of the reader)."""
    d = {"id": n.id, "op": n.op, "pass": n.pass_, "rank": n.rank, "mb": n.mb,
         "inputs": list(n.inputs), "outputs": list(n.outputs), "attrs": n.attrs}
    if n.source is not None:
        d["source"] = n.source
    return d


def part_dict(p) -> dict:
    """A model `LineagePart` as its JSON fields."""
    d = {"slice": [list(r) for r in p.slice], "sum_of": list(p.sum_of)}
    if p.scale != 1:
        d["scale"] = [p.scale.numerator, p.scale.denominator]
    return d
