"""A forked reader's heap in transparent huge pages (tvsmt/heap.py `huge_pages_for_heap`).

A placement of memory, never a result: it happens only in a process that ends soon after
(a forked reader, a command), for a large text, on glibc with huge pages on request; blocks
up to 32 MiB then come from the marked heap. A plan verified through it gets the same
report, bugs in folded-away units included (tests/test_fold_in_child.py's pair)."""

from __future__ import annotations

import ctypes
import json
import os

import pytest

from tvsmt import heap
from tvsmt.forked import ForkedCall

BIG = 64 << 20

needs_thp = pytest.mark.skipif(not heap._thp_on_request(),
                               reason="needs glibc and transparent huge pages on request "
                                      "(/sys/kernel/mm/transparent_hugepage/enabled)")


def _in_child(fn) -> dict:
    """`fn()` (a dict) in a forked process that ends after it, as ForkedCall children do."""
    data = ForkedCall(lambda: json.dumps(fn()).encode()).answer(60)
    assert data, "the child gave no answer"
    return json.loads(data)


def _flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a <= address < b
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def _a_block_and_where_it_is() -> dict:
    block = bytearray(8 << 20)  # above glibc's first mmap threshold (128 KiB)
    address = ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))
    start, end = heap.heap_range()
    return {"in_heap": start <= address < end, "flags": _flags_at(address)}


@needs_thp
def test_a_process_that_ends_soon_gets_its_blocks_from_a_heap_in_huge_pages():
    def child():
        marked = heap.huge_pages_for_heap(BIG)
        return {"marked": marked, "again": heap.huge_pages_for_heap(BIG),
                **_a_block_and_where_it_is()}

    got = _in_child(child)
    assert got["marked"] and got["again"]
    assert got["in_heap"] and "hg" in got["flags"]  # madvise(MADV_HUGEPAGE)'s flag


@needs_thp
def test_the_heap_is_left_alone_for_a_small_text_or_when_told():
    def small():
        return {"marked": heap.huge_pages_for_heap(heap.HUGE_HEAP_MIN_BYTES - 1),
                **_a_block_and_where_it_is()}

    def told():
        os.environ[heap.HUGE_PAGES_ENV] = "never"
        return {"marked": heap.huge_pages_for_heap(BIG), **_a_block_and_where_it_is()}

    for fn in (small, told):
        got = _in_child(fn)
        assert not got["marked"] and "hg" not in got["flags"]


def test_not_in_a_process_that_lives_on():
    """This test process is not ending (no `end_quickly`): a library caller's heap is its
    own."""
    assert heap._left_to_exit is None
    assert not heap.huge_pages_for_heap(BIG) and not heap._marked


def test_not_without_glibc(monkeypatch):
    def no_glibc(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(os, "confstr", no_glibc)  # the child is forked with it
    assert _in_child(lambda: {"marked": heap.huge_pages_for_heap(BIG)}) == {"marked": False}
