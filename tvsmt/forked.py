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
from collections.abc import Callable, Sequence
from typing import Any

from tvsmt.errors import SolverFailure

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


class WorkerDied(SolverFailure):
    """A forked worker died before it answered (killed from outside, e.g. by the out-of-memory
    killer): what it was given is unproven, so the run is inconclusive, never a pass."""


# In a forked call's child: the write ends of the pipes to its parent. Its own forked calls
# close them, so that the parent sees their end when this process closes them.
_FOR_PARENT: list[int] = []


class ForkedCall:
    """`fn()` in a forked child; `answer()` waits for the bytes it returned.

    With `notes=True`, `fn(note)` may also tell the caller things before it returns:
    `note(data)` sends `data` (written meanwhile: the child goes on), and `next_note()`
    waits for it. The caller uses them to start its own next work early (tvsmt.fold_child
    starts the solvers' setup while the child folds; the reader's forked numbering sends the
    numbers before it computes the fold's split); the caller must read every note before
    the answer."""

    def __init__(self, fn: Callable[..., bytes], notes: bool = False):
        from tvsmt.heap import end_quickly
        from tvsmt.solving.lifeline import die_with_parent

        parent = os.getpid()
        r, w = os.pipe()
        nr, nw = os.pipe() if notes else (-1, -1)
        for fd in (w, nw):
            _widen(fd)
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child's coverage is not collected)
            try:
                os.close(r)
                if notes:
                    os.close(nr)
                for fd in _FOR_PARENT:  # a forked call's own forked call: its parent's
                    os.close(fd)  # pipes end when its parent has written them
                _FOR_PARENT[:] = [w] + ([nw] if notes else [])
                die_with_parent(parent)
                gc.disable()
                end_quickly()  # ends with os._exit: what fn leaves to the exit is not freed
                sender = _NoteSender(nw) if notes else None
                try:
                    data = memoryview(fn(sender.send) if notes else fn())
                except BaseException:  # anything: no answer, the parent does the work
                    data = memoryview(b"")
                if notes:  # no more notes: a parent waiting for one goes on to the answer,
                    sender.finish()  # which it would otherwise never read (a full pipe)
                    os.close(nw)
                while data:
                    data = data[os.write(w, data):]
                # the answer is complete now: ending the process first would make the
                # parent wait for its memory's teardown (0.2 s for a loaded 128-rank plan)
                os.close(w)
            finally:
                os._exit(0)
        os.close(w)
        if notes:
            os.close(nw)
        self.pid: int | None = pid
        self._fd = r
        self._notes = nr

    def next_note(self, patience: float | None = None) -> bytes | None:
        """The child's next note, once it has sent it whole; None when it sends no more
        (it has ended, or failed, or closed the channel: `answer()` then says how it
        ended), or when it has not sent it whole within `patience` seconds (it is then
        killed)."""
        if self._notes < 0:
            return None
        deadline = None if patience is None else time.monotonic() + patience
        data = read_framed(self._notes, deadline)
        if data is None:
            if deadline is not None and time.monotonic() >= deadline:
                self.stop()
            self._close_notes()
            return None
        return data

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

    def _close_notes(self) -> None:
        if self._notes >= 0:
            os.close(self._notes)
            self._notes = -1

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
        self._close_notes()
        pid, self.pid = self.pid, None
        if wait or os.waitpid(pid, os.WNOHANG)[0]:
            if wait:
                os.waitpid(pid, 0)
            return
        import threading

        threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True,
                         name=f"tvsmt-reap-{pid}").start()


