"""Megatron-style sequence parallelism (tp2) written with torch.distributed and
autograd.Functions: the activations between the tensor-parallel blocks are split along the
sequence, the layer norm runs on each rank's sequence shard, an all-gather (backward: a
reduce-scatter) brings the whole sequence to the column-parallel linear, and a
reduce-scatter (backward: an all-gather) after the row-parallel linear returns to sequence
shards. The layer norm's weight and bias are replicated, but each rank only sees its part
of the sequence, so their gradients are partial sums and must be all-reduced across the
tensor-parallel group (what Megatron does for parameters marked `sequence_parallel`).

    tvsmt check examples/sequence_parallel.py                      # equivalent
    TVSMT_BUG=no-norm-grad-allreduce tvsmt check examples/sequence_parallel.py

Planted bug (environment variable TVSMT_BUG):
  no-norm-grad-allreduce   the layer-norm gradients are not all-reduced across the
                           tensor-parallel group (the class of Megatron-LM issue 1446)
"""

import os

import torch
import torch.distributed as dist

WORLD_SIZE = 2
SEQ, BATCH, HIDDEN, FFN = 4, 2, 4, 8
BUG = os.environ.get("TVSMT_BUG", "")


class GatherFromSequence(torch.autograd.Function):
    """All-gather of the sequence shards (dim 0) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x):
        tp = dist.get_world_size()
        out = torch.empty((x.shape[0] * tp,) + tuple(x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        tp = dist.get_world_size()
        out = torch.empty((grad.shape[0] // tp,) + tuple(grad.shape[1:]), dtype=grad.dtype)
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


class ScatterToSequence(torch.autograd.Function):
    """Reduce-scatter of the partial sums into sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x):
        tp = dist.get_world_size()
        out = torch.empty((x.shape[0] // tp,) + tuple(x.shape[1:]), dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        tp = dist.get_world_size()
        out = torch.empty((grad.shape[0] * tp,) + tuple(grad.shape[1:]), dtype=grad.dtype)
        dist.all_gather_into_tensor(out, grad.contiguous())
        return out


class Block(torch.nn.Module):
    """LayerNorm, then a column-parallel / row-parallel MLP (sequence-parallel when sp)."""

    def __init__(self, ffn, sp=False):
        super().__init__()
        self.sp = sp
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, ffn, bias=False)   # column-parallel
        self.fc2 = torch.nn.Linear(ffn, HIDDEN, bias=False)   # row-parallel

    def forward(self, x):
        h = self.norm(x)
        if self.sp:
            h = GatherFromSequence.apply(h)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        if self.sp:
            y = ScatterToSequence.apply(y)
        return x + y


def _random_norm(model):
    """Random layer-norm parameters (ones and zeros would make their slices ambiguous)."""
    with torch.no_grad():
        model.norm.weight.copy_(1 + 0.5 * torch.randn(HIDDEN))
        model.norm.bias.copy_(0.5 * torch.randn(HIDDEN))
    return model


def build_single():
    return _random_norm(Block(FFN)), torch.randn(SEQ, BATCH, HIDDEN)


def build_rank(rank):
    full, x = build_single()
    tp = dist.get_world_size()
    shard, seq = FFN // tp, SEQ // tp
    model = Block(shard, sp=True)
    with torch.no_grad():
        model.norm.load_state_dict(full.norm.state_dict())
        model.fc1.weight.copy_(full.fc1.weight[rank * shard:(rank + 1) * shard])
        model.fc2.weight.copy_(full.fc2.weight[:, rank * shard:(rank + 1) * shard])
    return model, x[rank * seq:(rank + 1) * seq]


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()           # this rank's part of the loss: its sequence shard
    loss.backward()
    if model.sp and BUG != "no-norm-grad-allreduce":
        for p in model.norm.parameters():    # partial over the sequence: sum across TP
            dist.all_reduce(p.grad)
    total = loss.detach().clone()
    if model.sp:
        dist.all_reduce(total)     # the whole sequence's loss, as the single device has it
    return total
