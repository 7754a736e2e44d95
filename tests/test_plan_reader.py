"""Bad input gets a one-line error naming the file and the node/tensor, and exit code 2."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt import forked as forked_policy
from tvsmt.cli import main
from tvsmt.errors import PlanError
from tvsmt.plan import load_plan, plan_from_dict, plan_from_object


def write(path, data, gz=False):
    text = json.dumps(data)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def run_cli(tmp_path, single: dict, parallel: dict):
    s = write(tmp_path / "single.json", single)
    p = write(tmp_path / "parallel.json.gz", parallel, gz=True)
    return CliRunner().invoke(main, ["verify", s, p])


def node(plan, nid):
    return next(n for n in plan["nodes"] if n["id"] == nid)


def mutate_unknown_op(s, p):
    node(p, "n2@1")["op"] = "flash_attention_v9"
    return "parallel.json.gz", ["n2@1", "flash_attention_v9"]


def mutate_undeclared(s, p):
    node(s, "n3")["inputs"][0] = "ghost"
    return "single.json", ["n3", "ghost", "undeclared"]


def mutate_written_twice(s, p):
    node(p, "n2@0")["outputs"] = ["h@0"]
    return "parallel.json.gz", ["n2@0", "h@0", "written twice"]


def mutate_out_of_order(s, p):
    s["nodes"][0], s["nodes"][1] = s["nodes"][1], s["nodes"][0]
    return "single.json", ["n2", "h", "topological"]


def mutate_cycle(s, p):
    node(s, "n1")["inputs"][0] = "y"
    return "single.json", ["n1", "y"]


def mutate_slice_outside(s, p):
    p["lineages"][1]["parts"][1]["slice"] = [[12, 20], [0, 8]]
    return "parallel.json.gz", ["w1", "outside the full shape"]


def mutate_slice_of_another_lineage(s, p):
    # w1's part 1 has this very slice, which fits w1 [16, 8]; it is outside x [8, 8]: the
    # columnar check (reader._slices_fit) checks each (full shape, slice) pair, not each slice
    p["lineages"][0]["parts"][1]["slice"] = [[8, 16], [0, 8]]
    return "parallel.json.gz", ["lineage #0", "x", "outside the full shape"]


def mutate_part_shape(s, p):
    p["lineages"][1]["parts"][0]["slice"] = [[0, 4], [0, 8]]
    return "parallel.json.gz", ["w1@0", "differs from the slice shape"]


def mutate_output_without_lineage(s, p):
    p["lineages"] = [l for l in p["lineages"] if l["single"] != "gw2"]
    return "parallel.json.gz", ["gw2", "no lineage"]


def mutate_format(s, p):
    p["format"] = "nnscaler.pickle"
    return "parallel.json.gz", ["unknown format"]


def mutate_version(s, p):
    s["version"] = 7
    return "single.json", ["unsupported version"]


def mutate_lineage_unknown_single(s, p):
    p["lineages"][0]["single"] = "nope"
    return "parallel.json.gz", ["nope", "does not declare"]


def mutate_bad_shape(s, p):
    s["tensors"]["x"]["shape"] = [8, "eight"]
    return "single.json", ["tensor x", "shape"]


MUTATIONS = [mutate_unknown_op, mutate_undeclared, mutate_written_twice, mutate_out_of_order,
             mutate_cycle, mutate_slice_outside, mutate_slice_of_another_lineage,
             mutate_part_shape,
             mutate_output_without_lineage, mutate_format, mutate_version,
             mutate_lineage_unknown_single, mutate_bad_shape]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__[7:])
def test_bad_plan_one_line_error_exit_2(tmp_path, mutate):
    s, p = single_mlp(), parallel_mlp()
    fname, words = mutate(s, p)
    result = run_cli(tmp_path, s, p)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    err = result.output.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert fname in err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("where", ["attrs", "world", "outputs", "lineages"])
@pytest.mark.parametrize("value", [0, False, ""], ids=repr)
def test_a_false_value_is_no_null(tmp_path, where, value):
    """Only null (or no key) means the default: a 0, false or "" where an object or a list
    belongs is a wrong type, refused by both readings (the reference validator once took
    any false value for the default; found by tests/test_reader_agreement.py)."""
    s, p = single_mlp(), parallel_mlp()
    if where == "attrs":
        node(p, "n2@1")["attrs"] = value
    else:
        p[where] = value
    with pytest.raises(PlanError, match="must be"):
        plan_from_dict(json.loads(json.dumps(p)), "parallel")
    result = run_cli(tmp_path, s, p)
    assert result.exit_code == 2 and "must be" in result.output, result.output
    if where == "world":  # (a null world is one rank: this plan's nodes are outside it)
        return
    if where == "attrs":
        node(p, "n2@1")["attrs"] = None
    else:
        p[where] = None
    plan = plan_from_dict(json.loads(json.dumps(p)), "parallel")  # null: the default
    assert where != "attrs" or next(n for n in plan.nodes if n.id == "n2@1").attrs == {}


def test_unmodified_pair_passes_the_same_path(tmp_path):
    result = run_cli(tmp_path, single_mlp(), parallel_mlp())
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("content,msg", [(b"{not json", "not valid JSON"),
                                         (b"\x1f\x8b\x08garbage", "cannot read")])
def test_unreadable_files(tmp_path, content, msg):
    path = tmp_path / ("p.json.gz" if content.startswith(b"\x1f") else "p.json")
    path.write_bytes(content)
    with pytest.raises(PlanError, match=msg):
        load_plan(path)


def test_missing_file_cli(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "a.json"),
                                       str(tmp_path / "b.json")])
    assert result.exit_code == 2
    assert "no such file" in result.output


def test_plans_swapped_is_an_error(tmp_path):
    result = run_cli(tmp_path, parallel_mlp(), copy.deepcopy(single_mlp()))
    assert result.exit_code == 2
    assert "expected a single plan" in result.output


@pytest.mark.parametrize("op,attrs,words", [
    ("chunk", {"idx": None}, ["c@0", "chunk", "idx"]),
    ("chunk", {"dim": 7}, ["c@0", "not an axis"]),
    ("div", {"consts": ["abc"]}, ["n2@0", "div", "abc"]),
    ("div", {"consts": [0]}, ["n2@0", "div"]),
])
def test_malformed_attributes_are_one_line_errors(tmp_path, op, attrs, words):
    s, p = single_mlp(), parallel_mlp()
    for n in p["nodes"]:
        if n["op"] == op:
            for k, v in attrs.items():
                if v is None:
                    n["attrs"].pop(k, None)
                else:
                    n["attrs"][k] = v
    result = run_cli(tmp_path, s, p)
    assert result.exit_code == 2, result.output
    err = result.output.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


# ------------------------------------------------------------------ the fast path and limits


def _damage(plan: dict, rng) -> None:
    junk = [None, -1, 0, 7, 2.5, "x", "", [], {}, [1, "a"], {"a": 1}, True, [[0, 99]],
            2**60, [[0, 2**54]], 1.0]
    node = plan
    path = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.85:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return
    parent, key = path[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    elif isinstance(parent, list) and rng.random() < 0.2:
        parent.insert(key, copy.deepcopy(parent[key]))  # a duplicate (id, write, part)
    else:
        parent[key] = copy.deepcopy(rng.choice(junk))


def _outcome(fn):
    try:
        p = fn()
    except PlanError as e:
        return ("error", str(e))
    nodes = list(p.nodes)  # a lazy sequence (nodes built on demand) as a list
    lineages = [dataclasses.replace(lin, parts=tuple(lin.parts)) for lin in p.lineages]
    return ("plan", p.name, p.kind, p.world, p.tensors, nodes, [n.attrs for n in nodes],
            [n.source for n in nodes], p.outputs, lineages)


@pytest.fixture(params=["dict", "arrow", "forked", "lazy"])
def numbering(request, monkeypatch):
    """The reader's tensor numbering through the dict, through Arrow at any size, or in a
    forked child for any document (tvsmt/plan/numbering.py), there also with the nodes
    decoded without their names and built on demand (`lazy`, reader.decode_document)."""
    import os

    from tvsmt.plan import numbering as module

    if request.param == "dict":
        monkeypatch.setenv("TVSMT_NUMBERING", "dict")
    elif request.param == "arrow":
        pytest.importorskip("pyarrow")
        monkeypatch.setattr(module, "ARROW_MIN_NAMES", 0)
    else:
        if not hasattr(os, "fork"):
            pytest.skip("no fork on this platform")
        monkeypatch.setattr(forked_policy, "PARALLEL", True)
        monkeypatch.setattr(module, "FORK_MIN_BYTES", 0)
    return request.param


@pytest.mark.parametrize("seed", range(400))
def test_fast_path_agrees_with_the_reference_validator(seed, numbering):
    """load_plan's typed fast path accepts exactly what plan_from_dict accepts, builds the
    same plan, and words every error the same way (its tensor numbering by a dict or by
    Arrow)."""
    import random

    from tvsmt.plan.reader import decode_document

    rng = random.Random(seed)
    plan = rng.choice([single_mlp, parallel_mlp])()
    for _ in range(rng.randint(1, 2)):
        _damage(plan, rng)
    text = json.dumps(plan).encode()
    fast = _outcome(lambda: decode_document(text, "p.json", lazy=numbering == "lazy"))
    reference = _outcome(lambda: plan_from_dict(json.loads(text), "p.json"))
    assert fast == reference
    # the same plan object converted in memory (the generator's path)
    assert _outcome(lambda: plan_from_object(json.loads(text), "p.json")) == reference


@pytest.mark.parametrize("attrs", [7, "x", [], None, True, {"k": [1, {"a": None}]}], ids=repr)
def test_nodes_built_on_demand_read_attributes_as_the_reference(attrs, monkeypatch):
    """A large document's nodes read without their names and built on demand (the forked
    numbering's `lazy` reading): a node's attributes that are not an object are refused,
    null read as none, exactly as plan_from_dict does."""
    import os

    from tvsmt.plan import numbering as module
    from tvsmt.plan.reader import decode_document

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(forked_policy, "PARALLEL", True)
    monkeypatch.setattr(module, "FORK_MIN_BYTES", 0)
    plan = parallel_mlp()
    plan["nodes"][3]["attrs"] = attrs
    text = json.dumps(plan).encode()
    lazy = _outcome(lambda: decode_document(text, "p.json", lazy=True))
    assert lazy == _outcome(lambda: plan_from_dict(json.loads(text), "p.json"))


_PART = '"slice": [[8, 16], [0, 8]], "sum_of": ["w1@1"]'  # lineage #1's second part
LAZY_PARTS = {
    "scale null": _PART + ', "scale": null',
    "scale a half": _PART + ', "scale": [1, 2]',
    "scale a half written otherwise": _PART + ', "scale": [2, 4]',
    "scale of denominator 0": _PART + ', "scale": [1, 0]',
    "scale of a boolean": _PART + ', "scale": [true, 1]',
    "scale of a float": _PART + ', "scale": [1.0, 2]',
    "scale of three": _PART + ', "scale": [1, 2, 3]',
    "scale as text": _PART + ', "scale": "1/2"',
    "scale at the int64 bound": _PART + ', "scale": [9223372036854775807, 1]',
    "scale beyond int64": _PART + ', "scale": [9223372036854775808, 1]',
    "slice spaced otherwise": '"slice":[ [8,16] ,[0, 8]], "sum_of": ["w1@1"]',
    "slice beyond 2**53": '"slice": [[8, 9007199254740993], [0, 8]], "sum_of": ["w1@1"]',
    "slice of a float": '"slice": [[8.0, 16], [0, 8]], "sum_of": ["w1@1"]',
    "slice of one bound": '"slice": [[8], [0, 8]], "sum_of": ["w1@1"]',
    "slice of another shape": '"slice": [[8, 12], [0, 8]], "sum_of": ["w1@1"]',
    "slice missing": '"sum_of": ["w1@1"]',
    "slice null": '"slice": null, "sum_of": ["w1@1"]',
    "tensors missing": '"slice": [[8, 16], [0, 8]]',
    "no tensors": '"slice": [[8, 16], [0, 8]], "sum_of": []',
    "a tensor twice": '"slice": [[8, 16], [0, 8]], "sum_of": ["w1@1", "w1@1"]',
    "two tensors": '"slice": [[8, 16], [0, 8]], "sum_of": ["w1@1", "w1@3"]',
    "an undeclared tensor": '"slice": [[8, 16], [0, 8]], "sum_of": ["nope"]',
    "a null tensor": '"slice": [[8, 16], [0, 8]], "sum_of": [null]',
}


@pytest.mark.parametrize("part", sorted(LAZY_PARTS))
def test_lineage_parts_read_as_columns_agree_with_the_reference(part, monkeypatch):
    """A large document's lineage parts read for the fold (the forked numbering decodes
    their tensors; this process codes each slice and scale by its text and decodes each
    distinct one once, reader._lazy_lineages): every part the same as plan_from_dict reads
    it, every damaged part refused with its words."""
    import os

    from tvsmt.plan import numbering as module
    from tvsmt.plan.reader import decode_document

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(forked_policy, "PARALLEL", True)
    monkeypatch.setattr(module, "FORK_MIN_BYTES", 0)
    text = json.dumps(parallel_mlp())
    assert text.count(_PART) == 1
    text = text.replace(_PART, LAZY_PARTS[part]).encode()
    lazy = _outcome(lambda: decode_document(text, "p.json", lazy=True))
    assert lazy == _outcome(lambda: plan_from_dict(json.loads(text), "p.json"))
    if lazy[0] == "plan":  # and the columns the fold reads say the same
        plan = decode_document(text, "p.json", lazy=True)
        cols = plan.columns
        if cols is None:  # read by plan_from_dict: only a scale beyond the typed decoding's
            assert part == "scale beyond int64"
            return
        flat = [p for lin in lazy[-1] for p in lin.parts]
        assert list(cols.parts) == flat
        assert [cols.scales[c] for c in cols.scale_code.tolist()] == [p.scale for p in flat]
        assert [cols.slices[c] for c in cols.slice_index.tolist()] == [p.slice for p in flat]
        assert len(set(cols.slices)) == len(cols.slices)  # equal slices share one index


def one_line_exit_2(result, *words):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    err = result.output.strip()
    assert len(err.splitlines()) == 1, err
    for leak in ("Traceback", "NoneType", "index out of range", "RecursionError"):
        assert leak not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def verify_with(tmp_path, parallel_text: bytes, name="parallel.json"):
    s = write(tmp_path / "single.json", single_mlp())
    p = tmp_path / name
    p.write_bytes(parallel_text)
    return CliRunner().invoke(main, ["verify", s, str(p), "--no-corpus"])


def test_deeply_nested_json(tmp_path):
    text = b'{"format": "tvsmt.execplan", "world": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    one_line_exit_2(verify_with(tmp_path, text), "parallel.json", "nested too deeply")


@pytest.mark.parametrize("where", ["scale", "shape"])
def test_a_5000_digit_integer(tmp_path, where):
    p = parallel_mlp()
    big = "9" * 5000
    text = json.dumps(p)
    if where == "scale":
        p["lineages"][0]["parts"][0]["scale"] = [1, 2]
        text = json.dumps(p).replace('"scale": [1, 2]', f'"scale": [{big}, 2]')
    else:
        text = text.replace('"shape": [8, 8]', f'"shape": [8, {big}]', 1)
    assert big in text
    one_line_exit_2(verify_with(tmp_path, text.encode()), "parallel.json", "out of range")


def test_dimensions_beyond_2_53(tmp_path):
    p = parallel_mlp()
    t = next(iter(p["tensors"]))
    p["tensors"][t]["shape"] = [2**54, 8]
    one_line_exit_2(verify_with(tmp_path, json.dumps(p).encode()), "parallel.json", t,
                    "2**53")
    p = parallel_mlp()
    p["tensors"][t]["shape"] = [2**70, 8]
    one_line_exit_2(verify_with(tmp_path, json.dumps(p).encode()), "parallel.json", t)


def test_dev_zero_is_refused_at_once(tmp_path):
    s = write(tmp_path / "single.json", single_mlp())
    result = CliRunner().invoke(main, ["verify", s, "/dev/zero", "--no-corpus"])
    one_line_exit_2(result, "/dev/zero", "not a JSON plan")


def test_gzip_bombs_are_bounded(tmp_path, monkeypatch):
    zeros = tmp_path / "zeros.json.gz"
    with gzip.open(zeros, "wb") as f:
        for _ in range(256):
            f.write(bytes(1 << 20))  # 256 MiB of zeros in a few hundred KiB
    s = write(tmp_path / "single.json", single_mlp())
    r = CliRunner().invoke(main, ["verify", s, str(zeros), "--no-corpus"])
    one_line_exit_2(r, "zeros.json.gz", "not a JSON plan")
    spaces = tmp_path / "spaces.json.gz"
    with gzip.open(spaces, "wb") as f:
        f.write(b"{")
        for _ in range(64):
            f.write(b" " * (1 << 20))
    monkeypatch.setenv("TVSMT_MAX_PLAN_BYTES", str(16 << 20))
    r = CliRunner().invoke(main, ["verify", s, str(spaces), "--no-corpus"])
    one_line_exit_2(r, "spaces.json.gz", "larger than the limit", "TVSMT_MAX_PLAN_BYTES")
    monkeypatch.setenv("TVSMT_MAX_PLAN_BYTES", "lots")
    r = CliRunner().invoke(main, ["verify", s, str(spaces), "--no-corpus"])
    one_line_exit_2(r, "TVSMT_MAX_PLAN_BYTES", "positive number")


def test_control_characters_in_names_are_escaped(tmp_path):
    p = parallel_mlp()
    node(p, "n2@1")["op"] = "evil\x1b[31m\nop"
    bad = tmp_path / "par\nallel\x1b[2J.json"
    bad.write_text(json.dumps(p))
    s = write(tmp_path / "single.json", single_mlp())
    r = CliRunner().invoke(main, ["verify", s, str(bad), "--no-corpus"])
    err = one_line_exit_2(r, "par\\nallel\\x1b[2J.json", "evil\\x1b[31m\\nop")
    assert "\x1b" not in err


def test_a_directory_is_not_a_plan(tmp_path):
    with pytest.raises(PlanError, match="is a directory"):
        load_plan(tmp_path)


@pytest.mark.parametrize("gz", [False, True])
def test_a_plan_read_from_a_pipe(tmp_path, gz):
    """Process substitution (`tvsmt verify <(zcat a) b`) gives a pipe that cannot seek."""
    import os
    import threading

    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    text = json.dumps(parallel_mlp()).encode()
    data = gzip.compress(text) if gz else text

    def feed():
        with open(fifo, "wb") as f:
            f.write(data)

    t = threading.Thread(target=feed)
    t.start()
    plan = load_plan(fifo)
    t.join()
    assert len(plan.nodes) == len(parallel_mlp()["nodes"])


def test_the_size_of_a_pipe_is_not_known_and_asking_does_not_open_it(tmp_path):
    """`text_size` (which chooses how to read) must not open a FIFO: with no writer yet the
    open blocks, and with one it would take the reader's place or its first bytes."""
    import os
    import threading

    from tvsmt.plan.reader import text_size

    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    answer = []
    t = threading.Thread(target=lambda: answer.append(text_size(str(fifo))), daemon=True)
    t.start()
    t.join(10)
    assert answer == [None]


