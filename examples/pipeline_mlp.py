"""Pipeline parallelism (pp2) with torch.distributed point-to-point calls: rank 0 holds the
first layer, rank 1 the second and the loss. The global batch is split into 2 micro-batches;
rank 0 runs the forward of each and sends the activation to rank 1 (isend), rank 1 receives
it, computes the loss, back-propagates and sends the activation's gradient back (send); rank
0 receives the gradients (irecv + wait) and back-propagates them into the first layer.
Gradients accumulate over the micro-batches in `.grad`, as in a training loop.

    tvsmt check examples/pipeline_mlp.py                      # equivalent
    TVSMT_BUG=grad-order tvsmt check examples/pipeline_mlp.py
    TVSMT_BUG=no-grad-send tvsmt check examples/pipeline_mlp.py

Planted bugs (environment variable TVSMT_BUG):
  grad-order     rank 0 applies the returned gradients in reverse micro-batch order (a
                 schedule that pops the last activation while rank 1 answers first-in first-out)
  no-grad-send   the gradient is not sent back: rank 0 back-propagates zeros into the first
                 layer instead of waiting for it
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORLD_SIZE = 2
HIDDEN, FFN, BATCH, MICRO = 4, 8, 4, 2
BUG = os.environ.get("TVSMT_BUG", "")


class FirstStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)

    def forward(self, x):
        return F.gelu(self.fc1(x))


class LastStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, h, target):
        return ((self.fc2(h) - target) ** 2).sum()


class MLP(torch.nn.Module):
    """The single-device model: both stages, with the same parameter names."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)


def build_single():
    return MLP(), (torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN))


def build_rank(rank):
    full, batch = build_single()
    model = FirstStage() if rank == 0 else LastStage()
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name in own:
                own[name].copy_(p)
    return model, batch


def single_step(model, batch):
    x, target = batch
    total = torch.zeros(())
    for xm, tm in zip(x.chunk(MICRO), target.chunk(MICRO)):
        loss = ((model.fc2(F.gelu(model.fc1(xm))) - tm) ** 2).sum()
        loss.backward()
        total = total + loss.detach()
    return total


def first_stage(model, x):
    acts = []
    for xm in x.chunk(MICRO):
        h = model(xm)
        dist.isend(h.detach(), dst=1).wait()             # activation to the next stage
        acts.append(h)
    grads = []
    for h in acts:
        g = torch.empty_like(h)
        if BUG != "no-grad-send":
            dist.irecv(g, src=1).wait()                  # its gradient, back from rank 1
        else:
            g = torch.zeros_like(h)
        grads.append(g)
    if BUG == "grad-order":
        grads.reverse()
    for h, g in zip(acts, grads):
        h.backward(g)
    return None


def last_stage(model, target):
    total = torch.zeros(())
    for tm in target.chunk(MICRO):
        h = torch.empty(tm.shape[0], FFN)
        dist.recv(h, src=0)                              # activation from rank 0
        h.requires_grad_(True)
        loss = model(h, tm)
        loss.backward()
        if BUG != "no-grad-send":
            dist.send(h.grad, dst=0)                     # gradient back to rank 0
        total = total + loss.detach()
    return total


def train_step(model, batch):
    x, target = batch
    if dist.get_rank() == 0:
        return first_stage(model, x)
    return last_stage(model, target)
