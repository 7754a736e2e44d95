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
