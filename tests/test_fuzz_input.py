"""Property-based fuzzing of the plan reader and the CLI (Hypothesis), with an oracle.

Each test takes a small valid plan pair (the hand-written MLP at a few dp x tp layouts, with
and without a bug, whose verdicts are known) and damages it in one structure-aware way. The
damage kind says what must happen:

* a damage that breaks the format (a wrong type, a missing key, a bad slice, a bad world
  value, a huge number, a dangling reference, truncated text) is an input error: exit code 2,
  exactly one line on stderr that starts with "tvsmt: error:" and names the damaged file, no
  traceback, within a time bound;
* a damage that leaves a valid plan (ids renamed consistently, including to unicode, rich
  markup and terminal escapes; unknown keys added; keys reordered) keeps the verdict, and
  nothing it printed contains a raw escape or a forged line.

The examples are derandomized (Hypothesis' database is off), so a failure is reproducible,
and bounded in number so that the module stays within about a minute.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import resource
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tvsmt.cli import main

LAYOUTS = [(1, 2), (2, 1), (2, 2)]
EXPECTED = {False: ("equivalent", 0), True: ("violation", 1)}  # by "has the bug"
SECONDS = 30  # far above any example's time: a hang, not a slow machine, breaks it

# No shrinking: it would run the CLI hundreds of times more on a failure (the failing example
# is printed as generated, with the damage described in the assertion).
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

# Damages the reader (tvsmt/plan/reader.py, owned by the reader's own work) still accepts:
# each test below asserts the expected outcome and is marked as a known failure until the
# reader refuses them; strict, so that it must be unmarked once it passes.


@lru_cache(maxsize=None)
def _base(dp: int, tp: int, buggy: bool) -> tuple[str, str]:
    """The JSON text of a valid pair (cached: every example starts from a fresh copy)."""
    parallel = parallel_mlp(dp=dp, tp=tp, wrong_const_rank=0 if buggy else None)
    return json.dumps(single_mlp()), json.dumps(parallel)


def base_pair(dp: int, tp: int, buggy: bool) -> tuple[dict, dict]:
    single, parallel = _base(dp, tp, buggy)
    return json.loads(single), json.loads(parallel)


pairs = st.tuples(st.sampled_from(LAYOUTS), st.booleans())


class Workdir:
    """A fresh folder per example (Hypothesis reuses the test's tmp_path)."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0

    def new(self) -> Path:
        self.count += 1
        folder = self.root / f"ex{self.count}"
        folder.mkdir()
        return folder


@pytest.fixture
def work(tmp_path):
    return Workdir(tmp_path)


@pytest.fixture(autouse=True, scope="module")
def _no_lingering_gc_callback():
    """Hypothesis times garbage collection with a gc callback that it never removes; a
    signal handler's exception (test_solving's Ctrl-C by SIGALRM) raised while it runs is
    swallowed as 'unraisable'. Remove it when this module is done, so that later tests in
    the same worker process see their interrupts."""
    import gc

    yield
    from hypothesis.internal.conjecture import junkdrawer

    gc.callbacks[:] = [cb for cb in gc.callbacks
                       if getattr(cb, "__module__", None) != junkdrawer.__name__]
    junkdrawer._gc_initialized = False


def write(folder: Path, single, parallel, raw: dict | None = None) -> tuple[Path, Path]:
    """Write both plans; `raw` maps a side to text written as is instead of its dict."""
    paths = folder / "single.json", folder / "parallel.json"
    for path, plan, side in zip(paths, (single, parallel), ("single", "parallel")):
        text = (raw or {}).get(side)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text if text is not None else json.dumps(plan), encoding="utf-8",
                            errors="surrogatepass")
    return paths


def verify(single: Path, parallel: Path):
    t0 = time.monotonic()
    result = CliRunner().invoke(main, ["verify", str(single), str(parallel), "--no-corpus",
                                       "--jobs", "1"])
    assert time.monotonic() - t0 < SECONDS, "took too long"
    return result


