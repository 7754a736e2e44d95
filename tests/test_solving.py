"""Solving phase: profiles, runner (z3 + cvc5 as external processes), crosscheck, corpus, replay.

Real solvers, small hand-made QF_UFNRA scripts; only tvsmt.solving.* and tvsmt.errors are used,
except in the last section (the command line's solver choice, and an installed package).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
import time
import uuid
from fractions import Fraction

import psutil
import pytest
from processes import tagged

from tvsmt.errors import PlanError
from tvsmt.solving import corpus as corpus_mod
from tvsmt.solving.corpus import Corpus, digest_of, split_header
from tvsmt.solving.profiles import (
    ProfileError,
    available_solvers,
    get_profile,
    load_profile,
    solver_version,
)
from tvsmt.solving.replay import replay
from tvsmt.solving.runner import crosscheck, reconcile, run_file, solve_all, solve_batch
from tvsmt.solving.sexpr import parse_get_value
from tvsmt.solving.types import ERROR, SAT, TIMEOUT, UNKNOWN, UNSAT, Obligation, SolverResult

# --------------------------------------------------------------------------------------------
# Hand-made obligations

UNSAT_UF = """\
(set-logic QF_UFNRA)
(declare-fun uf_exp (Real) Real)
(declare-fun a () Real)
(declare-fun b () Real)
(define-fun s1 () Real (+ (uf_exp a) (uf_exp b)))
(define-fun s2 () Real (+ (uf_exp b) (uf_exp a)))
(assert (not (= (* a s1) (* s2 a))))
(check-sat)
"""

# a row-parallel matmul whose all-reduce was forgotten: rank 0 keeps its partial sum
SAT_ALLREDUCE = """\
(set-logic QF_UFNRA)
(declare-fun x0 () Real)
(declare-fun x1 () Real)
(declare-fun w0 () Real)
(declare-fun w1 () Real)
(define-fun ref () Real (+ (* x0 w0) (* x1 w1)))
(define-fun partial () Real (* x0 w0))
(assert (not (= ref partial)))
(check-sat)
(get-value (x0 x1 w0 w1))
"""

SAT_NONLINEAR = """\
(set-logic QF_UFNRA)
(declare-fun x () Real)
(declare-fun y () Real)
(assert (= (* x y) 6.0))
(assert (> x 1.0))
(assert (< x 4.0))
(assert (> (* y y) 5.0))
(check-sat)
(get-value (x y))
"""

BROKEN_PAREN = """\
(set-logic QF_UFNRA)
(declare-fun x () Real)
(assert (> x 1.0)
(assert (< x 0.0))
(check-sat)
"""

# z3 drops the bad assertion, still answers sat and exits 1: must be ERROR, not sat
BROKEN_SYMBOL = """\
(set-logic QF_UFNRA)
(declare-fun x () Real)
(assert (< x undeclared_y))
(assert (> x 1.0))
(check-sat)
"""


def hard_softmax(c: int = 10) -> str:
    """Softmax with max-subtraction, sharded max vs global max: both solvers time out."""
    xs = [f"x{i}" for i in range(c)]

    def mx(a, b):
        return f"(ite (>= {a} {b}) {a} {b})"

    def fold(v):
        r = v[0]
        for t in v[1:]:
            r = mx(r, t)
        return r

    lines = ["(set-logic QF_UFNRA)", "(declare-fun uf_exp (Real) Real)"]
    lines += [f"(declare-fun {x} () Real)" for x in xs]
    lines += [f"(define-fun m () Real {fold(xs)})",
              f"(define-fun m1 () Real {fold(xs[:c // 2])})",
              f"(define-fun m2 () Real {fold(xs[c // 2:])})",
              f"(define-fun mm () Real {mx('m1', 'm2')})",
              "(define-fun s () Real (+ " + " ".join(f"(uf_exp (- {x} m))" for x in xs) + "))",
              "(define-fun t () Real (+ " + " ".join(f"(uf_exp (- {x} mm))" for x in xs) + "))",
              "(assert (or " + " ".join(f"(not (= (/ (uf_exp (- {x} m)) s) (/ (uf_exp (- {x} mm)) t)))"
                                        for x in xs) + "))",
              "(assert (> s 0.0))", "(check-sat)"]
    return "\n".join(lines) + "\n"


def ob(text: str, query=(), **meta) -> Obligation:
    return Obligation(hashlib.sha256(text.encode()).hexdigest(), text, tuple(query), meta)


def basic_obligations() -> list[Obligation]:
    return [ob(UNSAT_UF, stage="attn.exp"), ob(SAT_ALLREDUCE, ("x0", "x1", "w0", "w1")),
            ob(SAT_NONLINEAR, ("x", "y")), ob(BROKEN_PAREN), ob(BROKEN_SYMBOL)]


EXPECTED = [UNSAT, SAT, SAT, ERROR, ERROR]
SOLVERS = ["z3", "cvc5"]


def tagged_profile(name: str):
    """The profile with a unique environment tag, so that its processes can be found."""
    tag = uuid.uuid4().hex
    return dataclasses.replace(get_profile(name), env=(("TVSMT_TEST_TAG", tag),)), tag


def tagged_processes(tag: str) -> list[psutil.Process]:
    return tagged("TVSMT_TEST_TAG", tag)


def assert_no_survivor(tag: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = tagged_processes(tag)
    assert not left, f"solver processes survived: {[p.cmdline() for p in left]}"


def check_values(res: SolverResult, text: str) -> None:
    v = res.values
    if text is SAT_ALLREDUCE:
        assert v["x0"] * v["w0"] + v["x1"] * v["w1"] != v["x0"] * v["w0"]
    elif text is SAT_NONLINEAR:
        assert isinstance(v["x"], Fraction) and isinstance(v["y"], Fraction), v
        assert v["x"] * v["y"] == 6 and 1 < v["x"] < 4 and v["y"] * v["y"] > 5


# --------------------------------------------------------------------------------------------
# sexpr


def test_sexpr_value_forms():
    z3_answer = "((x (/ 1.0 2.0))\n (y (- 3.0))\n (z 0.25)\n (w (root-obj (+ (^ x 2) (- 2)) 2)))"
    assert parse_get_value(z3_answer) == {
        "x": Fraction(1, 2), "y": Fraction(-3), "z": Fraction(1, 4),
        "w": "(root-obj (+ (^ x 2) (- 2)) 2)"}
    cvc5_answer = ("((x (/ (- 1) 4)) (|odd name| 7) (r (_ real_algebraic_number "
                   "<1*x^2 + (-2), (5/4, 3/2)>)) (b true))")
    assert parse_get_value(cvc5_answer) == {
        "x": Fraction(-1, 4), "odd name": Fraction(7),
        "r": "(_ real_algebraic_number <1*x^2 + (-2), (5/4, 3/2)>)", "b": "true"}
    assert parse_get_value("((x (- (/ 1 4))))") == {"x": Fraction(-1, 4)}
    # (its speed is a benchmark figure, not a test assertion: a shared machine makes it flaky)


# --------------------------------------------------------------------------------------------
# profiles


def test_builtin_profiles_available():
    names = available_solvers()
    assert "z3" in names and "cvc5" in names
    assert solver_version("z3")[0].isdigit()
    assert solver_version("cvc5").startswith("1.")


def test_malformed_profile_is_one_line_error(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text('name = "broken"\n[binary]\nsearch = "z3"\n[run]\nfile = ["{bin}", "{file}"]\n')
    with pytest.raises(ProfileError) as e:
        load_profile(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, PlanError)
    bad.write_text('[binary]\nsearch = ["z3"]\n[run]\nfile = ["{bin}", "{fil}"]\n')
    with pytest.raises(ProfileError, match="unknown placeholder"):
        load_profile(bad)
    bad.write_text("[binary\nsearch=")
    with pytest.raises(ProfileError) as e:
        load_profile(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ProfileError, match="unknown solver"):
        get_profile("no-such-solver")


# --------------------------------------------------------------------------------------------
# runner


@pytest.mark.parametrize("solver", SOLVERS)
def test_solve_batch_answers(solver):
    obs = basic_obligations()
    results = solve_batch(obs, solver, timeout_s=20)
    assert [r.status for r in results] == EXPECTED, [(r.status, r.message) for r in results]
    for o, r in zip(obs, results):
        assert r.solver == solver and r.version
        if r.status == SAT:
            assert set(r.values) == set(o.query)
            check_values(r, o.smt2)
        if r.status == ERROR:
            assert r.message.startswith("(error")
    # the kept-alive process recovers after errors: run the good ones again after them
    again = solve_batch(obs[3:] + obs[:3], solver, timeout_s=20)
    assert [r.status for r in again] == EXPECTED[3:] + EXPECTED[:3]


def test_sat_without_model_is_not_sat():
    # cvc5 1.4.2 --nl-rlv=always answers `sat` on this valid obligation but has no model
    res = solve_batch([ob(hard_softmax(6), ("x0",)), ob(hard_softmax(6) + " ")], "cvc5",
                      timeout_s=10)
    for r in res:
        assert r.status in (UNSAT, UNKNOWN, TIMEOUT), r
        if r.status == UNKNOWN:
            assert "no model" in r.message


@pytest.mark.parametrize("solver", SOLVERS)
def test_timeout_kills_solver(solver):
    profile, tag = tagged_profile(solver)
    hard, easy = ob(hard_softmax()), ob(UNSAT_UF)
    results = solve_batch([hard, easy], profile, timeout_s=1)
    # behaviour, not speed: the hard one was given its whole second and then killed (it is a
    # timeout, the next obligation still got an answer, and no solver process is left)
    assert [r.status for r in results] == [TIMEOUT, UNSAT]
    assert results[0].seconds >= 0.9
    assert_no_survivor(tag, within=0.5)


def test_keyboard_interrupt_during_solve_leaves_no_solver():
    profile, tag = tagged_profile("z3")

    def interrupt(signum, frame):
        raise KeyboardInterrupt("Ctrl-C")

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            solve_batch([ob(hard_softmax())], profile, timeout_s=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert_no_survivor(tag, within=0.5)


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_exception_in_solve_all_leaves_no_solver(backend):
    profile, tag = tagged_profile("z3")
    obs = [ob(UNSAT_UF)] + [ob(hard_softmax() + f"; copy {i}\n") for i in range(3)]
    seen = []

    def progress(i, res):
        seen.append(res)
        if len(tagged_processes(tag)) == 0:  # make sure hard ones are running
            time.sleep(0.5)
        raise KeyboardInterrupt("stop")

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        solve_all(obs, profile, jobs=2, timeout_s=30, backend=backend, progress=progress,
                  chunk_size=1)
    assert time.monotonic() - start < 20
    assert seen
    assert_no_survivor(tag)


def test_threads_keep_one_solver_each(monkeypatch):
    """The default backend: each thread drives one kept-alive solver for all the obligations it
    takes (no solver started per chunk, as loky's workers do), and every answer is right."""
    from tvsmt.solving import runner

    started = []
    real_init = runner._SolverProcess.__init__

    def counting_init(self, *a, **kw):
        started.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(runner._SolverProcess, "__init__", counting_init)
    obs = [ob(UNSAT_UF + f"; copy {i}\n") for i in range(10)]
    obs += [ob(SAT_ALLREDUCE + f"; copy {i}\n", ("x0", "x1", "w0", "w1")) for i in range(10)]
    results = solve_all(obs, "z3", jobs=2, timeout_s=20, backend="threading")
    assert [r.status for r in results] == [UNSAT] * 10 + [SAT] * 10
    for r in results[10:]:
        check_values(r, SAT_ALLREDUCE)
    assert 1 <= len(started) <= 2


def test_threads_time_out_a_hard_obligation_and_go_on():
    """A thread whose solver hits the time limit kills it, reports TIMEOUT and answers its
    next obligations with a new solver; the other thread is not held up."""
    profile, tag = tagged_profile("z3")
    obs = [ob(hard_softmax() + f"; copy {i}\n") for i in range(2)]
    obs += [ob(UNSAT_UF + f"; copy {i}\n") for i in range(6)]
    results = solve_all(obs, profile, jobs=2, timeout_s=1, backend="threading")
    assert [r.status for r in results] == [TIMEOUT, TIMEOUT] + [UNSAT] * 6
    assert all(r.seconds >= 0.9 for r in results[:2])
    assert_no_survivor(tag, within=0.5)


@pytest.mark.parametrize("backend, stdin", [("threading", True), ("loky", True),
                                             ("threading", False)],
                         ids=["threads", "loky", "file-protocol"])
def test_a_budget_limits_its_obligation_only_in_the_same_run(backend, stdin):
    """`budgets` gives some obligations a time limit below the run's, in the same run (the
    policy's budget of obligations already refuted at concrete points): that one is killed at
    its budget, the others keep the run's timeout."""
    profile, tag = tagged_profile("z3")
    if not stdin:
        profile = dataclasses.replace(profile, stdin_command=None)
    hard = [ob(hard_softmax() + f"; copy {i}\n") for i in range(2)]
    easy = [ob(UNSAT_UF + f"; copy {i}\n") for i in range(4)]
    results = solve_all(hard + easy, profile, jobs=2, timeout_s=2, backend=backend,
                        budgets={hard[0].digest: 0.5})
    assert [r.status for r in results] == [TIMEOUT, TIMEOUT] + [UNSAT] * 4, results
    assert "after 0.5 s" in results[0].message and 0.4 <= results[0].seconds < 1.5
    assert "after 2 s" in results[1].message and results[1].seconds >= 1.9
    assert_no_survivor(tag, within=0.5)


def test_a_solving_thread_that_fails_ends_the_run_and_leaves_no_solver(monkeypatch):
    from tvsmt.solving import runner

    profile, tag = tagged_profile("z3")
    calls = []
    real_solve = runner._Batch.solve

    def failing_solve(self, o, timeout_s=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in a solving thread")
        return real_solve(self, o, timeout_s)

    monkeypatch.setattr(runner._Batch, "solve", failing_solve)
    obs = [ob(UNSAT_UF + f"; copy {i}\n") for i in range(8)]
    with pytest.raises(RuntimeError, match="boom in a solving thread"):
        solve_all(obs, profile, jobs=2, timeout_s=20, backend="threading")
    assert_no_survivor(tag)


def test_solve_all_parallel_progress_and_dedup():
    obs = basic_obligations()
    obs = obs + [obs[0], obs[1]]  # duplicates are solved once, reported for both indices
    calls = []
    results = solve_all(obs, "z3", jobs=2, timeout_s=20, progress=lambda i, r: calls.append(i))
    assert [r.status for r in results] == EXPECTED + [UNSAT, SAT]
    assert sorted(calls) == list(range(len(obs)))
    assert results[6].values == results[1].values


def test_dask_backend_matches_loky():
    distributed = pytest.importorskip("distributed")
    obs = basic_obligations()
    loky = solve_all(obs, "z3", jobs=2, timeout_s=20)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        dask = solve_all(obs, "z3", timeout_s=20, backend="dask",
                         scheduler=cluster.scheduler_address)
    assert [r.status for r in dask] == [r.status for r in loky] == EXPECTED


# --------------------------------------------------------------------------------------------
# crosscheck


@pytest.fixture
def fake_profile(tmp_path):
    from conftest import fake_solver_profile

    return fake_solver_profile(tmp_path, "fake", "sat")


def test_crosscheck_fake_disagrees(fake_profile):
    obs = [ob(UNSAT_UF), ob(SAT_ALLREDUCE, ("x0", "x1", "w0", "w1"))]
    got = []
    results = crosscheck(obs, solvers=("z3", fake_profile), jobs=2, timeout_s=20,
                         progress=lambda i, r: got.append(i))
    first, second = results
    assert first.status == UNKNOWN
    assert "z3 says unsat" in first.message and "fake says sat" in first.message
    assert [d.status for d in first.details] == [UNSAT, SAT]
    assert second.status == SAT and second.values  # agreement; z3's model kept
    assert sorted(got) == [0, 1]


def test_crosscheck_z3_cvc5_agree():
    obs = basic_obligations()[:3]
    results = crosscheck(obs, solvers=("z3", "cvc5"), jobs=2, timeout_s=20)
    assert [r.status for r in results] == EXPECTED[:3]
    assert all(len(r.details) == 2 for r in results)


def test_reconcile_one_side_timeout_is_reported():
    z3 = SolverResult(UNSAT, "z3", "5", 0.1)
    cvc5 = SolverResult(TIMEOUT, "cvc5", "1.4", 60.0, message="killed after 60 s")
    merged = reconcile([z3, cvc5])
    assert merged.status == UNSAT and "cvc5 says timeout" in merged.message
    assert merged.details == [z3, cvc5]
    assert reconcile([z3, cvc5], strict=True).status == UNKNOWN


# --------------------------------------------------------------------------------------------
# corpus + files accepted by both stock solvers


def test_corpus_roundtrip_and_both_solvers_accept_files(tmp_path):
    c = Corpus(tmp_path / "corpus")
    obs = basic_obligations()[:3]
    for i, o in enumerate(obs):
        path = c.add(o, stage_ids=[f"stage{i}"], header={"stage": f"stage{i}", "tensors": ["w"]})
        text = path.read_text()
        assert text.startswith("; tvsmt: ")
        meta, body = split_header(text)
        assert meta == {"stage": f"stage{i}", "tensors": ["w"]}
        assert body == o.smt2 and digest_of(body) == o.digest == path.stem
        # the real solvers run the corpus file as is (header included)
        for solver in SOLVERS:
            res = run_file(path, solver, timeout_s=20)
            assert res.status == EXPECTED[i], (solver, res)
            if res.status == SAT:
                check_values(res, o.smt2)
    if "cvc5-bin" in available_solvers():  # a cvc5 binary on PATH (optional)
        assert run_file(c.path_for(obs[0].digest), "cvc5-bin", timeout_s=20).status == UNSAT

    results = solve_batch(obs, "z3", timeout_s=20)
    for o, r in zip(obs, results):
        c.record(o.digest, r)
    c.save()
    again = Corpus(tmp_path / "corpus")
    assert again.stages == {f"stage{i}": o.digest for i, o in enumerate(obs)}
    cached = again.lookup(obs[1].digest, "z3")
    assert cached.status == SAT and cached.values == results[1].values
    assert again.lookup(obs[0].digest, "cvc5") is None
    back = again.read(obs[2].digest)
    assert back.smt2 == obs[2].smt2 and back.query == ("x", "y")
    assert again.verify_files() == []


def test_corpus_detects_edited_file(tmp_path):
    c = Corpus(tmp_path)
    o = ob(UNSAT_UF)
    path = c.add(o, stage_ids=["s"])
    c.save()
    path.write_text(path.read_text().replace("(* a s1)", "(* a s1 2.0)"))
    problems = Corpus(tmp_path).verify_files()
    assert [p.problem for p in problems] == ["hash mismatch"]
    assert problems[0].path == str(path)
    with pytest.raises(PlanError, match="does not match its name"):
        Corpus(tmp_path).read(o.digest)


def test_corrupt_manifest_is_one_line_plan_error(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "tvsmt-corpus/1", "stages": [')
    with pytest.raises(PlanError) as e:
        Corpus(tmp_path)
    assert "manifest.json" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": "tvsmt-corpus/1", "stages": {}, "verdicts": {"0" * 64: {"z3": {"status": "maybe"}}}}))
    with pytest.raises(PlanError, match="malformed"):
        Corpus(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(PlanError, match="not UTF-8"):
        Corpus(tmp_path)


def test_atomic_writes_leave_no_temp_files(tmp_path, monkeypatch):
    c = Corpus(tmp_path)
    o = ob(SAT_NONLINEAR, ("x", "y"))
    c.add(o, stage_ids=["a"])
    c.save()
    kept = sorted([f"{o.digest}.smt2", "manifest.json", ".lock", ".tvsmt-key"])
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    before = (tmp_path / "manifest.json").read_bytes()

    def boom(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(corpus_mod.os, "replace", boom)
    c.stages["b"] = o.digest
    with pytest.raises(KeyboardInterrupt):
        c.save()
    with pytest.raises(KeyboardInterrupt):
        c.add(ob(UNSAT_UF))
    monkeypatch.undo()
    assert (tmp_path / "manifest.json").read_bytes() == before  # old manifest intact
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


# --------------------------------------------------------------------------------------------
# replay


def test_replay_reports_differences_and_mismatches(tmp_path):
    c = Corpus(tmp_path)
    obs = basic_obligations()[:3]
    for i, o in enumerate(obs):
        c.add(o, stage_ids=[f"s{i}"])
        c.record(o.digest, SolverResult(EXPECTED[i], "z3", "x", 0.01))
    c.record(obs[2].digest, SolverResult(UNSAT, "z3", "x", 0.01))  # a wrong record
    c.save()
    report = replay(tmp_path, "z3", jobs=1, timeout=20)
    assert report.total == 3 and report.agree == 2 and not report.ok
    [diff] = report.differences
    assert (diff.digest, diff.recorded, diff.replayed, diff.stage_ids) == \
        (obs[2].digest, UNSAT, SAT, ["s2"])
    # cvc5 has no record: compared with z3's decisive records (a cross-check)
    report = replay(tmp_path, "cvc5", jobs=1, timeout=20)
    assert [d.digest for d in report.differences] == [obs[2].digest]
    # an edited file is listed, not solved
    p = c.path_for(obs[0].digest)
    p.write_text(p.read_text() + "(assert false)\n")
    report = replay(tmp_path, "z3", jobs=1, timeout=20)
    assert [m.path for m in report.hash_mismatches] == [str(p)]
    assert report.total == 2 and obs[0].digest not in report.results


def test_replay_reproduces_verdicts_not_timeouts(tmp_path):
    """A recorded timeout, unknown or error depended on the time its run gave: replay, with
    more time, answers and that is no difference; where another solver recorded a verdict,
    the answer is compared with that one (and a wrong one still differs)."""
    c = Corpus(tmp_path)
    obs = basic_obligations()[:3]
    for i, o in enumerate(obs):
        c.add(o, stage_ids=[f"s{i}"])
    c.record(obs[0].digest, SolverResult(TIMEOUT, "z3", "x", 0.5, message="killed after 0.5 s"))
    c.record(obs[1].digest, SolverResult(UNKNOWN, "z3", "x", 0.01))
    c.record(obs[1].digest, SolverResult(EXPECTED[1], "cvc5", "y", 0.01))
    wrong = UNSAT if EXPECTED[2] == SAT else SAT
    c.record(obs[2].digest, SolverResult(ERROR, "z3", "x", 0.01))
    c.record(obs[2].digest, SolverResult(wrong, "cvc5", "y", 0.01))
    c.save()
    report = replay(tmp_path, "z3", jobs=1, timeout=20)
    assert [report.results[o.digest].status for o in obs] == EXPECTED[:3]
    assert report.unrecorded == [obs[0].digest]
    assert [(d.digest, d.recorded, d.recorded_by) for d in report.differences] == \
        [(obs[2].digest, wrong, "cvc5 y")]
    assert report.agree == 1 and not report.ok


# --------------------------------------------------------------------------------------------
# the command line's solver choice (--crosscheck LIST, repeated --solver) and an installed
# package (these use the CLI and the handmade plans)


@pytest.fixture
def mlp_pairs(tmp_path):
    from handmade import parallel_mlp, single_mlp

    from tvsmt.frontends import write_pair_dicts

    return {"good": write_pair_dicts(tmp_path / "good", single_mlp(), parallel_mlp()),
            "bug": write_pair_dicts(tmp_path / "bug", single_mlp(),
                                    parallel_mlp(wrong_const_rank=2))}


def _cli(*args):
    from click.testing import CliRunner

    from tvsmt.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_crosscheck_takes_any_list_of_profiles(tmp_path, mlp_pairs):
    from conftest import fake_solver_profile

    liar = fake_solver_profile(tmp_path, "liar", "unsat")
    r = _cli("verify", *mlp_pairs["good"], "--no-corpus", "--crosscheck", "z3,cvc5",
             "--report", tmp_path / "good.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "good.json").read_text())["solver"] == "z3+cvc5"
    # a lying third solver cannot make the buggy plan pass; it is named in the report
    for flags in (["--crosscheck=z3,cvc5," + liar], ["--solver", "z3", "--solver", liar]):
        report = tmp_path / "bug.json"
        r = _cli("verify", *mlp_pairs["bug"], "--no-corpus", *flags, "--report", report)
        assert r.exit_code == 1, (flags, r.output)
        failures = json.loads(report.read_text())["failures"]
        assert any("disagree" in f["message"] and "liar says unsat" in f["message"]
                   for f in failures), failures
    # the liar alone "proves" it, which only the concrete evaluation next to each proof
    # catches (a solver failure, exit 3): the reason a pass needs every solver
    assert _cli("verify", *mlp_pairs["bug"], "--no-corpus", "--solver", liar).exit_code == 3


def test_crosscheck_usage_errors_are_one_line(mlp_pairs):
    single, parallel = mlp_pairs["good"]
    cases = [(["--crosscheck", single, parallel], "put --crosscheck after the plan files"),
             ([single, parallel, "--crosscheck", "z3"], "two or more distinct"),
             ([single, parallel, "--crosscheck", "z3,z3"], "two or more distinct"),
             ([single, parallel, "--crosscheck", "z3,nosuch"], "unknown solver 'nosuch'"),
             ([single, parallel, "--crosscheck", "--solver", "cvc5"], "takes no --solver"),
             ([single, parallel, "--crosscheck="], "empty list"),
             ([single, parallel, "--crosscheck", ","], "empty list")]
    for args, message in cases:
        r = _cli("verify", *args, "--no-corpus")
        assert r.exit_code == 2, (args, r.output)
        assert message in r.output and "Traceback" not in r.output, (args, r.output)


def test_help_says_how_profiles_are_found():
    for args in ([ "--help"], ["verify", "--help"]):
        text = " ".join(_cli(*args).output.split())
        assert "TVSMT_SOLVERS_DIR" in text and ".toml" in text, args
    assert "path to a .toml" in " ".join(_cli("verify", "--help").output.split())


@pytest.mark.slow
def test_a_non_editable_install_finds_its_profiles_from_any_directory(tmp_path, mlp_pairs):
    """`pip install .` (not editable) into a fresh venv; run from another directory, the
    built-in profiles are found as package data and give the verdicts. The venv reuses this
    environment's dependencies through a .pth line (no download) and gets the z3 binary as
    the z3-solver wheel would install it."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy: the build must not write into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "tvsmt", src / "tvsmt",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    z3 = shutil.which("z3", path=os.path.dirname(sys.executable))
    assert z3, "the z3-solver wheel's binary next to this interpreter"
    os.symlink(z3, venv / "bin" / "z3")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-build-isolation", "--no-index", str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVSMT_SOLVERS_DIR",
                                                             "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"

    def tvsmt(*args):
        return subprocess.run([str(venv / "bin" / "tvsmt"), *map(str, args)], cwd=elsewhere,
                              env=env, capture_output=True, text=True, timeout=300)

    where = subprocess.run([py, "-c", "import tvsmt.solving.profiles as p; "
                            "print(p.__file__); print(p.BUILTIN_DIR)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(w.startswith(site) for w in where), where  # the installed copy, not the checkout
    good, bug = mlp_pairs["good"], mlp_pairs["bug"]
    assert tvsmt("verify", *good, "--no-corpus").returncode == 0
    assert tvsmt("verify", *bug, "--no-corpus", "--crosscheck").returncode == 1
    r = tvsmt("verify", *good, "--no-corpus", "--solver", "cvc5")
    assert r.returncode == 0, r.stdout + r.stderr
    from conftest import SHARED_PLANS, fake_solver_profile

    for name, code in (("mlp-ly2-dp2pp2tp2mb2", 0), ("br0-llama3-ly1-dp2pp2tp2mb2", 1)):
        folder = SHARED_PLANS / name  # the real nnScaler fixtures, where they are
        if (folder / "parallel.json.gz").exists():
            r = tvsmt("verify", folder / "single.json.gz", folder / "parallel.json.gz",
                      "--no-corpus")
            assert r.returncode == code, (name, r.stdout[-2000:], r.stderr[-2000:])
    # a user profile directory is still searched first

    (tmp_path / "mine").mkdir()
    fake_solver_profile(tmp_path / "mine", "shrug", "unknown")
    env["TVSMT_SOLVERS_DIR"] = str(tmp_path / "mine")
    assert tvsmt("verify", *good, "--no-corpus", "--solver", "shrug").returncode == 3
