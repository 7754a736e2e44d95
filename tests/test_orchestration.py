"""Solver orchestration through `tvsmt verify` (issue 3): corpus, incremental runs, replay,
export, cvc5, crosscheck, solver profiles as data, the Dask backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import fake_solver_profile, fixture_pair
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.frontends import write_pair_dicts
from tvsmt.solving.corpus import Corpus, split_header
from tvsmt.solving.profiles import find_binary, get_profile
from tvsmt.verify import Options, verify_pair


@pytest.fixture
def mlp_pair(tmp_path):
    return write_pair_dicts(tmp_path / "mlp-dp2tp2", single_mlp(), parallel_mlp())


@pytest.fixture
def buggy_pair(tmp_path):
    return write_pair_dicts(tmp_path / "mlp-bug", single_mlp(),
                            parallel_mlp(wrong_const_rank=2))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_corpus_incremental_fresh_and_replay(tmp_path, mlp_pair):
    corpus = tmp_path / "corpus"
    first = tmp_path / "r1.json"
    r = run("verify", *mlp_pair, "--corpus", corpus, "--report", first)
    assert r.exit_code == 0, r.output
    rep1 = json.loads(first.read_text())
    files = sorted(corpus.glob("*.smt2"))
    assert len(files) == rep1["obligations_unique"] > 0
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest  # stage -> digest and verdicts
    for f in files:  # file name = sha256 of the body; header records the stages
        meta, body = split_header(f.read_text())
        import hashlib
        assert hashlib.sha256(body.encode()).hexdigest() == f.stem
        assert meta["stages"]
    second = tmp_path / "r2.json"
    r = run("verify", *mlp_pair, "--corpus", corpus, "--report", second)
    assert r.exit_code == 0
    assert json.loads(second.read_text())["cache_hits"] == rep1["obligations_unique"]
    third = tmp_path / "r3.json"
    r = run("verify", *mlp_pair, "--corpus", corpus, "--report", third, "--fresh")
    assert json.loads(third.read_text())["cache_hits"] == 0
    assert not list(corpus.glob("*.tmp")) and not list(corpus.glob(".*tmp*"))

    r = run("replay", corpus)
    assert r.exit_code == 0, r.output
    assert "0 differ" in r.output
    # edit one obligation: replay must notice the hash no longer matches the name
    victim = files[0]
    victim.write_text(victim.read_text().replace("(check-sat)", "(assert false)\n(check-sat)"))
    r = run("replay", corpus)
    assert r.exit_code != 0
    assert "DAMAGED" in r.output and victim.stem[:16] in r.output


def test_violation_verdicts_are_cached_too(tmp_path, buggy_pair):
    corpus = tmp_path / "c"
    out1, out2 = tmp_path / "1.json", tmp_path / "2.json"
    assert run("verify", *buggy_pair, "--corpus", corpus, "--report", out1).exit_code == 1
    assert run("verify", *buggy_pair, "--corpus", corpus, "--report", out2).exit_code == 1
    a, b = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert b["cache_hits"] > 0
    assert a["failures"][0]["counterexample"] == b["failures"][0]["counterexample"]


def test_export_writes_files_that_stock_solvers_accept(tmp_path, buggy_pair):
    corpus = tmp_path / "exported"
    r = run("export", *buggy_pair, "--corpus", corpus)
    assert r.exit_code == 0, r.output
    files = sorted(corpus.glob("*.smt2"))
    assert files
    assert not Corpus(corpus).verdicts  # nothing solved
    z3 = find_binary(get_profile("z3"))
    answers = []
    for f in files:
        _, body = split_header(f.read_text())
        plain = tmp_path / "plain.smt2"
        plain.write_text(body)
        z = subprocess.run([z3, str(plain)], capture_output=True, text=True, timeout=60)
        c = subprocess.run([sys.executable, "-m", "tvsmt.solving.cvc5_shim", str(plain)],
                           capture_output=True, text=True, timeout=60)
        assert "(error" not in z.stdout + c.stdout, (f, z.stdout, c.stdout)
        assert z.stdout.split()[0] == c.stdout.split()[0] in ("sat", "unsat")
        answers.append(z.stdout.split()[0])
    assert "sat" in answers and "unsat" in answers  # the bug is in some obligation


@pytest.mark.parametrize("flags", [["--solver", "cvc5"], ["--crosscheck"]])
@pytest.mark.parametrize("name,code", [("mlp-ly2-dp2pp2tp2mb2", 0),
                                       ("llama3-ly2-dp2pp2tp2mb2", 0),
                                       ("br0-llama3-ly1-dp2pp2tp2mb2", 1)])
def test_fixture_verdicts_with_cvc5_and_crosscheck(name, code, flags):
    single, parallel = fixture_pair(name)
    r = run("verify", single, parallel, "--no-corpus", *flags)
    assert r.exit_code == code, r.output


@pytest.mark.parametrize("flags", [["--solver", "cvc5"], ["--crosscheck"]])
def test_handmade_bug_with_cvc5_and_crosscheck(buggy_pair, flags):
    r = run("verify", *buggy_pair, "--no-corpus", *flags)
    assert r.exit_code == 1, r.output


def test_a_lying_solver_never_makes_a_buggy_plan_pass(tmp_path, buggy_pair):
    """A profile is all it takes to add a solver, so a broken one is easy to add too. One that
    answers `unsat` to everything must not prove a buggy plan: every proven stage is also
    evaluated at random concrete inputs, and a mismatch next to an `unsat` is a solver
    failure (inconclusive, exit 3), never a pass."""
    prof = fake_solver_profile(tmp_path, "liar", "unsat")
    out = tmp_path / "r.json"
    r = run("verify", *buggy_pair, "--no-corpus", "--solver", str(prof), "--report", out)
    assert r.exit_code != 0, r.output
    assert r.exit_code == 3, r.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "inconclusive"
    assert data["stages_proven"] < data["stages_total"]
    # the stage the bug breaks (hs = h / const on rank 2) is the one the liar got wrong: a
    # solver failure (the policy's inconclusive kind for an unsat the evaluation contradicts)
    assert any(f["kind"] == "solver-failure" and f["tensor"] == "hs"
               for f in data["failures"]), data["failures"]


def _liar_as(tmp_path, name: str, answer: str) -> dict:
    """An environment in which the solver profile `name` is a liar that always prints
    `answer` (TVSMT_SOLVERS_DIR is searched before the built-in profiles)."""
    import os

    folder = tmp_path / "profiles"
    folder.mkdir()
    fake_solver_profile(folder, name, answer)
    return {"TVSMT_SOLVERS_DIR": str(folder) + os.pathsep + os.environ.get(
        "TVSMT_SOLVERS_DIR", "")}


def test_crosscheck_catches_a_solver_that_proves_anything(tmp_path, buggy_pair, monkeypatch):
    """--crosscheck through the verify policy: with cvc5 replaced by a liar that answers
    `unsat` to everything, z3's `sat` is a disagreement, and the buggy plan is not a pass."""
    for k, v in _liar_as(tmp_path, "cvc5", "unsat").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "r.json"
    r = run("verify", *buggy_pair, "--no-corpus", "--crosscheck", "--report", out)
    assert r.exit_code == 1, r.output  # z3's counterexample, checked on the plan, stands
    data = json.loads(out.read_text())
    assert data["verdict"] == "violation"
    judged = [f for f in data["failures"] if f["solver"]]
    assert judged and any("disagree" in (f["solver"]["message"] or "") for f in judged), judged
    # the same policy through the API
    report = verify_pair(*buggy_pair, Options(jobs=1, crosscheck=True))
    assert report.verdict == "violation"


