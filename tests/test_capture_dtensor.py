"""DTensor `parallelize_module` in the capture: placements are the input lineages (and agree
with the inference by value), `.grad` placements the claims, the MLP and the attention block
are equivalent as written, the planted bugs are caught (or refused by torch in one line at
the user's line), and placements the capture does not model are one-line input errors."""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap

import pytest

from tvsmt.capture import check
from tvsmt.capture.lineages import input_lineage
from tvsmt.capture.script import load_script
from tvsmt.capture.trace import trace_program
from tvsmt.errors import InputError
from tvsmt.verify import Options
from capture_helpers import line_of as _line_of, sources as _sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "dtensor_mlp.py")
BLOCK = os.path.join(ROOT, "examples", "dtensor_block.py")
SP = os.path.join(ROOT, "examples", "dtensor_sp.py")


@pytest.fixture(autouse=True)
def _no_bug(monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)
    monkeypatch.delenv("DTENSOR_STEP", raising=False)


@pytest.mark.parametrize("bug", ["", "lr-on-one-rank"])
def test_an_optimizer_step_on_dtensor_parameters_is_verified(monkeypatch, bug):
    """torch's SGD on DTensor parameters writes their local shards below autograd (the
    DTensor's version counter moves, the local tensor's does not): each rank's updated
    shard is a claim `updated.<name>`, proven; one rank stepping with another learning rate
    is a violation. (Before: a false violation, "only the single step updates".)"""
    monkeypatch.setenv("DTENSOR_STEP", "sgd")
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(MLP, Options(jobs=1, timeout=5))
    stages = report.to_dict()["stages"]
    updated = {s[2] for s in stages if s[2].startswith("updated.")}
    assert updated == {f"updated.{n}" for n in ("proj.weight", "fc1.weight", "fc1.bias",
                                                "fc2.weight", "fc2.bias")}
    if not bug:
        assert report.verdict == "equivalent", [f.message for f in report.failures]
    else:
        assert report.verdict == "violation"
        assert {s[2] for s in stages if s[3] != "proven"} <= updated


def test_dtensor_mlp_is_equivalent_with_lineages_from_placements():
    report = check(MLP, Options(jobs=1, timeout=3))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    how = {(i["tensor"], i["rank"]): i["how"] for i in report.inputs}
    shards = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    for r in (0, 1):
        assert how[("param.fc1.weight", r)] == "from DTensor placement [Shard(0)] on mesh (2,)"
        assert how[("param.fc2.weight", r)] == "from DTensor placement [Shard(1)] on mesh (2,)"
        assert how[("param.fc2.bias", r)] == "from DTensor placement [Replicate()] on mesh (2,)"
        assert how[("param.proj.weight", r)].startswith("inferred from values")  # a plain one
    # rank 1's blocks are its own (DTensor's caches must not hand it rank 0's mesh)
    assert shards[("param.fc1.weight", 1)] == [[8, 16], [0, 8]]
    assert shards[("param.fc1.bias", 1)] == [[8, 16]]
    assert shards[("param.fc2.weight", 1)] == [[0, 8], [8, 16]]


def test_dtensor_block_with_attention_is_equivalent():
    report = check(BLOCK, Options(jobs=1, timeout=3))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    how = {(i["tensor"], i["rank"]): i["how"] for i in report.inputs}
    assert how[("param.attn.wq.weight", 1)].startswith("from DTensor placement [Shard(0)]")
    assert how[("param.attn.wo.weight", 1)].startswith("from DTensor placement [Shard(1)]")


def test_sequence_parallel_norm_with_partial_gradient_is_equivalent():
    """The norm's weight is constant (ones): only its placement can give its lineage; its
    gradient is Partial and is claimed as the optimizer reads it (reduced)."""
    report = check(SP, Options(jobs=1, timeout=3))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    how = {(i["tensor"], i["rank"]): i["how"] for i in report.inputs}
    shards = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    assert how[("param.norm.weight", 1)].startswith("from DTensor placement [Replicate()]")
    assert shards[("batch", 1)] == [[0, 2], [2, 4], [0, 8]]


def test_sequence_parallel_fed_the_whole_sequence_is_a_violation(monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "unsharded-input")
    report = check(SP, Options(jobs=1, timeout=1))
    assert report.verdict == "violation"
    line = _line_of(SP, "h = self.norm(x)")
    assert any(s.endswith(f"dtensor_sp.py:{line}") for s in _sources(report)), \
        _sources(report)


