"""The one-pass columnar reading of JSON Lines plans (tvsmt/plan/scan.py): it reads exactly
the plan the record-by-record reading (`iter_records`) reads, and it takes no file that
reading refuses. Damaged files get a correct trailer (counts and checksum), so that what is
tested is each check, not the checksum."""

from __future__ import annotations

import copy
import json
import random
import zlib

import numpy as np
import pytest
from handmade import parallel_mlp, single_mlp

from tvsmt.errors import PlanError
from tvsmt.fold.columns import build_columns
from tvsmt.frontends.builder import write_plan, write_unit_source
from tvsmt.frontends.stream import StreamedPlan
from tvsmt.plan import scan as scan_module
from tvsmt.plan.scan import NotScanned, scan_plan
from tvsmt.plan.stream import check_stream, read_stream

DIMS = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)
UNIT_WORLD = dict(layers=2, dp=3, tp=2, pp=2, mb=3, **DIMS)
ARRAYS = ("in_len", "in_num", "out_len", "out_num", "rank", "mb", "s_len", "s_num",
          "slice_index")


def _odd_mlp() -> dict:
    """What the format allows and the model's types do not hold as written: null attributes,
    a role that is not a string, an `aligned` hint, scales."""
    doc = parallel_mlp()
    doc["nodes"][1]["attrs"] = None
    doc["tensors"][next(iter(doc["tensors"]))]["role"] = 7
    doc["lineages"][0]["aligned"] = {"single": [], "parallel": [], "inputs": []}
    return doc


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scan")
    return {
        "units": write_unit_source(folder / "units.jsonl", StreamedPlan("llama3", **UNIT_WORLD)),
        "mlp": write_plan(folder / "mlp.jsonl", parallel_mlp()),
        "mlp.gz": write_plan(folder / "mlp.jsonl.gz", parallel_mlp()),
        "odd": write_plan(folder / "odd.jsonl", _odd_mlp()),
        "single": write_plan(folder / "single.jsonl", single_mlp()),
    }


def same_items(got, want, what: str) -> None:
    """`list(got) == list(want)`, failing on the first difference with a short message (in CI
    mode pytest explains a failed `==` of two long lists by a full diff, quadratic in their
    length: minutes for these)."""
    got, want = list(got), list(want)
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            pytest.fail(f"{what}[{k}]: {a!r:.500} != {b!r:.500}", pytrace=False)
    assert len(got) == len(want), f"{what}: {len(got)} items, expected {len(want)}"


def assert_scan_reads_the_plan(path: str) -> None:
    """Columns, records built on demand and header: those of `read_stream` and
    `build_columns` on the same file."""
    got = scan_plan(path)
    plan = read_stream(path)
    ref = build_columns(plan)
    cols = got.columns
    for name in ARRAYS:
        assert np.array_equal(np.asarray(getattr(cols, name)), np.asarray(getattr(ref, name))), \
            name
    same_items(cols.slices, ref.slices, "slices")
    nodes = list(cols.nodes)  # every record built back from the columns
    same_items(nodes, plan.nodes, "nodes")
    same_items([(n.attrs, n.source) for n in nodes], [(n.attrs, n.source) for n in plan.nodes],
               "nodes' attributes and sources")
    same_items(cols.infos, plan.tensors.values(), "tensors")
    same_items(cols.tids, plan.tensors, "tensor ids")
    same_items(cols.parts, [p for lin in plan.lineages for p in lin.parts], "lineage parts")
    same_items([cols.op_names[k] for k in cols.op_code], [n.op for n in plan.nodes], "ops")
    same_items([cols.pass_names[k] for k in cols.pass_code], [n.pass_ for n in plan.nodes],
               "passes")
    same_items([cols.shapes[k] for k in cols.shape_code],
               [t.shape for t in plan.tensors.values()], "shapes")
    header = got.header_plan()
    assert (header.kind, header.name, header.world, header.outputs) == \
        (plan.kind, plan.name, plan.world, plan.outputs)
    assert [(x.index, x.single, x.aligned, x.hypothesis) for x in header.lineages] == \
        [(x.index, x.single, x.aligned, x.hypothesis) for x in plan.lineages]
    assert np.array_equal(cols.output_num, ref.number.of_names(list(plan.outputs)))


@pytest.mark.parametrize("name", ["units", "mlp", "mlp.gz", "odd", "single"])
def test_the_scan_reads_the_plan_iter_records_reads(files, name):
    assert_scan_reads_the_plan(files[name])


def test_many_small_blocks_read_the_same_plan(files, monkeypatch):
    """Blocks of a few lines: names are looked up in the last two blocks' declarations or
    left for the end; records span every block boundary."""
    from tvsmt.plan import reader

    monkeypatch.setattr(reader, "_CHUNK", 700)
    for name in ("units", "mlp"):
        assert_scan_reads_the_plan(files[name])


def test_equal_hashes_never_merge_names(files, monkeypatch):
    """Hashes only say where to compare names: with every name hashed alike, every plan reads
    the same, and a name used twice is still found."""
    monkeypatch.setattr(scan_module, "hash", lambda s: 7, raising=False)
    assert_scan_reads_the_plan(files["mlp"])
    lines = _lines(files["mlp"])
    k = _index(lines, "node")
    dup = dict(json.loads(lines[k + 1]), id=json.loads(lines[k])["id"])
    _refused(_with_trailer(lines[:k + 1] + [json.dumps(dup) + "\n"] + lines[k + 2:]))


# ------------------------------------------------------------------ damaged files


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def _index(lines: list[str], kind: str, start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if json.loads(lines[i])["r"] == kind)


def _with_trailer(lines: list[str]) -> list[str]:
    """The lines with their trailer recomputed (counts and checksum), so that only the
    damage itself can make the file wrong."""
    recs = []
    for x in lines[:-1]:
        try:
            recs.append(json.loads(x))
        except ValueError:  # a damaged line: counted by no kind
            pass
    trailer = json.loads(lines[-1])
    for kind in ("tensor", "node", "lineage", "section"):
        trailer[kind + "s"] = sum(1 for r in recs if isinstance(r, dict) and r.get("r") == kind)
    body = "".join(lines[:-1]).encode()
    trailer["crc32"] = zlib.crc32(body)
    return lines[:-1] + [json.dumps(trailer, separators=(",", ":")) + "\n"]


