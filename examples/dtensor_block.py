"""A transformer block (attention and MLP, each with a residual) made tensor-parallel with
DTensor's `parallelize_module` (tp2), as in PyTorch's tensor-parallel tutorial: the query,
key and value projections and the MLP's first linear `ColwiseParallel`, the attention output
projection and the MLP's second linear `RowwiseParallel`. Each rank holds half of the heads;
the attention reshapes by `-1` heads, so the same code runs on one device and on a shard.
Nothing is annotated for tvsmt: the DTensor placements are the input lineages.

    tvsmt check examples/dtensor_block.py                                # equivalent
    TVSMT_BUG=replicated-wo tvsmt check examples/dtensor_block.py        # refused by torch

Planted bug (environment variable TVSMT_BUG):
  replicated-wo   the attention output projection is left out of the plan, so it is fed
                  the heads' local shard; torch refuses the program (the shard's width is
                  not the projection's input width); tvsmt reports it in one line at the
                  user's line
"""

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

WORLD_SIZE = 2
BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 4, 8, 2, 16
HEAD_DIM = HIDDEN // HEADS
BUG = os.environ.get("TVSMT_BUG", "")


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)  # -1: this rank's heads
        k = self.wk(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / HEAD_DIM ** 0.5
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(x)))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.mlp(h)


def build_single():
    return Block(), torch.randn(BATCH, SEQ, HIDDEN)


def build_rank(rank):
    model, x = build_single()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    if BUG == "replicated-wo":
        del plan["attn.wo"]
    parallelize_module(model, mesh, plan)
    return model, x


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    return loss
