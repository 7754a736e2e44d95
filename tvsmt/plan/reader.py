"""Reading and validating execplan v1 files.

Everything a plan producer can get wrong is checked here, once, and reported as a one-line
`PlanError` naming the file and the node or tensor: later phases may trust the dataclasses.
Checks that need both plans (lineages refer to single-plan tensors) are in `check_pair`.

Two forms (docs/format.md): one JSON document (`.json`, `.json.gz`), decoded here, or JSON
Lines, one record per line (`.jsonl`, `.jsonl.gz`, read by `tvsmt.plan.stream`);
`tvsmt.plan.load.load_plan` tells them apart by name and content. A document is decoded by
msgspec straight into typed structs (`tvsmt.plan.schema`) and checked by `_build`, a loop that
only says yes or no; when it says no (or the types do not fit), the document is decoded again
generically and `plan_from_dict`, the reference validator, finds and words the error. So the
fast path costs nothing in messages, and it can never accept what `plan_from_dict` refuses
(tests/test_plan_reader.py compares both on damaged plans).

Limits (bounded time and memory on hostile input): a document's decompressed text may not
exceed TVSMT_MAX_PLAN_BYTES (default 1 GiB); a JSON Lines record may not exceed
TVSMT_MAX_RECORD_BYTES (default 64 MiB); JSON nesting deeper than the decoder's limit, an
integer beyond 64 bits and a dimension or slice bound above 2**53 are refused.
"""

from __future__ import annotations

import io
import operator
import os
import stat
import weakref
import zlib
from collections import deque
from functools import partial
from fractions import Fraction
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Any

import msgspec
import numpy as np
from isal import igzip, isal_zlib
from msgspec.structs import force_setattr

from tvsmt.errors import PlanError, UnsupportedOperator
from tvsmt.heap import collector_paused
from tvsmt.plan.csr import PartsFromColumns, split_rows
from tvsmt.plan.csr import gather as _gather
from tvsmt.plan.csr import offsets as _ptr
from tvsmt.plan.model import (MAX_DIM, Aligned, LazySequence, Lineage, LineagePart, Node,
                              Plan, PlanColumns, TensorInfo)
from tvsmt.plan.numbering import (
    UNDECLARED,
    ForkedNumbering,
    Numbering,
    attr_text_codes,
    first_use_codes,
)
from tvsmt.plan.schema import HeadPlan, RawPlan, decode_scale
from tvsmt.timing import span

FORMAT = "tvsmt.execplan"
VERSION = 1
KINDS = ("single", "parallel")
PASSES = ("fw", "bw", None)
PLAN_LIMIT_ENV, RECORD_LIMIT_ENV = "TVSMT_MAX_PLAN_BYTES", "TVSMT_MAX_RECORD_BYTES"
DEFAULT_PLAN_LIMIT, DEFAULT_RECORD_LIMIT = 1 << 30, 64 << 20
GZIP_MAGIC = b"\x1f\x8b"
STREAM_SUFFIXES = (".jsonl", ".jsonl.gz")
STREAM_START = b'{"r":"header"'
_CHUNK = 16 << 20
# what reading a (compressed) plan can raise: a truncated or corrupt gzip stream included
READ_ERRORS = (OSError, EOFError, zlib.error, isal_zlib.error)


def byte_limit(env: str, default: int) -> int:
    """A size limit from the environment (a positive number of bytes)."""
    value = os.environ.get(env)
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise PlanError(f"{env} must be a positive number of bytes, not {value!r}")
    return n


