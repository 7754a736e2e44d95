"""FSDP2 on top of tensor parallelism (a 2-D mesh dp2 x tp2, as torchtitan trains Llama):
`parallelize_module` splits fc1 by rows (ColwiseParallel) and fc2 by columns
(RowwiseParallel) over the "tp" mesh dimension, then `fully_shard` shards every parameter
by rows over "dp". Each data-parallel group takes its own half of the batch. Nothing is
annotated for tvsmt: the parameters' 2-D DTensor placements (FSDP2 writes
`_StridedShard(0)` for dp where tp already splits the rows) are the input lineages, and
each rank's `.grad` rows are the claims.

    tvsmt check examples/fsdp2_tp_mlp.py                               # equivalent
    TVSMT_BUG=batch-by-tp-rank tvsmt check examples/fsdp2_tp_mlp.py    # a violation

Planted bugs (environment variable TVSMT_BUG):
  batch-by-tp-rank    the batch split by the tensor-parallel rank instead of the
                      data-parallel one: the two ranks of a tensor-parallel pair compute on
                      different samples
  loss-scaled-twice   the loss divided by the number of data-parallel groups on top of
                      FSDP2's averaging
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DP, TP = 2, 2
WORLD_SIZE = DP * TP
HIDDEN, FFN, BATCH = 8, 16, 2  # BATCH per data-parallel group
BUG = os.environ.get("TVSMT_BUG", "")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(x)))


def build_single():
    return MLP(), torch.randn(DP * BATCH, HIDDEN)


def build_rank(rank):
    model, x = build_single()
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    part = mesh["tp" if BUG == "batch-by-tp-rank" else "dp"].get_local_rank()
    return model, x[part * BATCH:(part + 1) * BATCH]


def loss_of(y):
    return (y * y).mean()


def single_step(model, x):
    loss = loss_of(model(x))
    loss.backward()
    return loss


def train_step(model, x):
    loss = loss_of(model(x))
    if BUG == "loss-scaled-twice":
        loss = loss / DP
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported
