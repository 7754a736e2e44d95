"""The streamed generator (frontends/stream.py) produces, unit by unit, exactly the plan the
tracer produces, and folding it verifies like folding the traced plan."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import numpy as np
import pytest

from tvsmt import forked as forked_policy
from tvsmt.fold import LoadedPlan, fold_source
from tvsmt.fold.folder import SumRefs
from tvsmt.frontends import generate_pair
from tvsmt.frontends.stream import StreamedPlan
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_source

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)


def _records(tensors, nodes, lineage_parts):
    return (Counter((t.id, t.shape) for t in tensors),
            Counter((n.id, n.op, n.pass_, n.rank, n.mb, n.inputs, n.outputs,
                     json.dumps(n.attrs, sort_keys=True, default=str)) for n in nodes),
            Counter((lin, p.slice, p.sum_of, p.scale) for lin, p in lineage_parts))


@pytest.mark.parametrize("world", [dict(dp=3, tp=2, pp=2, mb=4), dict(dp=4, tp=1, pp=2, mb=1),
                                   dict(dp=1, tp=2, pp=1, mb=3)])
def test_streamed_plan_is_the_traced_plan(world):
    _, parallel = generate_pair("llama3", layers=2, **world, **DIMS)
    traced = plan_from_dict(parallel, "p")
    stream = StreamedPlan("llama3", layers=2, **world, **DIMS)
    tensors, nodes, parts = [], [], []
    glob = stream.global_records()
    parts += [(lin, p.__class__(p.slice, glob.sum_of(j), p.scale))
              for j, (lin, _, p) in enumerate(glob.parts)]
    for u in stream.units():
        r = stream.records(u)
        tensors += r.tensors
        nodes += [n for _, n in r.nodes]
        parts += [(lin, p) for lin, _, p in r.parts]
    want = _records(traced.tensors.values(), traced.nodes,
                    [(lin.index, p) for lin in traced.lineages for p in lin.parts])
    got = _records(tensors, nodes, parts)
    for w, g, what in zip(want, got, ("tensors", "nodes", "lineage parts")):
        assert w == g, (what, list((w - g).items())[:3], list((g - w).items())[:3])
    assert stream.header.world == traced.world


def test_streamed_and_loaded_folds_agree():
    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    single, parallel = generate_pair("llama3", **world)
    s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
    loaded = fold_source(LoadedPlan(s, p))
    streamed = fold_source(StreamedPlan("llama3", **world), jobs=2)
    assert loaded.info.checked == streamed.info.checked
    assert {n.id for n in loaded.parallel.nodes} == {n.id for n in streamed.parallel.nodes}
    assert loaded.single.tensors == streamed.single.tensors
    produced: set = set()  # the folded nodes are still in a topological order
    outputs = {o for n in streamed.parallel.nodes for o in n.outputs}
    for n in streamed.parallel.nodes:
        assert all(x is None or x not in outputs or x in produced for x in n.inputs), n.id
        produced.update(n.outputs)


@pytest.mark.parametrize("bug,prefix", [
    ("grad-scale-wrong", "L1.ffn.up:BW.linear@"),
    ("drop-allreduce-keep-dataflow", "L1.attn.out~1:all_reduce@"),
])
def test_streamed_mutation_in_one_unit_is_caught(bug, prefix):
    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    clean = verify_source(StreamedPlan("llama3", **world), Options(jobs=2))
    assert clean.verdict == "equivalent" and clean.fold["exceptions"] == []
    broken = verify_source(StreamedPlan("llama3", **world, mutation=(bug, (3, 2), prefix)),
                           Options(jobs=2))
    assert broken.verdict == "violation"
    assert broken.fold["exceptions"] == ["replica 3 micro-batch 2"]
    in_unit = re.compile(r"@r1[2-5]m2$")  # replica 3 = ranks 12..15, micro-batch 2
    assert any(in_unit.search(t) for f in broken.failures for t in f.parallel_tensors), \
        [f.message for f in broken.failures]


def test_a_streamed_plan_that_cannot_be_folded_is_not_passed():
    """If one streamed unit does not fit folding (here a reducer on replica 3 that misses a
    replica), the plan cannot be verified unfolded either, since it is never held whole: the
    verdict is inconclusive, never equivalent."""

    class Broken(StreamedPlan):
        def table(self, unit):
            tab = super().table(unit)
            if unit == (3, None):
                i = next(i for i in range(len(tab.n_op))
                         if self.intern.values[tab.n_op[i]] == "reducer")
                a = tab.n_in_ptr[i + 1] - 1  # drop the reducer's last input
                tab.n_in = np.delete(tab.n_in, a, axis=0)
                tab.n_in_ptr[i + 1:] -= 1
            return tab

    world = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)
    report = verify_source(Broken("llama3", **world), Options(jobs=1))
    assert report.verdict == "inconclusive" and "misses" in report.fold_note
    assert "cannot be verified" in report.failures[0].message


# ------------------------------------------------ units streamed from a file into the folder

FILE_WORLD = dict(layers=2, dp=4, tp=2, pp=2, mb=4, **DIMS)


@pytest.fixture(scope="module")
def unit_file(tmp_path_factory):
    """A Llama3 pair on disk: the single plan, and the parallel plan in the JSON Lines form
    written unit by unit (one section per unit)."""
    from tvsmt.frontends.builder import write_plan, write_unit_source

    folder = tmp_path_factory.mktemp("units")
    single, _ = generate_pair("llama3", **FILE_WORLD)
    s = write_plan(folder / "single.json.gz", single)
    p = write_unit_source(folder / "parallel.jsonl", StreamedPlan("llama3", **FILE_WORLD))
    return s, p


def _opts():
    return Options(jobs=1, progress=None, corpus=None)


def _scanned_source(single, path):
    """A JSON Lines file as `tvsmt verify` folds it: read in one pass into columns
    (tvsmt/plan/scan.py), split into units over them (tvsmt/fold/columns.py)."""
    from tvsmt.fold.columns import ColumnPlan
    from tvsmt.plan.scan import scan_plan

    scanned = scan_plan(path)
    return ColumnPlan(single, scanned.header_plan(), scanned.columns)


def test_a_file_folds_from_its_columns_as_its_loaded_plan_folds(unit_file, monkeypatch):
    """The file read into columns folds exactly as the same file loaded whole, and only the
    records of the units the fold keeps are ever built (of 16 units, 4 kept)."""
    from tvsmt.fold import fold_plans
    from tvsmt.plan import load_plan
    from tvsmt.plan import scan as scan_module
    from tvsmt.verify import verify_pair

    built: list[int] = []
    nodes_of = scan_module._Records.nodes
    monkeypatch.setattr(scan_module._Records, "nodes",
                        lambda self, idx: built.extend(idx) or nodes_of(self, idx))
    s, p = unit_file
    single = load_plan(s)
    streamed = fold_source(_scanned_source(single, p))
    loaded = fold_plans(single, load_plan(p))
    assert streamed.info == loaded.info
    assert streamed.info.exceptions == [] and streamed.info.kept_units == 4
    assert streamed.parallel.nodes == loaded.parallel.nodes
    assert streamed.parallel.tensors == loaded.parallel.tensors
    assert streamed.parallel.lineages == loaded.parallel.lineages
    assert streamed.single.tensors == loaded.single.tensors
    kept = len(streamed.parallel.nodes)
    total = streamed.info.checked["nodes"]
    assert kept <= len(set(built)) < kept + total // 8, (len(set(built)), kept, total)
    report = verify_pair(s, p, _opts())
    assert report.verdict == "equivalent" and report.fold_note is None
    assert report.fold["kept_units"] == 4 and report.fold["exceptions"] == []


def _rewrite(src: str, dst: str, change) -> None:
    """Copy a JSON Lines plan record by record, `change(section name, node dict)` editing
    nodes on the way (a bug planted in the file itself, not by the generator)."""
    from tvsmt.plan.model import Lineage, Node, TensorInfo
    from tvsmt.plan.stream import Section, StreamWriter, iter_records, node_dict, part_dict

    it = iter_records(src)
    h = next(it)
    section = ""
    with StreamWriter(dst, h.kind, h.name, h.world, h.outputs, h.sections) as w:
        for r in it:
            if type(r) is Section:
                section = r.name
                w.section(r.name)
            elif type(r) is TensorInfo:
                w.tensor(r.id, r.shape, r.role)
            elif type(r) is Node:
                w.node(change(section, node_dict(r)))
            elif type(r) is Lineage:
                w.lineage({"single": r.single, "parts": [part_dict(x) for x in r.parts]})


def _sub_for_add(n) -> bool:
    if n["op"] == "add" and n["pass"] == "fw":
        n["op"] = "sub"
        return True
    return False


def _cube_for_square(n) -> bool:
    if n["op"] == "pow" and n["pass"] == "fw" and n["attrs"].get("consts") == [2]:
        n["attrs"] = {**n["attrs"], "consts": [3]}
        return True
    return False


def _in_unit(section_name: str, edit):
    done = []

    def change(section, n):
        if not done and section == section_name and edit(n):
            done.append(n["id"])
        return n
    return change, done


@pytest.mark.parametrize("edit", [_sub_for_add, _cube_for_square], ids=["op", "attrs"])
def test_a_bug_in_one_unit_read_from_disk_is_caught_and_named(unit_file, tmp_path, edit):
    """One node of replica 3, micro-batch 2 is edited in the file (an add becomes a sub, or
    a square a cube: only the attributes' text differs, which the scan keeps as a code of
    the text): the folder finds that unit is no copy, keeps it (its records built from the
    columns), and the verdict is a violation that names a tensor of that unit."""
    from tvsmt.verify import verify_pair

    s, p = unit_file
    change, done = _in_unit("unit replica 3 micro-batch 2", edit)
    bad = str(tmp_path / "bug.jsonl")
    _rewrite(p, bad, change)
    assert done
    report = verify_pair(s, bad, _opts())
    assert report.verdict == "violation", report.fold_note
    assert report.fold["exceptions"] == ["replica 3 micro-batch 2"]
    in_unit = re.compile(r"@r1[2-5]m2$")  # replica 3 = ranks 12..15, micro-batch 2
    assert any(in_unit.search(t) for f in report.failures for t in f.parallel_tensors), \
        [f.message for f in report.failures]


def _weight_of_replica_0(p: str):
    """An edit making a node of replica 1 read a weight of replica 0 (same shape)."""
    from tvsmt.plan.model import Node, TensorInfo
    from tvsmt.plan.stream import Section, iter_records

    info, read0, section = {}, {}, ""
    for r in iter_records(p):
        if type(r) is Section:
            section = r.name
        elif type(r) is TensorInfo:
            info[r.id] = r
        elif type(r) is Node and section == "unit replica 0 micro-batch 0":
            for x in r.inputs:
                if x in info and info[x].role == "param":
                    read0.setdefault(info[x].shape, x)

    def edit(n):
        for k, x in enumerate(n["inputs"]):
            if (x in info and info[x].role == "param" and x not in read0.values()
                    and info[x].shape in read0):
                n["inputs"][k] = read0[info[x].shape]
                return True
        return False
    return edit


@pytest.mark.parametrize("edit", ["op", "attrs", "weight of replica 0"])
def test_an_edited_file_folds_as_its_loaded_plan_folds(unit_file, tmp_path, edit):
    """Whatever the file holds, its fold from the columns is the loaded plan's fold: the same
    units checked, the same exceptions, the same folded pair (or the same refusal)."""
    from tvsmt.fold import FoldRefused, fold_plans
    from tvsmt.plan import load_plan

    s, p = unit_file
    fn = {"op": _sub_for_add, "attrs": _cube_for_square,
          "weight of replica 0": _weight_of_replica_0(p)}[edit]
    change, done = _in_unit("unit replica 1 micro-batch 0" if edit.startswith("weight")
                            else "unit replica 3 micro-batch 2", fn)
    bad = str(tmp_path / "edited.jsonl")
    _rewrite(p, bad, change)
    assert done
    single = load_plan(s)
    outcomes = []
    for fold in (lambda: fold_source(_scanned_source(single, bad)),
                 lambda: fold_plans(single, load_plan(bad))):
        try:
            f = fold()
            outcomes.append((f.info, f.parallel.nodes, f.parallel.tensors,
                             f.parallel.lineages))
        except FoldRefused as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


def test_a_file_not_grouped_by_unit_folds_from_its_columns(unit_file, tmp_path):
    """Units are found from the columns, wherever their records lie in the file: a file
    written from a document (one stream, no sections) folds as the sectioned one does."""
    from tvsmt.frontends.builder import write_plan
    from tvsmt.verify import verify_pair

    s, _ = unit_file
    _, parallel = generate_pair("llama3", **FILE_WORLD)
    p = write_plan(tmp_path / "p.jsonl", parallel)  # one stream, no sections
    report = verify_pair(s, p, _opts())
    assert report.verdict == "equivalent" and report.fold_note is None
    assert report.fold["kept_units"] == 4 and report.fold["exceptions"] == []


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def _expect_one_line(single, lines, tmp_path, *words):
    from tvsmt.errors import PlanError
    from tvsmt.verify import verify_pair

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(PlanError) as e:
        verify_pair(single, str(bad), _opts())
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "bad.jsonl" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_malformed_unit_files_are_one_line_errors_on_the_streaming_path(unit_file, tmp_path):
    s, p = unit_file
    lines = _lines(p)
    recs = [json.loads(x) for x in lines]
    sections = [k for k, r in enumerate(recs) if r["r"] == "section"]
    # truncated: the trailer is missing
    _expect_one_line(s, lines[:-1], tmp_path, "truncated", "no trailer")
    _expect_one_line(s, lines[: len(lines) // 2], tmp_path, "truncated")
    # a unit missing: its whole section (marker and records) dropped
    a, b = sections[3], sections[4]
    _expect_one_line(s, lines[:a] + lines[b:], tmp_path, "line", "section #", "missing")
    # records out of order: a unit's node after the lineages
    k = next(i for i in range(sections[2], len(recs)) if recs[i]["r"] == "node")
    _expect_one_line(s, lines[:k] + lines[k + 1:-1] + [lines[k], lines[-1]], tmp_path,
                     "after the lineages", "out of order")
    # a unit's records from another plan (same layout, another write): a second header, or
    # a trailer of another plan
    other = str(tmp_path / "other.jsonl")
    _rewrite(p, other, lambda section, n: n)
    o = _lines(other)
    _expect_one_line(s, lines[:sections[5]] + o[:sections[6]] + lines[sections[6]:], tmp_path,
                     "second header", "another plan")
    _expect_one_line(s, lines[:-1] + o[-1:], tmp_path, "trailer belongs to plan")


def _malformed_variants(p: str, tmp_path) -> dict[str, list[str]]:
    """Unit files broken in ways the checks catch; several of them would fold without a
    hitch if nothing checked them (the edited role, the id used twice, the unread tensor)."""
    lines = _lines(p)
    recs = [json.loads(x) for x in lines]
    sections = [k for k, r in enumerate(recs) if r["r"] == "section"]
    nodes = [k for k, r in enumerate(recs) if r["r"] == "node"]
    k = next(i for i in range(sections[2], len(recs)) if recs[i]["r"] == "node")
    other = str(tmp_path / "other.jsonl")
    _rewrite(p, other, lambda section, n: n)
    o = _lines(other)
    edited = next(i for i in range(sections[9], len(recs))
                  if recs[i]["r"] == "tensor" and recs[i]["role"] == "input")
    dup = dict(recs[nodes[-1]], id=recs[nodes[3]]["id"])  # an id of another unit's node
    dangling = dict(recs[k], inputs=["nowhere", *recs[k]["inputs"][1:]])
    listed = dict(recs[k], attrs=[1])  # attributes that are no object (the scan keeps text)
    role = lines[edited].replace('"input"', '"activation"')
    assert role != lines[edited]
    return {
        "truncated": lines[:-1],
        "half": lines[: len(lines) // 2],
        "unit missing": lines[:sections[3]] + lines[sections[4]:],
        "out of order": lines[:k] + lines[k + 1:-1] + [lines[k], lines[-1]],
        "another plan's unit": lines[:sections[5]] + o[:sections[6]] + lines[sections[6]:],
        "another plan's trailer": lines[:-1] + o[-1:],
        "edited record": lines[:edited] + [role] + lines[edited + 1:],
        "node id used twice": lines[:nodes[-1]] + [json.dumps(dup) + "\n"] + lines[nodes[-1] + 1:],
        "dangling reference": lines[:k] + [json.dumps(dangling) + "\n"] + lines[k + 1:],
        "attributes no object": lines[:k] + [json.dumps(listed) + "\n"] + lines[k + 1:],
    }


def test_a_malformed_file_gets_the_record_checks_own_error(unit_file, tmp_path):
    """`tvsmt verify` reads a JSON Lines file in one pass into columns; whatever that pass
    refuses is worded by the record-by-record checks: every malformed file fails with
    exactly the one-line error `check_stream` (and `read_stream`) gives."""
    from tvsmt.errors import PlanError
    from tvsmt.plan import stream
    from tvsmt.verify import verify_pair

    s, p = unit_file
    for name, lines in _malformed_variants(p, tmp_path).items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text("".join(lines), encoding="utf-8")
        with pytest.raises(PlanError) as checked:
            stream.check_stream(str(bad))
        with pytest.raises(PlanError) as built:
            stream.read_stream(str(bad))
        assert str(built.value) == str(checked.value), name
        with pytest.raises(PlanError) as verified:
            verify_pair(s, str(bad), _opts())
        assert str(verified.value) == str(checked.value), name
        assert len(str(verified.value).splitlines()) == 1 and "bad.jsonl" in str(verified.value)


def test_the_second_core_is_used_only_when_a_core_is_idle(monkeypatch):
    """Idle: fewer tasks runnable at this instant than cores (this one counted), or where
    the system does not say, a 1-minute load average below cores - 0.5."""
    from tvsmt import forked as F

    assert F.runnable_now() is None or F.runnable_now() >= 1  # this process runs
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for running, load, forced, forked in (
            (1, 1.7, None, True), (2, 0.1, None, False), (3, 0.1, True, True),
            (1, 0.1, False, False), (None, 0.9, None, True), (None, 1.7, None, False)):
        monkeypatch.setattr(F, "runnable_now", lambda running=running: running)
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        monkeypatch.setattr(forked_policy, "PARALLEL", forced)
        assert forked_policy.use_second_core() is forked, (running, load, forced)
    monkeypatch.setattr(forked_policy, "PARALLEL", None)  # from outside: the environment
    for value, running, forked in (("always", 9, True), ("never", 1, False),
                                   ("", 1, True), ("", 2, False)):
        monkeypatch.setenv(forked_policy.SECOND_CORE_ENV, value)
        monkeypatch.setattr(F, "runnable_now", lambda running=running: running)
        assert forked_policy.use_second_core() is forked, (value, running)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(forked_policy, "PARALLEL", True)
    assert forked_policy.use_second_core() is False


def test_a_busy_instant_is_looked_at_again_before_it_stands(monkeypatch):
    """One sample of a busy machine is not enough to read alone: it is taken again, up to
    BUSY_SAMPLES in all, and the fewest tasks runnable decide."""
    from tvsmt import forked as F

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(F, "PARALLEL", None)
    monkeypatch.delenv(F.SECOND_CORE_ENV, raising=False)
    for samples, idle in (([1], True), ([2, 1], True), ([3, 2, 1], True), ([2, 2, 2], False),
                          ([2, 2, 2, 1], False), ([4, 3, 2], False)):
        taken = iter(samples)
        monkeypatch.setattr(F, "runnable_now", lambda: next(taken))
        assert F.use_second_core() is idle, samples
        assert len(list(taken)) == max(0, len(samples) - F.BUSY_SAMPLES), samples


def test_tables_over_the_scanned_columns_are_the_reference_tables(unit_file):
    """The units, tables and records of the file folded from its columns are those of the
    node-by-node split of the loaded plan (source.LoadedPlan, the reference), column for
    column."""
    from dataclasses import fields

    from tvsmt.plan import load_plan

    s, p = unit_file
    single = load_plan(s)
    fast = _scanned_source(single, p)
    slow = LoadedPlan(single, load_plan(p))
    interned = ("t_shape", "n_op", "n_pass", "n_attrs", "p_scale")
    assert fast.units() == slow.units()
    for u in fast.units():
        a, b = fast.table(u), slow.table(u)
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert x.shape == y.shape, (u, f.name)
            if f.name in interned:
                x = [fast.intern.values[i] for i in x.tolist()]
                y = [slow.intern.values[i] for i in y.tolist()]
                assert x == y, (u, f.name)
            else:
                assert np.array_equal(x, y), (u, f.name)
        ra, rb = fast.records(u), slow.records(u)
        assert (ra.tensors, ra.nodes, ra.parts) == (rb.tensors, rb.nodes, rb.parts), u
    ga, gb = fast.global_records(), slow.global_records()
    assert (ga.tensors, ga.parts) == (gb.tensors, gb.parts)
    assert [r.pairs() if isinstance(r, SumRefs) else r for r in ga.part_refs] == \
        [r.pairs() if isinstance(r, SumRefs) else r for r in gb.part_refs]


class _CountingPlan(StreamedPlan):
    """Counts the unit tables built in this process (forked workers count in their own)."""

    built_here: list = []

    def table(self, unit):
        import os

        if os.getpid() == self._owner:
            self.built_here.append(unit)
        return super().table(unit)


def _counting(**kw):
    import os

    plan = _CountingPlan("llama3", **kw)
    plan._owner = os.getpid()
    plan.built_here = []
    return plan


PARALLEL_WORLD = dict(layers=2, dp=5, tp=2, pp=2, mb=5, **DIMS)  # 30 units: 24 checked by workers


def test_units_are_checked_by_the_workers_and_fold_as_serially():
    """With jobs=2 the units after the representatives are checked in worker processes and
    none comes back to be re-checked here; the fold equals the serial one."""
    serial = fold_source(StreamedPlan("llama3", **PARALLEL_WORLD), jobs=1)
    plan = _counting(**PARALLEL_WORLD)
    parallel = fold_source(plan, jobs=2)
    kept = {(d, m) for d in range(2) for m in range(2)} | {(0, None), (1, None)}
    assert set(plan.built_here) == kept
    assert parallel.info.checked == serial.info.checked
    assert parallel.info.exceptions == serial.info.exceptions == []
    assert {n.id for n in parallel.parallel.nodes} == {n.id for n in serial.parallel.nodes}


def test_units_no_worker_answered_for_are_never_folded_away(monkeypatch):
    """The folded pair is built only once every unit has been compared with its
    representative: when the workers' answers for a chunk of units go missing (a bug, not
    an input), the fold stops with an internal error instead of folding them away unseen."""
    from tvsmt.errors import InternalError
    from tvsmt.fold import source

    real = source._check_parallel
    monkeypatch.setattr(source, "_check_parallel", lambda *a, **k: real(*a, **k)[:-1])
    with pytest.raises(InternalError, match=r"the fold never checked \d+ of its 30 units"):
        fold_source(StreamedPlan("llama3", **PARALLEL_WORLD), jobs=2)


def test_a_bug_in_a_unit_checked_by_a_worker_is_caught():
    bug = ("grad-scale-wrong", (4, 3), "L1.ffn.up:BW.linear@")
    plan = _counting(**PARALLEL_WORLD, mutation=bug)
    report = verify_source(plan, Options(jobs=2))
    assert report.verdict == "violation"
    assert report.fold["exceptions"] == ["replica 4 micro-batch 3"]
    assert (4, 3) in plan.built_here  # found by a worker, re-checked (and kept) here


def test_streamed_unit_tables_are_the_traced_plans_tables():
    """Every streamed unit's table (what the folder checks; replica units widened over
    columns) equals the table built from the traced plan's records of that unit."""
    from dataclasses import fields

    world = dict(layers=2, dp=3, tp=2, pp=2, mb=3, **DIMS)
    single, parallel = generate_pair("llama3", **world)
    loaded = LoadedPlan(plan_from_dict(single, "s"), plan_from_dict(parallel, "p"))
    stream = StreamedPlan("llama3", **world)
    interned = {"t_shape", "n_op", "n_pass", "n_attrs"}

    def unpadded(row):  # slices are -1 padded (the stream's to the widest it holds)
        while row and row[-1] == -1:
            row = row[:-1]
        return tuple(row)

    def parts(src, tab):  # a replica unit's parts may come in another order
        return sorted((lin, str(src.intern.values[sc]), unpadded(slc),
                       tuple(map(tuple, tab.p_sum[tab.p_sum_ptr[i]:tab.p_sum_ptr[i + 1]])))
                      for i, (lin, sc, slc) in enumerate(zip(
                          tab.p_lin.tolist(), tab.p_scale.tolist(), tab.p_slice.tolist())))

    assert set(loaded.units()) == set(stream.units())
    for u in stream.units():
        a, b = loaded.table(u), stream.table(u)
        for f in fields(a):
            if f.name.startswith("p_") or f.name == "n_pos":
                continue  # parts below; positions in the plan: the stream orders by unit
            x, y = getattr(a, f.name).tolist(), getattr(b, f.name).tolist()
            if f.name in interned:
                x = [loaded.intern.values[i] for i in x]
                y = [stream.intern.values[i] for i in y]
            assert x == y, (u, f.name)
        assert parts(loaded, a) == parts(stream, b), u