def open_binary(path: str):
    """The plan file as a binary stream, decompressed when it is gzip (by its magic bytes)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise PlanError("no such file", file=path) from None
    except IsADirectoryError:
        raise PlanError("is a directory, not a plan file", file=path) from None
    except OSError as e:
        raise PlanError(f"cannot read plan: {e.strerror or e}", file=path) from None
    try:
        magic = f.peek(2)[:2]  # peek, not read: pipes cannot seek back
    except OSError as e:
        f.close()
        raise PlanError(f"cannot read plan: {os_reason(e)}", file=path) from None
    if magic == GZIP_MAGIC:
        return igzip.IGzipFile(fileobj=f, mode="rb")  # ISA-L: the stdlib's gzip, 3x faster
    return f


def text_size(path: str) -> int | None:
    """About how many bytes a plan file's text has, cheaply: a regular file's size, or for
    gzip its trailer's size of the last member (modulo 2**32, so never less than the file
    itself); None when it cannot tell (not a regular file, unreadable). An estimate for
    choosing how to read, never a check."""
    try:
        st = os.stat(path)  # before opening: a FIFO's open blocks (and takes its data)
        if not stat.S_ISREG(st.st_mode):
            return None
        with open(path, "rb") as f:
            if f.read(2) != GZIP_MAGIC or st.st_size < 20:
                return st.st_size
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
    except OSError:
        return None
    return max(isize, st.st_size)


def world_hint(path: str, window: int = 1 << 16) -> dict | None:
    """The plan's `world` object when the first `window` bytes of its text hold it (where
    tvsmt's writers and the nnScaler export put it, before the tensors), else None. A hint
    for choosing how to read, never a check: the reader decodes the world itself."""
    try:
        with open_binary(path) as f:
            head = f.read(window)
    except (PlanError, *READ_ERRORS):
        return None
    at = head.find(b'"world"')
    start = head.find(b"{", at) if at >= 0 else -1
    if start < 0 or head[at + 7:start].strip() != b":":
        return None
    end = head.find(b"}", start)
    for _ in range(64):  # the first closing brace that ends a JSON object (nested ones too)
        if end < 0:
            return None
        try:
            world = msgspec.json.decode(head[start:end + 1])
        except msgspec.DecodeError:
            end = head.find(b"}", end + 1)
            continue
        return world if isinstance(world, dict) else None
    return None


def is_stream(path: str, head: bytes) -> bool:
    return path.endswith(STREAM_SUFFIXES) or head.lstrip().startswith(STREAM_START)


def read_document(path: str, f, limit: int) -> bytes:
    """The whole (decompressed) text, refusing more than `limit` bytes."""
    raw = f.raw if isinstance(f, io.BufferedReader) else None
    if raw is not None:
        st = os.fstat(raw.fileno())
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise _too_big(path, limit)
    chunks, total, size = [], 0, 1 << 16  # chunks grow: small plans allocate little
    while True:
        chunk = f.read(min(size, limit + 1 - total))
        size = min(size * 4, _CHUNK)
        if not chunk:
            break
        if not chunks and chunk.lstrip()[:1] not in (b"{", b""):
            raise PlanError(f"not a JSON plan (starts with byte {chunk.lstrip()[:1]!r})",
                            file=path)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise _too_big(path, limit)
    return b"".join(chunks)


def gunzip_whole(path: str, limit: int) -> bytes | None:
    """A regular gzip file of one member decompressed by one call, no chunks to join (the
    128-rank MoE plan's whole read: 5.9 -> 5.6 us of CPU per node,
    `scripts/bench_read_history.py --base dce0f34 --repeat 5`); None for anything else,
    which `read_document` then reads or words: a pipe, several members or trailing bytes, a
    truncated or damaged stream, text that does not start like a JSON document, or more than
    `limit` bytes. The decompressor checks the member's CRC and length, as the stream reader
    does."""
    try:
        st = os.stat(path)  # before opening: a FIFO's open blocks (and takes its data)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with open(path, "rb") as raw_file:
            now = os.fstat(raw_file.fileno())
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None  # replaced meanwhile: left to the stream already open
            raw = raw_file.read()
        # the first bytes alone, before the whole: a bomb of zeros is refused at once
        start = isal_zlib.decompressobj(wbits=31).decompress(raw[:1 << 16], 1 << 10)
        if start.lstrip()[:1] != b"{":
            return None
        inflate = isal_zlib.decompressobj(wbits=31)
        text = inflate.decompress(raw, limit + 1)
    except READ_ERRORS:
        return None
    if len(text) > limit or not inflate.eof or inflate.unused_data:
        return None
    return text


def _too_big(path: str, limit: int) -> PlanError:
    return PlanError(f"plan is larger than the limit of {limit} bytes (set {PLAN_LIMIT_ENV} to "
                     "raise it, or use the JSON Lines form)", file=path)


def os_reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


_DOC = msgspec.json.Decoder(RawPlan, dec_hook=decode_scale)
_HEAD = msgspec.json.Decoder(HeadPlan, dec_hook=decode_scale)
_ATTRS_TEXT = msgspec.json.Decoder(dict[str, Any])  # Node.attrs' type
_ID, _OP, _PASS, _RANK, _MB = (attrgetter(k) for k in ("id", "op", "pass_", "rank", "mb"))
_INPUTS, _OUTPUTS, _ATTRS, _SOURCE = (attrgetter(k) for k in
                                      ("inputs", "outputs", "attrs", "source"))
_SHAPE, _ROLE = attrgetter("shape"), attrgetter("role")
_PASS_SET, _NONE, _STR = set(PASSES), {None}, {str}
_ANY = msgspec.json.Decoder()


class _Reject(Exception):
    """The fast path found something wrong: let `plan_from_dict` say what."""


class _NoNames(Exception):
    """Nodes decoded without their names, and the forked numbering gave none."""


def decode_document(text: bytes, path: str = "<memory>", lazy: bool = False) -> Plan:
    """Decode and validate one JSON document (the fast path, explained on failure).

    `lazy`: a large document whose names a forked process numbers may leave its nodes
    unbuilt (a `LazySequence`: each built where the fold looks at it); the caller then reads
    only `Plan.columns` in bulk (the fold does). The same plan, the same checks, the same
    errors (tests/test_plan_reader.py)."""
    # millions of new containers and no garbage: collections would only cost time
    with collector_paused(freeze_after=True):
        # a large document's names numbered meanwhile; attribute texts coded here when
        # this process keeps them as text (lazy), else there; for the fold (lazy), the
        # fold's split computed there too, after the numbers (its columns' `presplit`)
        forked = ForkedNumbering(text, attr_codes=not lazy, split=lazy)
        handed = False  # to the plan's columns, which stop it once they have its split
        try:
            if lazy and forked.pid is not None:
                try:
                    with span("head decode"):
                        head = _HEAD.decode(text)
                    plan = _build(head, path, forked, lazy=True)
                    handed = True
                    return plan
                except _NoNames:  # the forked process gave no answer: decoded whole here
                    return _build(_DOC.decode(text), path)
            return _build(_DOC.decode(text), path, forked)
        except (msgspec.ValidationError, _Reject):
            pass
        except msgspec.DecodeError as e:
            raise PlanError(f"not valid JSON: {e}", file=path) from None
        except RecursionError:
            raise PlanError("not valid JSON: nested too deeply", file=path) from None
        finally:
            if not handed:
                forked.stop()
        try:
            data = _ANY.decode(text)
        except msgspec.DecodeError as e:  # e.g. an integer beyond 64 bits
            raise PlanError(f"cannot decode plan: {e}", file=path) from None
        except RecursionError:
            raise PlanError("not valid JSON: nested too deeply", file=path) from None
        return plan_from_dict(data, path)


def plan_from_object(data: Any, path: str = "<memory>") -> Plan:
    """`plan_from_dict` for a plan already in memory (the generator's dicts): converted by
    msgspec into the typed structs and checked by `_build`, as a decoded document is; on
    anything the fast path does not take, `plan_from_dict` itself, which words the error.
    The same plan for anything JSON can hold (tests/test_plan_reader.py); a Python tuple
    where the format has an array is taken as the array (plan_from_dict wants lists). 2.1x
    faster on a 121k-node generated plan (scripts/bench_generate.py)."""
    with collector_paused(freeze_after=True):
        try:
            return _build(msgspec.convert(data, RawPlan, dec_hook=decode_scale), path)
        except (msgspec.ValidationError, _Reject):
            pass
    return plan_from_dict(data, path)


def _build(doc: RawPlan, path: str, forked: ForkedNumbering | None = None,
           lazy: bool = False) -> Plan:
    """The typed document as a `Plan`, or `_Reject` (every check of `plan_from_dict`).
    `lazy`: the document's nodes are `HeadNode`s, whose inputs and outputs only the forked
    numbering decoded (their presence and types included): their lengths and numbers are
    its, the plan's nodes built on demand (`_lazy_nodes`; `_NoNames` when it gave no
    answer)."""
    from tvsmt.ops import get as get_op

    if (doc.format != FORMAT or doc.version != VERSION or type(doc.version) is not int
            or doc.kind not in KINDS or type(doc.kind) is not str):
        raise _Reject
    world = _or_default(doc.world, {})
    if not isinstance(world, dict):
        raise _Reject
    # Dimensions (0..2**53) and roles (strings) were checked by the decoder; a tensor's id is
    # its key.
    tensors = doc.tensors
    if msgspec.UNSET in map(_SHAPE, tensors.values()):  # a tensor without a shape
        raise _Reject
    tids = list(tensors)
    deque(map(force_setattr, tensors.values(), repeat("id"), tids), 0)

    # The node checks run over flat columns, in C where possible (map, chain, sets, numpy).
    # The nodes are already the model's (schema.py), passes and the lower bounds of ranks and
    # micro-batches checked by the decoder; only missing lists remain (null attrs, like
    # a role that is not a string, fail the typed decoding: the generic path reads them).
    nodes = doc.nodes
    n_nodes = len(nodes)
    ins_col = outs_col = None
    if not lazy:
        ins_col = list(map(_INPUTS, nodes))
        outs_col = list(map(_OUTPUTS, nodes))
    # Declared tensors, SSA and topological order, over tensor numbers (numbering.py: Arrow
    # or a dict), then numpy: every name is declared, written at most once, and every input
    # is written by an earlier node or by none (a graph input).
    number = Numbering(tids)
    raw_lineages = doc.lineages or ()
    if lazy:  # HeadParts: the forked numbering decodes their tensors (`_lazy_lineages`)
        sums = None
        n_parts = sum(map(len, map(_PARTS, raw_lineages)))
    else:
        sums = list(map(_SUM_OF, chain.from_iterable(map(_PARTS, raw_lineages))))
        n_parts = len(sums)
    try:  # a missing list is UNSET, which has no length
        lens = [n if c is None else np.fromiter(map(len, c), np.int64, len(c))
                for c, n in ((outs_col, n_nodes), (ins_col, n_nodes), (sums, n_parts))]
    except TypeError:
        raise _Reject from None
    op_first: dict = {}  # op -> its first node
    op_at = np.fromiter(map(op_first.setdefault, map(_OP, nodes), range(n_nodes)), np.int64,
                        n_nodes)
    if not _distinct(list(map(_ID, nodes))) or any(get_op(op) is None for op in op_first):
        raise _Reject
    # ranks >= 0 and micro-batches >= -1 were checked by the decoder: only the largest remain
    try:
        ranks = np.fromiter(map(_RANK, nodes), np.int64, n_nodes)
        mbs = np.fromiter(map(_MB, nodes), np.int64, n_nodes)
    except OverflowError:  # beyond 64 bits: outside any world (the generic path says so)
        raise _Reject from None
    top_rank, top_mb = ([int(ranks.max())], [int(mbs.max())]) if n_nodes else ((), ())
    if world_problem(world, top_rank, top_mb) is not None:
        raise _Reject

    outputs = doc.outputs or []
    if any(t not in tensors for t in outputs):
        raise _Reject
    op_code = None  # per node its op's rank in order of first use: the fold's (forked reads)
    if forked is not None and forked.pid is not None:
        op_code = first_use_codes(op_first, op_at)
    if lazy:  # read for the fold: the forked numbering computes its split from these too
        forked.give_split_inputs(world, ranks, mbs, op_code, list(op_first), list(outputs))
    infos = list(tensors.values())
    shape_first: dict = {}  # shape -> the first tensor with it
    t_shape = np.fromiter(map(shape_first.setdefault, map(_SHAPE, infos), range(len(infos))),
                          np.int64, len(infos))
    numbered: list = []
    attr_text = []
    fold_codes: dict = {}  # PlanColumns' codes for the fold, computed while waiting for numbers

    def s_cols_of(part_codes) -> tuple:
        """The names' numbers, from the forked child when it numbered them meanwhile
        (waited for as late as possible: this process first computes the fold's codes, which
        need no numbers, instead of waiting idle); the lineage tensors' ones returned.
        `part_codes()`: the fold's codes of the lineage parts (`_part_codes`)."""
        if forked is not None and forked.pid is not None:
            fold_codes.update(_fold_codes(nodes, op_first, op_code, shape_first, t_shape))
            fold_codes.update(part_codes())
            if lazy:  # HeadNodes: their attributes' text
                attr_text.append(attr_text_codes(nodes))
        with span("wait for numbers"):
            got = forked.result(lens, n_nodes) if forked is not None else None
        if got is None and lazy:
            raise _NoNames
        if got is None:  # not forked, or the child did not answer for these names
            got = number.of_lists(outs_col, ins_col, sums, lens=lens)
        else:
            got, codes = got
            if codes is not None:
                attr_text.append(codes)
        numbered.append(got)
        return got[2]

    if lazy:
        lineages, parts, part_codes = _lazy_lineages(raw_lineages, s_cols_of, t_shape,
                                                     shape_first, tids)
        fold_codes.update(part_codes)
    else:
        lineages, parts = _document_lineages(raw_lineages, sums, s_cols_of, t_shape,
                                             shape_first)
    (out_lens, out_num), (in_lens, in_num), _ = numbered[0]
    n_in = len(in_num)
    # None (ABSENT, -1): an absent slot, "written" at -1 by the last entry of `written_at`
    if (len(out_num) and out_num.min() == UNDECLARED) or (n_in and in_num.min() == UNDECLARED):
        raise _Reject

    at = np.arange(n_nodes, dtype=np.int64)
    out_at = np.repeat(at, out_lens)
    real = out_num >= 0
    written = out_num[real]
    if len(written) and np.bincount(written, minlength=len(tids)).max() > 1:
        raise _Reject
    written_at = np.full(len(tids) + 1, -1, dtype=np.int64)
    written_at[written] = out_at[real]
    if n_in and bool((written_at[in_num] >= np.repeat(at, in_lens)).any()):
        raise _Reject
    if doc.kind == "single" and lineages:
        raise _Reject
    name = os.path.basename(path) if doc.name is msgspec.UNSET else doc.name
    if lazy:
        nodes = _lazy_nodes(nodes, tids, out_lens, out_num, in_lens, in_num, attr_text[0])
    columns = PlanColumns(nodes if lazy else list(nodes), tids, number, in_lens, in_num,
                          out_lens, out_num, ranks, mbs, op_at, infos, t_shape, list(lineages),
                          *parts, attr_text[0] if attr_text else None, **fold_codes)
    if lazy:  # the columns are the forked numbering's: its split is theirs
        columns.presplit = forked.presplit
        weakref.finalize(columns, forked.stop)
    return Plan(path, str(name), doc.kind, world, tensors, nodes, list(outputs), lineages,
                columns)


