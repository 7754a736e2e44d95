"""A large plan document is loaded and folded in a forked process, and only the folded pair
comes back (tvsmt/fold_child.py `fold_in_child`). That is a shortcut of the pipeline's plumbing,
so it must change nothing a user sees: the same report as the load in this process, bugs in
units the fold drops still caught, the second fold and the refusal still taken, input errors
worded the same, a failing child replaced by this process's own load, and no process left
behind."""

from __future__ import annotations

import copy
import os
import threading

import pytest
from test_fold import DIMS, PER_REPLICA, WORLD, _dropped_placement

from tvsmt import forked
from tvsmt import fold_child as FC
from tvsmt import verify as V
from tvsmt.errors import PlanError
from tvsmt.frontends import generate_pair
from tvsmt.frontends.builder import write_plan
from tvsmt.verify import Options, verify_pair


@pytest.fixture(scope="module")
def pair():
    return generate_pair("llama3", **WORLD, **DIMS)


def _write(tmp_path, single: dict, parallel: dict) -> tuple[str, str]:
    return (write_plan(tmp_path / "single.json.gz", single),
            write_plan(tmp_path / "parallel.json.gz", parallel))


def _verify(paths, how: str, monkeypatch) -> V.Report:
    monkeypatch.setenv(FC.FOLD_IN_CHILD_ENV, how)
    return verify_pair(*paths, Options(jobs=1))


def _same(a, b) -> None:
    """Two reports of one pair agree (but for times)."""
    assert (a.verdict, a.fold, a.fold_note, a.stages_total, a.stage_templates,
            a.obligations_unique) == (b.verdict, b.fold, b.fold_note, b.stages_total,
                                      b.stage_templates, b.obligations_unique)
    assert [row[:5] for row in a.stages] == [row[:5] for row in b.stages]
    assert [f.message for f in a.failures] == [f.message for f in b.failures]


@pytest.fixture
def children(monkeypatch):
    """The pids of the processes ForkedCall starts during the test."""
    pids: list[int] = []
    plain = forked.ForkedCall.__init__

    def init(self, fn, **kw):
        plain(self, fn, **kw)
        pids.append(self.pid)

    monkeypatch.setattr(forked.ForkedCall, "__init__", init)
    return pids


def _gone(pid: int) -> bool:
    """Has `pid` (a child of this process) ended and been collected, by `answer()` or by
    the thread it starts for a child that answered before it had ended?"""
    for t in threading.enumerate():
        if t.name == f"tvsmt-reap-{pid}":
            t.join(30)
    try:
        os.waitpid(pid, os.WNOHANG)  # (0, 0): still running; (pid, status): left a zombie
    except ChildProcessError:
        return True
    return False


def test_the_threshold_and_the_switch(tmp_path, pair, monkeypatch):
    paths = _write(tmp_path, *pair)
    monkeypatch.delenv(FC.FOLD_IN_CHILD_ENV, raising=False)
    assert not FC.fold_in_child(paths[1])  # a small plan is loaded here
    monkeypatch.setattr(FC, "FOLD_IN_CHILD_MIN_BYTES", 1000)
    assert FC.fold_in_child(paths[1])  # the text's size, from the gzip trailer
    monkeypatch.setenv(FC.FOLD_IN_CHILD_ENV, "never")
    assert not FC.fold_in_child(paths[1])
    monkeypatch.setattr(FC, "FOLD_IN_CHILD_MIN_BYTES", 1 << 40)
    monkeypatch.setenv(FC.FOLD_IN_CHILD_ENV, "always")
    assert FC.fold_in_child(paths[1])