def test_a_norm_left_unparallelised_but_fed_a_sequence_shard_is_a_violation(monkeypatch):
    """The issue's DTensor bug in the form torch accepts: the norm is left out of the plan
    but fed the rank's part of the sequence; the forward is right, its weight gradient is a
    partial sum nobody reduces. The report names the gradient and the norm's code."""
    monkeypatch.setenv("TVSMT_BUG", "norm-unparallelised")
    report = check(SP, Options(jobs=1, timeout=1))
    assert report.verdict == "violation"
    wrong = [f for f in report.failures if f.kind == "counterexample"]
    assert {f.tensor for f in wrong} == {"grad.norm.weight"}, [f.tensor for f in wrong]
    line = _line_of(SP, "return x * torch.rsqrt")
    assert any(c.endswith(f"dtensor_sp.py:{line}") for f in wrong for c in f.code), \
        [f.code for f in wrong]


def test_placement_lineages_agree_with_inference_by_value():
    """Every DTensor parameter's block from its placement is the block that the inference
    by value finds when the placement is hidden from it."""
    sc = load_script(MLP)
    single = {i.id: i for i in trace_program(sc, None).inputs}
    compared = 0
    for r in range(sc.world_size):
        for inp in trace_program(sc, r).inputs:
            if not (isinstance(inp.declared, dict) and "dtensor" in inp.declared):
                continue
            by_placement = input_lineage(single[inp.id], r, inp, {}, sc.path)
            hidden = dataclasses.replace(inp, declared=None)
            by_value = input_lineage(single[inp.id], r, hidden, {}, sc.path)
            assert by_placement.how.startswith("from DTensor placement")
            assert by_value.how.startswith("inferred from values")
            assert by_placement.slice == by_value.slice, (inp.id, r)
            compared += 1
    assert compared == 8  # fc1 weight/bias, fc2 weight/bias, on two ranks


def test_wrong_input_layout_is_a_violation_at_the_users_line(monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "wrong-input-layout")
    report = check(MLP, Options(jobs=1, timeout=1))
    assert report.verdict == "violation"
    line = _line_of(MLP, "h = self.fc1(h)")
    assert any(s.endswith(f"dtensor_mlp.py:{line}") for s in _sources(report)), \
        _sources(report)


def test_a_refuted_obligation_is_confirmed_at_its_point_where_the_whole_one_times_out(
        monkeypatch):
    """The planted bug's obligations are nonlinear: asked whole, z3 runs out of even the
    short budget on some of them; asked with their inputs and uninterpreted functions fixed at the
    point that refutes them, it answers sat at once, and the violation stands on that."""
    from tvsmt.encoding import obligations

    monkeypatch.setenv("TVSMT_BUG", "wrong-input-layout")
    report = check(MLP, Options(jobs=1, timeout=1))
    wrong = [f for f in report.failures if f.kind == "counterexample"]
    assert report.verdict == "violation" and wrong
    assert all(f.solver["status"] == "sat" and "fixed at the concrete point" in
               f.solver["message"] for f in wrong), [f.solver for f in wrong]
    monkeypatch.setattr(obligations, "exact_refutation", lambda *args: None)
    whole = check(MLP, Options(jobs=1, timeout=1))
    assert _failures(whole) == _failures(report)
    assert any(f.solver["status"] == "timeout" for f in whole.failures
               if f.kind == "counterexample"), [f.solver for f in whole.failures]


def _failures(report) -> list[tuple]:
    return sorted((f.kind, f.tensor, f.lineage, f.stage) for f in report.failures)


@pytest.mark.parametrize("script,bug,marker", [
    (MLP, "unparallelised-fc2", "return self.fc2(torch.nn.functional.silu(h))"),
    (BLOCK, "replicated-wo", "return self.wo(out.transpose(1, 2).reshape(b, s, -1))")])
def test_unparallelised_module_fed_a_shard_is_refused_at_the_users_line(
        monkeypatch, script, bug, marker):
    """torch itself refuses these programs (the shard's width is not the unparallelised
    linear's input width): a one-line input error at the line that feeds it."""
    monkeypatch.setenv("TVSMT_BUG", bug)
    line = _line_of(script, marker)
    with pytest.raises(InputError) as err:
        check(script, Options(jobs=1, timeout=1))
    message = str(err.value)
    assert "\n" not in message
    assert re.search(rf"rank 0 at \S*{os.path.basename(script)}:{line}: ", message), message
    assert "must have same reduction dim" in message