def _fold_codes(nodes: list, op_first: dict, op_code: np.ndarray, shape_first: dict,
                t_shape: np.ndarray) -> dict:
    """The codes `PlanColumns` may hold so that the fold need not compute them from every
    node and tensor (its results are the same either way): ops, passes and shapes as
    indices into their distinct values in order of first use (`op_code` computed by the
    caller; `t_shape`: each tensor's first tensor with the same shape); the lineage parts'
    are `_part_codes`. Measured on the 128-rank MoE plan's command: 3.01 -> 2.85 s (medians
    of seven, `scripts/bench_command_history.py`), the fold's column split 0.41 -> 0.34 s."""
    n = len(nodes)
    pass_first: dict = {}  # pass -> its first node
    pass_at = np.fromiter(map(pass_first.setdefault, map(_PASS, nodes), range(n)), np.int64, n)
    return {"op_code": op_code, "op_names": list(op_first),
            "pass_code": first_use_codes(pass_first, pass_at), "pass_names": list(pass_first),
            "shape_code": first_use_codes(shape_first, t_shape), "shapes": list(shape_first)}


def _part_codes(per: np.ndarray, parts, scale_code: np.ndarray, scales: list) -> dict:
    """The lineage parts' codes for `PlanColumns`: the parts (`per`: how many each lineage
    has), each with its lineage, its position in it, and its scale as an index into
    `scales`."""
    n = int(per.sum())
    return {"parts": parts, "part_lineage": np.repeat(np.arange(len(per)), per),
            "part_pos": np.arange(n) - np.repeat(_ptr(per)[:-1], per),
            "scale_code": scale_code, "scales": scales}