def test_crosscheck_never_passes_on_one_solver_alone(tmp_path, mlp_pair, monkeypatch):
    """A correct plan with cvc5 replaced by a solver that never proves anything (`unknown`):
    z3's `unsat` alone is not a pass (inconclusive, exit 3), and not a violation either."""
    for k, v in _liar_as(tmp_path, "cvc5", "unknown").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "r.json"
    r = run("verify", *mlp_pair, "--no-corpus", "--crosscheck", "--report", out)
    assert r.exit_code == 3, r.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "inconclusive" and data["stages_proven"] < data["stages_total"]
    assert all(f["kind"] == "inconclusive" for f in data["failures"])
    assert any("cvc5 says unknown" in f["message"] for f in data["failures"])


def test_dask_backend_gives_the_same_verdicts(mlp_pair, buggy_pair):
    distributed = pytest.importorskip("distributed")
    local = [verify_pair(*pair, Options(jobs=2)).verdict for pair in (mlp_pair, buggy_pair)]
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        remote = [verify_pair(*pair, Options(backend="dask",
                                             scheduler=cluster.scheduler_address)).verdict
                  for pair in (mlp_pair, buggy_pair)]
    assert remote == local == ["equivalent", "violation"]


def test_solver_timeout_is_inconclusive_never_a_pass(tmp_path, mlp_pair):
    import psutil

    prof = fake_solver_profile(tmp_path, "sleepy", "unsat")
    script = tmp_path / "sleepy_solver.py"
    script.write_text("import time\ntime.sleep(30)\nprint('unsat')\n")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    r = run("verify", *mlp_pair, "--no-corpus", "--solver", prof, "--timeout", "0.5",
            "--report", tmp_path / "r.json")
    assert r.exit_code == 3, r.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "inconclusive"
    assert data["stages_inconclusive"] > 0
    assert all(f["kind"] == "inconclusive" for f in data["failures"])
    assert any("timeout" in f["message"] for f in data["failures"])
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if psutil.pid_exists(p)
                and "sleepy" in " ".join(psutil.Process(p).cmdline())]