def test_a_plan_with_nothing_to_fold_is_read_once(tmp_path, monkeypatch, children,
                                                   loads_here):
    """Its world (2 replicas, 2 micro-batches), read from the start of the file, keeps it
    here: a child would read it only to refuse the fold, and this process read it again."""
    s, p = generate_pair("llama3", **dict(WORLD, dp=2, mb=2), **DIMS)
    paths = _write(tmp_path, s, p)
    monkeypatch.delenv(FC.FOLD_IN_CHILD_ENV, raising=False)
    monkeypatch.setattr(FC, "FOLD_IN_CHILD_MIN_BYTES", 1000)
    assert not FC.fold_in_child(paths[1])
    report = verify_pair(*paths, Options(jobs=1))
    assert report.verdict == "equivalent" and "nothing to fold" in report.fold_note
    assert children == [] and loads_here == [1]


@pytest.mark.parametrize("text,world", [
    (b'{"format":"x","world":{"dp":4,"mb":8,"model":{"a":{"b":1}}},"tensors":{}}',
     {"dp": 4, "mb": 8, "model": {"a": {"b": 1}}}),
    (b'{"world" :  {"dp": 16}}', {"dp": 16}),
    (b'{"tensors":{},"world":7}', None),  # not an object
    (b'{"world":{"dp":4', None),  # cut short
    (b'{"tensors":{"t":{"shape":[1]}}}', None),  # no world
    (b'{"name":"world","x":{"dp":4}}', None),  # the word, not the key
])
def test_the_world_hint(tmp_path, text, world):
    from tvsmt.plan.reader import world_hint

    plain = tmp_path / "p.json"
    plain.write_bytes(text)
    packed = tmp_path / "p.json.gz"
    packed.write_bytes(__import__("gzip").compress(text))
    assert world_hint(str(plain)) == world == world_hint(str(packed))
    late = tmp_path / "late.json"  # beyond the window: no hint
    late.write_bytes(b'{"pad":"' + b"x" * (1 << 16) + b'",' + text[1:])
    assert world_hint(str(late)) is None
    assert world_hint(str(tmp_path / "missing.json")) is None


@pytest.fixture
def loads_here(monkeypatch):
    """How many times this process loads a pair (the forked child's loads are its own)."""
    count = [0]
    plain = V.PlanPair.load.__func__

    def load(cls, *paths, **kw):
        count[0] += 1
        return plain(cls, *paths, **kw)

    monkeypatch.setattr(V.PlanPair, "load", classmethod(load))
    return count


@pytest.fixture
def aheads(monkeypatch):
    """The first fold's pairs this process prepared ahead (the child's guesses, sent before
    it checked the other units), and those whose preparation it used."""
    seen = {"prepared": [], "used": []}
    prepare, finish = FC._Ahead.prepare.__func__, FC._Ahead.finish

    def prepared(cls, blob, opts):
        got = prepare(cls, blob, opts)
        seen["prepared"].append(got)
        return got

    def used(self, opts, timer):
        seen["used"].append(self)
        return finish(self, opts, timer)

    monkeypatch.setattr(FC._Ahead, "prepare", classmethod(prepared))
    monkeypatch.setattr(FC._Ahead, "finish", used)
    return seen


def test_the_same_report_as_a_load_here(tmp_path, pair, monkeypatch, children, loads_here,
                                        aheads):
    paths = _write(tmp_path, *pair)
    here = _verify(paths, "never", monkeypatch)
    assert children == [] and loads_here == [1] and aheads["prepared"] == []
    there = _verify(paths, "always", monkeypatch)
    assert len(children) == 1 and _gone(children[0])
    assert loads_here == [1]  # the child loaded and folded it
    assert there.verdict == "equivalent" and there.fold["replicas"] == WORLD["dp"]
    _same(there, here)
    assert there.timings["load"] > 0 and there.timings["fold"] > 0
    # the child's guess was the pair it answered: encoded while it checked the other units
    assert len(aheads["prepared"]) == 1 and aheads["used"] == aheads["prepared"]


@pytest.mark.parametrize("bug", ["grad-scale-wrong", "drop-allreduce-keep-dataflow"])
def test_a_bug_in_a_folded_away_unit_is_caught(tmp_path, pair, monkeypatch, children, bug,
                                               aheads):
    broken, _ = _dropped_placement(pair[1], bug)
    paths = _write(tmp_path, pair[0], broken)
    there = _verify(paths, "always", monkeypatch)
    assert children and there.verdict == "violation", there.fold_note
    assert aheads["used"] == []  # a guess made before the bug was met is never judged
    _same(there, _verify(paths, "never", monkeypatch))