def test_cli_refusal_is_one_line_with_exit_code_2(monkeypatch, capfd):
    from tvsmt.cli import main

    monkeypatch.setenv("TVSMT_BUG", "unparallelised-fc2")
    with pytest.raises(SystemExit) as code:
        main(["check", MLP])
    assert code.value.code == 2
    err = capfd.readouterr().err  # file-descriptor level: torch's own log handlers too
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "dtensor_mlp.py:" in lines[0], err


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


HEADER = """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    WORLD_SIZE = 2
    def build_single():
        return torch.nn.Linear(4, OUT, bias=False), torch.randn(2, 4)
    def train_step(model, x):
        loss = model(x).sum()
        loss.backward()
        return loss
"""


@pytest.mark.parametrize("out,build,match", [
    (8, "m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, "
        "[_StridedShard(0, split_factor=2)]))", "strided shard"),
    (5, "parallelize_module(m, mesh, ColwiseParallel(output_layouts=Replicate()))",
     r"sharded unevenly \(dimension 0 of size 5 over 2 ranks\)"),
    (8, "m.weight = torch.nn.Parameter(DTensor.from_local(m.weight.detach() / 2, mesh, "
        "[Partial()]))", "Partial placement")])
def test_unsupported_placement_is_a_one_line_input_error_naming_the_parameter(
        tmp_path, out, build, match):
    path = _script(tmp_path, HEADER.replace("OUT", str(out)) + f"""
    def build_rank(rank):
        m, x = build_single()
        mesh = init_device_mesh("cpu", (2,))
        {build}
        return m, x
    """)
    with pytest.raises(InputError, match=match) as err:
        check(path, Options(jobs=1, timeout=1))
    assert "tensor weight" in str(err.value) and "\n" not in str(err.value)


def test_a_rank_model_that_is_not_the_single_model_is_refused(tmp_path):
    """The placement is trusted as the lineage only where the values agree with it."""
    path = _script(tmp_path, HEADER.replace("OUT", "8") + """
    def build_rank(rank):
        x = torch.randn(2, 4)  # drawn before the model: other weights than build_single's
        m = torch.nn.Linear(4, 8, bias=False)
        parallelize_module(m, init_device_mesh("cpu", (2,)),
                           ColwiseParallel(output_layouts=Replicate()))
        return m, x
    """)
    with pytest.raises(InputError, match="not the block .* that its DTensor placement names"):
        check(path, Options(jobs=1, timeout=1))


def test_param_sharding_cannot_contradict_a_dtensor_placement(tmp_path):
    path = _script(tmp_path, HEADER.replace("OUT", "8") + """
    PARAM_SHARDING = {"weight": lambda rank: ((0, 4), (0, 4))}  # rank 1 holds rows 4:8
    def build_rank(rank):
        m, x = build_single()
        parallelize_module(m, init_device_mesh("cpu", (2,)),
                           ColwiseParallel(output_layouts=Replicate()))
        return m, x
    """)
    with pytest.raises(InputError, match="DTensor placement says"):
        check(path, Options(jobs=1, timeout=1))


def test_a_dtensor_of_another_global_shape_is_refused(tmp_path):
    path = _script(tmp_path, HEADER.replace("OUT", "8") + """
    def build_rank(rank):
        m, x = build_single()
        mesh = init_device_mesh("cpu", (2,))
        m.weight = torch.nn.Parameter(DTensor.from_local(m.weight.detach(), mesh,
                                                         [torch.distributed.tensor.Shard(0)]))
        return m, x
    single_step = train_step
    def train_step(model, x):
        mesh = model.weight.device_mesh
        loss = model(DTensor.from_local(x, mesh, [Replicate()])).full_tensor().sum()
        loss.backward()
        return loss
    """)
    with pytest.raises(InputError, match=r"global shape \[16, 4\] is not the single"):
        check(path, Options(jobs=1, timeout=1))


def test_without_the_cache_reset_a_stale_mesh_is_an_internal_error(monkeypatch):
    """DTensor's caches hand rank 1 the mesh of rank 0 (its coordinate, so its blocks); the
    reset between worlds prevents it, and the coordinate check catches it if the reset
    misses a cache: never another rank's block taken silently."""
    import tvsmt.capture.world as world
    from tvsmt.capture import capture
    from tvsmt.errors import InternalError

    monkeypatch.setattr(world, "reset_caches", lambda: None)
    import tvsmt.capture.dtensor as dtensor

    dtensor.reset_caches()  # start from empty caches, then let rank 0 fill them
    with pytest.raises(InternalError, match="coordinate .* but this is rank 1"):
        capture(MLP)
    dtensor.reset_caches()
