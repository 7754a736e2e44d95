"""A per-token loss over data parallelism 2 and 2 micro-batches of gradient accumulation.

Language models ignore padding and prompt tokens (label -100), so the loss is the sum of the
kept tokens' cross entropies divided by how many tokens are kept in the whole global batch.
Each rank counts its own kept tokens and all-reduces the count before its micro-batches run;
each micro-batch divides its summed loss by that global count, and the gradients are summed
over the ranks at the end (Megatron-Core's `calculate_per_token_loss`, Hugging Face's
`num_items_in_batch`). `tvsmt check` proves this equal to the single device's mean over the
kept tokens; the count is data-dependent and differs between ranks and micro-batches.

Planted bugs (TVSMT_BUG=...), each a violation (tests/test_capture_token_loss.py):
  micro-batch-mean  each micro-batch takes the mean over its own kept tokens and the
                    micro-batches' means are averaged (the gradient accumulation bug fixed in
                    Hugging Face Transformers 4.46): wrong when micro-batches keep different
                    numbers of tokens
  rank-count        the count is not all-reduced: each rank divides by its own kept tokens
                    and the ranks' gradients are averaged
"""

import os

import torch
import torch.distributed as dist

from tvsmt.capture import microbatch

WORLD_SIZE = 2
MICRO = 2
VOCAB, HIDDEN, BATCH, SEQ = 8, 4, 8, 2
IGNORED = -100
BUG = os.environ.get("TVSMT_BUG", "")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.out(self.norm(self.emb(tokens))).view(-1, VOCAB)


def build_single():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels[torch.rand(BATCH, SEQ) < 0.3] = IGNORED  # padding, spread unevenly
    return Model(), (tokens, labels)


def build_rank(rank):
    model, (tokens, labels) = build_single()
    rows = BATCH // WORLD_SIZE
    mine = slice(rank * rows, (rank + 1) * rows)
    return model, (tokens[mine], labels[mine])


def _kept(labels):
    return (labels != IGNORED).sum().to(torch.float32)


def train_step(model, batch):
    tokens, labels = batch
    parallel = dist.get_world_size() > 1  # the single device's step runs in a world of 1
    micro = MICRO if parallel else 1
    count = _kept(labels)
    if parallel and BUG != "rank-count":
        dist.all_reduce(count)  # the global batch's kept tokens
    total = 0
    for i, (t, lab) in enumerate(zip(tokens.chunk(micro), labels.chunk(micro))):
        with microbatch(i):
            summed = torch.nn.functional.cross_entropy(
                model(t), lab.reshape(-1), ignore_index=IGNORED, reduction="sum")
            if BUG == "micro-batch-mean":
                loss = summed / _kept(lab) / micro
            else:
                loss = summed / count
            loss.backward()
            total = total + loss.detach()
    if parallel:
        averaged = BUG in ("micro-batch-mean", "rank-count")
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if averaged else dist.ReduceOp.SUM)
        dist.all_reduce(total, op=dist.ReduceOp.AVG if averaged else dist.ReduceOp.SUM)
    return total
