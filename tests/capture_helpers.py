"""What the capture tests share: where a line of an example is, and which source lines a
report's failures name."""

from __future__ import annotations

import textwrap


def line_of(path: str, text: str) -> int:
    """The 1-based number of the first line of `path` containing `text`."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(f"{text!r} is not in {path}")


def proven_tensors(report) -> set[str]:
    """The single tensors of the stages a report proved."""
    return {s[2] for s in report.to_dict()["stages"] if s[3] == "proven"}


def write_script(tmp_path, text: str, name: str = "train.py") -> str:
    """A capture script written from an indented test string; its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def sources(report) -> set[str]:
    """Every "file:line" that a report's failure nodes carry."""
    return {n.get("source") for f in report.failures for n in f.parallel_nodes + f.single_nodes
            if n.get("source")}


# The head of a capture script over two ranks: imports, a two-layer model whose mean square
# output is the loss, and its single-device build (tests append build_rank and the steps).
TWO_LAYER_SCRIPT = """
import os
import torch
import torch.distributed as dist

WORLD_SIZE = 2
BUG = os.environ.get("TVSMT_BUG", "")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def build_single():
    return Model(), torch.randn(4, 4)
"""


# Functions a data-parallel capture script appends (it imports torch.distributed as dist): the
# gradients averaged over the ranks, and the loss each rank reports, averaged.
DATA_PARALLEL_AVERAGES = """

def average_gradients(model):
    if dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def averaged_loss(loss):
    loss = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss
"""
