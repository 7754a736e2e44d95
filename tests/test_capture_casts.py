"""Ranks that hold their parameters cast to a narrower dtype before the step (DeepSpeed's
`bf16` mode casts the module when the engine is built; here a plain `model.to(bfloat16)`):
the rank's input holds the single tensor's block cast to its dtype (`lineages.held`), over
the reals the block itself, and the concrete run computes over the block (`cast_inputs`).
A rank whose tensor is not that cast is still refused; a wrong reduction a violation."""

from __future__ import annotations

import pytest
import torch
from capture_helpers import DATA_PARALLEL_AVERAGES, TWO_LAYER_SCRIPT, proven_tensors, write_script

from tvsmt.capture import check
from tvsmt.capture.lineages import held
from tvsmt.errors import InputError
from tvsmt.verify import Options

CAST = TWO_LAYER_SCRIPT + """

def build_rank(rank):
    model, x = build_single()
    model = model.to(torch.bfloat16)
    if BUG == "other-weights-on-rank-1" and rank == 1:
        with torch.no_grad():
            model.fc1.weight[0, 0] += 0.25
    return model, x[rank * 2:(rank + 1) * 2].to(torch.bfloat16)


def train_step(model, x):
    loss = model(x)
    loss.backward()
    if dist.is_initialized():
        op = dist.ReduceOp.SUM if BUG == "sum-not-average" else dist.ReduceOp.AVG
        for p in model.parameters():
            dist.all_reduce(p.grad, op=op)
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)


def test_a_block_cast_to_a_narrower_dtype_is_held_and_nothing_else_is():
    block = torch.randn(3, 4)
    assert held(block, block.clone())
    assert held(block, block.to(torch.bfloat16))
    assert held(block, block.to(torch.float16))
    assert not held(block, block.to(torch.bfloat16).float())  # rounded, yet no cast: not it
    assert not held(block, (block + 2 ** -6).to(torch.bfloat16))  # another tensor's cast
    assert held(block, block.double())  # the same values, wider
    wide = torch.randn(3, 4, dtype=torch.float64)
    assert held(wide, wide.float()) and not held(wide.float(), wide)  # a cast, not its undoing
    assert not held(block, block.to(torch.int64))


def test_parameters_cast_to_bfloat16_before_the_step_are_equivalent(tmp_path):
    report = check(write_script(tmp_path, CAST), Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert {"grad.fc1.weight", "grad.fc2.weight", "loss"} <= proven_tensors(report)
    how = {i["tensor"]: i["how"] for i in report.inputs if i["rank"] == 1}
    assert how["param.fc1.weight"].endswith("held as bfloat16"), how


def test_a_rank_whose_parameter_is_not_the_cast_of_the_single_one_is_refused(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "other-weights-on-rank-1")
    with pytest.raises(InputError, match="rank 1's tensor equals no block"):
        check(write_script(tmp_path, CAST), Options(jobs=1, timeout=30))


def test_summed_bfloat16_gradients_are_a_violation(tmp_path, monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "sum-not-average")
    report = check(write_script(tmp_path, CAST), Options(jobs=1, timeout=30))
    assert report.verdict == "violation", [f.message for f in report.failures]
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert wrong and all(t.startswith("grad.") for t in wrong), wrong