def test_an_obligation_refuted_at_concrete_points_gets_a_short_solver_budget(
        tmp_path, buggy_pair, monkeypatch):
    """Where random concrete points already show a difference, only `unsat` could change the
    outcome (to a solver failure): such an obligation gets the policy's short budget, and a
    solver that never answers leaves it a violation. Every other obligation keeps the run's
    timeout (here they end inconclusive: the solver never answers). A budget cut short on
    purpose says nothing of the obligation: the corpus does not record it."""
    import tvsmt.policy

    monkeypatch.setattr(tvsmt.policy, "REFUTED_BUDGET_S", 0.5)
    prof = fake_solver_profile(tmp_path, "sleepy", "sat")
    (tmp_path / "sleepy_solver.py").write_text("import time\ntime.sleep(30)\nprint('sat')\n")
    out, corpus = tmp_path / "r.json", tmp_path / "corpus"
    r = run("verify", *buggy_pair, "--corpus", corpus, "--solver", prof, "--timeout", "1.5",
            "--jobs", "4", "--report", out)
    assert r.exit_code == 1, r.output
    data = json.loads(out.read_text())
    failures = data["failures"]
    digest = {st[0]: st[4] for st in data["stages"]}
    recorded = Corpus(corpus).verdicts
    for f in failures:
        got = recorded.get(digest[f["stage"]], {}).get("sleepy")
        if f["kind"] == "counterexample":
            assert got is None, got
        else:
            assert got is not None and got["status"] == "timeout", (f, got)
    budget = "killed after 0.5 s, the budget of an obligation that concrete points already refute"
    refuted = [f for f in failures if f["kind"] == "counterexample"]
    assert [f["tensor"] for f in refuted] == ["hs"], failures
    assert budget in refuted[0]["message"] and budget in refuted[0]["solver"]["message"]
    others = [f for f in failures if f["kind"] != "counterexample"]
    assert others and all(f["kind"] == "inconclusive" and "killed after 1.5 s" in f["message"]
                          and "budget" not in f["message"] for f in others), others


def test_crosscheck_policy_pass_needs_every_solver_counterexample_stands_alone():
    from tvsmt.solving.runner import reconcile
    from tvsmt.solving.types import SolverResult
    from tvsmt.verify import _both_must_prove

    z3u, z3s = SolverResult("unsat", "z3"), SolverResult("sat", "z3", values={"x0": 1})
    cu, ct = SolverResult("unsat", "cvc5"), SolverResult("timeout", "cvc5")
    assert _both_must_prove(reconcile([z3u, cu])).status == "unsat"
    one_sided = _both_must_prove(reconcile([z3u, ct]))
    assert one_sided.status == "unknown" and "cvc5 says timeout" in one_sided.message
    assert _both_must_prove(reconcile([z3s, ct])).status == "sat"  # checked later, on the plan
    assert _both_must_prove(reconcile([z3s, cu])).status == "unknown"  # disagreement


