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
        if lens is None:
            lens = [np.fromiter(map(len, column), np.int64, len(column))
                    for column in columns]
        totals = [int(x.sum()) for x in lens]
        if sum(totals) >= ARROW_MIN_NAMES:
            got = self._arrow_numbers(columns)
            if got is not None:
                cuts = np.cumsum(totals)[:-1].tolist()
                return list(zip(lens, np.split(got, cuts)))
        get = self.as_dict().get
        return [(n, np.fromiter(map(get, chain.from_iterable(column), repeat(UNDECLARED)),
                                np.int64, total))
                for n, column, total in zip(lens, columns, totals)]

    def _arrow_numbers(self, columns) -> np.ndarray | None:
        """The numbers of all names of the columns, concatenated, computed by Arrow; None
        when it cannot (then the dict does)."""
        if self._arrow_table() is None:
            return None
        pa, pc = _arrow()
        try:
            arr = pa.concat_arrays([pa.array(column, pa.large_list(pa.large_string())).flatten()
                                    for column in columns])
        except (pa.ArrowException, UnicodeError, TypeError, ValueError, OverflowError):
            return None
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


# Documents at least this large (decompressed) are numbered in a forked process when a core
# is idle (the 128-rank MoE plan's text is ~100 MB; the 8-rank fixture's 0.5 MB).
FORK_MIN_BYTES = 16 << 20
WAIT_SECONDS = 30.0


class ForkedNumbering:
    """The numbers of a JSON document's tensor names (outputs, inputs, lineage tensors:
    `Numbering.of_lists` of the three columns), computed in a forked process from the same
    bytes while this process decodes the whole document: the second core takes the
    numbering off the load's critical path.

    The child decodes only the names (schema.NamesPlan: the fields the reader numbers,
    under the same types, by the same decoder, and each node's attributes as text) and sends
    back the numbers and, per node, a code of its attributes' text (the fold groups nodes by
    it: equal texts decode to equal attributes); `result(lens, n_nodes)` waits for them and
    returns them only when their lengths are those this process decoded (`lens`, one code
    per node), else None. None too where the platform cannot fork, no core is idle
    (`tvsmt.forked.use_second_core`), the child failed, died or was cut short: the caller then
    numbers here; also when it has not answered in far more time than it needs. The child
    dies with this process (parent-death signal); `stop()` kills it."""

    def __init__(self, text: bytes):
        # how long to wait for the answer: far more than the child needs (about a second
        # per 100 MB); a child stuck in a lock the fork copied is stopped after it
        self._patience = WAIT_SECONDS + len(text) / (10 << 20)
        self._call = None
        if len(text) < FORK_MIN_BYTES:
            return
        from tvsmt.forked import ForkedCall, use_second_core

        if use_second_core():
            self._call = ForkedCall(lambda: _numbers_message(text))

    @property
    def pid(self) -> int | None:
        return None if self._call is None else self._call.pid

    def result(self, lens: list, n_nodes: int
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray] | None:
        """(per column: lengths and numbers, per node: its attribute text's code), or
        None. Per column, `lens` holds the lengths this process decoded, which the child's
        must equal, or (a document read without its nodes' names, `reader`'s lazy nodes)
        how many entries the column has: the child's lengths are then taken as they are."""
        if self._call is None:
            return None
        data = self._call.answer(self._patience)  # None: hung (or very slow), killed
        k = len(lens)
        if data is None or len(data) < 16 * k:
            return None  # failed, died before it answered, or hung
        head = np.frombuffer(data, np.int64, 2 * k)
        entries, totals = head[:k].tolist(), head[k:].tolist()
        want = [x if isinstance(x, int) else len(x) for x in lens]
        if (entries != want
                or len(data) != 16 * k + 4 * (sum(entries) + sum(totals) + n_nodes)):
            return None  # other names than this process decoded, or cut short
        body = np.frombuffer(data, np.int32, offset=16 * k).astype(np.int64)
        got_lens = np.split(body[:sum(entries)], np.cumsum(entries)[:-1].tolist())
        for mine, got, total in zip(lens, got_lens, totals):
            if ((not isinstance(mine, int) and not np.array_equal(got, mine))
                    or int(got.sum()) != total or (len(got) and got.min() < 0)):
                return None
        nums = np.split(body[sum(entries):len(body) - n_nodes], np.cumsum(totals)[:-1].tolist())
        return list(zip(got_lens, nums)), body[len(body) - n_nodes:]

    def stop(self) -> None:
        if self._call is not None:
            self._call.stop()


def _numbers_message(text: bytes) -> bytes:
    """In the child: per column its number of entries and of names, then every entry's
    length, the names' numbers, and per node the code of its attributes' text (the first
    node with the same text), all int32."""
    import msgspec

    from tvsmt.heap import leave_to_exit
    from tvsmt.plan.schema import NamesPlan

    doc = msgspec.json.decode(text, type=NamesPlan)
    leave_to_exit(doc)  # a million names: freed with the process, after the answer
    nodes = doc.nodes
    parts = chain.from_iterable(lin.parts for lin in doc.lineages or ())
    columns = Numbering(list(doc.tensors)).of_lists(
        [n.outputs for n in nodes], [n.inputs for n in nodes], [p.sum_of for p in parts])
    first: dict = {}
    codes = np.fromiter(map(first.setdefault, (bytes(n.attrs) for n in nodes), range(len(nodes))),
                        np.int64, len(nodes))
    head = np.array([len(n) for n, _ in columns] + [len(x) for _, x in columns], np.int64)
    body = np.concatenate([n for n, _ in columns] + [x for _, x in columns] + [codes])
    return head.tobytes() + body.astype(np.int32).tobytes()