def assert_input_error(result, damaged: Path, what: str) -> None:
    """Exit 2, exactly one line on stderr naming the damaged file, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        (what, repr(result.exception))
    assert result.exit_code == 2, (what, result.exit_code, result.output[-600:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, (what, result.stderr)
    assert lines[0].startswith("tvsmt: error: "), (what, lines[0])
    assert str(damaged) in lines[0], (what, lines[0])
    assert "Traceback" not in result.output and "\x1b" not in result.output, what


def assert_verdict(result, buggy: bool, what: str) -> None:
    verdict, code = EXPECTED[buggy]
    assert result.exit_code == code, (what, result.exit_code, result.output[-600:])
    assert result.output.startswith(f"verdict: {verdict}"), (what, result.output[:200])
    assert "\x1b" not in result.output and "Traceback" not in result.output, what


def side_of(single, parallel, side):
    return single if side == "single" else parallel


# --- damages that break the format: the expected outcome is an input error ----------------------

WRONG = {  # field -> values of a wrong type or out of range, never valid there
    "format": [None, 1, "tvsmt.execplan2", ["tvsmt.execplan"]],
    "version": [None, 2, "1", 10**30],
    "kind": [None, "double", 1, ["single"]],
    "tensors": [None, [], "x", 5],
    "nodes": [None, {}, "x", 5],
    "outputs": ["loss", 5, {"a": 1}, [5], ["no-such-tensor"]],
    "lineages": ["x", 5, {"a": 1}, [5], [None]],
}
NODE_WRONG = {
    "id": [None, 7, ["n"], {"a": 1}],
    "op": [None, 7, "no_such_op", ["linear"], ""],
    "pass": ["sideways", 3, ["fw"], "FW"],
    "inputs": ["x", 5, {"a": 1}, [5], ["no-such-tensor"], [["x"]]],
    "outputs": ["x", 5, {"a": 1}, [5], ["no-such-tensor"]],
    "attrs": [[1], "x", 5],
    "rank": ["0", 1.5, True, None, [0]],
    "mb": ["0", 1.5, True, None, [0]],
    "source": [5, ["a.py:1"], {"file": "a.py"}],
}
TENSOR_WRONG = {"shape": [None, "8", 8, [8, "a"], [-1, 8], [2.5, 8], [True, 8], {}]}
LINEAGE_WRONG = {
    "single": [None, 5, ["x"]],
    "parts": [None, [], "x", 5, [5], [None]],
    "hypothesis": ["yes", 1, [True]],
}
PART_WRONG = {
    "slice": [None, "x", 5, [[0]], [[0, "a"]], [[0, 1, 2]], [[None, 1]], [0, 1],
              [[0, 10**30], [0, 8]], [[-4, 4], [0, 8]], [[5, 3], [0, 8]]],
    "sum_of": [None, [], "x", [5], ["no-such-tensor"], [[]]],
    "scale": ["x", [1], [1, 0], [1.5, 2], [True, 2], [1, 2, 3], 2],
}


@st.composite
def wrong_values(draw):
    """(side, description, apply) replacing one field somewhere by a value it cannot take."""
    side = draw(st.sampled_from(["single", "parallel"]))
    where = draw(st.sampled_from(["top", "node", "tensor"] +
                                 (["lineage", "part"] if side == "parallel" else [])))
    table = {"top": WRONG, "node": NODE_WRONG, "tensor": TENSOR_WRONG,
             "lineage": LINEAGE_WRONG, "part": PART_WRONG}[where]
    key = draw(st.sampled_from(sorted(table)))
    value = draw(st.sampled_from(table[key]))
    pick = draw(st.integers(min_value=0, max_value=10**6))

    def apply(plan: dict) -> None:
        if where == "top":
            plan[key] = copy.deepcopy(value)
        elif where == "node":
            plan["nodes"][pick % len(plan["nodes"])][key] = copy.deepcopy(value)
        elif where == "tensor":
            tids = sorted(plan["tensors"])
            plan["tensors"][tids[pick % len(tids)]][key] = copy.deepcopy(value)
        elif where == "lineage":
            plan["lineages"][pick % len(plan["lineages"])][key] = copy.deepcopy(value)
        else:
            lin = plan["lineages"][pick % len(plan["lineages"])]
            lin["parts"][pick % len(lin["parts"])][key] = copy.deepcopy(value)

    return side, f"{side} {where}.{key} = {value!r}", apply


REQUIRED_TOP = ["format", "version", "kind", "tensors", "nodes"]
REQUIRED_NODE = ["id", "op", "inputs", "outputs"]


@st.composite
def missing_keys(draw):
    side = draw(st.sampled_from(["single", "parallel"]))
    where = draw(st.sampled_from(["top", "node", "tensor"] +
                                 (["lineage", "part"] if side == "parallel" else [])))
    key = draw(st.sampled_from({"top": REQUIRED_TOP, "node": REQUIRED_NODE, "tensor": ["shape"],
                                "lineage": ["single", "parts"],
                                "part": ["slice", "sum_of"]}[where]))
    pick = draw(st.integers(min_value=0, max_value=10**6))

    def apply(plan: dict) -> None:
        if where == "top":
            del plan[key]
        elif where == "node":
            del plan["nodes"][pick % len(plan["nodes"])][key]
        elif where == "tensor":
            tids = sorted(plan["tensors"])
            del plan["tensors"][tids[pick % len(tids)]][key]
        elif where == "lineage":
            del plan["lineages"][pick % len(plan["lineages"])][key]
        else:
            lin = plan["lineages"][pick % len(plan["lineages"])]
            del lin["parts"][pick % len(lin["parts"])][key]

    return side, f"{side}: {where} without '{key}'", apply


@st.composite
def dangling_references(draw):
    """A reference to something that does not exist or breaks SSA/order."""
    side = draw(st.sampled_from(["single", "parallel"]))
    kind = draw(st.sampled_from(["undeclared input", "written twice", "cycle", "duplicate id",
                                 "unknown lineage single", "undeclared sum_of"]
                                if side == "parallel" else
                                ["undeclared input", "written twice", "cycle",
                                 "duplicate id"]))
    pick = draw(st.integers(min_value=0, max_value=10**6))

    def apply(plan: dict) -> None:
        nodes = plan["nodes"]
        n = nodes[pick % len(nodes)]
        if kind == "undeclared input":
            n["inputs"] = n["inputs"] + ["ghost-tensor"]
        elif kind == "written twice":
            other = nodes[(pick + 1) % len(nodes)]
            other["outputs"] = other["outputs"] + [t for t in n["outputs"] if t][:1]
        elif kind == "cycle":
            first = nodes[0]
            later = nodes[-1]
            first["inputs"] = first["inputs"] + [t for t in later["outputs"] if t][:1]
        elif kind == "duplicate id":
            nodes[(pick + 1) % len(nodes)]["id"] = n["id"]
        elif kind == "unknown lineage single":
            plan["lineages"][pick % len(plan["lineages"])]["single"] = "ghost-tensor"
        else:
            lin = plan["lineages"][pick % len(plan["lineages"])]
            lin["parts"][0]["sum_of"] = ["ghost-tensor"]

    return side, f"{side}: {kind}", apply


@given(case=pairs, damage=st.one_of(wrong_values(), missing_keys(), dangling_references()))
@FUZZ
def test_format_damage_is_a_one_line_input_error(work, case, damage):
    (dp, tp), buggy = case
    side, what, apply = damage
    single, parallel = base_pair(dp, tp, buggy)
    apply(side_of(single, parallel, side))
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), s if side == "single" else p, what)


@given(case=pairs, value=st.sampled_from(["x", 5, [1, 2], True]),
       side=st.sampled_from(["single", "parallel"]))
@FUZZ
def test_world_that_is_not_an_object_is_an_input_error(work, case, value, side):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    side_of(single, parallel, side)["world"] = value
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), s if side == "single" else p, f"{side} world = {value!r}")


WORLD_WRONG = [-1, 0, "2", {}, [], 1.5, True, None, 2**70]


@given(case=pairs, axis=st.sampled_from(["dp", "tp", "pp", "mb", "ranks"]),
       value=st.sampled_from(WORLD_WRONG), side=st.sampled_from(["single", "parallel"]))
@settings(FUZZ, max_examples=10)
def test_bad_world_values_are_input_errors(work, case, axis, value, side):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    side_of(single, parallel, side)["world"][axis] = value
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), s if side == "single" else p,
                       f"{side} world.{axis} = {value!r}")


@given(case=pairs, damage=st.sampled_from(["version true", "single without outputs",
                                           "single with empty outputs"]))
@settings(FUZZ, max_examples=6)
def test_vacuous_or_mistyped_headers_are_input_errors(work, case, damage):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    if damage == "version true":
        single["version"] = True
    elif damage == "single without outputs":
        del single["outputs"]
    else:
        single["outputs"] = []
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), s, damage)


HUGE = [2**53 + 1, 2**64, 10**30, -(10**30)]


@given(case=pairs, value=st.sampled_from(HUGE), pick=st.integers(min_value=0, max_value=10**6))
@FUZZ
def test_huge_dimension_that_breaks_a_slice_is_an_input_error(work, case, value, pick):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    tids = sorted(parallel["tensors"])
    parallel["tensors"][tids[pick % len(tids)]]["shape"][0] = value
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), p, f"parallel shape[0] = {value}")


@given(case=pairs, value=st.sampled_from(HUGE), pick=st.integers(min_value=0, max_value=10**6))
@settings(FUZZ, max_examples=12)
def test_huge_scale_is_never_a_pass(work, case, value, pick):
    """A part scaled by a huge factor is a wrong claim: a violation (or, should the reader
    refuse such numbers, an input error), never equivalent."""
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    lin = parallel["lineages"][pick % len(parallel["lineages"])]
    lin["parts"][0]["scale"] = [value, 1]
    s, p = write(work.new(), single, parallel)
    result = verify(s, p)
    if result.exit_code == 2:
        assert_input_error(result, p, f"scale {value}")
    else:
        assert result.exit_code == 1 and result.output.startswith("verdict: violation"), \
            (value, result.output[-300:])


@given(case=pairs, value=st.sampled_from(HUGE), where=st.sampled_from(["rank", "mb"]),
       pick=st.integers(min_value=0, max_value=10**6))
@settings(FUZZ, max_examples=8)
def test_rank_or_mb_outside_the_world_is_an_input_error(work, case, value, where, pick):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    parallel["nodes"][pick % len(parallel["nodes"])][where] = value
    s, p = write(work.new(), single, parallel)
    assert_input_error(verify(s, p), p, f"parallel {where} = {value}")


@given(case=pairs, side=st.sampled_from(["single", "parallel"]),
       cut=st.floats(min_value=0.0, max_value=0.999), gz=st.booleans())
@FUZZ
def test_truncated_files_are_input_errors(work, case, side, cut, gz):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    text = json.dumps(side_of(single, parallel, side)).encode()
    if gz:
        text = gzip.compress(text)
    raw = {side: text[:int(len(text) * cut)]}
    folder = work.new()
    s, p = write(folder, single, parallel, raw)
    if gz:  # the reader picks gzip by the name
        damaged = (s if side == "single" else p).rename(folder / f"{side}.json.gz")
        s, p = (damaged, p) if side == "single" else (s, damaged)
    assert_input_error(verify(s, p), s if side == "single" else p,
                       f"{side} cut at {cut:.3f}{' (gzip)' if gz else ''}")


@given(case=pairs, side=st.sampled_from(["single", "parallel"]),
       junk=st.sampled_from([b"", b"\x00" * 64, b"\xff\xfe{}", b"[]", b"null", b"{}",
                             b"\x1f\x8b\x08garbage", "{\"format\": \"\ud800\"}".encode(
                                 "utf-8", "surrogatepass"), b"[" * 500 + b"]" * 500]))
@FUZZ
def test_files_that_are_not_plans_are_input_errors(work, case, side, junk):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    s, p = write(work.new(), single, parallel, {side: junk})
    assert_input_error(verify(s, p), s if side == "single" else p, f"{side} = {junk[:20]!r}")


# --- damages that leave a valid plan: the verdict must not change -----------------------------

HOSTILE_TEXT = st.sampled_from([
    "[/]", "layers[i]", "[bold red]x[/]", "\x1b[2J\x1b[31m", "\nforged line", "\u202e",
    ":smile:", "\\", "ü-é-中", "t1v1@r0m-1", " ", "%s%n", "$(rm -rf /)",
])


def rename_node_ids(plan: dict, fix: str) -> None:
    for n in plan["nodes"]:
        n["id"] = n["id"] + fix


def rename_tensor_ids(plan: dict, fix: str, single_plan: dict | None = None) -> None:
    """Rename every tensor of `plan` consistently (and lineage targets in `single_plan`)."""
    new = {t: t + fix for t in plan["tensors"]}
    plan["tensors"] = {new[t]: info for t, info in plan["tensors"].items()}
    for n in plan["nodes"]:
        n["inputs"] = [new.get(t, t) if t is not None else None for t in n["inputs"]]
        n["outputs"] = [new.get(t, t) if t is not None else None for t in n["outputs"]]
    plan["outputs"] = [new[t] for t in plan.get("outputs", [])]
    for lin in plan.get("lineages", []):
        for part in lin["parts"]:
            part["sum_of"] = [new[t] for t in part["sum_of"]]


@given(case=pairs, fix=HOSTILE_TEXT, what=st.sampled_from(["nodes", "parallel tensors",
                                                             "single tensors", "both"]))
@settings(FUZZ, max_examples=24)
def test_hostile_ids_renamed_consistently_keep_the_verdict(work, case, fix, what):
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    if what in ("nodes", "both"):
        rename_node_ids(single, fix)
        rename_node_ids(parallel, fix)
    if what in ("parallel tensors", "both"):
        rename_tensor_ids(parallel, fix)
    if what in ("single tensors", "both"):
        rename_tensor_ids(single, fix)
        for lin in parallel["lineages"]:
            lin["single"] = lin["single"] + fix
    s, p = write(work.new(), single, parallel)
    result = verify(s, p)
    assert_verdict(result, buggy, f"{what} + {fix!r}")
    if "\n" in fix:
        assert not any(line.startswith("forged line") for line in result.output.splitlines())


@given(case=pairs, extra=st.dictionaries(st.text(min_size=1, max_size=8),
                                         st.none() | st.integers() | st.text(max_size=8),
                                         min_size=1, max_size=3),
       where=st.sampled_from(["top", "node", "tensor", "lineage", "part"]),
       shuffle=st.booleans())
@settings(FUZZ, max_examples=16)
def test_unknown_keys_and_key_order_keep_the_verdict(work, case, extra, where, shuffle):
    """Producers may add fields (the spec's forward compatibility): never a different
    verdict because of them, nor because of the order of keys."""
    (dp, tp), buggy = case
    single, parallel = base_pair(dp, tp, buggy)
    known = {"format", "version", "name", "kind", "world", "tensors", "nodes", "outputs",
             "lineages", "id", "op", "pass", "rank", "mb", "inputs", "outputs", "attrs",
             "source", "shape", "role", "single", "parts", "aligned", "hypothesis", "slice",
             "sum_of", "scale"}
    extra = {f"x-{k}": v for k, v in extra.items() if k not in known}
    targets = {"top": [parallel], "node": parallel["nodes"],
               "tensor": list(parallel["tensors"].values()), "lineage": parallel["lineages"],
               "part": [pt for lin in parallel["lineages"] for pt in lin["parts"]]}[where]
    for obj in targets:
        obj.update(extra)
        if shuffle:
            items = list(obj.items())[::-1]
            obj.clear()
            obj.update(items)
    s, p = write(work.new(), single, parallel)
    assert_verdict(verify(s, p), buggy, f"{where} + {extra!r}")


# --- bounded memory and time, in a separate process -----------------------------------------------

MEMORY_LIMIT = 3 * 2**30


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("damage,code", [
    ("unreducible batch", 3),
    ("markup and escapes in every id", 1),
    ("deep nesting", 2),
    ("5000-digit scale", 2),
    ("wide world", 2),
])
def test_hostile_plans_in_a_memory_limited_process(tmp_path, damage, code):
    """The CLI as a user runs it, under a 3 GB address-space limit and a time limit: the
    expected exit code, no traceback, and for an input error one line naming the file."""
    import handmade

    single, parallel = base_pair(2, 2, damage == "markup and escapes in every id")
    raw = None
    if damage == "unreducible batch":  # 2 replicas of p rows, p prime: nothing to divide
        from sympy import prevprime

        batch, saved = 2 * prevprime(2**51), handmade.B
        handmade.B = batch
        try:
            single, parallel = single_mlp(), parallel_mlp(dp=2, tp=2)
        finally:
            handmade.B = saved
    elif damage == "markup and escapes in every id":
        for plan in (single, parallel):
            rename_node_ids(plan, "[/]\x1b[2J\n")
    elif damage == "deep nesting":
        raw = {"parallel": "[" * 100000 + "]" * 100000}
    elif damage == "5000-digit scale":
        raw = {"parallel": json.dumps(parallel).replace('"sum_of"', '"scale": [1' + "0" * 5000
                                                        + ', 1], "sum_of"', 1)}
    else:
        parallel["world"].update(dp=2**40, ranks=2**41)
    s, p = write(tmp_path, single, parallel, raw)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "tvsmt.cli", "verify", str(s), str(p),
                           "--no-corpus", "--jobs", "1"], capture_output=True, text=True,
                          timeout=120, preexec_fn=_limited, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == code, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert "\x1b" not in proc.stdout
    if code == 2:
        assert len(proc.stderr.splitlines()) == 1 and str(p) in proc.stderr, proc.stderr