def test_every_slice_is_checked_against_the_single_plan_also_in_units_folded_away(
        unit_file, tmp_path):
    """A single plan whose tensor is smaller than the parallel plan's lineages say: the
    pair is checked over the stream's columns (every part's slice, like the document reader
    does), so the same one-line input error, found without reading the 3.6M-node file whole
    (the fold would refuse the pair and send it there)."""
    from tvsmt.errors import PlanError
    from tvsmt.frontends.builder import write_plan
    from tvsmt.plan import load_plan
    from tvsmt.verify import verify_pair

    s, p = unit_file
    single, parallel = generate_pair("llama3", **FILE_WORLD)
    target = next(lin["single"] for lin in parallel["lineages"]
                  if len(single["tensors"][lin["single"]]["shape"]) == 2
                  and single["tensors"][lin["single"]]["shape"][0] > 1)
    shape = single["tensors"][target]["shape"]
    single["tensors"][target]["shape"] = [shape[0] - 1, *shape[1:]]
    small = write_plan(tmp_path / "single.json.gz", single)
    doc = write_plan(tmp_path / "parallel.json.gz", parallel)
    with pytest.raises(PlanError) as whole:
        verify_pair(small, doc, _opts())
    from tvsmt.plan import stream

    def never(*a, **k):
        raise AssertionError("the file was read whole")
    mp = pytest.MonkeyPatch()
    mp.setattr(stream, "read_stream", never)
    try:
        with pytest.raises(PlanError) as streamed:
            verify_pair(small, p, _opts())
    finally:
        mp.undo()
    assert "outside the full shape" in str(whole.value)
    assert str(streamed.value).replace(p, doc) == str(whole.value)
    assert load_plan(p)  # the stream itself is sound