def _first_tensor(p):
    return next(iter(p["tensors"].values()))


# What the typed decoder now checks itself (tvsmt.plan.model's Dim/Rank/MicroBatch/Literal
# annotations) and what the fast path reads differently (a tensor's id from its key, the
# largest rank only): each damage must get exactly plan_from_dict's outcome.
DECODER_CHECKS = {
    "negative dimension": lambda p: _first_tensor(p).update(shape=[-1, 8]),
    "dimension 2**53+1": lambda p: _first_tensor(p).update(shape=[2**53 + 1, 8]),
    "dimension 2**53": lambda p: _first_tensor(p).update(shape=[2**53, 8]),
    "boolean dimension": lambda p: _first_tensor(p).update(shape=[True, 8]),
    "role not a string": lambda p: _first_tensor(p).update(role=7),
    "a tensor without a shape": lambda p: _first_tensor(p).pop("shape"),
    "a tensor no node names, without a shape": lambda p: p["tensors"].update(spare={}),
    "a tensor no node names": lambda p: p["tensors"].update(spare={"shape": [2]}),
    "an id inside a tensor": lambda p: _first_tensor(p).update(id="somebody else"),
    "pass xx": lambda p: p["nodes"][3].update({"pass": "xx"}),
    "pass not a string": lambda p: p["nodes"][3].update({"pass": 1}),
    "rank -1": lambda p: p["nodes"][3].update(rank=-1),
    "rank beyond the world": lambda p: p["nodes"][-1].update(rank=4),
    "rank a float": lambda p: p["nodes"][3].update(rank=1.0),
    "rank 2**64": lambda p: p["nodes"][3].update(rank=2**64),
    "mb 2**63": lambda p: p["nodes"][3].update(mb=2**63),
    "mb -1": lambda p: p["nodes"][3].update(mb=-1),
    "mb -2": lambda p: p["nodes"][3].update(mb=-2),
    "mb beyond the world": lambda p: p["nodes"][-1].update(mb=1),
    "inputs missing": lambda p: p["nodes"][-1].pop("inputs"),
    "outputs missing": lambda p: p["nodes"][0].pop("outputs"),
    "attrs null": lambda p: p["nodes"][2].update(attrs=None),
    "world dp 0": lambda p: p["world"].update(dp=0),
    "no nodes, bad world": lambda p: (p.update(nodes=[]), p["world"].update(tp="2")),
    "lineage names an undeclared tensor":
        lambda p: p["lineages"][0]["parts"][0].update(sum_of=["ghost"]),
    "scale 1/2": lambda p: p["lineages"][0]["parts"][0].update(scale=[1, 2]),
    "scale null": lambda p: p["lineages"][0]["parts"][0].update(scale=None),
    "scale 2**64": lambda p: p["lineages"][0]["parts"][0].update(scale=[1, 2**64]),
    "scale den 0": lambda p: p["lineages"][0]["parts"][0].update(scale=[1, 0]),
    "scale boolean": lambda p: p["lineages"][0]["parts"][0].update(scale=[1, True]),
    "scale float": lambda p: p["lineages"][0]["parts"][0].update(scale=[1.5, 2]),
    "scale of three": lambda p: p["lineages"][0]["parts"][0].update(scale=[1, 2, 3]),
    # the lineage checks the reader runs over the columns of all parts at once
    "a lineage without parts": lambda p: p["lineages"][2].update(parts=[]),
    "a part summing nothing": lambda p: p["lineages"][1]["parts"][3].update(sum_of=[]),
    "a part naming a tensor twice":
        lambda p: p["lineages"][1]["parts"][2].update(sum_of=["w1@2", "w1@2"]),
    "a part of two tensors, one of another shape":
        lambda p: p["lineages"][0]["parts"][3].update(sum_of=["x@3", "seed@0"]),
    "a part of two tensors": lambda p: p["lineages"][0]["parts"][3].update(sum_of=["x@3", "x@0"]),
    "the last part of another shape":
        lambda p: p["lineages"][-1]["parts"][-1].update(slice=[[0, 3]]),
    "a slice bound 2**53+1":
        lambda p: p["lineages"][1]["parts"][1].update(slice=[[8, 2**53 + 1], [0, 8]]),
    "a slice of no tensor's shape":
        lambda p: p["lineages"][1]["parts"][1].update(slice=[[8, 15], [0, 8]]),
    "a part naming a tensor of a later lineage's shape":
        lambda p: p["lineages"][1]["parts"][1].update(sum_of=["seed@1"]),
}
_VALID = ("a tensor no node names", "mb -1", "attrs null", "scale 1/2", "scale null", "scale 2**64",
          "an id inside a tensor", "role not a string", "a part of two tensors")