@pytest.fixture
def lazy_loads(monkeypatch, tmp_path):
    """The names of every document numbered in a forked process (as for a large one), so
    that the child reads the parallel plan's nodes without their names (built on demand,
    tvsmt.plan.reader.decode_document's `lazy`); how many plans were read so, counted in a
    file (the reads happen in the child)."""
    from tvsmt.plan import numbering, reader

    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 0)
    monkeypatch.setenv(forked.SECOND_CORE_ENV, "always")
    log = tmp_path / "lazy.log"
    plain = reader._lazy_nodes

    def logged(*args):
        with open(log, "a") as f:
            f.write("lazy\n")
        return plain(*args)

    monkeypatch.setattr(reader, "_lazy_nodes", logged)
    return lambda: log.read_text().count("lazy") if log.exists() else 0


@pytest.mark.parametrize("bug", [None, "grad-scale-wrong", "drop-allreduce-keep-dataflow"])
def test_nodes_built_on_demand_give_the_same_report(tmp_path, pair, monkeypatch, lazy_loads,
                                                    aheads, bug):
    """The child reads the plan's nodes without their names (their numbers from the forked
    numbering, their names from the tensor table): the same report as a load here, and a
    bug in a folded-away unit still caught."""
    parallel = pair[1] if bug is None else _dropped_placement(pair[1], bug)[0]
    paths = _write(tmp_path, pair[0], parallel)
    there = _verify(paths, "always", monkeypatch)
    assert lazy_loads() == 1  # the parallel plan, read in the child
    assert there.verdict == ("equivalent" if bug is None else "violation"), there.fold_note
    assert there.fold["replicas"] == WORLD["dp"]
    assert len(aheads["used"]) == (bug is None)
    _same(there, _verify(paths, "never", monkeypatch))


@pytest.mark.parametrize("guess", ["wrong", "refused"])
def test_a_guess_that_is_not_the_answer_is_never_judged(tmp_path, pair, monkeypatch,
                                                        children, aheads, guess):
    """The child's early guess of the folded pair (here made wrong on purpose: a lineage
    scale doubled, which would be a violation) is prepared, then dropped because the pair
    answered is not the same bytes: the verdict is the answered pair's. And a guess the
    child cannot make (the fold refuses it so early) changes nothing."""
    from fractions import Fraction

    from tvsmt.fold import folder
    from tvsmt.plan.model import replace

    finish = folder.Folder.finish

    def guessing(self, fetch=None, complete=True):
        got = finish(self, fetch, complete)
        if complete:
            return got
        if guess == "refused":
            raise folder.FoldRefused("no guess")
        lin = got.parallel.lineages[0]
        parts = (replace(lin.parts[0], scale=lin.parts[0].scale * Fraction(2)),
                 *lin.parts[1:])
        got.parallel.lineages[0] = folder.Lineage(lin.index, lin.single, parts, lin.aligned)
        return got

    monkeypatch.setattr(folder.Folder, "finish", guessing)
    paths = _write(tmp_path, *pair)
    there = _verify(paths, "always", monkeypatch)
    assert len(children) == 1 and _gone(children[0])
    assert there.verdict == "equivalent", [f.message for f in there.failures]
    assert len(aheads["prepared"]) == (guess == "wrong") and aheads["used"] == []
    if guess == "wrong":  # the guess alone would have been a violation
        ahead = aheads["prepared"][0]
        assert V.solve_and_judge(ahead.prepared, ahead.single, ahead.parallel,
                                 Options(jobs=1), V.Timer()).verdict == "violation"
    _same(there, _verify(paths, "never", monkeypatch))


