"""The streaming form (JSON Lines, docs/format.md): round trips, the record iterator, the
generator's `--format jsonl`, atomic writes, and one-line errors for malformed streams."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.errors import PlanError
from tvsmt.fold import fold_plans
from tvsmt.frontends.builder import write_plan, write_unit_source
from tvsmt.frontends.generator import generate_pair
from tvsmt.plan import Lineage, Node, TensorInfo, load_plan, plan_from_dict
from tvsmt.plan.scan import NotScanned, scan_plan
from tvsmt.plan.stream import Section, StreamHeader, StreamWriter, iter_records


def same_plan(a, b) -> None:
    assert a.kind == b.kind and a.name == b.name and a.world == b.world
    assert a.tensors == b.tensors
    assert a.nodes == b.nodes and [n.attrs for n in a.nodes] == [n.attrs for n in b.nodes]
    assert a.lineages == b.lineages and a.outputs == b.outputs


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip_equals_the_document_form(tmp_path, suffix):
    for plan in (single_mlp(), parallel_mlp()):
        doc = write_plan(tmp_path / f"{plan['kind']}.json", plan)
        lines = write_plan(tmp_path / f"{plan['kind']}{suffix}", plan)
        same_plan(load_plan(doc), load_plan(lines))


def test_content_decides_the_form_not_only_the_name(tmp_path):
    lines = write_plan(tmp_path / "p.jsonl", parallel_mlp())
    os.rename(lines, tmp_path / "p.txt")
    same_plan(load_plan(tmp_path / "p.txt"), plan_from_dict(parallel_mlp(), "x") and
              load_plan(write_plan(tmp_path / "q.json", parallel_mlp())))


def test_iterator_yields_header_then_records_in_file_order(tmp_path):
    path = write_plan(tmp_path / "p.jsonl", parallel_mlp())
    it = iter_records(path)
    header = next(it)
    assert isinstance(header, StreamHeader) and header.kind == "parallel"
    kinds = [type(r) for r in it]
    assert set(kinds) == {TensorInfo, Node, Lineage}
    first_lineage = kinds.index(Lineage)
    assert Node not in kinds[first_lineage:]


def test_generated_stream_is_verified_from_the_file(tmp_path):
    out = tmp_path / "g"
    r = CliRunner().invoke(main, ["plan", "generate", "--model", "mlp", "--dp", "2", "--tp",
                                  "2", "-o", str(out), "--format", "jsonl"])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["parallel.jsonl.gz", "single.jsonl.gz"]
    r = CliRunner().invoke(main, ["verify", str(out / "single.jsonl.gz"),
                                  str(out / "parallel.jsonl.gz"), "--no-corpus", "--jobs", "1"])
    assert r.exit_code == 0, r.output


def test_unit_by_unit_writer_gives_the_generators_plan(tmp_path):
    """`write_unit_source` (what `plan generate --format jsonl` uses for big worlds) writes
    the plan the tracer gives, in sections, in an order the reader accepts."""
    from tvsmt.frontends.stream import StreamedPlan

    kw = dict(layers=2, dp=3, tp=1, pp=2, mb=3)
    path = write_unit_source(tmp_path / "p.jsonl.gz", StreamedPlan("llama3", **kw))
    streamed = load_plan(path)
    _, parallel = generate_pair("llama3", **kw)
    traced = plan_from_dict(parallel, "traced")
    assert set(streamed.nodes) == set(traced.nodes)
    assert {t: i.shape for t, i in streamed.tensors.items()} == \
        {t: i.shape for t, i in traced.tensors.items()}
    # the same parts in the same order (replica units' parts listed once per micro-batch
    # included), so the file folds exactly as the traced plan does
    assert [(lin.single, lin.parts) for lin in streamed.lineages] == \
        [(lin.single, lin.parts) for lin in traced.lineages]
    single = plan_from_dict(generate_pair("llama3", **kw)[0], "single")
    from_file, from_tracer = fold_plans(single, streamed), fold_plans(single, traced)
    assert from_file.info == from_tracer.info and from_file.info.exceptions == []
    sections = [r.name for r in iter_records(path) if isinstance(r, Section)]
    assert len(sections) == 3 * 3 + 2 and "unit replica 2 micro-batch 1" in sections


# ------------------------------------------------------------------ malformed streams


def lines_of(tmp_path, plan=None) -> list[str]:
    path = write_plan(tmp_path / "orig.jsonl", plan or parallel_mlp())
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def write_lines(tmp_path, lines, name="bad.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def expect_error(path, *words):
    with pytest.raises(PlanError) as e:
        load_plan(path)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "Traceback" not in msg
    assert os.path.basename(path) in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_truncated_at_a_record_boundary(tmp_path):
    lines = lines_of(tmp_path)
    expect_error(write_lines(tmp_path, lines[:-1]), "truncated", "no trailer")
    expect_error(write_lines(tmp_path, lines[: len(lines) // 2]), "truncated")


def test_truncated_inside_a_record(tmp_path):
    lines = lines_of(tmp_path)
    cut = lines[:5] + [lines[5][:17]]
    expect_error(write_lines(tmp_path, cut), f"line {len(cut)}", "not valid JSON")


def test_truncated_gzip_stream(tmp_path):
    path = write_plan(tmp_path / "p.jsonl.gz", parallel_mlp())
    data = open(path, "rb").read()
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2])
    expect_error(str(bad))


def test_records_out_of_order(tmp_path):
    lines = lines_of(tmp_path)
    kinds = [json.loads(x)["r"] for x in lines]
    node = kinds.index("node")
    # a node moved after the lineages
    moved = lines[:node] + lines[node + 1:-1] + [lines[node], lines[-1]]
    expect_error(write_lines(tmp_path, moved), "after the lineages", "out of order")
    # two dependent nodes swapped: the reader names the line and the tensor
    recs = [json.loads(x) for x in lines]
    i = next(k for k, r in enumerate(recs) if r["r"] == "node" and recs[k + 1]["r"] == "node"
             and set(recs[k]["outputs"]) & set(recs[k + 1]["inputs"]))
    swapped = lines[:i] + [lines[i + 1], lines[i]] + lines[i + 2:]
    expect_error(write_lines(tmp_path, swapped), f"line {i + 2}", "topological")
    # a tensor declared after a node that reads it
    t = kinds.index("tensor")
    late = lines[:t] + lines[t + 1:node + 1] + [lines[t]] + lines[node + 1:]
    expect_error(write_lines(tmp_path, late), "undeclared")


def test_a_missing_section(tmp_path):
    w = StreamWriter(tmp_path / "s.jsonl", "parallel", "p", {}, sections=3)
    for k in range(3):
        w.section(f"unit {k}")
    w.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines(keepends=True)
    expect_error(write_lines(tmp_path, lines[:2] + lines[3:]), "line 3", "section #2",
                 "#1 was expected", "missing")


def test_a_unit_missing_without_its_marker_is_caught_by_the_trailer(tmp_path):
    lines = lines_of(tmp_path)
    kinds = [json.loads(x)["r"] for x in lines]
    first = kinds.index("node")
    expect_error(write_lines(tmp_path, lines[:first] + lines[first + 1:]), "")


def test_records_from_another_plan(tmp_path):
    a = lines_of(tmp_path)
    b = lines_of(tmp_path, parallel_mlp(dp=1, tp=2))
    expect_error(write_lines(tmp_path, a[:-1] + b), "second header", "another plan")
    expect_error(write_lines(tmp_path, a[:-1] + b[-1:]), "trailer belongs to plan")


def test_edited_record_fails_the_checksum(tmp_path):
    lines = lines_of(tmp_path)
    k = next(i for i, x in enumerate(lines) if '"role":"param"' in x)
    lines[k] = lines[k].replace('"role":"param"', '"role":"input"')
    expect_error(write_lines(tmp_path, lines), "checksum")


def test_bad_first_line_and_empty_lines(tmp_path):
    lines = lines_of(tmp_path)
    expect_error(write_lines(tmp_path, lines[1:], "a.jsonl"), "line 1", "header")
    expect_error(write_lines(tmp_path, lines[:3] + ["\n"] + lines[3:], "b.jsonl"), "line 4",
                 "empty line")
    expect_error(write_lines(tmp_path, [], "c.jsonl"), "empty file")


def test_a_malformed_record_names_its_line_and_node(tmp_path):
    lines = lines_of(tmp_path)
    k = next(i for i, x in enumerate(lines) if '"r":"node"' in x)
    rec = json.loads(lines[k])
    rec["rank"] = "zero"
    lines[k] = json.dumps(rec) + "\n"
    expect_error(write_lines(tmp_path, lines), f"line {k + 1}", "rank")
    rec["rank"], rec["op"] = 0, "warp_drive"
    lines[k] = json.dumps(rec) + "\n"
    expect_error(write_lines(tmp_path, lines), f"line {k + 1}", rec["id"], "warp_drive")


def test_a_bad_lineage_is_worded_by_the_reference_validator(tmp_path):
    lines = lines_of(tmp_path)
    k = next(i for i, x in enumerate(lines) if '"r":"lineage"' in x)
    rec = json.loads(lines[k])
    rec["parts"][0]["slice"] = [[0, 1]] * len(rec["parts"][0]["slice"])
    lines[k] = json.dumps(rec) + "\n"
    expect_error(write_lines(tmp_path, lines), f"line {k + 1}", "differs from the slice shape")


def test_record_size_limit(tmp_path, monkeypatch):
    """The first line longer than the limit is named, by the record-by-record reading and by
    the one-pass scan alike."""
    path = write_plan(tmp_path / "p.jsonl", parallel_mlp())
    with open(path, "rb") as f:
        lengths = [len(line) - 1 for line in f]
    limit = sorted(lengths)[len(lengths) // 2]  # about half the lines are longer
    first = next(k for k, n in enumerate(lengths) if n > limit) + 1
    monkeypatch.setenv("TVSMT_MAX_RECORD_BYTES", str(limit))
    expect_error(path, f"line {first}: record longer than the limit", "TVSMT_MAX_RECORD_BYTES")
    with pytest.raises(PlanError) as e:
        scan_plan(str(path))
    assert f"line {first}: record longer than the limit" in str(e.value)


def test_zeros_as_a_stream_are_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TVSMT_MAX_RECORD_BYTES", str(1 << 20))
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(64):
            f.write(bytes(1 << 20))
    expect_error(str(bomb), "longer than the limit")


# ------------------------------------------------------------------ atomic writes


WRITER = textwrap.dedent("""
    import os, signal, sys
    from tvsmt.plan.stream import StreamWriter
    w = StreamWriter(sys.argv[1], "parallel", "p", {})
    for i in range(20000):
        w.tensor(f"t{i}", [4, 4])
    w._flush()
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_a_killed_write_leaves_no_file_that_reads_as_complete(tmp_path, name):
    target = tmp_path / name
    proc = subprocess.run([sys.executable, "-c", WRITER, str(target)], cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    partial = [p for p in os.listdir(tmp_path) if p.startswith(".p.jsonl")]
    assert len(partial) == 1
    with pytest.raises(PlanError):
        load_plan(tmp_path / partial[0])


def test_a_failed_write_removes_its_partial_file(tmp_path):
    with pytest.raises(RuntimeError):
        with StreamWriter(tmp_path / "p.jsonl", "parallel", "p", {}) as w:
            w.tensor("t", [1])
            raise RuntimeError("producer failed")
    assert os.listdir(tmp_path) == []


def test_records_come_out_before_the_end_is_read(tmp_path):
    """The iterator streams: a consumer gets records before the file's end is reached (and
    learns only at the end that the file is truncated)."""
    lines = lines_of(tmp_path)
    path = write_lines(tmp_path, lines[:-1])
    got = []
    with pytest.raises(PlanError, match="truncated"):
        for rec in iter_records(path):
            got.append(rec)
    assert isinstance(got[0], StreamHeader)
    assert sum(isinstance(r, Node) for r in got) == sum('"r":"node"' in x for x in lines)


def test_a_tensor_declared_twice(tmp_path):
    lines = lines_of(tmp_path)
    k = next(i for i, x in enumerate(lines) if '"r":"tensor"' in x)
    expect_error(write_lines(tmp_path, lines[:k + 1] + [lines[k]] + lines[k + 1:]),
                 f"line {k + 2}", "declared twice")


def _with_a_second_node_named(plan: dict, nid: str) -> dict:
    """The plan with one more node (a copy of `nid` writing a new tensor) under the same id:
    a consistent file (trailer, checksum) whose only fault is the id."""
    import copy

    twin = copy.deepcopy(next(n for n in plan["nodes"] if n["id"] == nid))
    twin["outputs"] = ["twin_out"]
    plan["tensors"]["twin_out"] = dict(plan["tensors"][next(
        n for n in plan["nodes"] if n["id"] == nid)["outputs"][0]])
    plan["nodes"].append(twin)
    return plan


@pytest.mark.parametrize("chunk", [None, 300], ids=["one block", "a block per line or two"])
def test_a_node_id_used_twice_is_found_across_blocks(tmp_path, monkeypatch, chunk):
    """Node ids are kept as hashes (not strings) between blocks: a repeated id anywhere in
    the file is still an error naming the second line that uses it."""
    from tvsmt.plan import reader

    if chunk:
        monkeypatch.setattr(reader, "_CHUNK", chunk)
    path = write_plan(tmp_path / "p.jsonl", _with_a_second_node_named(parallel_mlp(), "n1@0"))
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    second = max(k for k, x in enumerate(lines) if '"id":"n1@0"' in x) + 1
    msg = expect_error(path, f"line {second}", "node id used twice", "n1@0")
    assert "n1@0" in msg


def test_equal_hashes_of_different_node_ids_are_no_error(tmp_path, monkeypatch):
    """Equal hashes only make the reader compare the ids themselves (read again from the
    file): with every id hashed alike, a sound plan still reads, and a repeated id is still
    found."""
    from tvsmt.plan import reader, stream

    monkeypatch.setattr(reader, "_CHUNK", 300)
    monkeypatch.setattr(stream, "hash", lambda s: 7, raising=False)
    good = write_plan(tmp_path / "good.jsonl", parallel_mlp())
    assert len(load_plan(good).nodes) == len(parallel_mlp()["nodes"])
    bad = write_plan(tmp_path / "bad.jsonl", _with_a_second_node_named(parallel_mlp(), "n3@1"))
    expect_error(bad, "node id used twice", "n3@1")


# ------------------------------------------------------------------ both forms refuse alike
# Found by a differential fuzz of the readers (the document's fast path, plan_from_dict, the
# JSON Lines record-by-record reading and its one-pass scan): the JSON Lines readers took a
# node outside the world that the document reader refuses, and crashed (an internal error)
# on a rank beyond 64 bits and on an undeclared tensor named "".


def _verify_exit(tmp_path, parallel_path: str) -> tuple[int, str]:
    single = write_plan(tmp_path / "single.jsonl", single_mlp())
    r = CliRunner().invoke(main, ["verify", single, parallel_path, "--no-corpus"])
    return r.exit_code, r.output


@pytest.mark.parametrize("field,value,words", [
    ("rank", 4, "rank 4, outside the world's 4 ranks"),
    ("rank", -1, "rank -1, outside"),
    ("mb", 1, "micro-batch 1, outside the world's 1"),
    ("mb", -2, "micro-batch -2, outside"),
    ("mb", -2**63 - 1, "micro-batch -9223372036854775809"),
])
def test_a_node_outside_the_world_is_an_input_error_in_both_forms(tmp_path, field, value,
                                                                  words):
    plan = parallel_mlp()
    node = plan["nodes"][3]
    node[field] = value
    document = write_plan(tmp_path / "p.json", plan)
    with pytest.raises(PlanError) as refused:
        load_plan(document)
    assert node["id"] in str(refused.value) and words in str(refused.value)
    stream = write_plan(tmp_path / "p.jsonl", plan)
    lines = open(stream, encoding="utf-8").read().splitlines()
    at = next(k for k, x in enumerate(lines, 1) if f'"id":"{node["id"]}"' in x)
    expect_error(stream, f"line {at}", node["id"], words)
    with pytest.raises(NotScanned):  # the one-pass scan leaves the wording to the above
        scan_plan(stream)
    code, out = _verify_exit(tmp_path, stream)
    assert code == 2 and f"line {at}" in out and node["id"] in out and "Traceback" not in out


@pytest.mark.parametrize("world,words", [({"dp": 0, "tp": 2}, "world.dp must be"),
                                         ({"dp": 2, "tp": "2"}, "world.tp must be"),
                                         ({"dp": 2, "tp": 2, "ranks": 5}, "world.ranks is 5")])
def test_a_header_whose_world_is_no_world_is_an_input_error(tmp_path, world, words):
    plan = parallel_mlp()
    plan["world"] = world
    stream = write_plan(tmp_path / "p.jsonl", plan)
    expect_error(stream, "line 1", words)
    code, out = _verify_exit(tmp_path, stream)
    assert code == 2 and words in out


def test_an_undeclared_tensor_named_the_empty_string_is_an_input_error(tmp_path):
    """"" is a name like any other (only null is no tensor): the fast block check once let
    it through to a crash."""
    plan = parallel_mlp()
    plan["nodes"][2]["outputs"] = [""]
    stream = write_plan(tmp_path / "p.jsonl", plan)
    expect_error(stream, plan["nodes"][2]["id"], "undeclared tensor")
    code, out = _verify_exit(tmp_path, stream)
    assert code == 2 and "undeclared tensor" in out and "Traceback" not in out