@pytest.mark.parametrize("damage", list(DECODER_CHECKS), ids=str)
def test_decoder_checks_agree_with_the_reference_validator(damage, numbering):
    from tvsmt.plan.reader import decode_document

    plan = parallel_mlp()
    DECODER_CHECKS[damage](plan)
    text = json.dumps(plan).encode()
    fast = _outcome(lambda: decode_document(text, "p.json"))
    reference = _outcome(lambda: plan_from_dict(json.loads(text), "p.json"))
    assert fast == reference
    assert _outcome(lambda: plan_from_object(json.loads(text), "p.json")) == reference
    assert fast[0] == ("plan" if damage in _VALID else "error"), fast
    if fast[0] == "plan":
        assert all(tid == info.id for tid, info in fast[4].items())


@pytest.mark.parametrize("name", ["parallel.json.gz", "parallel.jsonl.gz"])
def test_a_corrupt_gzip_stream_is_one_line(tmp_path, name):
    """Deflate data damaged in the middle (not cut short: that is an EOFError) raises the
    decompressor's own error type, which is neither OSError nor EOFError."""
    if name.endswith(".jsonl.gz"):
        text = b'{"r":"header","format":"tvsmt.execplan"}\n' * 2000
    else:
        text = json.dumps(parallel_mlp()).encode() * 20
    data = bytearray(gzip.compress(text))
    data[40:240] = bytes(200)
    one_line_exit_2(verify_with(tmp_path, bytes(data), name), name, "cannot read plan")