def _object_part_codes(lineages: list, parts: list) -> dict:
    """`_part_codes` of parts held as `LineagePart`s (scales coded by object: the parts of a
    document share a few)."""
    per = np.fromiter(map(len, map(_PARTS, lineages)), np.int64, len(lineages))
    scale_at: dict = {}  # id of a scale object -> its first part
    scales = list(map(_SCALE, parts))
    first_scale = np.fromiter(map(scale_at.setdefault, map(id, scales), range(len(scales))),
                              np.int64, len(scales))
    return _part_codes(per, parts, first_use_codes(scale_at, first_scale),
                       [scales[i] for i in scale_at.values()])


def _lazy_nodes(heads: list, tids: list, out_lens, out_num, in_lens, in_num,
                attr_code: np.ndarray) -> LazySequence:
    """The nodes of a document decoded as `HeadNode`s, built on demand (`_NodeBuilder`;
    the fold reads their ops and passes as codes, `_fold_codes`). `_Reject` when an attribute
    text is not an object (the decoding of `Node.attrs` would refuse it): each distinct text
    is decoded once, here (`attr_code`: per node the first node with the same text)."""
    n = len(heads)
    for i in np.flatnonzero(attr_code == np.arange(n)).tolist():
        text = heads[i].attrs
        if len(text):
            try:
                _ATTRS_TEXT.decode(text)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                raise _Reject from None
    return LazySequence(n, _NodeBuilder(heads, tids, out_lens, out_num, in_lens, in_num))


class _NodeBuilder:
    """Nodes built back from `HeadNode`s and the numbers of their inputs and outputs (names
    from the tensor table): exactly the nodes the numbers describe."""

    def __init__(self, heads, tids, out_lens, out_num, in_lens, in_num):
        self._heads, self._tids = heads, tids
        self._out = (_ptr(out_lens), out_num)
        self._in = (_ptr(in_lens), in_num)

    def _names(self, ptr: np.ndarray, nums: np.ndarray, rows: np.ndarray) -> list[tuple]:
        """Per row, the names of its numbers (None for an absent slot), gathered at once."""
        lens, flat = _gather(ptr, nums, rows)
        tids = self._tids
        return split_rows([None if x < 0 else tids[x] for x in flat.tolist()], lens)

    def __call__(self, idx: list) -> list:
        heads, rows = self._heads, np.asarray(idx, dtype=np.int64)
        ins, outs = self._names(*self._in, rows), self._names(*self._out, rows)
        out = []
        for i, a, b in zip(idx, ins, outs):
            h = heads[i]
            out.append(Node(h.id, h.op, h.pass_, h.rank, h.mb, a, b,
                            _ATTRS_TEXT.decode(h.attrs) if len(h.attrs) else {}, h.source))
        return out


_PARTS = attrgetter("parts")
_IS = operator.is_


def _document_lineages(raws, sums: list, s_cols_of, t_shape: np.ndarray,
                       shape_first: dict) -> tuple[list[Lineage], tuple]:
    """A document's typed lineages as `Lineage`s, or `_Reject` (the checks of `_fast_lineage`,
    over the columns of all parts at once): every part has tensors, distinct ones, declared,
    of its slice's shape; slice bounds at most 2**53. `t_shape`: each tensor's shape as the
    number of the first tensor with it (`shape_first`); `sums`: every part's tensor ids,
    `s_cols_of()`: their lengths and numbers (numbering.py). Also the parts' columns for the fold
    (PlanColumns): tensors per part and their numbers, each part's distinct slice, those
    slices."""
    lineages = []
    for i, raw in enumerate(raws):
        if not raw.parts:
            raise _Reject
        aligned = None
        if raw.aligned is not None:
            aligned = _aligned(raw.aligned, i)
            if aligned is None:
                raise _Reject
        lineages.append(Lineage(i, raw.single, tuple(raw.parts), aligned, raw.hypothesis))
    flat = list(chain.from_iterable(map(_PARTS, lineages)))
    n_p = len(flat)
    first: dict = {}  # slice -> its first part
    at = np.fromiter(map(first.setdefault, map(_SLICE, flat), range(n_p)), np.int64, n_p)
    distinct = list(first)
    want = []
    for key in distinct:  # each distinct slice's shape, as a tensor's shape code (-1: none)
        if any(s > MAX_DIM or e > MAX_DIM for s, e in key):
            raise _Reject
        want.append(shape_first.get(tuple(e - s for s, e in key), -1))
    index = first_use_codes(first, at)
    # per part (`sums`: its tensor ids): how many, their numbers
    s_len, s_num = s_cols_of(lambda: _object_part_codes(lineages, flat))
    if n_p and s_len.min() == 0:
        raise _Reject
    if any(len(set(sums[j])) != len(sums[j]) for j in np.flatnonzero(s_len > 1).tolist()):
        raise _Reject
    if len(s_num) and s_num.min() < 0:  # an undeclared tensor (or a None, not a name)
        raise _Reject
    if len(s_num) and (t_shape[s_num] != np.repeat(np.array(want, np.int64)[index], s_len)
                       ).any():
        raise _Reject
    return lineages, (s_len, s_num, index, distinct)


