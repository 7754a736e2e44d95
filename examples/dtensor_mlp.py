"""A tensor-parallel MLP written with DTensor's `parallelize_module` (tp2): the first linear
`ColwiseParallel` (weight and bias split by rows), the second `RowwiseParallel` (weight split
by columns, output all-reduced). A replicated, unparallelised input projection in front makes
the gradient that flows back into the replicated part matter. Nothing is annotated for tvsmt:
the DTensor placements of the parameters are the input lineages.

    tvsmt check examples/dtensor_mlp.py                                   # equivalent
    TVSMT_BUG=wrong-input-layout tvsmt check examples/dtensor_mlp.py      # violation
    TVSMT_BUG=unparallelised-fc2 tvsmt check examples/dtensor_mlp.py      # refused by torch
    DTENSOR_STEP=sgd tvsmt check examples/dtensor_mlp.py                  # equivalent

Planted bugs (environment variable TVSMT_BUG):
  wrong-input-layout   fc1 is told that its input arrives sharded by batch
                       (input_layouts=Shard(0)) while every rank is fed the whole batch:
                       DTensor gathers the "shards" into a batch twice as large
  unparallelised-fc2   fc2 is left out of the plan while fc1 is column-parallel, so the
                       unparallelised fc2 is fed fc1's local shard; torch itself refuses the
                       program (the shard's width is not fc2's input width), and tvsmt
                       reports torch's error in one line at the user's line
  lr-on-one-rank       (with DTENSOR_STEP=sgd) rank 1 steps with twice the learning rate
"""

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD_SIZE = 2
HIDDEN, FFN, BATCH = 8, 16, 4
BUG = os.environ.get("TVSMT_BUG", "")
STEP = os.environ.get("DTENSOR_STEP") == "sgd"  # end the step with torch's SGD


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)  # replicated
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        h = self.proj(x)
        h = self.fc1(h)
        return self.fc2(torch.nn.functional.silu(h))


def build_single():
    return MLP(), torch.randn(BATCH, HIDDEN)


def build_rank(rank):
    model, x = build_single()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if BUG == "wrong-input-layout":
        plan["fc1"] = ColwiseParallel(input_layouts=Shard(0))
    if BUG == "unparallelised-fc2":
        del plan["fc2"]
    parallelize_module(model, mesh, plan)
    return model, x


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    if STEP:  # updates the DTensor parameters' local shards: each rank's are claims too
        lr = 0.2 if BUG == "lr-on-one-rank" and torch.distributed.get_rank() == 1 else 0.1
        torch.optim.SGD(model.parameters(), lr=lr).step()
    return loss