def test_reading_leaves_the_collector_on_and_the_new_plan_out_of_its_next_collection():
    """decode_document pauses the cyclic collector while it builds a plan; afterwards the
    collector is on again (also after a refused plan) and the plan's containers are in the
    permanent generation (tvsmt/heap.py), so the first allocation does not start a collection
    that traverses them all."""
    import gc

    from tvsmt.plan.reader import decode_document

    plan = parallel_mlp()
    text = json.dumps(plan).encode()
    gc.collect()
    before = gc.get_freeze_count()
    try:
        p = decode_document(text, "p.json")
        assert gc.isenabled()
        assert gc.get_freeze_count() > before and gc.get_count()[0] < 50
        assert p.nodes and gc.get_freeze_count() - before >= len(p.nodes)  # its tuples, dicts
        plan["nodes"][0]["op"] = "no_such_op"
        with pytest.raises(PlanError):
            decode_document(json.dumps(plan).encode(), "p.json")
        assert gc.isenabled()
        gc.disable()
        decode_document(text, "p.json")
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_columnar_slice_check_is_taken_on_a_real_plan_and_finds_a_shifted_slice(
        tmp_path):
    """check_pair decides the slices over the reader's columns on a real plan (the loop over
    each lineage's slices only runs when that says no), and a part's slice moved past the end
    of its tensor (same size, so the reader's own checks pass) is still found and named."""
    from conftest import fixture_pair

    from tvsmt.plan.reader import _slices_fit, check_pair

    single_path, parallel_path = fixture_pair("llama3-ly2-dp2pp2tp2mb2")
    single, parallel = load_plan(single_path), load_plan(parallel_path)
    assert parallel.columns is not None and _slices_fit(single, parallel)
    check_pair(single, parallel)

    with gzip.open(parallel_path, "rt") as f:
        doc = json.load(f)
    k, lin = next((k, lin) for k, lin in enumerate(doc["lineages"])
                  if single.shape(lin["single"]) and single.shape(lin["single"])[0] > 1)
    n = single.shape(lin["single"])[0]
    part = lin["parts"][-1]
    part["slice"][0] = [part["slice"][0][0] + n, part["slice"][0][1] + n]
    bad = load_plan(write(tmp_path / "parallel.json.gz", doc, gz=True))
    assert bad.columns is not None and not _slices_fit(single, bad)
    with pytest.raises(PlanError, match=f"lineage #{k} part {len(lin['parts']) - 1}: slice "
                                        ".* is outside the full shape"):
        check_pair(single, bad)


