"""Trusted caches and concurrent writers (issue 9 items 3 and 6): a corpus verdict is reused
only if tvsmt wrote it, for the same solver name, version and profile; a hand-edited manifest
is noticed; --fresh recovers a damaged manifest; concurrent runs on one corpus lose nothing and
keep their stage maps apart."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.frontends import write_pair_dicts
from tvsmt.solving.corpus import KEY_FILE, Corpus, pair_key
from tvsmt.solving.profiles import get_profile, solver_version
from tvsmt.solving.types import SAT, UNSAT, Obligation, SolverResult

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def buggy_pair(tmp_path):
    return write_pair_dicts(tmp_path / "mlp-bug", single_mlp(), parallel_mlp(wrong_const_rank=2))


def liar_named_z3(folder: Path, same_version: bool = True) -> str:
    """A profile named `z3` whose 'solver' answers unsat to everything; with same_version,
    it even reports the real z3's version."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "liar.py"
    script.write_text("print('unsat')\n")
    version = solver_version("z3") if same_version else "0.0.1"
    prof = folder / "z3.toml"
    prof.write_text(textwrap.dedent(f"""\
        name = "z3"
        [binary]
        search = ["{{python}}"]
        version_command = ["{{bin}}", "-c", "print('Z3 version {version}')"]
        [run]
        file = ["{{bin}}", {json.dumps(str(script))}, "{{file}}"]
        """))
    return str(prof)


def verify(pair, corpus, report, *flags):
    r = run("verify", *pair, "--corpus", corpus, "--report", report, *flags)
    data = json.loads(Path(report).read_text()) if Path(report).exists() else None
    return r, data


@pytest.mark.parametrize("same_version", [True, False])
def test_a_lying_profile_named_z3_poisons_nothing_for_the_real_z3(tmp_path, buggy_pair,
                                                                  same_version):
    corpus = tmp_path / "corpus"
    liar = liar_named_z3(tmp_path / "liar", same_version)
    r, rep = verify(buggy_pair, corpus, tmp_path / "1.json", "--solver", liar)
    # the liar "proves" the buggy plan (belt and braces catches it: exit 3, not a pass), and
    # its unsat verdicts are recorded in the corpus...
    assert r.exit_code == 3, r.output
    assert rep["cache_hits"] == 0
    r, rep = verify(buggy_pair, corpus, tmp_path / "2.json")
    assert r.exit_code == 1, r.output  # ...which the real z3 never takes from the corpus
    assert rep["cache_hits"] == 0 and rep["cache"] == {}
    reason = "other profile" if same_version else "other version"
    assert rep["cache_refused"] == {reason: rep["obligations_unique"]}
    # the real z3's own verdicts are reused next time, and the report says by whom
    r, rep = verify(buggy_pair, corpus, tmp_path / "3.json")
    assert r.exit_code == 1
    assert rep["cache_hits"] == rep["obligations_unique"] > 0
    assert rep["cache"] == {"z3": rep["obligations_unique"]} and rep["cache_refused"] == {}
    # and the liar, run again, does not get the real z3's verdicts either: only its own
    # that the real z3 left in place (the refuted obligation, which z3 answered at its point)
    own = [dg for dg, by in Corpus(corpus).verdicts.items()
           if by["z3"]["profile"] == get_profile(liar).digest]
    r, rep = verify(buggy_pair, corpus, tmp_path / "4.json", "--solver", liar)
    assert rep["cache_hits"] == len(own) == 1


def test_the_profile_digest_is_the_file_content(tmp_path):
    real = get_profile("z3")
    copy = tmp_path / "z3.toml"
    copy.write_bytes(Path(real.source).read_bytes())
    assert get_profile(str(copy)).digest == real.digest
    copy.write_bytes(copy.read_bytes() + b"\n# one more comment\n")
    assert get_profile(str(copy)).digest != real.digest


def test_a_hand_edited_verdict_is_not_trusted(tmp_path, buggy_pair):
    corpus = tmp_path / "corpus"
    r, first = verify(buggy_pair, corpus, tmp_path / "1.json")
    assert r.exit_code == 1
    manifest = corpus / "manifest.json"
    text = manifest.read_text()
    assert '"status": "sat"' in text
    # the sat is the refuted obligation's, answered at its refuting point: that script is in
    # the corpus in its own right, naming the obligation it stands for
    kept = Corpus(corpus)
    sat = [dg for dg, by in kept.verdicts.items() if by["z3"]["status"] == SAT]
    assert sat and all(kept.read(dg).meta.get("pinned_from") in kept.digests() for dg in sat)
    manifest.write_text(text.replace('"status": "sat"', '"status": "unsat"'))
    r, rep = verify(buggy_pair, corpus, tmp_path / "2.json")
    assert r.exit_code == 1, r.output  # solved again: still the bug
    edited = text.count('"status": "sat"')
    assert rep["cache_refused"] == {"changed outside tvsmt": edited}
    assert rep["cache_hits"] == first["obligations_unique"] - edited
    # the new verdicts are sealed again: a third run takes everything from the corpus
    r, rep = verify(buggy_pair, corpus, tmp_path / "3.json")
    assert rep["cache_hits"] == first["obligations_unique"] and rep["cache_refused"] == {}


def test_a_lost_key_makes_every_verdict_untrusted(tmp_path, buggy_pair):
    corpus = tmp_path / "corpus"
    r, first = verify(buggy_pair, corpus, tmp_path / "1.json")
    (corpus / KEY_FILE).unlink()
    r, rep = verify(buggy_pair, corpus, tmp_path / "2.json")
    assert r.exit_code == 1
    assert rep["cache_hits"] == 0
    assert rep["cache_refused"] == {"changed outside tvsmt": first["obligations_unique"]}