def _damages(lines: list[str]) -> dict[str, list[str]]:
    recs = [json.loads(x) for x in lines]
    kinds = [r["r"] for r in recs]
    node, tensor, lin = kinds.index("node"), kinds.index("tensor"), kinds.index("lineage")
    k = next(i for i, r in enumerate(recs) if r["r"] == "node" and recs[i + 1]["r"] == "node"
             and set(r["outputs"]) & set(recs[i + 1]["inputs"]))

    def edit(i, **changes):
        return lines[:i] + [json.dumps(dict(recs[i], **changes)) + "\n"] + lines[i + 1:]

    part = copy.deepcopy(recs[lin]["parts"])
    bad_shape = copy.deepcopy(part)
    bad_shape[0]["slice"] = [[0, 1]] * len(part[0]["slice"])
    twice = copy.deepcopy(part)
    twice[0]["sum_of"] = twice[0]["sum_of"] * 2
    zero = copy.deepcopy(part)
    zero[0]["scale"] = [1, 0]
    wide = copy.deepcopy(part)
    wide[0]["slice"] = [[0, 2 ** 60]] + part[0]["slice"][1:]
    out = {
        "tensor after its reader": lines[:tensor] + lines[tensor + 1:node + 1] + [lines[tensor]]
        + lines[node + 1:],
        "dependent nodes swapped": lines[:k] + [lines[k + 1], lines[k]] + lines[k + 2:],
        "node after the lineages": lines[:node] + lines[node + 1:-1] + [lines[node], lines[-1]],
        "tensor declared twice": lines[:tensor + 1] + [lines[tensor]] + lines[tensor + 1:],
        "node id used twice": edit(k + 1, id=recs[k]["id"]),
        "written twice": edit(k + 1, outputs=recs[k]["outputs"]),
        "undeclared input": edit(node, inputs=["nowhere", *recs[node]["inputs"][1:]]),
        "undeclared output": edit(node, outputs=["nowhere"]),
        "unknown op": edit(node, op="warp_drive"),
        "bad pass": edit(node, **{"pass": "sideways"}),
        "rank not an int": edit(node, rank="zero"),
        "attributes no object": edit(node, attrs=[1]),
        "negative dimension": edit(tensor, shape=[-1]),
        "huge dimension": edit(tensor, shape=[2 ** 60]),
        "lineage tensor of another shape": edit(lin, parts=bad_shape),
        "tensor twice in a part": edit(lin, parts=twice),
        "zero scale": edit(lin, parts=zero),
        "slice beyond 2**53": edit(lin, parts=wide),
        "lineage without parts": edit(lin, parts=[]),
        "undeclared lineage tensor": edit(lin, parts=[dict(part[0], sum_of=["nowhere"])]),
        "bad aligned": edit(lin, aligned={"inputs": [5]}),
        "second header": lines[:node] + [lines[0]] + lines[node:],
        "empty line": lines[:node] + ["\n"] + lines[node:],
        "not JSON": lines[:node] + ["{nope\n"] + lines[node:],
        "header not first": lines[1:2] + lines[:1] + lines[2:],
        "single plan with lineages": [lines[0].replace('"parallel"', '"single"')] + lines[1:],
        "unknown record": lines[:node] + ['{"r":"comment"}\n'] + lines[node:],
    }
    damaged = {}  # the sections' damages first: the merge's own check meets them
    if "section" in kinds:
        sec = [i for i, kind in enumerate(kinds) if kind == "section"]
        swapped = (lines[:sec[1]] + [lines[sec[2]]] + lines[sec[1] + 1:sec[2]]
                   + [lines[sec[1]]] + lines[sec[2] + 1:])
        damaged["sections swapped"] = _with_trailer(swapped)
        # a marker missing, the trailer still counting the header's sections: only the
        # numbering of the markers shows it
        gap = _with_trailer(lines[:sec[2]] + lines[sec[2] + 1:])
        trailer = json.loads(gap[-1])
        trailer["sections"] = recs[0]["sections"]
        damaged["section missing"] = gap[:-1] + [json.dumps(trailer) + "\n"]
    damaged.update((name, _with_trailer(x)) for name, x in out.items())
    return damaged


