"""DeepSpeed data parallelism with ZeRO (stage 0, 1, 2 or 3) over two ranks: an MLP whose
every rank takes its own half of the batch, wrapped by `deepspeed.initialize`, trained by
`engine.backward`. Under ZeRO-1 and ZeRO-2 DeepSpeed keeps on each rank only its partition
of the averaged gradients (every `p.grad` is None); tvsmt claims that partition, which is
what the rank's optimizer step reads. Under ZeRO-3 the parameters too live only as each
rank's partition, all-gathered before each layer runs: the partitions are the inputs.

    tvsmt check examples/deepspeed_zero.py                 # ZeRO-2: equivalent
    DS_STAGE=3 tvsmt check examples/deepspeed_zero.py      # ZeRO-3 (0: ZeRO off): equivalent
    TVSMT_BUG=loss-scaled-twice tvsmt check examples/deepspeed_zero.py      # a violation

Planted bugs (environment variable TVSMT_BUG):
  loss-scaled-twice   the loss divided by the number of ranks on top of DeepSpeed's own
                      averaging of the gradients
  sum-not-average     DeepSpeed's gradient averaging turned off: the ranks' gradients summed
                      (ZeRO-3 has no such switch: its averaged partitions multiplied back)
  no-reduce           DeepSpeed's reduction of the gradients skipped (each rank keeps its
                      own gradients, divided by the number of ranks): its all-reduces, or
                      ZeRO-3's reduce-scatter

DS_NONCONTIGUOUS=1 turns DeepSpeed's contiguous gradient buckets off (another code path of
its reduction, also equivalent). DS_SINGLE=engine builds the single device's model with
`deepspeed.initialize` too (ZeRO 0, 1 or 2 in a world of one rank, `engine.backward`): its
one partition of each gradient is the whole gradient; equivalent, and the bugs violations
(ZeRO-3 there is refused in one line).

DS_BF16=1 turns DeepSpeed's `bf16` mode on: the engine casts the module to bfloat16 when it
is built, so each rank's parameters are the single model's cast to bfloat16 (the capture
matches them as such: over the reals a cast is the value itself). Forward and backward are
equivalent at every ZeRO stage and the planted bugs violations; its step (DeepSpeed's
BF16_Optimizer, overflow checks) is refused in one line.

DS_STEP=1 (ZeRO stage 0 in float32; under ZeRO-1/2/3 the step is refused in one line) takes the
whole step: `engine.step()` clips the averaged gradients to a global norm of MAX_NORM
(`gradient_clipping`) and SGD updates the parameters; the claims are the updated
parameters, against `clip_grad_norm_` and the same update on the
single device. The clip's 0.05 is a Python float in torch's `clip_grad_norm_` and a float32
tensor in DeepSpeed's: one value, as PyTorch's float32 kernels compute with the float32
nearest to a Python float (the capture writes that float32). Its planted bugs:
  no-clip             `gradient_clipping: 0` in DeepSpeed's config: the step does not clip
  clip-before-reduce  each rank clips its own gradients before they are averaged (the
                      all-reduce deferred by `engine.no_sync()`)

    DS_STAGE=0 DS_STEP=1 tvsmt check examples/deepspeed_zero.py                 # equivalent
    DS_STAGE=0 DS_STEP=1 TVSMT_BUG=no-clip tvsmt check examples/deepspeed_zero.py   # violation

Needs `pip install deepspeed==0.19.8` (no GPU: DeepSpeed picks its CPU accelerator).
"""

import os

import torch
import torch.distributed as dist

WORLD_SIZE = 2
HIDDEN, FFN, BATCH = 8, 16, 4  # BATCH per rank; the single device takes both halves
STAGE = int(os.environ.get("DS_STAGE", "2"))
BUG = os.environ.get("TVSMT_BUG", "")
STEP = bool(os.environ.get("DS_STEP"))
MAX_NORM, LR = 0.05, 0.1  # below this MLP's gradient norms (0.1-0.2): the clip acts


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


class Single(torch.nn.Module):
    """The single device's model under the names DeepSpeed's engine gives (`module.*`)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def loss_of(y):
    return (y * y).mean()


def build_single():
    model, x = MLP(), torch.randn(WORLD_SIZE * BATCH, HIDDEN)
    if os.environ.get("DS_SINGLE") == "engine":
        return _engine(model, WORLD_SIZE * BATCH), x
    return Single(model), x


def _engine(model, batch):
    """The model under deepspeed.initialize with the configuration of this example."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": {"stage": STAGE,
                              "contiguous_gradients": not os.environ.get("DS_NONCONTIGUOUS")},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if os.environ.get("DS_BF16"):  # the module in bfloat16, fp32 master weights and grads
        config["bf16"] = {"enabled": True}
    if STEP:  # DeepSpeed's default is 1.0; 0 turns clipping off
        config["gradient_clipping"] = 0.0 if BUG == "no-clip" else MAX_NORM
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def build_rank(rank):
    model, x = MLP(), torch.randn(WORLD_SIZE * BATCH, HIDDEN)  # as the single's, drawn alike
    return _engine(model, BATCH), x[rank * BATCH:(rank + 1) * BATCH]


def single_step(model, x):
    loss = loss_of(model(x))
    if hasattr(model, "backward"):  # DS_SINGLE=engine
        model.backward(loss)
    else:
        loss.backward()
    if STEP:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return loss


def _backward_zero3_bug(engine, loss, world):
    """ZeRO-3 reduce-scatters the gradients (it has no averaging switch): `no-reduce` skips
    the reduce-scatter (each rank keeps its own chunk, pre-divided), `sum-not-average` undoes
    the averaging of the reduced chunks."""
    import deepspeed.runtime.comm.coalesced_collectives as coalesced
    import deepspeed.runtime.zero.stage3 as stage3

    if BUG == "no-reduce":
        real, where, name = coalesced._torch_reduce_scatter_fn, coalesced, \
            "_torch_reduce_scatter_fn"
        fake = lambda *a, **k: None  # noqa: E731
    else:
        real, where, name = stage3.reduce_scatter_coalesced, stage3, "reduce_scatter_coalesced"
        fake = lambda ts, group=None: [t * world for t in real(ts, group)]  # noqa: E731
    setattr(where, name, fake)
    try:
        engine.backward(loss)
    finally:
        setattr(where, name, real)


def train_step(engine, x):
    loss = loss_of(engine(x))
    if BUG == "loss-scaled-twice":
        loss = loss / dist.get_world_size()
    if BUG == "sum-not-average" and STAGE == 0:
        engine.gradient_average = False
    elif BUG == "sum-not-average" and STAGE < 3:
        engine.optimizer.gradient_average = False
    if BUG in ("no-reduce", "sum-not-average") and STAGE == 3:
        _backward_zero3_bug(engine, loss, dist.get_world_size())
    elif BUG == "no-reduce":  # DeepSpeed's all-reduces of the gradients skipped
        import deepspeed.comm

        real, deepspeed.comm.all_reduce = deepspeed.comm.all_reduce, lambda *a, **k: None
        try:
            engine.backward(loss)
        finally:
            deepspeed.comm.all_reduce = real
    elif BUG == "clip-before-reduce":
        with engine.no_sync():
            engine.backward(loss)
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), MAX_NORM)
        engine.allreduce_gradients()
    else:
        engine.backward(loss)
    if STEP:
        engine.step()
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported
