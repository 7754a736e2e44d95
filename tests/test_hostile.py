"""Hostile input outside the plan reader (issue 9 items 7 and 9): options, ids and file names
that reach the terminal, huge dimensions, and the exit code of every kind of failure."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import handmade
import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main

FORBIDDEN = ("Traceback", "\x1b")  # no traceback, no raw terminal escape, anywhere


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def write_pair(folder, single=None, parallel=None, name="p"):
    s, p = folder / f"{name}_single.json", folder / f"{name}_parallel.json"
    s.write_text(json.dumps(single or single_mlp()))
    p.write_text(json.dumps(parallel or parallel_mlp(dp=1, tp=2)))
    return s, p


def rename_node(plan: dict, old: str, new: str) -> dict:
    (node,) = [n for n in plan["nodes"] if n["id"] == old]
    node["id"] = new
    return plan


def one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tvsmt: "), result.stderr
    assert not any(f in result.output for f in FORBIDDEN), result.output
    return lines[0]


# --- --timeout -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "-0.5", "abc", ""])
def test_timeout_that_is_not_a_finite_non_negative_number_is_a_usage_error(tmp_path, value):
    s, p = write_pair(tmp_path)
    r = run("verify", s, p, "--no-corpus", "--timeout", value)
    assert r.exit_code == 2, r.output
    assert "--timeout" in r.stderr and "Traceback" not in r.output


def test_timeout_zero_means_no_limit_and_says_so(tmp_path):
    assert "0 for no limit" in " ".join(run("verify", "--help").output.split())
    s, p = write_pair(tmp_path)
    r = run("verify", s, p, "--no-corpus", "--jobs", "1", "--timeout", "0")
    assert r.exit_code == 0 and "equivalent" in r.output, r.output


def test_jobs_below_one_is_a_usage_error(tmp_path):
    s, p = write_pair(tmp_path)
    r = run("verify", s, p, "--no-corpus", "--jobs", "0")
    assert r.exit_code == 2 and "--jobs" in r.stderr, r.output


# --- --backend dask --scheduler ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_scheduler_where_nothing_listens_is_one_line_in_seconds(tmp_path):
    s, p = write_pair(tmp_path)
    t0 = time.monotonic()
    r = run("verify", s, p, "--no-corpus", "--backend", "dask", "--scheduler",
            f"tcp://127.0.0.1:{_free_port()}")
    line = one_line_error(r)
    assert time.monotonic() - t0 < 10
    assert "cannot reach the Dask scheduler" in line


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64])
def test_scheduler_address_that_accepts_but_is_no_scheduler(tmp_path, reply):
    """A proxy or firewall that accepts every connection and never answers (or answers
    something else) must not hang the run for distributed's 30 s connect timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if reply:
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    s, p = write_pair(tmp_path)
    try:
        t0 = time.monotonic()
        r = run("verify", s, p, "--no-corpus", "--backend", "dask", "--scheduler",
                f"tcp://127.0.0.1:{server.getsockname()[1]}")
        line = one_line_error(r)
        assert time.monotonic() - t0 < 10
        assert "no Dask scheduler answered" in line
    finally:
        server.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("address", ["tcp://[::1", "tcp://host:notaport", "inproc://abc"])
def test_unparsable_scheduler_address_is_a_usage_error(tmp_path, address):
    s, p = write_pair(tmp_path)
    r = run("verify", s, p, "--no-corpus", "--backend", "dask", "--scheduler", address)
    assert r.exit_code == 2 and "--scheduler" in r.stderr and "Traceback" not in r.output


def test_scheduler_without_dask_backend_is_a_usage_error(tmp_path):
    s, p = write_pair(tmp_path)
    r = run("verify", s, p, "--no-corpus", "--scheduler", "tcp://127.0.0.1:8786")
    assert r.exit_code == 2 and "--backend dask" in r.stderr


def test_probe_accepts_a_real_scheduler_and_refuses_a_worker():
    distributed = pytest.importorskip("distributed")
    from tvsmt.cli_checks import probe_scheduler
    from tvsmt.errors import InputError

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  protocol="tcp://", host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        probe_scheduler(cluster.scheduler_address)  # no error
        (worker,) = cluster.scheduler_info["workers"]
        with pytest.raises(InputError, match="is not a Dask scheduler"):
            probe_scheduler(worker)


# --- ids, file names and messages that reach the terminal --------------------------------------

