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
