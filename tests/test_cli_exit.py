"""How the `tvsmt` command ends (tvsmt/heap.py `end_process`, tvsmt/cli.py).

Run as a program, a command ends its process without the interpreter's teardown and without
freeing the plans it loaded (`leave_to_exit`): what `atexit` registered still runs, the
output is complete, the exit code is the command's. Called from Python (click's CliRunner,
a library caller), nothing of this happens: the plans are freed as usual. A reader of the
output that goes away ends the command quietly with 141."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt import heap
from tvsmt.cli import main
from tvsmt.frontends import write_pair_dicts
from tvsmt.frontends.mutations import apply


def _python(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=120, check=False, **kw)


class _Thing:
    pass


def test_a_library_caller_frees_what_is_left_to_exit():
    assert heap._left_to_exit is None  # no command of this process ends it
    thing = _Thing()
    gone = weakref.ref(thing)
    heap.leave_to_exit(thing)
    del thing
    gc.collect()
    assert gone() is None


def test_a_command_keeps_what_is_left_to_exit_and_ends_with_its_code():
    code = """if True:
        import atexit, gc, sys, weakref
        from tvsmt import heap
        class Thing: pass
        atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))
        heap.end_quickly()
        thing = Thing(); kept = weakref.ref(thing)
        heap.leave_to_exit(thing); del thing; gc.collect()
        print("kept" if kept() is not None else "freed")
        print("unflushed", end="")  # end_process flushes it
        heap.end_process(int(sys.argv[1]))
        print("not reached")
    """
    run = _python(code, "3")
    assert run.returncode == 3, run.stderr
    assert run.stdout == "kept\nunflushed"
    assert "atexit ran" in run.stderr
    message = _python("from tvsmt import heap; heap.end_process('gave up')")
    assert message.returncode == 1 and message.stderr.strip() == "gave up"


def test_a_running_thread_gets_the_ordinary_exit():
    code = """if True:
        import threading, time
        from tvsmt import heap
        t = threading.Thread(target=time.sleep, args=(0.5,)); t.start()
        heap.end_process(5)
        print("returned")
    """
    run = _python(code)
    assert run.stdout.strip() == "returned" and run.returncode == 0, run.stderr


def test_the_command_line_output_report_and_code_survive_the_quick_end(tmp_path):
    """`python -m tvsmt verify` on a pair with a violation ends through `end_process`: the
    report file, stdout and the exit code are those of the same command run by CliRunner."""
    broken, _ = apply(parallel_mlp(dp=2, tp=2), "drop-allreduce-keep-dataflow")
    single, bad = write_pair_dicts(tmp_path / "bad", single_mlp(), broken)
    report = tmp_path / "r.json"
    env = dict(os.environ, TVSMT_PROGRESS="")
    run = subprocess.run([sys.executable, "-m", "tvsmt", "verify", single, bad,
                          "--no-corpus", "--report", str(report), "-j", "1"], check=False,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 1, run.stderr
    assert json.loads(report.read_text())["verdict"] == "violation"
    assert f"report written to {report}" in run.stdout
    same = CliRunner().invoke(main, ["verify", single, bad, "--no-corpus", "-j", "1"])
    assert same.exit_code == 1
    assert same.output.splitlines()[0] == run.stdout.splitlines()[0]


@pytest.mark.parametrize("args", [["plan", "bugs"], ["--version"], ["--help"]])
def test_output_that_cannot_be_written_is_one_line_never_a_traceback(args):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system (a device every write to fails: ENOSPC)")
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "tvsmt", *args], stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert run.returncode == 2
    assert run.stderr == "tvsmt: error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args", [["plan", "bugs"], ["--version"]])
def test_a_reader_gone_before_any_output_ends_the_command_quietly(args):
    """A command ends with 141; --version and --help are click's own, which ends them with 1
    (quietly too)."""
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run([sys.executable, "-m", "tvsmt", *args], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (1 if args == ["--version"] else 141, "")


@pytest.mark.parametrize("closed", [1, 2])
def test_a_command_started_with_a_standard_stream_closed_keeps_its_exit_code(tmp_path, closed):
    """Started with stdout or stderr closed (a daemon's way), the verdict's exit code stands:
    0 for an equivalent pair, 1 for a violation, 2 for a missing file; nothing crashes."""
    ok = write_pair_dicts(tmp_path / "ok", single_mlp(), parallel_mlp(dp=2, tp=2))
    broken, _ = apply(parallel_mlp(dp=2, tp=2), "drop-allreduce-keep-dataflow")
    bad = write_pair_dicts(tmp_path / "bad", single_mlp(), broken)
    for pair, code in ((ok, 0), (bad, 1), ((ok[0], str(tmp_path / "missing.json")), 2)):
        run = subprocess.run([sys.executable, "-m", "tvsmt", "verify", *pair, "--no-corpus",
                              "-j", "1"], preexec_fn=lambda: os.close(closed), cwd=tmp_path,
                             capture_output=False, stdin=subprocess.DEVNULL, timeout=300,
                             check=False)
        assert run.returncode == code, pair