class _NoteSender:
    """In the child: each note written by a thread of its own, one after the other, so
    that the child goes on working while the parent has not read it yet (a pipe holds 64
    KiB, 1 MiB once `_widen`ed: the 128-rank MoE plan's numbers, 6 MB, would stop it until
    then)."""

    def __init__(self, fd: int):
        self._fd, self._thread = fd, None

    def send(self, data: bytes) -> None:
        import threading

        self.finish()
        self._thread = threading.Thread(target=self._write, args=(data,), daemon=True)
        self._thread.start()

    def _write(self, data: bytes) -> None:
        try:
            write_framed(self._fd, data)
        except OSError:  # the parent stopped reading (it kills this child next): no note
            pass

    def finish(self) -> None:
        """Wait until every note is written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _widen(fd: int) -> None:
    """A pipe's buffer as large as the system lets an unprivileged process make it (1 MiB
    on Linux, against 64 KiB): a large answer or note (the 128-rank MoE plan's 15 MB split,
    its 6 MB of numbers) then crosses in fewer turns of writer and reader (15 MB: 35 -> 25
    ms, docs/performance.md)."""
    if fd < 0:
        return
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (ImportError, AttributeError, OSError):  # not Linux, or a lower limit: as it is
        pass


def write_framed(fd: int, data: bytes) -> None:
    """`data` into the pipe `fd`, its length first (8 bytes, little-endian): a note, or
    what a reader gives its forked numbering (`read_framed` reads it)."""
    for view in (memoryview(len(data).to_bytes(8, "little")), memoryview(data)):
        while view:  # the head, then the data itself (not a copy of both joined)
            view = view[os.write(fd, view):]


def read_framed(fd: int, deadline: float | None = None) -> bytes | None:
    """What `write_framed` wrote, whole; None when the writer closed the pipe first or the
    `deadline` (time.monotonic) passed."""
    head = _read_exactly(fd, 8, deadline)
    if len(head) != 8:
        return None
    size = int.from_bytes(head, "little")
    data = _read_exactly(fd, size, deadline)
    return data if len(data) == size else None


def _read_exactly(fd: int, size: int, deadline: float | None = None) -> bytes:
    """`size` bytes from a pipe, fewer only when its writer closed it first or the
    `deadline` (time.monotonic) passed."""
    chunks, left = [], size
    while left > 0:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                break
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# What `fork_map`'s workers call, set while it runs: a forked worker finds it in the memory
# it inherited, so neither the function nor the data it closes over is ever pickled.
_FORK_TASK: Callable[[Any], Any] | None = None


def _run_fork_task(item: Any) -> Any:
    return _FORK_TASK(item)


def fork_map(fn: Callable[[Any], Any], items: Sequence, jobs: int,
             meanwhile: Callable[[], None] | None = None) -> list:
    """`[fn(x) for x in items]`, computed by `jobs` forked worker processes (a
    multiprocessing pool, one item at a time) that inherit this process's memory: `fn` and
    the plans it reads are never pickled, only the items and the results. `meanwhile()`
    runs here while the workers work. The workers die with this process (lifeline's fork
    hook) and are terminated when this call ends, however it ends; a worker that dies first
    (killed from outside) raises `WorkerDied` instead of a wait without end. Only where the
    platform can fork (the callers check `can_fork_workers()`).

    Not joblib's multiprocessing backend: it starts a resource-tracker interpreter on every
    call (a second Python importing joblib, 0.3 s of CPU on this 2-core machine, taken from
    the workers). Leaving it made the 8-rank real fixture's command 0.86 -> 0.69 s (medians,
    `scripts/bench_command_history.py --base 916b9b0`, one alternating run)."""
    import multiprocessing

    global _FORK_TASK
    _FORK_TASK = fn
    try:
        before = set(multiprocessing.active_children())
        with multiprocessing.get_context("fork").Pool(worker_count(jobs, len(items))) as pool:
            workers = [p for p in multiprocessing.active_children() if p not in before]
            pending = pool.map_async(_run_fork_task, items, chunksize=1)
            if meanwhile is not None:
                meanwhile()
            while not pending.ready():
                pending.wait(WORKER_CHECK_SECONDS)
                if not pending.ready():
                    _check_alive(workers)
            return pending.get()
    finally:
        _FORK_TASK = None


def worker_count(jobs: int, tasks: int) -> int:
    """How many worker processes to start for `tasks` tasks, at most `jobs` at a time: never
    more than the tasks (`-j 100000` would otherwise start 100000 processes for a handful of
    templates or obligations)."""
    return max(1, min(jobs, tasks))


def cpu_workers(jobs: int | None) -> int:
    """How many worker processes CPU work of this interpreter (encoding, the fold's check)
    may use for `jobs` (None: every core): at most one per core, since a worker beyond the
    cores only costs memory. The solvers, external processes, take `jobs` as it is."""
    cores = os.cpu_count() or 1
    return cores if jobs is None else max(1, min(jobs, cores))


# How often `fork_map` looks whether its workers are still alive while it waits. A pool
# whose worker is killed from outside (the out-of-memory killer, a SIGKILL) loses that
# worker's item and would wait for it forever; the pool replaces the worker, never the item.
WORKER_CHECK_SECONDS = 0.05


def _check_alive(workers: list) -> None:
    """WorkerDied when one of the pool's first workers has ended: a pool worker never ends
    while items are left (no task limit), so an end is a death."""
    for w in workers:
        code = w.exitcode
        if code is not None:
            how = (f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0
                   else f"exited with code {code}")
            raise WorkerDied(f"a worker process {how} before it answered: nothing it was "
                             "given is proven (out of memory? try -j 1)")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def can_fork_workers() -> bool:
    """Can `fork_map` run here?"""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()
