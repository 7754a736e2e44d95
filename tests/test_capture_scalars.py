"""Python float arguments in the capture: PyTorch computes an op of float32 tensors with the
float32 nearest to the scalar (`trace.computes_in_float32`), so the capture writes that
float32 into the plan. A program that scales by the Python float 0.05 and one that scales by
a float32 tensor holding 0.05 compute the same thing; scalars that differ in float32, and any
scalar of a float64 program, stay apart."""

from __future__ import annotations

import pytest
import torch
from capture_helpers import DATA_PARALLEL_AVERAGES, proven_tensors, write_script

from tvsmt.capture import capture_pair, check
from tvsmt.verify import Options

# the ranks scale the loss by a tensor made in the step (its value is read from the tensor),
# the single device by a Python float (the single step also runs in a world, of one rank)
SCALED = """
import os
import torch
import torch.distributed as dist

WORLD_SIZE = 2
SCALE = float(os.environ.get("SCALE", "0.05"))
RANK_SCALE = float(os.environ.get("RANK_SCALE", SCALE))
DTYPE = getattr(torch, os.environ.get("DTYPE", "float32"))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


def build_single():
    return Model().to(DTYPE), torch.randn(4, 4, dtype=DTYPE)


def build_rank(rank):
    model, x = build_single()
    return model, x[rank * 2:(rank + 1) * 2]


def train_step(model, x):
    loss = model(x)
    if dist.get_world_size() > 1:
        loss = loss * torch.tensor(RANK_SCALE, dtype=DTYPE)  # a constant the trace lifts
    else:
        loss = loss * SCALE
    loss.backward()
    average_gradients(model)
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("SCALE", "RANK_SCALE", "DTYPE"):
        monkeypatch.delenv(name, raising=False)


def _script(tmp_path) -> str:
    return write_script(tmp_path, SCALED)


def test_a_python_float_and_a_float32_tensor_of_it_are_one_value(tmp_path):
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert {"grad.fc.weight", "grad.fc.bias", "loss"} <= proven_tensors(report)


def test_the_plan_holds_the_float32_the_kernel_multiplies_by(tmp_path):
    single = capture_pair(_script(tmp_path)).single
    scalars = [a for n in single["nodes"] if n["op"] == "aten.mul.Tensor"
               for a in n["attrs"]["args"] if isinstance(a, float)]
    assert scalars, [n["op"] for n in single["nodes"]]
    assert set(scalars) == {float(torch.tensor(0.05).item())} != {0.05}


@pytest.mark.parametrize("dtype, rank_scale", [
    ("float32", "0.0500001"),  # another float32: 27 units in the last place away
    ("float64", repr(float(torch.tensor(0.05).item()))),  # float32(0.05), a float64 program
])
def test_scalars_that_differ_where_the_op_computes_stay_apart(tmp_path, monkeypatch, dtype,
                                                              rank_scale):
    """The rounding is the op's own: in float32 two scalars of different float32 values stay
    different, and a float64 program keeps its scalars as the doubles they are (0.05 against
    the double nearest float32's 0.05 differ there by 7.5e-10)."""
    monkeypatch.setenv("DTYPE", dtype)
    monkeypatch.setenv("RANK_SCALE", rank_scale)
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert any(f.tensor.startswith("grad.") for f in report.failures), \
        [f.tensor for f in report.failures]
