"""Compressed sparse rows: a column of rows of different lengths (each node's inputs, each
lineage part's tensors) held as the rows' lengths and their values concatenated. One home for
the two helpers the reader, the JSON Lines scan and the fold's column split all use."""

from __future__ import annotations

import numpy as np


def offsets(lens: np.ndarray) -> np.ndarray:
    """Where each row starts, and the total at the end (len(lens) + 1 entries)."""
    ptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    return ptr


def gather(ptr: np.ndarray, flat: np.ndarray, rows: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Rows `rows` of the CSR column (`ptr`: its `offsets`, `flat`: its values): their
    lengths, and their values concatenated in the order of `rows`."""
    lens = ptr[rows + 1] - ptr[rows]
    total = int(lens.sum()) if len(rows) else 0
    if not total:
        return lens, flat[:0]
    starts = np.repeat(ptr[rows] - offsets(lens)[:-1], lens)
    return lens, flat[starts + np.arange(total)]


def split_rows(values: list, lens: np.ndarray) -> list[tuple]:
    """`values` (the rows' values concatenated) cut into one tuple per row."""
    out, at = [], 0
    for n in lens.tolist():
        out.append(tuple(values[at:at + n]))
        at += n
    return out


class PartsFromColumns:
    """Lineage parts built back from a reader's columns, for the few the fold keeps (the
    builder of a `LazySequence` of all parts): per part its tensors as a CSR column of
    tensor numbers (`s_len`, `s_num`), its slice and scale as indices into the distinct
    ones; `names(numbers)` gives the tensor ids of a list of numbers."""

    def __init__(self, names, s_len, s_num, slices: list, slice_index, scales: list,
                 scale_code):
        self._names, self._ptr, self._s_num = names, offsets(s_len), s_num
        self._slices, self._slice_index = slices, slice_index
        self._scales, self._scale_code = scales, scale_code

    def __call__(self, idx: list) -> list:
        from tvsmt.plan.model import LineagePart

        if not idx:
            return []
        rows = np.asarray(idx, dtype=np.int64)
        lens, nums = gather(self._ptr, self._s_num, rows)
        slices, scales = self._slices, self._scales
        return [LineagePart(slices[s], names, scales[c]) for s, names, c in zip(
            self._slice_index[rows].tolist(), split_rows(self._names(nums.tolist()), lens),
            self._scale_code[rows].tolist())]