def test_the_second_fold_comes_from_the_child(tmp_path, pair, monkeypatch, children):
    """A unit that is not a copy (a residual add with its operands swapped): the child folds
    twice, and the second fold is the one the report shows."""
    broken = copy.deepcopy(pair[1])
    node = next(n for n in broken["nodes"] if n["op"] == "add" and n["pass"] == "fw"
                and n["rank"] // PER_REPLICA == 3 and n["mb"] == 3
                and len(set(n["inputs"])) == 2)
    node["inputs"] = node["inputs"][::-1]
    paths = _write(tmp_path, pair[0], broken)
    there = _verify(paths, "always", monkeypatch)
    assert there.verdict == "equivalent" and len(children) == 1
    assert there.fold["exceptions"] == ["replica 3 micro-batch 3"]
    assert there.fold["second_fold"]["extra"] == 1
    _same(there, _verify(paths, "never", monkeypatch))


def test_a_refused_fold_is_verified_unfolded_here(tmp_path, pair, monkeypatch, children):
    broken = copy.deepcopy(pair[1])
    red = next(n for n in broken["nodes"] if n["op"] == "reducer"
               and n["rank"] // PER_REPLICA == 2 and len(n["inputs"]) > 1)
    red["inputs"] = red["inputs"][:-1]
    paths = _write(tmp_path, pair[0], broken)
    there = _verify(paths, "always", monkeypatch)
    assert len(children) == 1 and "misses" in there.fold_note
    assert there.verdict == "violation"
    _same(there, _verify(paths, "never", monkeypatch))


def test_a_malformed_plan_is_worded_as_by_a_load_here(tmp_path, pair, monkeypatch):
    broken = copy.deepcopy(pair[1])
    broken["nodes"][7]["inputs"].append("no-such-tensor")
    paths = _write(tmp_path, pair[0], broken)
    errors = []
    for how in ("always", "never"):
        with pytest.raises(PlanError) as e:
            _verify(paths, how, monkeypatch)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "no-such-tensor" in errors[0]


@pytest.mark.parametrize("failure", ["raises", "dies", "cut short"])
def test_a_failing_child_is_replaced_by_a_load_here(tmp_path, pair, monkeypatch, children,
                                                    failure):
    plain = FC._load_and_fold

    def broken_child(single_path, parallel_path, note=None):
        if failure == "dies":
            os._exit(3)
        if failure == "cut short":
            return plain(single_path, parallel_path, note)[:-200]
        raise MemoryError

    monkeypatch.setattr(FC, "_load_and_fold", broken_child)
    broken, _ = _dropped_placement(pair[1], "grad-scale-wrong")
    paths = _write(tmp_path, pair[0], broken)
    there = _verify(paths, "always", monkeypatch)
    assert len(children) == 1 and _gone(children[0])
    assert there.verdict == "violation" and there.fold["exceptions"]


def test_the_answer_brings_back_exactly_the_folded_pair(pair):
    """The folds travel as typed MessagePack: what comes back equals a fold here, down to
    the types of attribute values (tuple or list) and exact lineage scales."""
    from tvsmt.fold import Folded, fold_plans
    from tvsmt.plan import plan_from_dict

    broken = copy.deepcopy(pair[1])  # with an exception: both folds travel
    node = next(n for n in broken["nodes"] if n["op"] == "add" and n["pass"] == "fw"
                and n["rank"] // PER_REPLICA == 3 and n["mb"] == 3
                and len(set(n["inputs"])) == 2)
    node["inputs"] = node["inputs"][::-1]
    single, parallel = plan_from_dict(pair[0], "s"), plan_from_dict(broken, "p")
    folds = [fold_plans(single, parallel, 0), fold_plans(single, parallel, 1), "refused: why"]
    raw, phases = FC._FoldAnswer.decode_raw(FC._FoldAnswer.encode(folds, {"load": 1.5}))
    # as verify_folded_in_child decodes them: each fold's pair from its own bytes
    got = [f if isinstance(f, str) else Folded(*FC._FoldAnswer.decode_pair(f[0]), f[1])
           for f in raw]
    assert got == folds and phases == {"load": 1.5}

    def kinds(x):
        if isinstance(x, dict):
            return {k: kinds(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x), [kinds(v) for v in x]
        return type(x)

    for a, b in zip(folds[:2], got[:2]):
        for plan, back in ((a.single, b.single), (a.parallel, b.parallel)):
            assert [kinds(n.attrs) for n in plan.nodes] == [kinds(n.attrs) for n in back.nodes]
            assert [repr(x) for x in plan.lineages] == [repr(x) for x in back.lineages]


def test_every_lineage_part_comes_back_with_its_own_scale(pair):
    """Scales travel as text and each distinct text is parsed once (`_scale_decoder`):
    every part still gets its own value back."""
    import dataclasses
    from fractions import Fraction

    import msgspec

    from tvsmt.fold import fold_plans
    from tvsmt.plan import plan_from_dict

    folded = fold_plans(plan_from_dict(pair[0], "s"), plan_from_dict(pair[1], "p"), 0)
    scales = [Fraction(1), Fraction(1, 2), Fraction(-3, 4), Fraction(1, 2), Fraction(7)]
    lins = folded.parallel.lineages
    for k, lin in enumerate(lins[:12]):
        lins[k] = dataclasses.replace(lin, parts=tuple(
            msgspec.structs.replace(p, scale=scales[(k + j) % len(scales)])
            for j, p in enumerate(lin.parts)))
    back = FC._FoldAnswer.decode_pair(FC._FoldAnswer.encode_pair(folded))[1]
    want = [p.scale for lin in lins for p in lin.parts]
    assert [p.scale for lin in back.lineages for p in lin.parts] == want
    assert len(set(want)) == len(scales) - 1  # the test covers distinct and repeated texts


def test_an_answer_holding_anything_else_is_refused(tmp_path, pair, monkeypatch, children,
                                                    loads_here):
    """Only a folded pair's own records are built from the child's answer: anything else
    (here a pickle of a function that would run a command) is refused, never run, and the
    pair is loaded here instead."""
    import pickle

    class Trap:
        def __reduce__(self):
            return (os.system, ("echo unpickled > " + str(tmp_path / "ran"),))

    monkeypatch.setattr(FC, "_load_and_fold",
                        lambda *paths: pickle.dumps(([Trap()], {"load": 0.0})))
    paths = _write(tmp_path, *pair)
    there = _verify(paths, "always", monkeypatch)
    assert len(children) == 1 and loads_here == [1]
    assert not (tmp_path / "ran").exists()
    assert there.verdict == "equivalent" and there.fold["replicas"] == WORLD["dp"]


def test_the_timeline_lays_every_process_s_phases_side_by_side(tmp_path, pair):
    """$TVSMT_TIMELINE (tvsmt/timing.py, scripts/timeline.py): each phase's start and end
    from the process that ran it: the load and the fold from the forked child, with the guess
    sent inside its fold, the solving from the verifying process; nothing without it."""
    import subprocess
    import sys

    from tvsmt.timing import TIMELINE_ENV

    paths = _write(tmp_path, *pair)
    argv = [sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", "2", *paths]
    env = {k: v for k, v in os.environ.items() if k != TIMELINE_ENV}
    env[FC.FOLD_IN_CHILD_ENV] = "always"
    plain = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "timeline" not in plain.stderr
    proc = subprocess.Popen(argv, env={**env, TIMELINE_ENV: "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    spans: dict[tuple[int, str], tuple[float, float]] = {}
    for line in err.splitlines():
        tag, pid, name, start, end = line.split()
        assert tag == "timeline" and float(start) <= float(end), line
        spans[int(pid), name] = (float(start), float(end))
    child = {pid for pid, name in spans if name == "load"}
    assert len(child) == 1 and proc.pid not in child
    (child,) = child
    fold, guess = spans[child, "fold"], spans[child, "guess_sent"]
    assert fold[0] <= guess[0] <= fold[1]
    assert (proc.pid, "solving") in spans and (child, "solving") not in spans
    assert spans[child, "load"][1] <= spans[proc.pid, "solving"][0]
