"""Keeping Python's cyclic garbage collector off the loaded plans.

Loaded plans are millions of long-lived objects without reference cycles. Every collection of
the oldest generation re-scans them all, and the fold and the encoding allocate enough to
trigger many: that scanning was a third of the fold of a 327k-node plan. Frozen
(`gc.freeze`), they are left out of collections; reference counting still frees everything,
and they are unfrozen when the outermost `plans_frozen` ends, so nothing outlives a run.
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
