"""Megatron-style vocabulary parallelism (tp2) written with torch.distributed and
autograd.Functions: a vocab-parallel embedding (each rank holds a range of the vocabulary,
looks up the tokens in its range, zeroes the others, all-reduce), a replicated projection,
a column-parallel output layer that produces each rank's range of the logits, and Megatron's
vocab-parallel cross entropy: the row max all-reduced with MAX, the target's logit looked up
on the rank that holds it (masked elsewhere) and all-reduced, the sum of exponentials
all-reduced, loss = log(sum) - target logit; its backward is softmax minus the one-hot
target on the owning rank.

The single device runs the same code in a world of one rank (every collective is the
identity there): the cross entropy with the max subtracted is what is compared, because
exp and log are uninterpreted functions for the solver (exp(x - m) and exp(x) / exp(m) are
different terms to it).

    tvsmt check examples/vocab_parallel.py                    # equivalent
    TVSMT_BUG=local-max tvsmt check examples/vocab_parallel.py

Planted bug (environment variable TVSMT_BUG):
  local-max   each rank subtracts its own row max (the MAX all-reduce is missing), so the
              ranks' exponentials are scaled differently and the loss is wrong
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORLD_SIZE = 2
VOCAB, HIDDEN, TOKENS = 8, 4, 4
BUG = os.environ.get("TVSMT_BUG", "")


def vocab_range(world: int, rank: int) -> tuple[int, int]:
    per = VOCAB // world
    return rank * per, (rank + 1) * per


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, world: int, rank: int):
        super().__init__()
        self.start, self.end = vocab_range(world, rank)
        self.weight = torch.nn.Parameter(torch.randn(self.end - self.start, HIDDEN))

    def forward(self, ids):
        mask = (ids < self.start) | (ids >= self.end)
        local = ids.clone() - self.start
        local[mask] = 0
        out = F.embedding(local, self.weight)
        out[mask, :] = 0.0
        return ReduceFromTP.apply(out)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab_parallel_cross_entropy (without label smoothing)."""

    @staticmethod
    def forward(ctx, logits, target):
        logits_max = torch.max(logits, dim=-1)[0]
        if BUG != "local-max":
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)
        start, end = vocab_range(dist.get_world_size(), dist.get_rank())
        target_mask = (target < start) | (target >= end)
        masked_target = target.clone() - start
        masked_target[target_mask] = 0
        rows = torch.arange(0, logits.shape[0])
        predicted = logits[rows, masked_target]
        predicted[target_mask] = 0.0
        dist.all_reduce(predicted)
        exp_logits = torch.exp(logits)
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp)
        loss = torch.log(sum_exp) - predicted
        softmax = exp_logits / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad_input = softmax.clone()
        rows = torch.arange(0, grad_input.shape[0])
        grad_input[rows, masked_target] -= 1.0 - target_mask.float()
        return grad_input * grad.unsqueeze(-1), None


class LM(torch.nn.Module):
    def __init__(self, world: int, rank: int):
        super().__init__()
        start, end = vocab_range(world, rank)
        self.embed = VocabParallelEmbedding(world, rank)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)          # replicated
        self.head = torch.nn.Parameter(torch.randn(end - start, HIDDEN))  # column-parallel

    def forward(self, ids, target):
        h = torch.tanh(self.proj(self.embed(ids)))
        logits = F.linear(CopyToTP.apply(h), self.head)
        return VocabParallelCrossEntropy.apply(logits, target).mean()


def _batch():
    return (torch.randint(0, VOCAB, (TOKENS,)), torch.randint(0, VOCAB, (TOKENS,)))


def build_single():
    return LM(1, 0), _batch()


def build_rank(rank):
    full, batch = build_single()
    world = dist.get_world_size()
    start, end = vocab_range(world, rank)
    model = LM(world, rank)
    with torch.no_grad():
        model.embed.weight.copy_(full.embed.weight[start:end])
        model.proj.weight.copy_(full.proj.weight)
        model.head.copy_(full.head[start:end])
    return model, batch


def train_step(model, batch):
    ids, target = batch
    loss = model(ids, target)
    loss.backward()
    return loss