def _lazy_lineages(raws, s_cols_of, t_shape: np.ndarray, shape_first: dict, tids: list
                   ) -> tuple[list[Lineage], tuple, dict]:
    """`_document_lineages` of lineages decoded as `HeadLineage`s, whose parts' tensors only
    the forked numbering decoded (`s_cols_of` gives their lengths and numbers): the same
    checks, over columns, each distinct slice text and scale decoded once. Each `Lineage`'s
    parts are built on demand from the columns (a `LazySequence`, as are the plan's
    `PlanColumns.parts`). Also the fold's codes of the parts (`_part_codes`).
    On the 128-rank MoE plan (326,664 parts) the reading process ends its load 0.14 s
    sooner; `verify_pair` 2.42 -> 2.27 s (medians of 8, `scripts/bench_command_history.py
    --in-process`)."""
    aligned = []
    for i, raw in enumerate(raws):
        if not raw.parts:
            raise _Reject
        aligned.append(None if raw.aligned is None else _aligned(raw.aligned, i))
        if raw.aligned is not None and aligned[-1] is None:
            raise _Reject
    per = np.fromiter(map(len, map(_PARTS, raws)), np.int64, len(raws))
    flat = list(chain.from_iterable(map(_PARTS, raws)))
    n_p = len(flat)
    first: dict = {}  # slice text -> its first part
    at = np.fromiter(map(first.setdefault, map(bytes, map(_SLICE, flat)), range(n_p)),
                     np.int64, n_p)
    try:
        distinct, text_index = decode_slice_texts(first)
    except ValueError:
        raise _Reject from None
    want = [shape_first.get(tuple(e - s for s, e in key), -1) for key in distinct]
    index = np.array(text_index, np.int64)[first_use_codes(first, at)]
    scale_at: dict = {}  # scale pair (None: 1) -> its first part
    raw_scales = list(map(_SCALE, flat))
    if raw_scales.count(None) == n_p:  # the common case: no part has a scale
        scale_code, scales = np.zeros(n_p, np.int64), [_ONE]
    else:
        first_scale = np.fromiter(map(scale_at.setdefault, raw_scales, range(n_p)),
                                  np.int64, n_p)
        scales = []
        for sc in scale_at:
            try:
                scales.append(decode_scale(Fraction, None if sc is None else list(sc)))
            except ValueError:
                raise _Reject from None
        scale_code = first_use_codes(scale_at, first_scale)
    s_len, s_num = s_cols_of(dict)  # the parts' codes need the numbers: returned below
    if n_p and s_len.min() == 0:
        raise _Reject
    if len(s_num) and s_num.min() < 0:  # an undeclared tensor (or a None, not a name)
        raise _Reject
    if (s_len > 1).any():  # a tensor twice in one part: a (part, number) pair twice
        mine = np.repeat(s_len > 1, s_len)
        pair = np.repeat(np.arange(n_p), s_len)[mine] * (len(tids) + 1) + s_num[mine]
        if len(np.unique(pair)) != len(pair):
            raise _Reject
    if len(s_num) and (t_shape[s_num] != np.repeat(np.array(want, np.int64)[index], s_len)
                       ).any():
        raise _Reject
    built = PartsFromColumns(lambda nums: list(map(tids.__getitem__, nums)), s_len, s_num,
                             distinct, index, scales, scale_code)
    lineages = [Lineage(i, raw.single, LazySequence(n, partial(_rows_from, built, a)), al,
                        raw.hypothesis)
                for i, (raw, al, a, n) in enumerate(zip(raws, aligned, _ptr(per).tolist(),
                                                        per.tolist()))]
    return (lineages, (s_len, s_num, index, distinct),
            _part_codes(per, LazySequence(n_p, built), scale_code, scales))


def _rows_from(build, start: int, idx: list) -> list:
    """`build` of rows numbered from `start` (one lineage's parts among all parts)."""
    return build([start + i for i in idx])


_SLICE_TEXT = msgspec.json.Decoder(tuple[tuple[int, int], ...])


def decode_slice_texts(texts) -> tuple[list, list[int]]:
    """Lineage slices kept as their JSON text (distinct texts), each decoded and checked once
    as the typed decoding of a part checks its slice (pairs of ints, bounds at most 2**53):
    the distinct slices, and per text the index of its slice among them (texts written
    differently may decode alike). ValueError, with the reason, for a text that is not one."""
    by_value: dict = {}  # slice -> its index
    index = []
    for text in texts:
        try:
            key = _SLICE_TEXT.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            raise ValueError("a bad slice") from None
        if any(s > MAX_DIM or e > MAX_DIM for s, e in key):
            raise ValueError("a slice bound beyond 2**53")
        index.append(by_value.setdefault(key, len(by_value)))
    return list(by_value), index


def _distinct(ids: list[str]) -> bool:
    """No string twice: their hashes all differ (a numpy sort), or, when two hashes are
    equal, a set of the strings says."""
    hashes = np.fromiter(map(hash, ids), np.int64, len(ids))
    hashes.sort()
    if not (hashes[1:] == hashes[:-1]).any():
        return True  # equal strings have equal hashes
    return len(set(ids)) == len(ids)


_ONE = Fraction(1)


