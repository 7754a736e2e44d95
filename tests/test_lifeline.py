"""A solver dies with the process that started it, even when that process dies while the
solver is still starting (tvsmt/solving/lifeline.py). The whole command's signal handling
is tested in test_signals.py; here, the start-up race alone, made wide on purpose."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest
from processes import command_line, tagged

from tvsmt.solving import lifeline

pytestmark = pytest.mark.skipif(lifeline._setpriv_and_shell() is None,
                                reason="no setpriv with --pdeathsig (util-linux) here")


def _tagged(tag: str) -> list[psutil.Process]:
    return tagged("TVSMT_LIFELINE_TEST", tag)


def test_a_solver_whose_starter_died_before_the_death_signal_was_set_does_not_run(tmp_path):
    """A slow `setpriv` on PATH: the starting process is gone (SIGKILL-like `os._exit`)
    before the real setpriv asks for the parent-death signal (it waits for that), so the
    kernel would never send it; the solver must not run (before the guard, `sleep 60` ran
    on, re-parented to init)."""
    real = lifeline._setpriv_and_shell()[0]
    slow = tmp_path / "bin" / "setpriv"
    slow.parent.mkdir()
    started = tmp_path / "started"
    # it waits (10 s at most) until the process that started it is gone, then goes on
    slow.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --help ] && exec {real} "$@"
        parent=$PPID
        touch {started}
        n=0
        while kill -0 $parent 2>/dev/null && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done
        exec {real} "$@"
        """))
    slow.chmod(0o755)
    ran = tmp_path / "ran"
    tag = uuid.uuid4().hex
    starter = textwrap.dedent(f"""\
        import os, subprocess, time
        from tvsmt.solving import lifeline
        argv, preexec = lifeline.spawn_args(["sh", "-c", "touch {ran}; exec sleep 60"])
        assert argv[0] == {str(slow)!r}, argv
        subprocess.Popen(argv, preexec_fn=preexec, start_new_session=True)
        while not os.path.exists({str(started)!r}):
            time.sleep(0.01)
        os._exit(0)
        """)
    env = dict(os.environ, PATH=f"{slow.parent}{os.pathsep}{os.environ['PATH']}",
               TVSMT_LIFELINE_TEST=tag)
    subprocess.run([sys.executable, "-c", starter], env=env, check=True, timeout=60)
    deadline = time.monotonic() + 8
    while _tagged(tag) and time.monotonic() < deadline:  # the slow setpriv, then the guard
        time.sleep(0.1)
    left = [command_line(p) or f"pid {p.pid}" for p in _tagged(tag)]
    for p in _tagged(tag):
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, left
    assert not ran.exists()


def test_a_solver_started_through_the_guard_gets_its_arguments_and_gives_its_exit_code():
    argv, preexec = lifeline.spawn_args(
        [sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)",
         "two words", "$HOME", "'quoted'", ""])
    out = subprocess.run(argv, preexec_fn=preexec, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == str(["two words", "$HOME", "'quoted'", ""])


def test_a_started_solver_is_killed_with_its_starter():
    tag = uuid.uuid4().hex
    starter = textwrap.dedent("""\
        import subprocess, sys, time
        from tvsmt.solving import lifeline
        argv, preexec = lifeline.spawn_args(["sleep", "60"])
        p = subprocess.Popen(argv, preexec_fn=preexec, start_new_session=True)
        print(p.pid, flush=True)
        time.sleep(60)
        """)
    env = dict(os.environ, TVSMT_LIFELINE_TEST=tag)
    proc = subprocess.Popen([sys.executable, "-c", starter], env=env, stdout=subprocess.PIPE,
                            text=True)
    solver = psutil.Process(int(proc.stdout.readline()))
    deadline = time.monotonic() + 15
    while "sleep" not in " ".join(solver.cmdline()[:1]) and time.monotonic() < deadline:
        time.sleep(0.05)  # past setpriv and the guard: the solver itself
    proc.kill()
    proc.wait()
    try:
        solver.wait(timeout=15)
    except psutil.TimeoutExpired:
        solver.kill()
        pytest.fail("the solver outlived its starter")


def test_a_sigterm_that_reaches_a_forked_worker_during_its_fork_ends_it():
    """A process pool stops its workers with SIGTERM and replaces a worker that died at
    once: a SIGTERM that reaches the replacement while it is still being set up (here: an
    at-fork hook that takes 0.5 s, registered before tvsmt's) must end it as soon as its
    set-up is done, never be taken by the command's own handler (or dropped) and leave a
    worker the pool waits for without end. The child reports whether it ran its own code."""
    script = textwrap.dedent("""\
        import os, signal, sys, time
        os.register_at_fork(after_in_child=lambda: time.sleep(0.5))  # a slow set-up
        from tvsmt.solving import lifeline
        with lifeline.activate(program=False):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, b"ran")  # the child's own code: never reached if it was ended
                time.sleep(3)
                os._exit(0)
            os.close(w)
            os.kill(pid, signal.SIGTERM)  # at once: the child is still in its hooks
            _, status = os.waitpid(pid, 0)
            blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        print(os.read(r, 16).decode() or "-", os.WIFSIGNALED(status)
              and os.WTERMSIG(status) == signal.SIGTERM, blocked)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # not run, ended by the SIGTERM, and SIGTERM not left blocked in the forking process
    assert out.stdout.split() == ["-", "True", "False"], (out.stdout, out.stderr)
