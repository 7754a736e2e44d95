"""The PyTorch capture frontend: script convention, tracing, lineages, the hypothesis driver,
and the Megatron-style TP MLP example (equivalent as written; each planted bug a violation
that names the user's line)."""

from __future__ import annotations

import gzip
import json
import os
import re
import textwrap

import pytest

from tvsmt.capture import capture, check, write_pair
from tvsmt.capture.driver import check_pair
from tvsmt.errors import InputError
from tvsmt.verify import Options
from capture_helpers import line_of as _line_of, sources as _sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "megatron_mlp.py")
OPTS = Options(jobs=1, timeout=3)


@pytest.fixture(scope="module")
def mlp_pair():
    os.environ.pop("TVSMT_BUG", None)
    return capture(MLP)


def test_mlp_is_equivalent_and_inputs_are_inferred(mlp_pair):
    report = check_pair(mlp_pair, OPTS)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert report.hypotheses["proposed"] > 0
    shards = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    assert shards[("param.fc1.weight", 1)] == [[8, 16], [0, 8]]
    assert shards[("param.fc2.weight", 1)] == [[0, 8], [8, 16]]
    assert shards[("param.proj.weight", 1)] == [[0, 8], [0, 8]]
    assert all("2 random draws" in i["how"] for i in report.inputs)


def test_nodes_carry_the_users_source_lines(mlp_pair):
    line = _line_of(MLP, "dist.all_reduce(x)")
    sources = {n.get("source") for n in mlp_pair.parallel["nodes"]}
    assert any(s and s.endswith(f"megatron_mlp.py:{line}") for s in sources)
    reduces = [n for n in mlp_pair.parallel["nodes"] if n["op"] == "all_reduce"]
    assert len(reduces) == 4 and all(n["attrs"]["ranks"] == [0, 1] for n in reduces)
    assert all(len(n["inputs"]) == 2 for n in reduces)


@pytest.mark.parametrize("bug,marker", [("no-forward-allreduce", "y = ReduceFromTP.apply(y)"),
                                        ("no-backward-allreduce", "h = CopyToTP.apply(h)")])
def test_mlp_bugs_are_violations_at_the_users_line(monkeypatch, bug, marker):
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(MLP, Options(jobs=1, timeout=2))
    assert report.verdict == "violation"
    line = _line_of(MLP, marker)
    assert any(s.endswith(f"megatron_mlp.py:{line}") for s in _sources(report)), _sources(report)


def test_a_wrong_hypothesis_never_turns_into_a_pass(monkeypatch):
    """Without the forward all-reduce, claim that each rank's un-reduced output IS the
    single output: if the driver trusted it, the loss and gradients would pass."""
    monkeypatch.setenv("TVSMT_BUG", "no-forward-allreduce")
    pair = capture(MLP)
    s_mul = next(n for n in pair.single["nodes"] if n["op"] == "aten.mul.Tensor")
    y = s_mul["inputs"][0]
    p_muls = [n for n in pair.parallel["nodes"] if n["op"] == "aten.mul.Tensor"
              and n["inputs"][0] == n["inputs"][1]]
    assert len(p_muls) == 2
    shape = pair.single["tensors"][y]["shape"]
    wrong = {"single": y, "hypothesis": True,
             "parts": [{"slice": [[0, n] for n in shape], "sum_of": [m["inputs"][0]]}
                       for m in p_muls]}
    lins = pair.parallel["lineages"]
    first_claim = next(i for i, lin in enumerate(lins) if not lin.get("hypothesis")
                       and not lin["parts"][0]["sum_of"][0].split(":")[1].startswith(
                           ("param.", "batch")))
    lins.insert(first_claim, wrong)
    report = check_pair(pair, Options(jobs=1, timeout=2))
    assert report.verdict == "violation"
    assert report.hypotheses["dropped"] >= 1


def test_capture_writes_plans_that_the_reader_accepts(mlp_pair, tmp_path):
    from tvsmt.plan import load_plan
    from tvsmt.plan.reader import check_pair as check_plans

    single, parallel = write_pair(mlp_pair, str(tmp_path))
    s, p = load_plan(single), load_plan(parallel)
    check_plans(s, p)
    assert s.outputs[0] == "loss" and "grad.fc1.weight" in s.outputs
    meta = json.loads((tmp_path / "capture.json").read_text())
    assert len(meta["inputs"]) == 8
    with gzip.open(parallel, "rt") as f:
        assert any(lin.get("hypothesis") for lin in json.load(f)["lineages"])


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_missing_function_is_an_input_error(tmp_path):
    path = _script(tmp_path, "WORLD_SIZE = 2\ndef build_single():\n    pass\n")
    with pytest.raises(InputError, match="build_rank"):
        capture(path)


_SMALL_STEP = """
    import sys
    import torch
    WORLD_SIZE = 2
    def build_single():
        return torch.nn.Linear(4, 4, bias=False), torch.randn(2, 4)
    def build_rank(rank):
        {build_rank}
        return build_single()
    def train_step(model, x):
        {train_step}
        loss = model(x).sum()
        loss.backward()
        return loss
    """


@pytest.mark.parametrize("where,code,shown", [
    ("top", "raise ValueError('no config file')",
     "importing the script failed at {at}: ValueError: no config file"),
    ("build_rank", "assert rank == 0, 'one rank only'",
     r"build_rank\(1\) failed at {at}: AssertionError: one rank only"),
    ("train_step", "x = x[99]", "single at {at}: tracing the training step failed: IndexError"),
    # the user's code ending the process must not end tvsmt with exit code 0, the code of a pass
    ("train_step", "sys.exit(0)",
     r"single at {at}: tracing the training step failed: the script called sys.exit\(0\)"),
    ("top", "sys.exit(0)", r"importing the script failed at {at}: the script called sys.exit\(0\)"),
])
def test_the_users_code_failing_is_an_input_error_at_its_line(tmp_path, where, code, shown):
    """An exception (or sys.exit) in the user's own code, wherever tvsmt runs it: exit 2 and
    one line naming the user's source line, never "a bug in tvsmt" (exit 4) nor a pass."""
    from click.testing import CliRunner

    from tvsmt.cli import main

    body = textwrap.dedent(_SMALL_STEP).format(
        build_rank=code if where == "build_rank" else "pass",
        train_step=code if where == "train_step" else "pass")
    if where == "top":
        body = body.replace("WORLD_SIZE = 2\n", f"WORLD_SIZE = 2\n{code}\n")
    path = tmp_path / "train.py"
    path.write_text(body)
    line = next(i for i, text in enumerate(body.splitlines(), 1) if text.strip() == code)
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert re.search(shown.format(at=rf"train\.py:{line}"), lines[0]), lines[0]


@pytest.mark.parametrize("spec,shown", [
    ("lambda rank: 1 // (rank - rank)",
     r"PARAM_SHARDING\['weight'\]\(\d\) failed at train\.py:{line}: ZeroDivisionError"),
    ("lambda rank: ((0, 2.5), (0, 4))",
     r"tensor weight: PARAM_SHARDING\['weight'\]\(\d\) returned .*, not \(\(start, end\)"),
    ("lambda rank: 7", r"PARAM_SHARDING\['weight'\]\(\d\) returned 7, not"),
])
def test_a_sharding_function_that_fails_is_an_input_error(tmp_path, spec, shown):
    from click.testing import CliRunner

    from tvsmt.cli import main

    body = textwrap.dedent(_SMALL_STEP).format(build_rank="pass", train_step="pass")
    body = body.replace("WORLD_SIZE = 2\n",
                        f"WORLD_SIZE = 2\nPARAM_SHARDING = {{'weight': {spec}}}\n")
    path = tmp_path / "train.py"
    path.write_text(body)
    line = next(i for i, text in enumerate(body.splitlines(), 1) if "PARAM_SHARDING" in text)
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(shown.format(line=line), lines[0]), result.output


def test_degenerate_parameter_is_refused_by_name(tmp_path):
    """A rank's zero weight of half the single's rows equals either half: refused, naming
    it (a zero weight of the whole shape can only be the whole one:
    tests/test_capture_megatron_core.py)."""
    path = _script(tmp_path, """
        import torch
        WORLD_SIZE = 2
        def _model(rows):
            m = torch.nn.Linear(4, rows, bias=False)
            torch.nn.init.zeros_(m.weight)
            return m
        def build_single():
            return _model(4), torch.randn(2, 4)
        def build_rank(rank):
            return _model(2), torch.randn(2, 4)
        def train_step(model, x):
            loss = model(x).sum()
            loss.backward()
            return loss
        """)
    with pytest.raises(InputError, match="weight.*degenerate|degenerate"):
        capture(path)


