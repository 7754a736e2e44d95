"""A Llama block (RMSNorm, rotary embedding, causal attention, SiLU MLP) with tensor
parallelism 2 x data parallelism 2 and 2 micro-batches of gradient accumulation; gradients
are averaged over the data-parallel group after the last micro-batch.

`tvsmt check` proves it equivalent; each planted bug is a violation whose report shows the
line at fault (tests/test_capture_llama.py). The micro-batch loop marks each micro-batch
with `tvsmt.capture.microbatch(i)` (a no-op outside a capture), so nodes carry `mb`.

Ranks: rank = 2 * dp + tp; tensor-parallel groups {0, 1}, {2, 3}; data-parallel groups
{0, 2}, {1, 3}. Attention heads and the MLP's hidden units are split over the TP group
(column-parallel q/k/v/gate/up, row-parallel o/down), Megatron style.

    tvsmt check examples/llama_block.py
    TVSMT_BUG=wrong-group tvsmt check examples/llama_block.py

Planted bugs (environment variable TVSMT_BUG):
  wrong-group       the gradient all-reduce runs over the tensor-parallel group
  sum-not-average   the gradients are summed over the data-parallel group, not averaged
  per-microbatch    each micro-batch's loss is normalised by the micro-batch alone, where
                    the global batch is meant
"""

import os

import torch
import torch.distributed as dist

from tvsmt.capture import microbatch

WORLD_SIZE = 4
TP, DP, MICRO = 2, 2, 2
HIDDEN, HEADS, FFN, SEQ, BATCH = 16, 4, 32, 4, 4
if os.environ.get("TVSMT_LLAMA_WIDTHS") == "8b":  # Llama-3-8B widths (scripts/bench_capture.py)
    HIDDEN, HEADS, FFN, SEQ = 4096, 32, 14336, 2048
HEAD_DIM = HIDDEN // HEADS
BUG = os.environ.get("TVSMT_BUG", "")


def _groups():
    """(tp_group, dp_group) of this rank; every rank creates every group, in one order."""
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


def _copy(x, group):
    return x if group is None else CopyToTP.apply(x, group)


def _reduce(x, group):
    return x if group is None else ReduceFromTP.apply(x, group)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rotary(x):
    """Rotate-half rotary embedding over the last axis (positions along axis 2)."""
    half = HEAD_DIM // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.arange(SEQ, dtype=torch.float32)[:, None] * freqs[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(torch.nn.Module):
    def __init__(self, tp=1, group=None):
        super().__init__()
        self.group, self.heads = group, HEADS // tp
        inner, ffn = HIDDEN // tp, FFN // tp
        self.norm1 = torch.nn.Parameter(torch.randn(HIDDEN))
        self.norm2 = torch.nn.Parameter(torch.randn(HIDDEN))
        self.q = torch.nn.Linear(HIDDEN, inner, bias=False)
        self.k = torch.nn.Linear(HIDDEN, inner, bias=False)
        self.v = torch.nn.Linear(HIDDEN, inner, bias=False)
        self.o = torch.nn.Linear(inner, HIDDEN, bias=False)
        self.gate = torch.nn.Linear(HIDDEN, ffn, bias=False)
        self.up = torch.nn.Linear(HIDDEN, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, HIDDEN, bias=False)

    def attention(self, x):
        b = x.shape[0]
        x = _copy(x, self.group)
        q, k, v = (f(x).view(b, SEQ, self.heads, HEAD_DIM).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        q, k = rotary(q), rotary(k)
        scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, -1e4)
        out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(b, SEQ, self.heads * HEAD_DIM)
        return _reduce(self.o(out), self.group)

    def mlp(self, x):
        x = _copy(x, self.group)
        h = torch.nn.functional.silu(self.gate(x)) * self.up(x)
        return _reduce(self.down(h), self.group)

    def forward(self, x):
        h = x + self.attention(rms_norm(x, self.norm1))
        return h + self.mlp(rms_norm(h, self.norm2))


def build_single():
    return Block(), torch.randn(BATCH, SEQ, HIDDEN)


def build_rank(rank):
    full, x = build_single()
    tp_group, dp_group = _groups()
    t, d = rank % TP, rank // TP
    model = Block(TP, tp_group)
    model.dp_group = dp_group
    cols = slice(t * HIDDEN // TP, (t + 1) * HIDDEN // TP)
    ffn = slice(t * FFN // TP, (t + 1) * FFN // TP)
    with torch.no_grad():
        model.norm1.copy_(full.norm1)
        model.norm2.copy_(full.norm2)
        for name in ("q", "k", "v"):
            getattr(model, name).weight.copy_(getattr(full, name).weight[cols])
        model.o.weight.copy_(full.o.weight[:, cols])
        model.gate.weight.copy_(full.gate.weight[ffn])
        model.up.weight.copy_(full.up.weight[ffn])
        model.down.weight.copy_(full.down.weight[:, ffn])
    rows = BATCH // DP
    return model, x[d * rows:(d + 1) * rows]


def _loss(out, global_elements, replicas):
    """This micro-batch's share of the global mean-square loss, times the number of
    data-parallel replicas (their gradients are averaged)."""
    if BUG == "per-microbatch":
        return (out * out).mean()
    return (out * out).sum() / global_elements * replicas


def train_step(model, x):
    dp_group = getattr(model, "dp_group", None)
    replicas = DP if dp_group is not None else 1
    micro = MICRO if dp_group is not None else 1
    total = 0
    for i, mb in enumerate(x.chunk(micro)):
        with microbatch(i):
            loss = _loss(model(mb), x.numel() * replicas, replicas)
            loss.backward()
            total = total + loss.detach()
    if dp_group is not None:
        op = dist.ReduceOp.SUM if BUG == "sum-not-average" else dist.ReduceOp.AVG
        group = model.group if BUG == "wrong-group" else dp_group
        for p in model.parameters():
            dist.all_reduce(p.grad, op=op, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_group)
    return total