def _fast_lineage(raw, index: int, shapes_of, slices: dict) -> Lineage:
    """One typed lineage (a `schema.RawLineage` or `LineageRec`) as a `Lineage`, or
    `_Reject`, checked over columns of its parts. `shapes_of(ids)`: the declared shapes of
    these tensor ids, in order (None, or AttributeError, for an undeclared one). `slices`
    caches slice -> shape: each distinct slice is computed once."""
    raw_parts = raw.parts
    if not raw_parts:
        raise _Reject
    keys = list(map(_SLICE, raw_parts))
    shapes = list(map(slices.get, keys))
    if None in shapes:
        for key in {k for k, sh in zip(keys, shapes) if sh is None}:
            if any(s > MAX_DIM or e > MAX_DIM for s, e in key):
                raise _Reject
            slices[key] = tuple(e - s for s, e in key)
        shapes = list(map(slices.__getitem__, keys))
    sums = list(map(_SUM_OF, raw_parts))
    lens = list(map(len, sums))
    try:
        if max(lens) == 1 and min(lens) == 1:  # the common case: one tensor per part
            if shapes_of(map(_FIRST, sums)) != shapes:
                raise _Reject
        else:
            if 0 in lens or any(len(set(x)) != n for x, n in zip(sums, lens) if n > 1):
                raise _Reject
            want = list(chain.from_iterable(map(repeat, shapes, lens)))
            if shapes_of(chain.from_iterable(sums)) != want:
                raise _Reject
    except AttributeError:
        raise _Reject from None
    return built_lineage(raw, index, keys, sums)


def built_lineage(raw, index: int, keys=None, sums=None) -> Lineage:
    """The `Lineage` of a typed lineage record whose parts' slices and tensors were checked
    (by `_fast_lineage`); `keys`/`sums`: the parts' slices and tensor lists when the caller
    has them. `_Reject` on a zero scale denominator or an `aligned` that does not fit."""
    raw_parts = raw.parts
    if type(raw_parts[0]) is LineagePart:  # a document's parts: decoded as the model's
        parts = tuple(raw_parts)
    else:
        keys = list(map(_SLICE, raw_parts)) if keys is None else keys
        sums = list(map(_SUM_OF, raw_parts)) if sums is None else sums
        if (scales := list(map(_SCALE, raw_parts))).count(None) == len(scales):
            parts = tuple(map(LineagePart, keys, sums))
        else:
            if any(sc[1] == 0 for sc in scales if sc is not None):
                raise _Reject
            parts = tuple(map(LineagePart, keys, sums, [
                _ONE if sc is None else Fraction(sc[0], sc[1]) for sc in scales]))
    aligned = None
    if raw.aligned is not None:
        aligned = _aligned(raw.aligned, index)
        if aligned is None:
            raise _Reject
    return Lineage(index, raw.single, parts, aligned, raw.hypothesis)


_SLICE, _SUM_OF, _SCALE, _FIRST = (attrgetter("slice"), attrgetter("sum_of"),
                                   attrgetter("scale"), itemgetter(0))


def _aligned(a: Any, index: int) -> Aligned | None:
    if not (isinstance(a, dict) and all(isinstance(a.get(k, []), list)
                                        for k in ("single", "parallel", "inputs"))):
        return None
    ins = a.get("inputs", [])
    if not (_int_list(ins) and all(0 <= k < index for k in ins)):
        return None
    return Aligned(tuple(a.get("single", [])), tuple(a.get("parallel", [])), tuple(ins))


def _require(cond: bool, msg: str, path: str, **where) -> None:
    if not cond:
        raise PlanError(msg, file=path, **where)


MAX_WORLD = 1 << 24  # ranks or micro-batches beyond this are not a training world


def world_problem(world: dict, ranks: Any, mbs: Any) -> str | None:
    """Why a plan's world (and its nodes' rank and mb fields) is not a world, or None.

    dp, tp, pp, mb are positive ints, `ranks` (if given) is dp*tp*pp; every node runs on a
    rank of the world and on a micro-batch of it (or -1: not tied to one)."""
    size = {}
    for axis in ("dp", "tp", "pp", "mb"):
        v = world.get(axis, 1)
        if type(v) is not int or not 1 <= v <= MAX_WORLD:
            return f"world.{axis} must be a positive int (at most {MAX_WORLD}), not {v!r}"
        size[axis] = v
    total = size["dp"] * size["tp"] * size["pp"]
    if "ranks" in world and (type(world["ranks"]) is not int or world["ranks"] != total):
        return f"world.ranks is {world['ranks']!r}, not dp*tp*pp = {total}"
    return placement_problem(ranks, mbs, (total, size["mb"]))


def world_extent(world: dict) -> tuple[int, int]:
    """(ranks, micro-batches) of a world that `world_problem` accepts."""
    return (world.get("dp", 1) * world.get("tp", 1) * world.get("pp", 1), world.get("mb", 1))


def placement_problem(ranks: Any, mbs: Any, extent: tuple[int, int]) -> str | None:
    """Why nodes of these ranks and micro-batches do not run in a world of `extent`
    (`world_extent`), or None."""
    total, n_mb = extent
    ranks, mbs = list(ranks), list(mbs)
    if ranks and (min(ranks) < 0 or max(ranks) >= total):
        bad = next(r for r in ranks if not 0 <= r < total)
        return f"a node runs on rank {bad}, outside the world's {total} ranks"
    if mbs and (min(mbs) < -1 or max(mbs) >= n_mb):
        bad = next(m for m in mbs if not -1 <= m < n_mb)
        return f"a node runs on micro-batch {bad}, outside the world's {n_mb}"
    return None


def _misplaced(nodes: list, world: dict, problem: str) -> str | None:
    """The first node outside the world, which `problem` (world_problem's) is about, or None
    when the problem is the world's own."""
    if problem.startswith("world."):
        return None
    extent = world_extent(world)
    return next((n.id for n in nodes
                 if placement_problem((n.rank,), (n.mb,), extent) is not None), None)


def _or_default(value: Any, default: Any) -> Any:
    """An optional field's value, its default when null or absent. Only null: a 0, false or
    "" where an object or list belongs is a wrong type, not an absent value."""
    return default if value is None else value


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)