def test_fresh_recovers_a_damaged_manifest(tmp_path, buggy_pair):
    corpus = tmp_path / "corpus"
    verify(buggy_pair, corpus, tmp_path / "1.json")
    (corpus / "manifest.json").write_text('{"format": "tvsmt-corpus/2", "pairs": ')
    r = run("verify", *buggy_pair, "--corpus", corpus)
    assert r.exit_code == 2 and "Traceback" not in r.output
    [line] = [ln for ln in r.output.splitlines() if ln.strip()]
    assert "manifest.json" in line and "--fresh" in line
    r, rep = verify(buggy_pair, corpus, tmp_path / "2.json", "--fresh")
    assert r.exit_code == 1, r.output
    again = Corpus(corpus)  # readable again, with this pair's stages and verdicts
    assert again.pairs[pair_key(buggy_pair[1])]
    assert len(again.verdicts) == rep["obligations_unique"]


def test_an_old_format_manifest_is_read_but_its_verdicts_are_not_trusted(tmp_path):
    ob = Obligation("a" * 64, "(check-sat)\n")
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "tvsmt-corpus/1", "stages": {"s0": ob.digest},
        "verdicts": {ob.digest: {"z3": {"status": "unsat", "seconds": 0.1, "version": ""}}}}))
    c = Corpus(tmp_path)
    assert c.refusal(ob.digest, "z3") == "changed outside tvsmt"
    assert c.stage_ids(ob.digest) == ["s0"]
    c.save()
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == "tvsmt-corpus/2"


def test_refusal_reasons(tmp_path):
    c = Corpus(tmp_path)
    dg = "b" * 64
    c.record(dg, SolverResult(UNSAT, "z3", "4.1", 0.1, profile="p1"))
    c.record(dg, SolverResult("timeout", "cvc5", "1.4", 9.0, profile="p2"))
    c.save()
    c = Corpus(tmp_path)
    assert c.refusal(dg, "z3", version="4.1", profile="p1") is None
    assert c.lookup(dg, "z3", version="4.1", profile="p1").status == UNSAT
    assert c.refusal(dg, "z3", version="4.2", profile="p1") == "other version"
    assert c.refusal(dg, "z3", version="4.1", profile="p9") == "other profile"
    assert c.refusal(dg, "cvc5") == "not decisive"
    assert c.refusal(dg, "yices") == "none recorded"
    assert c.lookup(dg, "z3", version="4.1", profile="p9") is None


# --------------------------------------------------------------------------------------------
# concurrent writers


def _writer(root: str, k: int, rounds: int, barrier) -> None:
    for rnd in range(rounds):
        barrier.wait()
        c = Corpus(root, pair=f"pair{k}")
        for j in range(5):
            dg = f"{k:02x}{rnd:02x}{j:02x}".ljust(64, "0")
            c.stages[f"s{rnd}.{j}"] = dg  # stage ids that every writer uses
            c.record(dg, SolverResult(SAT if j % 2 else UNSAT, "z3", "4", 0.01, profile="p"))
        c.save()


def test_concurrent_writers_lose_no_verdict(tmp_path):
    writers, rounds = 3, 8
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(writers)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), k, rounds, barrier))
             for k in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    c = Corpus(tmp_path)
    assert len(c.verdicts) == writers * rounds * 5
    for k in range(writers):  # each pair keeps its own map: same stage ids, own digests
        stages = c.pairs[f"pair{k}"]
        assert stages["s0.0"] == f"{k:02x}0000".ljust(64, "0")
        assert len(stages) == rounds * 5  # the map of one pair grows across rounds
    assert all(c.refusal(dg, "z3", version="4", profile="p") is None for dg in c.verdicts)


def test_three_verify_runs_on_one_corpus_keep_every_verdict(tmp_path):
    pairs = [write_pair_dicts(tmp_path / f"mlp{c}", single_mlp(const=c), parallel_mlp(const=c))
             for c in (2.0, 3.0, 5.0)]
    corpus = tmp_path / "corpus"
    procs = [subprocess.Popen([sys.executable, "-m", "tvsmt.cli", "verify", *pair, "--corpus",
                               str(corpus), "--jobs", "1", "--report",
                               str(tmp_path / f"r{k}.json")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for k, pair in enumerate(pairs)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()
    c = Corpus(corpus)
    digests = set()
    for k, pair in enumerate(pairs):
        stages = c.pairs[pair_key(pair[1])]
        rep = json.loads((tmp_path / f"r{k}.json").read_text())
        assert len(set(stages.values())) == rep["obligations_unique"] > 0
        digests |= set(stages.values())
    assert digests <= set(c.verdicts)  # every obligation of every pair has its verdict
    assert all("z3" in c.verdicts[dg] for dg in digests)


def test_crosscheck_reuses_only_what_every_solver_recorded(tmp_path, buggy_pair):
    corpus = tmp_path / "corpus"
    r, one = verify(buggy_pair, corpus, tmp_path / "1.json")  # z3 alone
    n = one["obligations_unique"]
    r, both = verify(buggy_pair, corpus, tmp_path / "2.json", "--crosscheck")
    assert r.exit_code == 1 and both["cache_hits"] == 0  # cvc5 has recorded nothing yet
    r, again = verify(buggy_pair, corpus, tmp_path / "3.json", "--crosscheck")
    assert r.exit_code == 1
    assert again["cache_hits"] == n and again["cache"] == {"z3": n, "cvc5": n}
    assert again["failures"] == both["failures"]