def _refused(lines: list[str], tmp_path=None) -> str:
    """The file is refused by the record-by-record checks, and the scan takes it neither:
    returns the checks' one-line message."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/bad.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(lines))
        with pytest.raises(PlanError) as checked:
            check_stream(path)
        with pytest.raises((NotScanned, PlanError)) as scanned:
            scan_plan(path)
        if scanned.type is PlanError:  # what the reading itself meets: the same words
            assert str(scanned.value) == str(checked.value)
        return str(checked.value)


@pytest.mark.parametrize("source", ["mlp", "units"])
def test_no_damaged_file_is_scanned(files, source):
    damages = _damages(_lines(files[source]))
    assert len(damages) > 20
    for name, lines in damages.items():
        msg = _refused(lines)
        assert len(msg.splitlines()) == 1, name


def test_random_damage_the_checks_refuse_is_never_scanned(files):
    """Lines deleted, repeated, swapped, or one value changed, with a correct trailer: the
    scan takes a damaged file only when the record-by-record reading does, and then reads
    the same plan."""
    import tempfile

    rng = random.Random(12)
    base = _lines(files["mlp"])
    refused = taken = 0
    for _ in range(150):
        lines = list(base[:-1])
        what = rng.randrange(4)
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        if what == 0 and i > 0:
            del lines[i]
        elif what == 1:
            lines.insert(j, lines[i])
        elif what == 2 and i > 0 and j > 0:
            lines[i], lines[j] = lines[j], lines[i]
        else:
            rec = json.loads(lines[i])
            key = rng.choice([k for k in rec if k != "r"])
            rec[key] = rng.choice([None, 0, -1, 2, "x", [], {}, [0, 1], rec.get(key)])
            lines[i] = json.dumps(rec) + "\n"
        lines = _with_trailer(lines + base[-1:])
        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/p.jsonl"
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(lines))
            try:
                check_stream(path)
            except PlanError:
                refused += 1
                with pytest.raises((NotScanned, PlanError)):
                    scan_plan(path)
                continue
            try:
                scan_plan(path)
            except NotScanned:
                continue
            taken += 1
            assert_scan_reads_the_plan(path)
    assert refused > 50 and taken > 5, (refused, taken)


# ------------------------------------------------------------------ two processes


def _line_starts(path: str) -> list[int]:
    with open(path, "rb") as f:
        data = f.read()
    return [0] + [i + 1 for i, c in enumerate(data) if c == 10][:-1]


def _split_at(monkeypatch, mid: int | None) -> None:
    monkeypatch.setattr(scan_module, "_split_point", lambda path: mid)


@pytest.mark.parametrize("name", ["mlp", "units"])
def test_two_halves_read_the_same_plan_wherever_the_file_is_cut(files, monkeypatch, name):
    """The second half read in a forked process (its state sent back as bytes), merged into
    the first: the same plan for a cut in the tensors, the nodes, a section marker or the
    lineages, and for a cut whose second half is read here (the process gave no answer)."""
    from tvsmt import forked

    path = files[name]
    starts = _line_starts(path)
    cuts = sorted({starts[k] for k in np.linspace(1, len(starts) - 1, 7).astype(int)})
    for mid in cuts:
        _split_at(monkeypatch, mid)
        assert_scan_reads_the_plan(path)
    with monkeypatch.context() as m:  # the forked process fails: its half is read here
        m.setattr(forked.ForkedCall, "answer", lambda self, patience=None: self.stop() or b"")
        for mid in cuts:
            _split_at(monkeypatch, mid)
            assert_scan_reads_the_plan(path)


@pytest.mark.parametrize("source", ["mlp", "units"])
def test_a_damage_in_either_half_is_never_scanned(files, monkeypatch, source):
    """Whichever half holds the damage, and wherever the cut, the merged reading refuses what
    the record-by-record checks refuse (the checks that span the cut among them: sections,
    the order of lineages, names declared in the other half, the checksum combined)."""
    import tempfile

    lines = _lines(files[source])
    damages = _damages(lines)
    for name, bad in damages.items():
        starts = np.cumsum([0] + [len(x.encode()) for x in bad])[:-1]
        cuts = {1, len(bad) // 3, len(bad) // 2, len(bad) - 1}
        if name.startswith("section"):  # a cut at each of the first markers (the damage's)
            cuts |= {k for k, x in enumerate(bad[:-1]) if x.startswith('{"r":"section"')
                     and k < len(bad) // 3}
        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/bad.jsonl"
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(bad))
            with pytest.raises(PlanError) as checked:  # the checks do not depend on the cut
                check_stream(path)
            for mid in sorted(int(starts[k]) for k in cuts):
                _split_at(monkeypatch, mid)
                with pytest.raises((NotScanned, PlanError)) as scanned:
                    scan_plan(path)
                if scanned.type is PlanError:  # what the reading itself meets: same words
                    assert str(scanned.value) == str(checked.value), (name, mid)


def test_the_split_is_taken_only_for_a_large_plain_file_and_an_idle_core(files, monkeypatch):
    from tvsmt import forked

    monkeypatch.setattr(scan_module, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(forked, "PARALLEL", True)
    mid = scan_module._split_point(files["mlp"])
    assert mid and mid in _line_starts(files["mlp"])
    assert scan_module._split_point(files["mlp.gz"]) is None
    monkeypatch.setattr(forked, "PARALLEL", False)
    assert scan_module._split_point(files["mlp"]) is None
    monkeypatch.setattr(forked, "PARALLEL", True)
    monkeypatch.setattr(scan_module, "SPLIT_MIN_BYTES", 1 << 40)
    assert scan_module._split_point(files["mlp"]) is None