def _buggy_pair_with_parallel_node_named(tmp_path, new_id):
    """A violation whose localized parallel node (n2@0, the wrong constant) has `new_id`."""
    parallel = rename_node(parallel_mlp(dp=1, tp=2, wrong_const_rank=0), "n2@0", new_id)
    return write_pair(tmp_path, parallel=parallel)


@pytest.mark.parametrize("node_id", ["n2[/]@0", "layers[i].n2@0", "[bold red]n2[/bold red]",
                                     "n2:smile:@0", "n2\\[x]"])
def test_rich_markup_in_ids_is_shown_literally_and_the_report_is_written(tmp_path, node_id):
    s, p = _buggy_pair_with_parallel_node_named(tmp_path, node_id)
    out = tmp_path / "report.json"
    r = run("verify", s, p, "--no-corpus", "--jobs", "1", "--report", out)
    assert r.exit_code == 1, r.output
    assert f"parallel nodes: {node_id} (div)" in r.output
    saved = json.loads(out.read_text())
    assert any(n["id"] == node_id for f in saved["failures"] for n in f["parallel_nodes"])
    again = run("report", out)  # re-rendering the saved report shows the same
    assert again.exit_code == 1 and f"parallel nodes: {node_id} (div)" in again.output


@pytest.mark.parametrize("node_id,shown", [
    ("evil\x1b[2J\x1b[31mred\nforged line", "evil\\x1b[2J\\x1b[31mred\\nforged line"),
    ("bidi\u202egnp.exe", "bidi\\u202egnp.exe"),
    ("tab\there\rback", "tab\\there\\rback"),
])
def test_terminal_escapes_and_newlines_in_ids_are_escaped(tmp_path, node_id, shown):
    s, p = _buggy_pair_with_parallel_node_named(tmp_path, node_id)
    r = run("verify", s, p, "--no-corpus", "--jobs", "1")
    assert r.exit_code == 1
    assert f"parallel nodes: {shown} (div)" in r.output, r.output
    assert "\x1b" not in r.output and "\u202e" not in r.output
    assert not any(line.startswith("forged line") for line in r.output.splitlines())


