"""Work on the machine's second core: one function run in a forked child, its answer as bytes.

The readers use it to take work off the critical path of a large load (half of a JSON Lines
file, tvsmt.plan.scan; a document's numbering, tvsmt.plan.numbering.ForkedNumbering), when
`use_second_core()` says so: the one home of that policy. The child sees the
parent's memory as it was at the fork, so it needs no arguments sent; it dies with the parent
(parent-death signal), runs without the cyclic collector, frees nothing it leaves to its exit
(`heap.leave_to_exit`: the answer is not held up by freeing a large result object by object),
and whatever goes wrong in it ends as an answer of no bytes: the caller then does the work
itself. Nothing the child says is trusted further than the caller checks it.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from collections.abc import Callable


# Where the readers' second-core work runs (scan's first half, numbering's
# ForkedNumbering): True in a forked process, False in this one, None (the default) in a
# forked process when a core is idle now (`idle_core`): on a busy machine the second process
# only adds work (the file is decoded twice), on an idle one it takes the work off the
# reading's critical path.
PARALLEL: bool | None = None
# The same choice from outside (benchmarks, tests of whole runs): "always", "never", or unset
# (a core idle now). `PARALLEL`, when set, comes first.
SECOND_CORE_ENV = "TVSMT_SECOND_CORE"


def use_second_core() -> bool:
    """Should a reader fork its second-core work now? (`PARALLEL`, else $TVSMT_SECOND_CORE;
    never without fork or a second core.)"""
    if not hasattr(os, "fork") or (os.cpu_count() or 1) < 2:
        return False
    if PARALLEL is not None:
        return PARALLEL
    forced = os.environ.get(SECOND_CORE_ENV, "").strip().lower()
    if forced in ("always", "never"):
        return forced == "always"
    return idle_core()


# An idle machine shows a busy instant now and then (1% of samples on this one, measured
# with runnable_now in a loop): a busy answer is looked at again this many times, this far
# apart, before it stands.
BUSY_SAMPLES, BUSY_SPACING = 3, 0.001


def idle_core() -> bool:
    """Is a core idle at this instant? Fewer tasks runnable now than cores (Linux: the
    fourth field of /proc/loadavg, which counts this process; a busy instant is sampled
    again, `BUSY_SAMPLES` in all), else (elsewhere) the 1-minute load average below the
    number of cores minus a half. An instant, not an average: a benchmark's own previous
    run keeps the average up for a minute."""
    cores = os.cpu_count() or 1
    if cores < 2 or not hasattr(os, "fork"):
        return False
    running = runnable_now()
    if running is None:
        return os.getloadavg()[0] < cores - 0.5
    for _ in range(BUSY_SAMPLES - 1):
        if running < cores:
            break
        time.sleep(BUSY_SPACING)
        running = min(running, runnable_now() or running)
    return running < cores


def runnable_now() -> int | None:
    """Tasks runnable at this instant, this one included (None where the system does not
    say)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class ForkedCall:
    """`fn()` in a forked child; `answer()` waits for the bytes it returned."""

    def __init__(self, fn: Callable[[], bytes]):
        from tvsmt.heap import end_quickly
        from tvsmt.solving.lifeline import die_with_parent

        parent = os.getpid()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child's coverage is not collected)
            try:
                os.close(r)
                die_with_parent(parent)
                gc.disable()
                end_quickly()  # ends with os._exit: what fn leaves to the exit is not freed
                try:
                    data = memoryview(fn())
                except BaseException:  # anything: no answer, the parent does the work
                    data = memoryview(b"")
                while data:
                    data = data[os.write(w, data):]
                # the answer is complete now: ending the process first would make the
                # parent wait for its memory's teardown (0.2 s for a loaded 128-rank plan)
                os.close(w)
            finally:
                os._exit(0)
        os.close(w)
        self.pid: int | None = pid
        self._fd = r

    def answer(self, patience: float | None = None) -> bytes | None:
        """All the child wrote (b"" when it failed or died first), once it has ended; None
        when it has not finished within `patience` seconds (it is then killed)."""
        if self.pid is None:
            return None
        chunks = []
        deadline = None if patience is None else time.monotonic() + patience
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                    self.stop()
                    return None
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        self._reap(wait=False)
        return b"".join(chunks)

    def stop(self) -> None:
        """Kill the child (if it still runs) and reap it."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover (already reaped elsewhere)
                pass
            self._reap()

    def _reap(self, wait: bool = True) -> None:
        """Close the pipe and collect the child's exit status. `wait=False` once it has
        answered: it may still be returning a large heap to the kernel (0.05 s for a loaded
        128-rank plan), which this process need not wait for, so a daemon thread collects
        it."""
        os.close(self._fd)
        pid, self.pid = self.pid, None
        if wait or os.waitpid(pid, os.WNOHANG)[0]:
            if wait:
                os.waitpid(pid, 0)
            return
        import threading

        threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True,
                         name=f"tvsmt-reap-{pid}").start()
