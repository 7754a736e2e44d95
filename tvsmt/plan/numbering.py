"""Tensor ids as numbers: each name's position in the plan's tensor table, for a million
names at once.

A plan names its tensors by opaque strings: 400k declared and 1.07M references in the
128-rank MoE plan. Looking every reference up in a Python dict costs about 0.4 us each
(memory-bound: the dict, its key strings and its int values are spread over 50 MB), plus
0.15 s to build the dict. For large plans the names go instead into Apache Arrow string
arrays (contiguous UTF-8 bytes) and Arrow's `index_in` kernel numbers them with its own hash
table, which compares the bytes exactly after a hash match: a hash collision can never make
an undeclared name a declared one. The result is the same function as the dict's
(tests/test_plan_numbering.py compares both, undeclared and absent names included);
without pyarrow, for small plans, or for names Arrow cannot hold (a lone surrogate has no
UTF-8), the dict computes it.
"""

from __future__ import annotations

import os
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

ABSENT, UNDECLARED = -1, -2  # the number of a None slot; of a name not in the table
# below this many names the dict is as fast as Arrow's import (about 50 ms)
ARROW_MIN_NAMES = 100_000
_ARROW_ENV = "TVSMT_NUMBERING"  # "dict": never Arrow (tests compare the two)


def _arrow():
    if os.environ.get(_ARROW_ENV) == "dict":
        return None
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:  # pragma: no cover (a dependency; the dict path still works)
        return None
    if not _POOL_SET:
        # Arrow's own allocator (mimalloc) made the fold's numpy work that follows pay
        # twice the kernel time (page faults: sys 0.33 s against 0.10 s on the 128-rank MoE
        # plan's fold); the C library's malloc, which numpy uses too, does not
        pa.set_memory_pool(pa.system_memory_pool())
        _POOL_SET.append(True)
    return pa, pc


_POOL_SET: list = []


def first_use_codes(first: dict, at: np.ndarray) -> np.ndarray:
    """Values coded in order of first use: `first` maps each distinct value to its first
    element and `at` holds each element's first element with the same value (both as
    `first.setdefault(value, index)` over the elements builds them); each element's code is
    its value's rank among the distinct values."""
    return np.searchsorted(np.fromiter(first.values(), np.int64, len(first)), at)


