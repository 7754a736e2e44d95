"""A whole training step: forward, backward, data-parallel gradient averaging, gradient
clipping by the global norm, and the optimizer's update (torch.optim.Adam by default). A
Megatron-style tensor-parallel MLP (tp2: column-parallel fc1, row-parallel fc2, a replicated
input projection) times data parallelism 2.

What is verified is every parameter after `optimizer.step()` (the claims `updated.<name>`),
besides the loss and the clipped gradients: the parallel step must leave each rank's block
of every parameter exactly as the single-device step leaves it, for every input.

Clipping needs the norm of the whole model's gradient: each rank sums the squares of the
gradients it holds (a replicated parameter counted on one tensor-parallel rank only), the
tensor-parallel group adds the sums up, as Megatron's `clip_grad_norm_fp32` does. The same
function clips the single model (no group: nothing to add up).

    tvsmt check examples/optimizer_step.py                   # equivalent
    TVSMT_BUG=local-norm tvsmt check examples/optimizer_step.py
    OPTIMIZER=sgd tvsmt check examples/optimizer_step.py     # SGD with momentum

Planted bugs (environment variable TVSMT_BUG):
  local-norm          each rank clips by the norm of its own gradient shards (the sum of
                      squares is not added up over the tensor-parallel group)
  clip-before-reduce  gradients are clipped before the data-parallel average
  lr-on-one-rank      one rank's optimizer has another learning rate
"""

import os

import torch
import torch.distributed as dist

WORLD_SIZE = 4
TP, DP = 2, 2
HIDDEN, FFN, BATCH = 4, 8, 4
MAX_NORM = 0.5
BUG = os.environ.get("TVSMT_BUG", "")
OPTIMIZER = os.environ.get("OPTIMIZER", "adam")


def _groups():
    """(tp_group, dp_group) of this rank; rank = 2 * dp + tp, every group made by every rank."""
    rank = dist.get_rank()
    tp = [dist.new_group([2 * d, 2 * d + 1]) for d in range(DP)]
    dp = [dist.new_group([t, t + 2]) for t in range(TP)]
    return tp[rank // 2], dp[rank % 2]


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MLP(torch.nn.Module):
    def __init__(self, tp=1, group=None):
        super().__init__()
        self.group = group
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)  # replicated
        self.fc1 = torch.nn.Linear(HIDDEN, FFN // tp, bias=False)  # column-parallel
        self.fc2 = torch.nn.Linear(FFN // tp, HIDDEN, bias=False)  # row-parallel
        self.proj.weight.replicated = True  # counted once in the global norm

    def forward(self, x):
        h = self.proj(x)
        if self.group is not None:
            h = CopyToTP.apply(h, self.group)
        y = self.fc2(torch.nn.functional.silu(self.fc1(h)))
        if self.group is not None:
            y = ReduceFromTP.apply(y, self.group)
        return y


def build_single():
    return MLP(), torch.randn(BATCH, HIDDEN)


def build_rank(rank):
    full, x = build_single()
    tp_group, dp_group = _groups()
    t, d = rank % TP, rank // TP
    model = MLP(TP, tp_group)
    model.tp_rank, model.dp_group = t, dp_group
    shard = slice(t * FFN // TP, (t + 1) * FFN // TP)
    with torch.no_grad():
        model.proj.weight.copy_(full.proj.weight)
        model.fc1.weight.copy_(full.fc1.weight[shard])
        model.fc2.weight.copy_(full.fc2.weight[:, shard])
    rows = BATCH // DP
    return model, x[d * rows:(d + 1) * rows]


def clip_by_global_norm(model, max_norm):
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), the norm over the whole
    model (torch.nn.utils.clip_grad_norm_'s rule)."""
    squares = torch.zeros(())
    for p in model.parameters():
        if getattr(p, "replicated", False) and getattr(model, "tp_rank", 0) != 0:
            continue  # held by every tensor-parallel rank: counted on the first
        squares = squares + p.grad.pow(2).sum()
    if model.group is not None and BUG != "local-norm":
        dist.all_reduce(squares, group=model.group)
    coef = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)


def _optimizer(model):
    lr = 0.01
    if BUG == "lr-on-one-rank" and dist.is_initialized() and dist.get_rank() == 3:
        lr = 0.02
    if OPTIMIZER == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr)


def _average(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=model.dp_group)


def train_step(model, x):
    optimizer = _optimizer(model)
    y = model(x)
    loss = (y * y).mean()
    loss.backward()
    parallel = getattr(model, "dp_group", None) is not None
    if parallel and BUG != "clip-before-reduce":
        _average(model)
    clip_by_global_norm(model, MAX_NORM)
    if parallel and BUG == "clip-before-reduce":
        _average(model)
    optimizer.step()
    loss = loss.detach().clone()
    if parallel:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=model.dp_group)
    return loss
