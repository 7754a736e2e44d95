"""Megatron-style tensor-parallel MLP (tp2) written with torch.distributed and
autograd.Functions: a column-parallel layer (weight split by rows, input gradient all-reduced
in backward) followed by a row-parallel layer (weight split by columns, output all-reduced in
forward). A replicated input projection in front makes the input gradient matter.

    tvsmt check examples/megatron_mlp.py                       # equivalent
    TVSMT_BUG=no-forward-allreduce tvsmt check examples/megatron_mlp.py
    TVSMT_BUG=no-backward-allreduce tvsmt check examples/megatron_mlp.py

Planted bugs (environment variable TVSMT_BUG):
  no-forward-allreduce   the row-parallel output is not all-reduced (ReduceFromTP.forward)
  no-backward-allreduce  the column-parallel input gradient is not all-reduced
                         (CopyToTP.backward)
"""

import os

import torch
import torch.distributed as dist

WORLD_SIZE = 2
HIDDEN, FFN, BATCH = 8, 16, 4
BUG = os.environ.get("TVSMT_BUG", "")


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient across the TP group backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if BUG != "no-backward-allreduce":
            dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    """All-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        if BUG != "no-forward-allreduce":
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class MLP(torch.nn.Module):
    def __init__(self, ffn, tp=False):
        super().__init__()
        self.tp = tp
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.fc1 = torch.nn.Linear(HIDDEN, ffn, bias=False)   # column-parallel
        self.fc2 = torch.nn.Linear(ffn, HIDDEN, bias=False)   # row-parallel

    def forward(self, x):
        h = self.proj(x)
        if self.tp:
            h = CopyToTP.apply(h)
        y = self.fc2(torch.nn.functional.silu(self.fc1(h)))
        if self.tp:
            y = ReduceFromTP.apply(y)
        return y


def build_single():
    return MLP(FFN), torch.randn(BATCH, HIDDEN)


def build_rank(rank):
    full, x = build_single()
    tp = dist.get_world_size()
    shard = FFN // tp
    model = MLP(shard, tp=True)
    with torch.no_grad():
        model.proj.weight.copy_(full.proj.weight)
        model.fc1.weight.copy_(full.fc1.weight[rank * shard:(rank + 1) * shard])
        model.fc2.weight.copy_(full.fc2.weight[:, rank * shard:(rank + 1) * shard])
    return model, x


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    return loss
