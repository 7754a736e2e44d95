"""Lineages carried over by structure to other widths (tvsmt/capture/scale.py): a capture at
small widths infers them from values, the same code at large widths is traced with fake
tensors and takes them scaled. It must prove the correct code, refuse a program of another
structure, and never let lineages carried from correct code pass a wide bug."""

from __future__ import annotations

import textwrap

import pytest

from tvsmt.capture import capture, check_pair
from tvsmt.errors import InputError
from tvsmt.verify import Options

OPTS = Options(jobs=1, timeout=5)
SCRIPT = """
import os
import torch
import torch.distributed as dist

WORLD_SIZE = 2
WIDE = os.environ.get("TVSMT_TEST_WIDE") == "1"
HIDDEN, FFN = (64, 256) if WIDE else (4, 8)
BUG = WIDE and os.environ.get("TVSMT_TEST_BUG") == "1"

class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad

class MLP(torch.nn.Module):
    def __init__(self, ffn, tp=False):
        super().__init__()
        self.tp = tp
        self.fc1 = torch.nn.Linear(HIDDEN, ffn, bias=False)
        self.fc2 = torch.nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)) EXTRA)
        return Reduce.apply(y) if self.tp else y

def build_single():
    return MLP(FFN), torch.randn(2, HIDDEN)

def build_rank(rank):
    full, x = build_single()
    n = FFN // 2
    model = MLP(n, tp=True)
    with torch.no_grad():
        model.fc1.weight.copy_(full.fc1.weight[rank * n:(rank + 1) * n])
        model.fc2.weight.copy_(full.fc2.weight[:, rank * n:(rank + 1) * n])
    return model, x

def train_step(model, x):
    y = model(x)
    scale = 3 if BUG and dist.get_world_size() > 1 else 1  # the same op at any width
    loss = (y * y).sum() * scale
    loss.backward()
    return loss
"""


def _script(tmp_path, extra: str = "") -> str:
    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent(SCRIPT).replace(" EXTRA", extra))
    return str(path)


@pytest.fixture()
def small(tmp_path, monkeypatch):
    monkeypatch.delenv("TVSMT_TEST_WIDE", raising=False)
    path = _script(tmp_path)
    return path, capture(path)


def test_wide_capture_takes_the_small_lineages_scaled(small, monkeypatch):
    path, pair = small
    monkeypatch.setenv("TVSMT_TEST_WIDE", "1")
    wide = capture(path, carry_from=pair)
    assert wide.single["tensors"]["param.fc1.weight"]["shape"] == [256, 64]
    report = check_pair(wide, OPTS)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    shards = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    assert shards[("param.fc1.weight", 1)] == [[128, 256], [0, 64]]
    assert all(i["how"].startswith("carried over by structure") for i in report.inputs)


def test_a_wide_bug_is_not_passed_by_lineages_carried_from_correct_code(small, monkeypatch):
    """The wide ranks scale their loss by 3 (the same nodes as the small code, another
    constant): lineages carried from the correct small capture must not let it pass."""
    path, pair = small
    monkeypatch.setenv("TVSMT_TEST_WIDE", "1")
    monkeypatch.setenv("TVSMT_TEST_BUG", "1")
    wide = capture(path, carry_from=pair)
    assert check_pair(wide, OPTS).verdict == "violation"


def test_a_program_of_another_structure_is_refused(small, monkeypatch, tmp_path):
    path, pair = small
    monkeypatch.setenv("TVSMT_TEST_WIDE", "1")
    other = _script(tmp_path, " * 2")
    with pytest.raises(InputError, match="cannot be carried over"):
        capture(other, carry_from=pair)