def test_lone_surrogate_in_an_id_is_an_input_error(tmp_path):
    """JSON syntax allows "\\ud800", but it is no Unicode text (printed raw it makes writing
    to a UTF-8 stdout fail): the reader refuses it, one line naming the file, exit 2."""
    s, p = _buggy_pair_with_parallel_node_named(tmp_path, "PLACEHOLDER")
    p.write_text(p.read_text().replace("PLACEHOLDER", "n2\\ud800@0"))
    proc = subprocess.run([sys.executable, "-m", "tvsmt.cli", "verify", str(s), str(p),
                           "--no-corpus", "--jobs", "1"], capture_output=True, timeout=120,
                          env={"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.decode("utf-8").strip().splitlines()
    assert len(lines) == 1 and str(p) in lines[0] and "surrogate" in lines[0]
    assert b"Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["no\nsuch\x1b[31m.json", "[/]missing.json"])
def test_file_names_in_errors_stay_on_one_line_and_literal(tmp_path, name):
    s, _ = write_pair(tmp_path)
    r = run("verify", s, tmp_path / name, "--no-corpus")
    line = one_line_error(r)
    assert "no such file" in line
    assert ("no\\nsuch\\x1b[31m.json" in line) if "\n" in name else ("[/]missing.json" in line)


@pytest.mark.parametrize("args", [["verify", "--no-such-option"], ["verify"], ["nosuch"],
                                  ["plan", "generate", "--layers", "x"], ["check", "--bogus", "s.py"]])
def test_click_usage_errors_are_one_line_exit_2(args):
    line = one_line_error(run(*args))
    assert line.startswith("tvsmt: usage: ") and "--help" in line


def test_plan_generate_prints_its_output_folder_escaped(tmp_path):
    out = tmp_path / "a\x1b[2Jb"
    r = run("plan", "generate", "--layers", "1", "-o", out)
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "a\\x1b[2Jb" in r.output


def test_ids_in_input_errors_stay_on_one_line(tmp_path):
    parallel = parallel_mlp(dp=1, tp=2)
    parallel["nodes"][0]["op"] = "no_such_op"
    parallel["nodes"][0]["id"] = "bad\nid\x1b[0m"
    s, p = write_pair(tmp_path, parallel=parallel)
    line = one_line_error(run("verify", s, p, "--no-corpus"))
    assert "bad\\nid\\x1b[0m" in line and "no_such_op" in line


def test_textsafe_plain_keeps_ordinary_text_and_escapes_the_rest():
    from tvsmt.textsafe import markup, plain

    assert plain("t12v1@r0m-1 layers.0/ü") == "t12v1@r0m-1 layers.0/ü"
    assert plain("a\nb\x00c\x7f\u2028") == "a\\nb\\x00c\\x7f\\u2028"
    assert markup("x[/]") == "x\\[/]"


# --- huge dimensions ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2**54, 2**70, 2**61 - 1, 34359738337 * 34359738319,
                               2**70 * 3**70, 10**4000 + 1])
def test_divisors_of_huge_dimensions_are_quick_and_true(n):
    from tvsmt.shapes.dims import _divisors

    _divisors.cache_clear()
    t0 = time.perf_counter()
    divs = _divisors(n)
    assert time.perf_counter() - t0 < 5
    assert divs[0] == 1 and all(n % d == 0 for d in divs)
    assert list(divs) == sorted(set(divs))
    if n < 2**128:
        assert n in divs  # fully factored: the largest reduction stays available


def test_divisors_of_ordinary_sizes_are_all_of_them():
    from tvsmt.shapes.dims import _divisors

    from sympy import divisors

    for n in (1, 2, 12, 4096, 65536 * 3):
        assert list(_divisors(n)) == [k for k in range(1, n + 1) if n % k == 0]
    for n in (128256, 2**24 - 2, 2**24 + 6, 2**40 * 3 * 5 * 7):  # both sides of the switch
        assert list(_divisors(n)) == divisors(n)


def _huge_batch_pair(tmp_path, monkeypatch, batch, **bug):
    monkeypatch.setattr(handmade, "B", batch)
    return write_pair(tmp_path, single_mlp(), parallel_mlp(dp=2, tp=2, **bug),
                      name="bug" if bug else "ok")


@pytest.mark.parametrize("batch", [2**52, 2**53, 3 * 2**51])
def test_batch_near_2_pow_53_verifies_and_still_finds_the_bug(tmp_path, monkeypatch, batch):
    """Sizes up to 2**53 (a JSON number is exact up to there; larger ones are the reader's
    to refuse). Trying every number up to the square root took minutes here."""
    s, p = _huge_batch_pair(tmp_path, monkeypatch, batch)
    r = run("verify", s, p, "--no-corpus", "--jobs", "1")
    assert r.exit_code == 0 and "verdict: equivalent" in r.output, r.output
    s, p = _huge_batch_pair(tmp_path, monkeypatch, batch, wrong_const_rank=1)
    r = run("verify", s, p, "--no-corpus", "--jobs", "1")
    assert r.exit_code == 1 and "verdict: violation" in r.output, r.output


def test_dimension_that_cannot_be_reduced_is_inconclusive_not_a_crash(tmp_path, monkeypatch):
    """Batch 2p with p prime near 2**51 on 2 replicas: each replica's rows (p) admit no
    divisor, so the reduced stage is still enormous: inconclusive (exit 3), never a pass."""
    from sympy import prevprime

    s, p = _huge_batch_pair(tmp_path, monkeypatch, 2 * prevprime(2**51))
    r = run("verify", s, p, "--no-corpus", "--jobs", "1")
    assert r.exit_code == 3 and "verdict: inconclusive" in r.output, r.output
    assert "too large to encode" in " ".join(r.output.split())


# --- exit codes -----------------------------------------------------------------------------------

def test_help_documents_every_exit_code():
    for args in ([], ["verify"], ["export"], ["report"], ["replay"]):
        text = run(*args, "--help").output
        for code, word in ((0, "equivalent"), (1, "violation"), (2, "input error"),
                           (3, "inconclusive"), (4, "internal error")):
            assert f"{code}  {word}" in text, (args, code, text)


def test_internal_error_is_one_line_and_exit_4(tmp_path, monkeypatch):
    import tvsmt.verify
    from tvsmt.errors import InternalError

    def broken(*_a, **_k):
        raise InternalError("while executing node n1: shape rule crashed")

    monkeypatch.setattr(tvsmt.verify, "verify_pair", broken)
    s, p = write_pair(tmp_path)
    assert "internal error" in one_line_error(run("verify", s, p, "--no-corpus"), code=4)


def test_unexpected_exception_is_an_internal_error_not_a_traceback(tmp_path, monkeypatch):
    import tvsmt.verify

    def broken(*_a, **_k):
        return [][1]

    monkeypatch.setattr(tvsmt.verify, "verify_pair", broken)
    s, p = write_pair(tmp_path)
    line = one_line_error(run("verify", s, p, "--no-corpus"), code=4)
    assert "internal error (IndexError" in line and "bug in tvsmt" in line
    r = run("verify", s, p, "--no-corpus", env={"TVSMT_DEBUG": "1"})
    assert isinstance(r.exception, IndexError)  # the traceback is there for whoever asks


def test_export_exit_codes(tmp_path):
    s, p = write_pair(tmp_path)
    r = run("export", s, p, "--corpus", tmp_path / "c1")
    assert r.exit_code == 0, r.output
    underivable = parallel_mlp(dp=1, tp=2)
    del underivable["lineages"][0]  # x@r: graph inputs that nothing relates to the single x
    s, p = write_pair(tmp_path, parallel=underivable, name="b")
    r = run("export", s, p, "--corpus", tmp_path / "c2")
    assert r.exit_code == 1 and "not exported: structural" in r.stderr, r.output
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    one_line_error(run("export", s, broken, "--corpus", tmp_path / "c3"), code=2)


def test_report_command_exit_codes_follow_the_verdict(tmp_path):
    s, p = write_pair(tmp_path)
    out = tmp_path / "r.json"
    assert run("verify", s, p, "--no-corpus", "--jobs", "1", "--report", out).exit_code == 0
    data = json.loads(out.read_text())
    for verdict, code in (("equivalent", 0), ("violation", 1), ("inconclusive", 3),
                          ("error", 3)):
        out.write_text(json.dumps({**data, "verdict": verdict}))
        assert run("report", out).exit_code == code, verdict


@pytest.mark.parametrize("damage", [
    {"verdict": "bogus"}, {"verdict": None}, {"failures": [{"kind": "x"}]},
    {"failures": [{"kind": "x", "message": 5}]}, {"failures": "x"}, {"failures": [7]},
    {"failures": [{"kind": "x", "message": "m", "slice": [[0, "a"]]}]},
    {"fold": {"replicas": 2}}, {"stages_total": "many"}, {"timings": {"load": "slow"}},
    {"failures": [{"kind": "x", "message": "m", "parallel_nodes": [{"op": "div"}]}]},
])
def test_damaged_report_is_an_input_error(tmp_path, damage):
    s, p = write_pair(tmp_path)
    out = tmp_path / "r.json"
    assert run("verify", s, p, "--no-corpus", "--jobs", "1", "--report", out).exit_code == 0
    out.write_text(json.dumps({**json.loads(out.read_text()), **damage}))
    line = one_line_error(run("report", out), code=2)
    assert str(out) in line


@pytest.mark.parametrize("damage, why", [
    ({"failures": [{"kind": "counterexample", "message": "x differs"}]}, "lists 1 failure"),
    ({"stages_proven": 0}, "proves 0 of"),
    ({"stages_total": 0, "stages_proven": 0}, "proves no stage"),
    ({"stages_inconclusive": 1}, "stages"),
])
def test_a_report_that_contradicts_its_pass_is_never_shown_as_one(tmp_path, damage, why):
    """`tvsmt report` of a report that says equivalent while recording a failure or a stage
    not proven (edited, or pieced together): exit 2, never 0."""
    s, p = write_pair(tmp_path)
    out = tmp_path / "r.json"
    assert run("verify", s, p, "--no-corpus", "--jobs", "1", "--report", out).exit_code == 0
    assert run("report", out).exit_code == 0
    out.write_text(json.dumps({**json.loads(out.read_text()), **damage}))
    line = one_line_error(run("report", out), code=2)
    assert "inconsistent report" in line and why in line, line


def test_a_folded_runs_report_reads_back_as_it_was_written(tmp_path):
    from tvsmt.frontends import write_pair as generate

    s, p = generate(tmp_path / "p", "llama3", layers=2, dp=4, mb=4, heads=2, hidden=16,
                    ffn=16, vocab=16, seq=4)
    out = tmp_path / "r.json"
    r = run("verify", s, p, "--no-corpus", "--jobs", "1", "--report", out)
    assert r.exit_code == 0 and json.loads(out.read_text())["fold"] is not None, r.output
    assert run("report", out).exit_code == 0


def test_replay_of_something_that_is_not_a_folder_is_an_input_error():
    line = one_line_error(run("replay", "/dev/null"))
    assert "/dev/null" in line and "not a folder" in line