class Numbering:
    """The numbers of the tensor ids `tids` (distinct: a dict's keys), computed for many
    names at once; `number[tid]` for a few (a dict, built on first use)."""

    def __init__(self, tids: list[str]):
        self.tids = tids
        self._dict: dict | None = None
        self._table = None  # the Arrow array of tids, when Arrow numbered something

    # -- a few names

    def __getitem__(self, tid) -> int:
        return self.as_dict()[tid]

    def get(self, tid, default=None):
        return self.as_dict().get(tid, default)

    def as_dict(self) -> dict:
        """tensor id -> number (None -> ABSENT)."""
        if self._dict is None:
            tids = self.tids
            self._dict = dict(zip(chain(tids, (None,)), chain(range(len(tids)), (ABSENT,))))
        return self._dict

    # -- many names

    def of_names(self, names: list) -> np.ndarray:
        """Each name's number (ABSENT for None, UNDECLARED for a name not in the table)."""
        if not names:
            return np.zeros(0, dtype=np.int64)
        if (self._dict is None and len(names) < ARROW_MIN_NAMES <= len(self.tids)
                and self._arrow_table() is not None):  # a dict of a large table costs more
            got = self._few_by_arrow(names)
            if got is not None:
                return got
        return self.of_lists([names])[0][1]

    def of_lists(self, *columns: list, lens: list | None = None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each column of name sequences (e.g. one per node): each sequence's length
        (`lens`, when the caller has them), and the numbers of all its names concatenated.
        TypeError when an entry has no length. All columns are numbered by one Arrow call
        (it hashes the table once)."""
        return self.of_prepared(NameColumns(columns, lens))

    def of_prepared(self, cols: "NameColumns") -> list[tuple[np.ndarray, np.ndarray]]:
        """`of_lists` of columns made ready (`NameColumns`)."""
        if cols.arrow is not None:
            got = self._numbers_of_array(cols.arrow)
            if got is not None:
                cuts = np.cumsum(cols.totals)[:-1].tolist()
                return list(zip(cols.lens, np.split(got, cuts)))
        get = self.as_dict().get
        return [(n, np.fromiter(map(get, chain.from_iterable(column), repeat(UNDECLARED)),
                                np.int64, total))
                for n, column, total in zip(cols.lens, cols.columns, cols.totals)]

    def _numbers_of_array(self, arr) -> np.ndarray | None:
        """The numbers of the names of an Arrow string array, computed by Arrow; None when
        it cannot (then the dict does)."""
        if self._arrow_table() is None:
            return None
        pa, pc = _arrow()
        found = pc.index_in(arr, value_set=self._table)
        nums = pc.fill_null(found, UNDECLARED).to_numpy(zero_copy_only=False).astype(np.int64)
        if len(nums) != len(arr):  # pragma: no cover (Arrow's contract)
            return None
        if arr.null_count:
            nums[arr.is_null().to_numpy(zero_copy_only=False)] = ABSENT
        return nums

    def _arrow_table(self):
        """The tensor ids as an Arrow array (None: no Arrow, or ids it cannot hold)."""
        if self._table is None:
            mods = _arrow()
            if mods is None:
                return None
            pa = mods[0]
            try:
                self._table = pa.array(self.tids, pa.large_string())
            except (pa.ArrowException, UnicodeError, TypeError, ValueError, OverflowError):
                return None
        return self._table

    def _few_by_arrow(self, names: list) -> np.ndarray | None:
        """A few names' numbers without a dict of the whole table: which table entry is
        which name (Arrow hashes the few names, then reads the table once)."""
        pa, pc = _arrow()
        distinct = list(dict.fromkeys(x for x in names if x is not None))
        try:
            which = pc.index_in(self._table, value_set=pa.array(distinct, pa.large_string()))
        except (pa.ArrowException, UnicodeError, TypeError, ValueError, OverflowError):
            return None
        at = np.flatnonzero(which.is_valid().to_numpy(zero_copy_only=False))
        code = dict(zip(map(distinct.__getitem__,
                            which.take(pa.array(at)).to_numpy(zero_copy_only=False).tolist()),
                        at.tolist()))
        code[None] = ABSENT
        return np.fromiter((code.get(x, UNDECLARED) for x in names), np.int64, len(names))


class NameColumns:
    """Columns of name sequences made ready to be numbered: each sequence's length (`lens`,
    when the caller has them), and, for many names, all of them as one Arrow string array.
    TypeError when an entry has no length."""

    def __init__(self, columns, lens: list | None = None):
        self.columns = columns
        if lens is None:
            lens = [np.fromiter(map(len, column), np.int64, len(column))
                    for column in columns]
        self.lens = lens
        self.totals = [int(x.sum()) for x in lens]
        self.arrow = None
        if sum(self.totals) >= ARROW_MIN_NAMES:
            lists = _list_arrays(columns)
            if lists is not None:
                self.arrow = _flat(lists)

    @classmethod
    def by_arrow(cls, columns) -> "NameColumns":
        """The same for columns known to hold many names (a forked numbering's), converted
        by Arrow first: each sequence's length is read off Arrow's list offsets instead of
        counted (0.05 s of the 128-rank MoE plan's numbering)."""
        lists = _list_arrays(columns)
        if lists is None:
            return cls(columns)
        self = cls.__new__(cls)
        self.columns = columns
        self.lens = [np.diff(a.offsets.to_numpy()) for a in lists]
        self.totals = [int(x.sum()) for x in self.lens]
        self.arrow = _flat(lists)
        return self


def _list_arrays(columns) -> list | None:
    """Each column as an Arrow list array of strings (None: no Arrow, or names it cannot
    hold; then the dict numbers them)."""
    mods = _arrow()
    if mods is None:
        return None
    pa = mods[0]
    try:
        lists = [pa.array(column, pa.large_list(pa.large_string())) for column in columns]
    except (pa.ArrowException, UnicodeError, TypeError, ValueError, OverflowError):
        return None
    # a null entry (not a sequence) has no length: the dict's path raises TypeError for it
    return lists if all(a.offset == 0 and not a.null_count for a in lists) else None


def _flat(lists: list):
    """All names of the list arrays, in order, as one string array."""
    import pyarrow as pa

    return pa.concat_arrays([a.flatten() for a in lists])


# Documents at least this large (decompressed) are numbered in a forked process when a core
# is idle (the 128-rank MoE plan's text is ~100 MB; the 8-rank fixture's 0.5 MB).
FORK_MIN_BYTES = 16 << 20
WAIT_SECONDS = 30.0


def arrow_meanwhile(size: int | None):
    """A thread importing Arrow while the caller decompresses a document of about `size`
    bytes (ISA-L lets go of the interpreter's lock while it inflates, and the other core
    waits for the load): the forked numbering's child then inherits Arrow instead of
    importing it on the load's critical path (0.05 s of the 128-rank MoE plan's). None when
    nothing is to gain: a document too small to be numbered by a fork, Arrow imported
    already, no core to spare. The caller joins it before anything forks."""
    import sys
    import threading

    if size is None or size < FORK_MIN_BYTES or "pyarrow.compute" in sys.modules:
        return None
    from tvsmt.forked import use_second_core

    if not use_second_core():
        return None
    thread = threading.Thread(target=_arrow, name="tvsmt-import-arrow", daemon=True)
    thread.start()
    return thread


class ForkedNumbering:
    """The numbers of a JSON document's tensor names (outputs, inputs, lineage tensors:
    `Numbering.of_lists` of the three columns), computed in a forked process from the same
    bytes while this process decodes the whole document: the second core takes the
    numbering off the load's critical path.

    The child decodes only the names (schema.NamesPlan: the fields the reader numbers,
    under the same types, by the same decoder) and sends back the numbers; with
    `attr_codes`, also per node a code of its attributes' text (schema.NamesAttrsPlan; the
    fold groups nodes by it: equal texts decode to equal attributes), for a caller that
    decodes the attributes themselves and so has no text to code. `result(lens, n_nodes)`
    waits for them and returns them only when their lengths are those this process decoded
    (`lens`, and one code per node), else None. None too where the platform cannot fork, no
    core is idle (`tvsmt.forked.use_second_core`), the child failed, died or was cut short:
    the caller then numbers here; also when it has not answered in far more time than it
    needs. The child dies with this process (parent-death signal); `stop()` kills it.

    With `split` (a document read for the fold), the child sends the numbers as soon as it
    has them, then computes the fold's split (tvsmt/fold/split.py) from them and from what
    this process decoded and gives it (`give_split_inputs`: the nodes' ranks, micro-batches
    and ops, the world, the outputs); `presplit()` returns it. The second core computes it
    while this process finishes reading (0.2 s of the 128-rank MoE plan's fold)."""

    def __init__(self, text: bytes, attr_codes: bool = True, split: bool = False):
        self.attr_codes, self.split = attr_codes, split
        # how long to wait for the answer: far more than the child needs (about a second
        # per 100 MB); a child stuck in a lock the fork copied is stopped after it
        self._patience = WAIT_SECONDS + len(text) / (10 << 20)
        self._call = None
        self._numbered = False
        self._presplit: list = []
        self._inputs = -1  # the pipe's end give_split_inputs writes to
        if len(text) < FORK_MIN_BYTES:
            return
        from tvsmt.forked import ForkedCall, use_second_core

        if not use_second_core():
            return
        if split:
            import tvsmt.fold.split  # noqa: F401 - before the fork: the child inherits it
            r, w = os.pipe()  # this process -> the child: give_split_inputs
            try:
                self._call = ForkedCall(lambda note: _numbers_then_split(text, note, r, w),
                                        notes=True)
            except BaseException:
                os.close(w)
                raise
            finally:
                os.close(r)
            self._inputs = w
        else:
            self._call = ForkedCall(lambda: _numbers_message(text, attr_codes))

    @property
    def pid(self) -> int | None:
        return None if self._call is None else self._call.pid

    def result(self, lens: list, n_nodes: int
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray | None] | None:
        """(per column: lengths and numbers, per node: its attribute text's code or, without
        `attr_codes`, None), or None. Per column, `lens` holds the lengths this process
        decoded, which the child's must equal, or (a document read without its nodes'
        names, `reader`'s lazy nodes) how many entries the column has: the child's lengths
        are then taken as they are."""
        if self._call is None:
            return None
        # None: hung (or very slow), killed
        if self.split:
            data = self._call.next_note(self._patience)
            self._numbered = data is not None
        else:
            data = self._call.answer(self._patience)
        k = len(lens)
        if data is None or len(data) < 16 * k:
            return None  # failed, died before it answered, or hung
        head = np.frombuffer(data, np.int64, 2 * k)
        entries, totals = head[:k].tolist(), head[k:].tolist()
        want = [x if isinstance(x, int) else len(x) for x in lens]
        codes = n_nodes if self.attr_codes else 0
        if (entries != want
                or len(data) != 16 * k + 4 * (sum(entries) + sum(totals) + codes)):
            return None  # other names than this process decoded, or cut short
        body = np.frombuffer(data, np.int32, offset=16 * k).astype(np.int64)
        got_lens = np.split(body[:sum(entries)], np.cumsum(entries)[:-1].tolist())
        for mine, got, total in zip(lens, got_lens, totals):
            if ((not isinstance(mine, int) and not np.array_equal(got, mine))
                    or int(got.sum()) != total or (len(got) and got.min() < 0)):
                return None
        nums = np.split(body[sum(entries):len(body) - codes], np.cumsum(totals)[:-1].tolist())
        return list(zip(got_lens, nums)), body[len(body) - codes:] if codes else None

    def give_split_inputs(self, world: dict, rank: np.ndarray, mb: np.ndarray,
                          opc: np.ndarray, op_names: list, outputs: list) -> None:
        """What the child's split reads besides the numbers (`split`): written by a thread
        (the child reads it only once it has numbered the names), this process goes on."""
        import threading

        import msgspec

        fd, self._inputs = self._inputs, -1
        if fd < 0:
            return
        try:
            data = msgspec.msgpack.encode((world, op_names, outputs, *(
                np.ascontiguousarray(a, np.int64).tobytes() for a in (rank, mb, opc))))
        except (TypeError, ValueError, OverflowError):
            os.close(fd)  # the child then computes no split
            return
        threading.Thread(target=_write_and_close, args=(fd, data), daemon=True,
                         name="tvsmt-split-inputs").start()

    def presplit(self):
        """The fold's split the child computed after the numbers (`split`), as
        tvsmt.fold.split.Split, or None (not asked for, not computed, failed, hung). Its
        caller uses it only when it was computed from its own inputs (`Split.digest`)."""
        if not self._presplit:
            got = None
            if self._call is not None and self._numbered:
                data = self._call.answer(self._patience)
                if data:
                    from tvsmt.fold.split import Split

                    got = Split.from_bytes(data)
            self.stop()
            self._presplit.append(got)
        return self._presplit[0]

    def stop(self) -> None:
        if self._call is not None:
            if self._call.pid is not None:
                self._call.stop()
            self._call = None
        if self._inputs >= 0:
            os.close(self._inputs)
            self._inputs = -1


def _write_and_close(fd: int, data: bytes) -> None:
    """`data` into the pipe `fd` (framed: its length first), then close it (a child killed
    meanwhile: dropped)."""
    from tvsmt.forked import write_framed

    try:
        write_framed(fd, data)
    except OSError:  # the child ended (stopped): nobody reads it
        pass
    finally:
        os.close(fd)


def _numbers_message(text: bytes, attr_codes: bool = True) -> bytes:
    """In the child: per column its number of entries and of names, then every entry's
    length, the names' numbers, and (`attr_codes`) per node the code of its attributes' text
    (`attr_text_codes`), all int32."""
    import msgspec

    from tvsmt.heap import leave_to_exit
    from tvsmt.plan.schema import NamesAttrsPlan, NamesPlan

    doc = msgspec.json.decode(text, type=NamesAttrsPlan if attr_codes else NamesPlan)
    leave_to_exit(doc)  # a million names: freed with the process, after the answer
    columns = _numbered(doc, Numbering(list(doc.tensors)))
    return _message(columns, [attr_text_codes(doc.nodes)] if attr_codes else [])


def _numbered(doc, number: Numbering) -> list[tuple[np.ndarray, np.ndarray]]:
    """The names' numbers of a document decoded by schema.NamesPlan (or a subclass)."""
    return number.of_prepared(NameColumns.by_arrow(_name_columns(doc)))


def _name_columns(doc) -> list[list]:
    """The columns the reader numbers (outputs, inputs, lineage parts' tensors) of a
    document decoded by schema.NamesPlan (or a subclass)."""
    nodes = doc.nodes
    parts = chain.from_iterable(lin.parts for lin in doc.lineages or ())
    return [[n.outputs for n in nodes], [n.inputs for n in nodes], [p.sum_of for p in parts]]


def _message(columns: list, codes: list) -> bytes:
    head = np.array([len(n) for n, _ in columns] + [len(x) for _, x in columns], np.int64)
    body = np.concatenate([n for n, _ in columns] + [x for _, x in columns] + codes)
    return head.tobytes() + body.astype(np.int32).tobytes()


def _numbers_then_split(text: bytes, note, inputs: int, unused: int) -> bytes:
    """In the child (`ForkedNumbering`'s `split`): the numbers' message as a note, then the
    fold's split computed from them and from the parent's inputs, read from the pipe
    `inputs` (`give_split_inputs`), with the digest of all its inputs, as its answer."""
    import threading

    import msgspec

    from tvsmt.fold.split import inputs_digest, split_dataflow
    from tvsmt.forked import read_framed
    from tvsmt.heap import leave_to_exit
    from tvsmt.plan.schema import NamesPlan
    from tvsmt.timing import span

    os.close(unused)  # the parent's end: the pipe ends when the parent closes its own
    with span("names decode"):
        doc = msgspec.json.decode(text, type=NamesPlan)
    leave_to_exit(doc)
    with span("numbering"):
        number = Numbering(list(doc.tensors))
        columns = _numbered(doc, number)
    note(_message(columns, []))
    # framed (its length first), not read to the end: another fork may hold the pipe open
    with span("wait for inputs"):
        given = read_framed(inputs)
    os.close(inputs)
    world, op_names, outputs, *arrays = msgspec.msgpack.decode(
        given or b"", type=tuple[dict, list[str], list[str], bytes, bytes, bytes])
    rank, mb, opc = (np.frombuffer(a, np.int64) for a in arrays)
    (out_len, out_num), (in_len, in_num), (_, s_num) = columns
    args = (world, rank, mb, opc, op_names, in_len, in_num, out_len, out_num,
            len(number.tids), number.of_names(outputs), s_num)
    # the digest (14 ms for the 128-rank MoE plan) hashed by a thread meanwhile: hashlib
    # lets go of the interpreter's lock, and the reading process's core waits for the split
    digest: list = []
    hasher = threading.Thread(target=lambda: digest.append(inputs_digest(*args)),
                              name="tvsmt-split-digest", daemon=True)
    hasher.start()
    with span("split"):
        split = split_dataflow(*args)
        hasher.join()
    split.digest = digest[0] if digest else b""  # none: the reading process splits itself
    return split.to_bytes()


def attr_text_codes(nodes: list) -> np.ndarray:
    """Per node (its `attrs` undecoded, msgspec.Raw), the first node whose attributes have
    the same text."""
    first: dict = {}
    return np.fromiter(map(first.setdefault, map(bytes, map(_ATTRS, nodes)), range(len(nodes))),
                       np.int64, len(nodes))


_ATTRS = attrgetter("attrs")
