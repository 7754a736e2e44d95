"""A forked worker killed from outside (the out-of-memory killer, a SIGKILL) ends the run as
inconclusive, at once, instead of a pool waiting forever for the item it lost
(tvsmt/forked.py `fork_map`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.frontends import write_pair_dicts

_KILLED_WORKER = """if True:
    import multiprocessing, os, signal, sys, time
    from tvsmt.forked import WorkerDied, fork_map

    def square(x):
        if x == 2 and sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
        return x * x

    try:
        print(fork_map(square, list(range(6)), 2))
    except WorkerDied as e:
        print("died:", e)
    print("workers left:", len(multiprocessing.active_children()))
"""


def _run(mode: str) -> str:
    # a hang is the bug: the timeout fails the test instead of blocking the suite
    done = subprocess.run([sys.executable, "-c", _KILLED_WORKER, mode], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_killed_worker_is_an_error_not_a_hang():
    out = _run("kill")
    assert "died: a worker process was killed by signal 9 (SIGKILL) before it answered" in out
    assert "workers left: 0" in out  # the pool is terminated, no worker left behind


def test_without_a_death_every_item_is_answered():
    out = _run("keep")
    assert "[0, 1, 4, 9, 16, 25]" in out
    assert "workers left: 0" in out


_MANY_JOBS = """if True:
    import multiprocessing
    from tvsmt.forked import fork_map

    started = []
    print(fork_map(lambda x: x + 1, [1, 2, 3], 40,
                   meanwhile=lambda: started.append(len(multiprocessing.active_children()))))
    print("workers started:", started[0])
"""


def test_more_jobs_than_items_start_no_more_workers_than_items():
    """`-j 100000` must not start 100000 processes for a handful of templates (40 here)."""
    done = subprocess.run([sys.executable, "-c", _MANY_JOBS], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "[2, 3, 4]" in done.stdout and "workers started: 3" in done.stdout, done.stdout


def test_a_killed_encoding_worker_makes_the_run_inconclusive(tmp_path, monkeypatch):
    """Through the command: an encoding worker that dies is never a pass (exit 3, one line)."""
    from tvsmt.encoding import obligations

    single, parallel = write_pair_dicts(tmp_path / "p", single_mlp(), parallel_mlp())
    monkeypatch.setattr(obligations, "PARALLEL_TEMPLATES", 1)  # encode in workers
    parent = os.getpid()
    plain = obligations._encode_chunk

    def dying(*args):
        if os.getpid() != parent:  # in a worker (the pool forks this process)
            os.kill(os.getpid(), signal.SIGKILL)
        return plain(*args)

    monkeypatch.setattr(obligations, "_encode_chunk", dying)

    def hung(*_):  # the bug was a wait without end: fail instead of blocking the suite
        raise TimeoutError("the run still waits for its dead worker")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(90)
    try:
        result = CliRunner().invoke(main, ["verify", "--no-corpus", "-j", "2", single,
                                           parallel])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert result.exit_code == 3, result.output
    assert "inconclusive: a worker process was killed by signal 9" in result.output
    assert "equivalent" not in result.output


def test_encoding_starts_no_more_workers_than_cores(tmp_path, monkeypatch):
    """`-j` sets how many solvers run at once; encoding is this interpreter's CPU work, so
    its worker processes stay within the cores (on 2 cores, `-j 50` forks 2, not 50)."""
    from tvsmt.encoding import obligations

    single, parallel = write_pair_dicts(tmp_path / "p", single_mlp(), parallel_mlp())
    monkeypatch.setattr(obligations, "PARALLEL_TEMPLATES", 1)  # encode in workers
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    asked = []
    plain = obligations.fork_map

    def recording(fn, items, jobs, *rest, **kw):
        asked.append(jobs)
        return plain(fn, items, jobs, *rest, **kw)

    monkeypatch.setattr(obligations, "fork_map", recording)
    result = CliRunner().invoke(main, ["verify", "--no-corpus", "-j", "50", single, parallel])
    assert result.exit_code == 0, result.output
    assert asked == [2]