@pytest.mark.parametrize("model,dims", [
    ("llama3", dict(layers=2, dp=2, tp=2, pp=2, mb=2)),
    ("moe", dict(layers=2, dp=2, tp=2, pp=2, mb=2)),
    ("mlp", dict(layers=2, dp=2, tp=2, pp=1, mb=2)),
])
def test_generated_plans_convert_to_what_the_reference_validator_builds(model, dims):
    """plan_from_object (the streamed generator's reader) builds exactly plan_from_dict's
    plan from the generator's own dicts, attributes and lineages included, and takes the
    fast path (its plans carry the columns the fold reads)."""
    from tvsmt.frontends.generator import generate_pair

    for data in generate_pair(model, **dims):
        fast = plan_from_object(data, "g")
        assert _outcome(lambda: fast) == _outcome(lambda: plan_from_dict(data, "g"))
        assert fast.columns is not None


def test_an_object_the_fast_path_refuses_gets_the_reference_message():
    """A value the typed conversion refuses (a float rank) goes to plan_from_dict, which
    words the error."""
    plan = parallel_mlp()
    plan["nodes"][3]["rank"] = 1.0
    with pytest.raises(PlanError) as fast:
        plan_from_object(plan, "p")
    with pytest.raises(PlanError) as ref:
        plan_from_dict(plan, "p")
    assert str(fast.value) == str(ref.value)
    assert "rank" in str(fast.value)


