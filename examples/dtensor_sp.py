"""Sequence parallelism with DTensor (tp2): an RMSNorm made `SequenceParallel` (each rank
normalises its part of the sequence; its weight is replicated and its gradient a Partial
sum, which DTensor reduces when the optimizer uses it), then a tensor-parallel MLP whose
first linear gathers the sequence (`ColwiseParallel(input_layouts=Shard(1))`) and whose
second returns the whole output on every rank. Nothing is annotated for tvsmt.

    tvsmt check examples/dtensor_sp.py                                   # equivalent
    TVSMT_BUG=unsharded-input tvsmt check examples/dtensor_sp.py         # violation
    TVSMT_BUG=norm-unparallelised tvsmt check examples/dtensor_sp.py     # violation

Planted bug (environment variable TVSMT_BUG):
  unsharded-input   every rank is fed the whole sequence, but SequenceParallel takes a
                    rank's input to be its part of the sequence: the model then sees a
                    sequence twice as long
  norm-unparallelised
                    the norm is left out of the plan but still fed the rank's part of the
                    sequence: the forward is right (fc1 gathers the sequence), but the
                    norm weight's gradient stays this rank's partial sum, never reduced
"""

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

WORLD_SIZE = 2
BATCH, SEQ, HIDDEN, FFN = 2, 4, 8, 16
BUG = os.environ.get("TVSMT_BUG", "")


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.fc2(torch.nn.functional.silu(self.fc1(h)))


def build_single():
    return Block(), torch.randn(BATCH, SEQ, HIDDEN)


def build_rank(rank):
    model, x = build_single()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    plan = {"norm": SequenceParallel(),
            "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Replicate())}
    if BUG == "norm-unparallelised":
        del plan["norm"]
    parallelize_module(model, mesh, plan)
    if BUG == "unsharded-input":
        return model, x
    return model, x.chunk(WORLD_SIZE, dim=1)[rank]  # this rank's part of the sequence


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    return loss
