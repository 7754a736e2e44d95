"""Keeping Python's cyclic garbage collector off the loaded plans.

Loaded plans are millions of long-lived objects without reference cycles. Every collection of
the oldest generation re-scans them all, and the fold and the encoding allocate enough to
trigger many: that scanning was a third of the fold of a 327k-node plan. Frozen
(`gc.freeze`), they are left out of collections; reference counting still frees everything,
and they are unfrozen when the outermost `plans_frozen` ends, so nothing outlives a run.

A command (tvsmt/cli.py) goes one step further: its process ends right after, so it frees
nothing at all (`leave_to_exit`, `end_process`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0


@contextmanager
def plans_frozen() -> Iterator[None]:
    """Freeze everything alive now for the cyclic collector (re-entrant)."""
    global _depth
    if _depth == 0:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()


@contextmanager
def collector_paused(freeze_after: bool = False) -> Iterator[None]:
    """No cyclic collection inside: for phases that allocate millions of acyclic records (a
    loaded plan split into units: collecting them as they grew was a tenth of the fold of a
    327k-node plan); reference counting still frees them.

    `freeze_after`: what was built inside is kept (a plan just read), so it moves to the
    permanent generation before the collector runs again. Otherwise the first allocation
    after re-enabling starts a collection that traverses every new container (a fifth of the
    load of a 300k-node plan); `plans_frozen` unfreezes them when it next ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if freeze_after:
                gc.freeze()
            gc.enable()


@contextmanager
def collector_running(when: bool = True) -> Iterator[None]:
    """Inside a `collector_paused` generator: the collector runs while the consumer holds
    control (`when`: it was enabled before the pause), and is paused again after."""
    if when:
        gc.enable()
    try:
        yield
    finally:
        if when:
            gc.disable()


# ------------------------------------------------------------------ the end of a command

_left_to_exit: list | None = None  # a list while a command will end its process quickly


def leave_to_exit(obj) -> None:
    """Keep `obj` until the process ends instead of freeing it now, when the command line
    will end the process without the interpreter's teardown (`end_process`): freeing a loaded
    128-rank plan object by object takes about 0.4 s, which ending the process does not.
    Outside such a command (tvsmt used as a library, the tests) it does nothing, and `obj`
    is freed as usual. Meant for what a command loads once (`tvsmt verify` one pair, the
    demo two small ones): everything left stays until the end."""
    if _left_to_exit is not None:
        _left_to_exit.append(obj)


def end_quickly() -> None:
    """This process is a command that will call `end_process`: `leave_to_exit` keeps."""
    global _left_to_exit
    if _left_to_exit is None:
        _left_to_exit = []


def end_process(code) -> None:
    """End the process with `code` (a SystemExit's) without tearing the interpreter down:
    everything registered with `atexit` runs first (multiprocessing joins its children, loky
    stops its workers, logging flushes), then the standard streams are flushed and the
    process exits. Nothing is freed object by object. Returns (the caller then exits
    normally) while a non-daemon thread still runs: the interpreter would wait for it."""
    import atexit
    import os
    import sys
    import threading

    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None or any(t.is_alive() and not t.daemon for t in threading.enumerate()
                                    if t is not threading.main_thread()):
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # as the interpreter does with SystemExit("message")
        print(code, file=sys.stderr)
        status = 1
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(status & 0xFF)


# ------------------------------------------------------------------ huge pages for a reader

HUGE_PAGES_ENV = "TVSMT_HUGE_PAGES"  # "never": leave the C library's heap as it is
HUGE_HEAP_MIN_BYTES = 16 << 20  # plan text below this: the heap's usual growth is as quick
_HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
_MALLOPT_TRIM, _MALLOPT_TOP_PAD, _MALLOPT_MMAP = -1, -2, -3  # glibc's M_TRIM_THRESHOLD, ...
_MMAP_MAX = 32 << 20  # glibc's largest mmap threshold on 64 bits
_MADV_HUGEPAGE = 14
_INT_MAX = 0x7FFFFFFF  # mallopt takes an int
_marked: list = []  # the heap was marked (inherited by forked children)


def huge_pages_for_heap(text_bytes: int) -> bool:
    """Before building a plan from `text_bytes` of text, in a process that then ends
    (`end_quickly` was called: a command, a forked reader): the C library's heap grows at once
    by 8 times the text, is marked for transparent huge pages (madvise), and keeps what is
    freed. Blocks up to 32 MiB (list and dict tables, numpy columns, Arrow buffers) then come
    from 2 MiB pages instead of 4 KiB ones: fewer page faults, and fewer TLB misses when the
    tensor tables are probed at random. Loading the 128-rank MoE plan (104 MB of text) in a
    fresh process took 1.6-2.2 s against 2.1-2.8 s (five alternating runs); the C library's
    own `glibc.malloc.hugetlb=1`, which a running process cannot set, did as well.

    Nothing happens for a smaller text, in a process that lives on (its heap would stay
    large: a library caller's), with `$TVSMT_HUGE_PAGES=never`, or where the C library is not
    glibc or the kernel gives no huge pages on request. Never changes what is computed.
    Returns whether the heap is marked."""
    import os

    if _marked:
        return True
    if (text_bytes < HUGE_HEAP_MIN_BYTES or _left_to_exit is None
            or os.environ.get(HUGE_PAGES_ENV) == "never" or not _thp_on_request()):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
        libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if not (libc.mallopt(_MALLOPT_TRIM, _INT_MAX) and libc.mallopt(_MALLOPT_MMAP, _MMAP_MAX)
                and libc.mallopt(_MALLOPT_TOP_PAD, min(8 * text_bytes, _INT_MAX))):
            return False
        before = libc.sbrk(0)
        blocks = []
        for _ in range(4):  # until the heap has grown (its top may already hold a block)
            blocks.append(libc.malloc(_MMAP_MAX - (1 << 20)))
            if libc.sbrk(0) != before:
                break
        for p in blocks:
            libc.free(p)
        start, end = heap_range()
        start = (start + _HUGE - 1) & ~(_HUGE - 1)
        if end > start and libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            _marked.append(True)
    except (OSError, AttributeError, ValueError, TypeError):  # no such C library or function
        return False
    return bool(_marked)


def _thp_on_request() -> bool:
    """glibc (whose mallopt and sbrk `huge_pages_for_heap` uses), and a kernel that gives
    transparent huge pages to regions that ask for them."""
    import os

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except (OSError, ValueError):  # not glibc, or no transparent huge pages
        return False
    return "[madvise]" in mode or "[always]" in mode


def heap_range() -> tuple[int, int]:
    """Where this process's heap starts and ends (/proc/self/maps), (0, 0) when it has none.
    In a forked process, the heap's growth is a second `[heap]` mapping next to the first
    (the kernel does not extend a mapping shared with the parent): both are counted."""
    start = end = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                a, b = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
                start, end = (a, b) if not end else (min(start, a), max(end, b))
    return start, end