def test_crosscheck_finds_every_zoo_bug_the_single_solver_finds(tmp_path):
    from tvsmt.frontends import generate_pair
    from tvsmt.frontends.mutations import apply

    single, parallel = generate_pair("llama3", layers=2, dp=2, tp=2, pp=2, mb=2,
                                     hidden=16, heads=4, ffn=32, vocab=16, seq=4)
    for bug in ("bw-wrong-input", "swap-bw-outputs", "wrong-constant-one-rank"):
        broken, _ = apply(parallel, bug)
        paths = write_pair_dicts(tmp_path / bug, single, broken)
        r = run("verify", *paths, "--no-corpus", "--crosscheck")
        assert r.exit_code == 1, (bug, r.output)


def test_without_a_solver_answer_evaluation_still_finds_a_real_bug(tmp_path, mlp_pair,
                                                                    buggy_pair):
    """A solver that only says `unknown`: the correct plan is inconclusive (never a pass), the
    buggy one is a violation found by evaluating both plans at concrete inputs."""
    prof = fake_solver_profile(tmp_path, "shrug", "unknown")
    good = run("verify", *mlp_pair, "--no-corpus", "--solver", prof)
    assert good.exit_code == 3, good.output
    report = tmp_path / "bad.json"
    bad = run("verify", *buggy_pair, "--no-corpus", "--solver", prof, "--report", report)
    assert bad.exit_code == 1, bad.output
    failures = json.loads(report.read_text())["failures"]
    found = [f for f in failures if f["kind"] == "counterexample"]
    assert found and found[0]["counterexample"]["found_by"] == "evaluation"
    assert "n2@2" in [n["id"] for n in found[0]["parallel_nodes"]]


def test_cli_usage_errors_are_one_line_exit_2(tmp_path, mlp_pair):
    r = run("verify", *mlp_pair, "--crosscheck", "--solver", "cvc5")
    assert r.exit_code == 2 and "takes no --solver" in r.output and "Traceback" not in r.output
    r = run("verify", *mlp_pair, "--solver", "nosuchsolver")
    assert r.exit_code == 2 and "unknown solver" in r.output
    r = run("verify", *mlp_pair, "--backend", "dask")
    assert r.exit_code == 2 and "--scheduler" in r.output
    (tmp_path / "empty").mkdir()
    r = run("replay", tmp_path / "empty")
    assert r.exit_code == 2 and "not a tvsmt corpus" in r.output
    (tmp_path / "empty" / "manifest.json").write_text("{broken")
    r = run("replay", tmp_path / "empty")
    assert r.exit_code == 2 and "manifest.json" in r.output


def test_more_input_errors_are_one_line_exit_2(tmp_path, mlp_pair):
    r = run("verify", *mlp_pair, "--no-corpus", "--report", tmp_path / "no" / "dir" / "r.json")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = run("report", mlp_pair[0])  # a plan, not a report
    assert r.exit_code == 2 and "cannot read report" in r.output
    r = run("plan", "mutate", tmp_path / "nothing", "--bug", "wrong-group", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "no such file" in r.output
    r = run("plan", "generate", "--model", "llama3", "--tp", "3", "-o", tmp_path / "g")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_replay_names_a_verdict_changed_outside_tvsmt(tmp_path, mlp_pair):
    """A hand-edited verdict in the manifest (status kept, so the statuses still agree) is
    listed as unsealed and replay fails: the corpus can no longer be trusted."""
    corpus = tmp_path / "corpus"
    assert run("verify", *mlp_pair, "--corpus", corpus).exit_code == 0
    assert run("replay", corpus).exit_code == 0
    path = corpus / "manifest.json"
    manifest = json.loads(path.read_text())
    digest, per_solver = next(iter(manifest["verdicts"].items()))
    per_solver["z3"]["seconds"] = 0.001  # any change outside tvsmt breaks the seal
    path.write_text(json.dumps(manifest))
    r = run("replay", corpus)
    assert r.exit_code == 1, r.output
    assert f"UNSEALED {digest[:16]}" in r.output and "z3" in r.output
    assert "0 differ" in r.output