def plan_from_dict(data: Any, path: str = "<memory>") -> Plan:
    """Validate a decoded plan object and build the typed `Plan`."""
    from tvsmt.ops import get as get_op

    _require(isinstance(data, dict), "a plan must be a JSON object", path)
    fmt, ver = data.get("format"), data.get("version")
    _require(fmt == FORMAT, f"unknown format {fmt!r} (expected {FORMAT!r})", path)
    _require(ver == VERSION and type(ver) is int,
             f"unsupported version {ver!r} (this reader knows {VERSION})", path)
    kind = data.get("kind")
    _require(kind in KINDS, f"kind must be 'single' or 'parallel', not {kind!r}", path)
    for key, typ in (("tensors", dict), ("nodes", list)):
        _require(isinstance(data.get(key), typ), f"'{key}' must be a JSON {typ.__name__}", path)
    world = _or_default(data.get("world"), {})
    _require(isinstance(world, dict), "'world' must be an object", path)

    tensors: dict[str, TensorInfo] = {}
    for tid, info in data["tensors"].items():
        _require(isinstance(info, dict) and _int_list(info.get("shape")),
                 "tensor needs a 'shape' list of ints", path, tensor=tid)
        _require(all(d >= 0 for d in info["shape"]), "negative dimension", path, tensor=tid)
        _require(all(d <= MAX_DIM for d in info["shape"]),
                 "dimension larger than 2**53 (the largest size tvsmt handles exactly)", path,
                 tensor=tid)
        tensors[tid] = TensorInfo(tid, tuple(info["shape"]), str(info.get("role", "activation")))

    nodes: list[Node] = []
    writer: dict[str, str] = {}
    seen_ids: set[str] = set()
    known_ops: set[str] = set()
    for i, raw in enumerate(data["nodes"]):  # hot loop: checks inline, messages built on error
        if not isinstance(raw, dict):
            raise PlanError(f"node #{i} is not an object", file=path)
        nid = raw.get("id")
        if not isinstance(nid, str):
            raise PlanError(f"node #{i} has no string 'id'", file=path)
        if nid in seen_ids:
            raise PlanError("node id used twice", file=path, node=nid)
        seen_ids.add(nid)
        op = raw.get("op")
        if type(op) is not str:
            raise PlanError("node has no string 'op'", file=path, node=nid)
        if op not in known_ops:
            if get_op(op) is None:
                raise UnsupportedOperator(f"unknown operator {op!r}", file=path, node=nid)
            known_ops.add(op)
        pass_ = raw.get("pass")
        if not (pass_ is None or type(pass_) is str) or pass_ not in PASSES:
            raise PlanError(f"'pass' must be fw, bw or null, not {pass_!r}", file=path, node=nid)
        ins, outs = raw.get("inputs"), raw.get("outputs")
        for key, lst in (("inputs", ins), ("outputs", outs)):
            if not isinstance(lst, list):
                raise PlanError(f"'{key}' must be a list of tensor ids or null", file=path,
                                node=nid)
        for t in ins:
            if t is not None and (type(t) is not str or t not in tensors):
                raise PlanError("reads an undeclared tensor", file=path, node=nid,
                                tensor=str(t))
        for t in outs:
            if t is None:
                continue
            if type(t) is not str or t not in tensors:
                raise PlanError("writes an undeclared tensor", file=path, node=nid,
                                tensor=str(t))
            if t in writer:
                raise PlanError(f"tensor written twice (also by {writer[t]}): the plan is not "
                                "SSA", file=path, node=nid, tensor=t)
            writer[t] = nid
        attrs = _or_default(raw.get("attrs"), {})
        rank, mb = raw.get("rank", 0), raw.get("mb", 0)
        if not (isinstance(attrs, dict) and type(rank) is int and type(mb) is int):
            raise PlanError("'attrs' must be an object and rank/mb ints", file=path, node=nid)
        source = raw.get("source")
        if source is not None and type(source) is not str:
            raise PlanError("'source' must be a string (file:line) or null", file=path,
                            node=nid)
        nodes.append(Node(nid, op, pass_, rank, mb, tuple(ins), tuple(outs), attrs, source))
    problem = world_problem(world, (n.rank for n in nodes), (n.mb for n in nodes))
    if problem is not None:
        raise PlanError(problem, file=path, node=_misplaced(nodes, world, problem))

    # Topological order: every input is a graph input or written by an earlier node.
    position = {n.id: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t is not None and t in writer and position[writer[t]] >= i:
                what = "itself" if writer[t] == n.id else f"later node {writer[t]}"
                raise PlanError(f"reads a tensor written by {what} (cycle or nodes out of "
                                "topological order)", file=path, node=n.id, tensor=t)

    outputs = _or_default(data.get("outputs"), [])
    _require(isinstance(outputs, list), "'outputs' must be a list of tensor ids", path)
    for t in outputs:
        _require(isinstance(t, str) and t in tensors, "output is not a declared tensor", path,
                 tensor=str(t))

    raw_lineages = _or_default(data.get("lineages"), [])
    _require(isinstance(raw_lineages, list), "'lineages' must be a list", path)
    cache: dict = {}
    lineages = [_lineage(raw, i, tensors, path, cache) for i, raw in enumerate(raw_lineages)]
    if kind == "single":
        _require(not lineages, "a single plan carries no lineages", path)
    return Plan(path, str(data.get("name", os.path.basename(path))), kind, world, tensors, nodes,
                list(outputs), lineages)


def _lineage(raw: Any, index: int, tensors: dict[str, TensorInfo], path: str,
             cache: dict) -> Lineage:
    where = f"lineage #{index}"
    _require(isinstance(raw, dict) and isinstance(raw.get("single"), str),
             f"{where} needs a 'single' tensor id", path)
    single = raw["single"]
    parts_raw = raw.get("parts")
    _require(isinstance(parts_raw, list) and parts_raw, f"{where} needs a non-empty 'parts' list",
             path, tensor=single)
    parts = []
    checked: dict[tuple, tuple[int, ...]] = cache.setdefault("slices", {})  # slice -> shape
    for j, p in enumerate(parts_raw):
        pw = f"{where} part {j}"
        if not isinstance(p, dict):
            raise PlanError(f"{pw} is not an object", file=path, tensor=single)
        sl = p.get("slice")
        try:
            key = tuple((a, b) for a, b in sl)
            if not all(type(a) is int and type(b) is int for a, b in key):
                key = None
        except (TypeError, ValueError):
            key = None
        if key not in checked:  # compute each distinct slice's shape once
            _require(key is not None, f"{pw}: 'slice' must be a list of [start, end] int pairs",
                     path, tensor=single)
            _require(all(s <= MAX_DIM and e <= MAX_DIM for s, e in key),
                     f"{pw}: slice bound larger than 2**53", path, tensor=single)
            checked[key] = tuple(e - s for s, e in key)
        shape = checked[key]
        sum_of = p.get("sum_of")
        if not (isinstance(sum_of, list) and sum_of and all(type(t) is str for t in sum_of)
                and len(set(sum_of)) == len(sum_of)):
            raise PlanError(f"{pw}: 'sum_of' must be a non-empty list of distinct tensor ids",
                            file=path, tensor=single)
        scale = Fraction(1)
        if p.get("scale") is not None:
            sc = p["scale"]
            _require(_int_list(sc) and len(sc) == 2 and sc[1] != 0,
                     f"{pw}: 'scale' must be [num, den] ints with den != 0", path, tensor=single)
            scale = Fraction(sc[0], sc[1])
        for t in sum_of:
            info = tensors.get(t) if isinstance(t, str) else None
            if info is None:
                raise PlanError(f"{pw} names an undeclared parallel tensor", file=path,
                                tensor=str(t))
            if info.shape != shape:
                raise PlanError(f"{pw}: shape {list(info.shape)} differs from the slice shape "
                                f"{list(shape)} of {single}", file=path, tensor=t)
        parts.append(LineagePart(key, tuple(sum_of), scale))
    aligned = None
    if raw.get("aligned") is not None:
        a = raw["aligned"]
        ok = (isinstance(a, dict) and all(isinstance(a.get(k, []), list) for k in
                                          ("single", "parallel", "inputs")))
        _require(ok, f"{where}: malformed 'aligned' hint", path, tensor=single)
        ins = a.get("inputs", [])
        _require(_int_list(ins) and all(0 <= k < index for k in ins),
                 f"{where}: 'aligned.inputs' must name earlier lineages", path, tensor=single)
        aligned = Aligned(tuple(a.get("single", [])), tuple(a.get("parallel", [])), tuple(ins))
    hypothesis = raw.get("hypothesis", False)
    _require(type(hypothesis) is bool, f"{where}: 'hypothesis' must be true or false", path,
             tensor=single)
    return Lineage(index, single, tuple(parts), aligned, hypothesis)


def _slices_fit(single: Plan, parallel: Plan) -> bool:
    """True when every lineage part's slice lies inside its single tensor's full shape,
    decided over the reader's columns (`Plan.columns`: each part's slice as an index into the
    distinct slices): each distinct (full shape, slice) pair is checked once instead of each
    lineage's distinct slices (326k parts, 87k checks in the 128-rank MoE plan). False when
    some slice does not fit, or when there are no columns describing these lineages: then
    check_pair's loop checks every lineage and names the misfit."""
    cols, lins = parallel.columns, parallel.lineages
    if (cols is None or len(cols.lineages) != len(lins)
            or not all(map(_IS, cols.lineages, lins))):
        return False
    if cols.part_lineage is not None:  # parts held by the columns only (a scan's)
        n_parts = np.bincount(np.asarray(cols.part_lineage, dtype=np.int64),
                              minlength=len(lins))
    else:
        n_parts = np.fromiter(map(len, map(_PARTS, lins)), np.int64, len(lins))
    n_slices = len(cols.slices)
    if int(n_parts.sum()) != len(cols.slice_index):
        return False
    if not n_slices:
        return not len(cols.slice_index)
    full_code: dict = {}  # full shape -> its number
    code = np.fromiter((full_code.setdefault(single.shape(lin.single), len(full_code))
                        for lin in lins), np.int64, len(lins))
    fulls = list(full_code)
    pairs = np.unique(np.repeat(code, n_parts) * n_slices + np.asarray(cols.slice_index))
    for x in pairs.tolist():
        full, key = fulls[x // n_slices], cols.slices[x % n_slices]
        if len(key) != len(full) or not all(0 <= s < e <= n for (s, e), n in zip(key, full)):
            return False
    return True


def _parts_of(plan: Plan, lin: Lineage) -> tuple:
    """A lineage's parts: its own, or, for a plan whose parts only its columns hold (a JSON
    Lines scan, tvsmt/plan/scan.py), those built from them."""
    cols = plan.columns
    if lin.parts or cols is None or cols.part_lineage is None:
        return lin.parts
    rows = np.flatnonzero(np.asarray(cols.part_lineage) == lin.index).tolist()
    return tuple(cols.parts.take(rows))


def check_pair(single: Plan, parallel: Plan) -> None:
    """Cross-plan checks: kinds, lineage targets and slices, every single output has a lineage."""
    if single.kind != "single":
        raise PlanError(f"expected a single plan, found kind {single.kind!r}", file=single.path)
    if parallel.kind != "parallel":
        raise PlanError(f"expected a parallel plan, found kind {parallel.kind!r}",
                        file=parallel.path)
    for lin in parallel.lineages:
        if lin.single not in single.tensors:
            raise PlanError(f"lineage #{lin.index} names {lin.single!r}, which the single plan "
                            f"{single.path} does not declare", file=parallel.path,
                            tensor=lin.single)
    if _slices_fit(single, parallel):
        lineages_to_check = ()  # every part's slice fits its tensor (decided over columns)
    else:
        lineages_to_check = parallel.lineages
    for lin in lineages_to_check:  # the loop that finds and names the misfit
        full = single.shape(lin.single)
        parts = _parts_of(parallel, lin)
        for key in dict.fromkeys(map(_SLICE, parts)):  # each distinct slice once
            ok = len(key) == len(full) and all(0 <= s < e <= n for (s, e), n in zip(key, full))
            if not ok and not (len(full) == 0 and key == ()):
                j = next(j for j, part in enumerate(parts) if part.slice == key)
                raise PlanError(f"lineage #{lin.index} part {j}: slice "
                                f"{[list(r) for r in key]} is outside the full shape "
                                f"{list(full)}", file=parallel.path, tensor=lin.single)
    if not single.outputs:
        # Nothing would be claimed, so nothing proven: a pass here would be vacuous (the
        # reference verifier reports success on such exports).
        raise PlanError("the single plan lists no outputs: nothing to verify (an execution "
                        "plan must name the loss and the final weight gradients)",
                        file=single.path)
    with_lineage = {lin.single for lin in parallel.lineages}
    for out in single.outputs:
        if out not in with_lineage:
            raise PlanError("output of the single plan has no lineage in the parallel plan",
                            file=parallel.path, tensor=out)