def _gzip_variants(text: bytes) -> dict[str, bytes]:
    """A plan's gzip file, whole and damaged in the ways a whole-file read must notice."""
    whole = gzip.compress(text)
    half = len(text) // 2
    crc = bytearray(whole)
    crc[-8] ^= 1  # the member's CRC-32
    length = bytearray(whole)
    length[-4] ^= 1  # its length modulo 2**32
    return {
        "one member": whole,
        "two members": gzip.compress(text[:half]) + gzip.compress(text[half:]),
        "trailing zeros": whole + bytes(16),
        "trailing text": whole + b"{}",
        "cut short": whole[:-12],
        "wrong crc": bytes(crc),
        "wrong length": bytes(length),
        "not json": gzip.compress(b"\x00" + text),
        "empty member": gzip.compress(b""),
    }


@pytest.mark.parametrize("case", list(_gzip_variants(b"{}")))
def test_a_gzip_plan_read_whole_is_the_plan_the_stream_reads(tmp_path, monkeypatch, case):
    """`gunzip_whole` (one call for a regular file of one member) gives the stream reader's
    text or nothing: a plan split over two members, bytes after the member, a cut or a wrong
    checksum read through it give exactly what the chunked stream read gives (the same plan
    or the same one-line error)."""
    from tvsmt.plan import reader

    text = json.dumps(parallel_mlp()).encode()
    path = tmp_path / "parallel.json.gz"
    path.write_bytes(_gzip_variants(text)[case])
    whole = reader.gunzip_whole(str(path), 1 << 30)
    assert whole == (text if case == "one member" else None)
    fast = _outcome(lambda: load_plan(path))
    monkeypatch.setattr(reader, "gunzip_whole", lambda *a: None)
    assert fast == _outcome(lambda: load_plan(path))
    # the stream reader's rules: members are concatenated, zeros after the last are padding
    assert fast[0] == ("plan" if case in ("one member", "two members", "trailing zeros")
                       else "error")


def test_a_gzip_plan_over_the_limit_is_not_read_whole(tmp_path):
    from tvsmt.plan import reader

    text = json.dumps(parallel_mlp()).encode()
    path = tmp_path / "parallel.json.gz"
    path.write_bytes(gzip.compress(text))
    assert reader.gunzip_whole(str(path), len(text)) == text
    assert reader.gunzip_whole(str(path), len(text) - 1) is None