def test_declared_sharding_is_used_and_reported(tmp_path):
    path = _script(tmp_path, """
        import torch
        WORLD_SIZE = 2
        PARAM_SHARDING = {"weight": "replicate"}
        def build_single():
            m = torch.nn.Linear(4, 4, bias=False)
            return m, torch.randn(2, 4)
        def build_rank(rank):
            return build_single()
        def train_step(model, x):
            loss = model(x).sum()
            loss.backward()
            return loss
        """)
    report = check(path, OPTS)
    assert report.verdict == "equivalent"
    assert {i["how"] for i in report.inputs if i["tensor"] == "param.weight"} == {
        "declared (PARAM_SHARDING)"}


def test_unpaired_collective_names_rank_and_line(tmp_path):
    path = _script(tmp_path, """
        import torch
        import torch.distributed as dist
        WORLD_SIZE = 2
        def build_single():
            return torch.nn.Linear(4, 4, bias=False), torch.randn(2, 4)
        def build_rank(rank):
            return build_single()
        def train_step(model, x):
            loss = model(x).sum()
            loss.backward()
            if dist.get_rank() == 1:
                dist.all_reduce(model.weight.grad)
            return loss
        """)
    with pytest.raises(InputError, match=r"rank 1 at .*train.py:13.*no partner"):
        capture(path)


def test_worlds_leave_no_process_group_or_excepthook_behind(mlp_pair):
    import sys

    import torch.distributed as dist

    hook = sys.excepthook
    capture(MLP)
    assert not dist.is_initialized()
    assert sys.excepthook is hook


def test_values_that_are_not_finite_give_no_hypothesis():
    """A block holding a NaN or an infinity on the concrete run (a wrong program's random
    draw can) is never fingerprinted, and no ratio is taken of one: before, a NaN made the
    hypothesis search fail with Fraction's ValueError (a Megatron-Core capture in CI)."""
    import torch

    from tvsmt.capture.lineages import _nice, _normalised

    for bad in (float("nan"), float("inf"), -float("inf")):
        assert _normalised(torch.tensor([1.0, bad, 2.0])) == (b"", 0.0)
        assert _nice(bad) is None
    key, pivot = _normalised(torch.tensor([1.0, -4.0, 2.0]))
    assert pivot == -4.0 and key


def test_the_launcher_environment_of_a_rank_is_gone_afterwards(monkeypatch):
    """DeepSpeed reads RANK, WORLD_SIZE, MASTER_ADDR... as a launcher sets them; the capture
    sets them per rank and leaves the environment as it found it."""
    from tvsmt.capture.world import launcher_environment

    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    before = dict(os.environ)
    with launcher_environment(1, 4):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == \
            ("1", "4", "29500")
    assert dict(os.environ) == before


def test_a_gradient_only_the_ranks_compute_is_a_violation(tmp_path):
    """The single model's fc2.bias frozen (no gradient, no update), the ranks' trained: the
    ranks' gradient of it has nothing to be checked against. A structural violation naming
    it, never a gradient left unclaimed."""
    from capture_helpers import DATA_PARALLEL_AVERAGES, TWO_LAYER_SCRIPT, write_script

    from tvsmt.errors import StructuralViolation

    path = write_script(tmp_path, TWO_LAYER_SCRIPT.replace(
        "    return Model(), torch.randn(4, 4)",
        "    model = Model()\n"
        "    model.fc2.bias.requires_grad_(dist.get_world_size() > 1)\n"
        "    return model, torch.randn(4, 4)") + """

def build_rank(rank):
    model, x = build_single()
    return model, x[rank * 2:(rank + 1) * 2]


def train_step(model, x):
    loss = model(x)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES)
    with pytest.raises(StructuralViolation, match="only the step of rank 0 leaves a gradient "
                                                  "of fc2.bias"):
        capture(path)
    assert check(path, Options(jobs=1, timeout=5)).verdict == "violation"
