"""PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) over two ranks: every rank takes
its own half of the batch; each linear layer and the whole model are `fully_shard`ed, so
every parameter is a DTensor sharded by rows over the ranks, all-gathered before each
layer's forward (and again before its backward) and its gradient reduce-scattered
(averaged) into the rank's rows after the backward. Nothing is annotated for tvsmt: the
DTensor placements FSDP2 gives the parameters are the input lineages, and each rank's
`.grad` rows are the claims.

    tvsmt check examples/fsdp2_mlp.py                                 # equivalent
    FSDP_RESHARD=0 tvsmt check examples/fsdp2_mlp.py                  # equivalent
    FSDP_SHAPE=uneven tvsmt check examples/fsdp2_mlp.py               # equivalent
    FSDP_SHAPE=hsdp tvsmt check examples/fsdp2_mlp.py                 # equivalent
    TVSMT_BUG=sum-not-average tvsmt check examples/fsdp2_mlp.py       # a violation

FSDP_OPTIMIZER=sgd or adamw ends the step with torch's SGD or AdamW on the sharded
parameters: each rank's updated rows are claims too. FSDP_CLIP=1 (with FSDP_OPTIMIZER)
clips the gradients to a global norm first, `torch.nn.utils.clip_grad_norm_` as torchtitan
does (the norm over DTensor shards: each rank's squares all-reduced): equivalent.
FSDP_RESHARD=0 keeps the gathered parameters from the forward to the backward
(`reshard_after_forward=False`: no second all-gather). FSDP_SHAPE=uneven runs four ranks on
widths that do not divide by four (FSDP2 pads each rank's rows to the first rank's count;
the last rank holds no row of fc3): also equivalent. FSDP_SHAPE=hsdp: hybrid sharding on
four ranks, two replicas of two shards (a 2-D mesh: rows sharded within a replica,
gradients reduce-scattered there and all-reduced across replicas): equivalent. FSDP_MP=bf16:
torchtitan's mixed precision (parameters all-gathered in bfloat16, gradients reduced in
float32): equivalent over the reals, and its bugs are still violations. FSDP_HELD=1 (with
FSDP_OPTIMIZER): the optimizer is built once with the model, as training code builds it (SGD
with momentum, or AdamW), and held by it: the state its step leaves (the momentum buffers,
Adam's moments, DTensors sharded like the parameters) is claimed too, each rank's rows.
FSDP_HELD=resumed: that optimizer as training resumed from a checkpoint finds it, its state
there before the step (set from the parameters here, as loading a checkpoint sets it): the
state's DTensor placements are its inputs' lineages.

Planted bugs (environment variable TVSMT_BUG):
  sum-not-average     the gradients' divide factor set to 1: the ranks' gradients summed
                      (FSDP2 then reduce-scatters with NCCL's PREMUL_SUM, whose factor the
                      traced op does not show: refused in one line, never taken for a sum)
  no-gradient-sync    set_requires_gradient_sync(False) left on: no rank holds its rows of
                      the averaged gradients
  lr-on-one-rank      (with FSDP_OPTIMIZER) rank 1 steps with twice the learning rate
  clip-local-norm     (with FSDP_CLIP) each rank clips by the norm of its own rows of the
                      gradients (their local tensors) instead of the global norm
  loss-scaled-twice   the loss divided by the number of ranks on top of FSDP2's averaging
  same-batch-half     every rank is fed the first half of the batch (a data loader bug)
  resumed-state-on-one-rank  (with FSDP_HELD=resumed, sgd) rank 1 resumes with other
                      momentum buffers than the checkpoint's: an input error naming them
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

UNEVEN = os.environ.get("FSDP_SHAPE") == "uneven"
HSDP = os.environ.get("FSDP_SHAPE") == "hsdp"  # 2 replicas x 2 shards (hybrid sharding)
WORLD_SIZE = 4 if UNEVEN or HSDP else 2
# BATCH per rank; the single device takes every rank's. Uneven: rows that do not divide
# among the ranks (10 rows: 3, 3, 3, 1; fc3's 5 rows: 2, 2, 1 and none on rank 3)
HIDDEN, FFN, BATCH = (5, 10, 2) if UNEVEN else (8, 16, 4)
BUG = os.environ.get("TVSMT_BUG", "")
RESHARD = os.environ.get("FSDP_RESHARD", "1") != "0"
OPTIMIZER = os.environ.get("FSDP_OPTIMIZER", "")  # "sgd" or "adamw": the step ends with it
CLIP = bool(os.environ.get("FSDP_CLIP"))
HELD = bool(os.environ.get("FSDP_HELD")) and bool(OPTIMIZER)
RESUMED = HELD and os.environ.get("FSDP_HELD") == "resumed"
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
    if os.environ.get("FSDP_MP") == "bf16" else MixedPrecisionPolicy()
MAX_NORM = 0.0625  # below this MLP's gradient norms: the clip acts on the concrete run


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, FFN)
        self.fc3 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        h = torch.nn.functional.silu(self.fc1(x))
        h = torch.nn.functional.silu(self.fc2(h))
        return self.fc3(h)


def loss_of(y):
    return (y * y).mean()


def build_single():
    model = MLP()
    if HELD:
        held_optimizer(model)
    return model, torch.randn(WORLD_SIZE * BATCH, HIDDEN)


def held_optimizer(model):
    """The optimizer built once, an attribute of the model (built again on the sharded
    parameters once fully_shard has made them DTensors)."""
    if OPTIMIZER == "adamw":
        model.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    else:
        model.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if RESUMED:  # the state a checkpoint of step 3 would hold, each rank's rows of it
        scale = 0.25 if BUG == "resumed-state-on-one-rank" and dist.is_initialized() \
            and dist.get_rank() == 1 else 0.5
        for p in model.parameters():
            w = p.detach()
            model.optimizer.state[p] = (
                {"step": torch.tensor(3.0), "exp_avg": w * 0.1, "exp_avg_sq": w * w * 0.01}
                if OPTIMIZER == "adamw" else {"momentum_buffer": w * scale})


def build_rank(rank):
    model, x = build_single()
    mesh = None  # FSDP2's default: one mesh dimension over every rank
    if HSDP:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh, reshard_after_forward=RESHARD, mp_policy=MP)
    fully_shard(model, mesh=mesh, reshard_after_forward=RESHARD, mp_policy=MP)
    if BUG == "sum-not-average":
        for module in (model.fc1, model.fc2, model.fc3, model):
            module.set_gradient_divide_factor(1.0)
    if BUG == "no-gradient-sync":
        model.set_requires_gradient_sync(False)
    part = 0 if BUG == "same-batch-half" else rank
    if HELD:
        held_optimizer(model)
    return model, x[part * BATCH:(part + 1) * BATCH]


def optimizer_step(model, lr=0.1, local_norm=False):
    if CLIP and local_norm:
        torch.nn.utils.clip_grad_norm_([p.grad.to_local() for p in model.parameters()],
                                       MAX_NORM)
    elif CLIP:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if HELD:
        for group in model.optimizer.param_groups:
            group["lr"] = lr
        model.optimizer.step()
    elif OPTIMIZER:
        kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[OPTIMIZER]
        kind(model.parameters(), lr=lr).step()


def single_step(model, x):
    loss = loss_of(model(x))
    loss.backward()
    optimizer_step(model)
    return loss


def train_step(model, x):
    loss = loss_of(model(x))
    if BUG == "loss-scaled-twice":
        loss = loss / dist.get_world_size()
    loss.backward()
    optimizer_step(model, lr=0.2 if BUG == "lr-on-one-rank" and dist.get_rank() == 1 else 0.1,
                   local_norm=BUG == "clip-local-norm")
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported
