"""Megatron-Core's own data parallelism as shipped (megatron-core 0.16.1): its
`DistributedDataParallel` around a model of its tensor-parallel layers, tp2 x dp2 on four
ranks. DDP keeps every gradient in a flat buffer it allocated when built (`param.main_grad`,
a view of it; its backward hooks add each `.grad` there and clear `.grad`), and
`finish_grad_sync` scales the buckets of that buffer by 1/dp and all-reduces them over the
data-parallel group. Nothing is annotated: the gradients tvsmt claims are the `main_grad`s
(tvsmt.capture.megatron_ddp), the shards Megatron's parameter attributes.

    pip install megatron-core==0.16.1
    tvsmt check examples/megatron_core_ddp.py                       # equivalent
    DDP_OVERLAP=1 tvsmt check examples/megatron_core_ddp.py         # equivalent
    TVSMT_BUG=no-grad-sync tvsmt check examples/megatron_core_ddp.py

The single device's model is the same code on one rank (DDP over a data-parallel group of
one: nothing to reduce); DDP_SINGLE=plain builds it without DDP (its gradients in `.grad`,
its parameters under the same `module.` names): also equivalent. DDP_OVERLAP=1 turns on
`overlap_grad_reduce`, with buckets of a few elements: each bucket's all-reduce is started by the backward hook of the last of its
gradients and waited for in `finish_grad_sync`. DDP_DISTOPT=1 turns on Megatron's
distributed optimizer's layout (`use_distributed_optimizer`: parameters in a flat buffer,
each bucket reduce-scattered): a rank holds the reduced gradients of its shard of each bucket
only, and those pieces of the parameters are what tvsmt claims: also equivalent.

Planted bugs (environment variable TVSMT_BUG):
  no-grad-sync        `finish_grad_sync` not called: each rank keeps the gradients of its
                      own half of the batch
  per-token-scaling   `calculate_per_token_loss=True` in the TransformerConfig with a loss
                      that is a mean: DDP then leaves the 1/dp scaling to the loss, and the
                      ranks' gradients are summed
"""

import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="When using async grad allreduce")  # CUDA advice
warnings.filterwarnings("ignore", message="full scope is deprecated")
torch.cuda.current_device = lambda: "cpu"  # Megatron-Core's buffers ask for a device
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

WORLD_SIZE = 4
TP = 2
HIDDEN, FFN, BATCH = 8, 32, 4  # BATCH per data-parallel rank; the single device takes both
BUG = os.environ.get("TVSMT_BUG", "")
OVERLAP = bool(os.environ.get("DDP_OVERLAP"))
DISTOPT = bool(os.environ.get("DDP_DISTOPT"))
PLAIN_SINGLE = os.environ.get("DDP_SINGLE") == "plain"


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        init, group = torch.nn.init.normal_, parallel_state.get_tensor_model_parallel_group()
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False,
            tp_group=group)
        self.fc2 = tensor_parallel.RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False, tp_group=group)

    def forward(self, x):
        h, _ = self.fc1(x)
        y, _ = self.fc2(torch.nn.functional.silu(h))
        return y


def _build(tp):
    # tvsmt resets Megatron-Core's parallel state before every build
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=tp,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False,
                               calculate_per_token_loss=BUG == "per-token-scaling")
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=OVERLAP,
                                               bucket_size=40 if OVERLAP else None,
                                               use_distributed_optimizer=DISTOPT)
    if tp == 1 and PLAIN_SINGLE:
        return Single(MLP(config)), torch.randn(2 * BATCH, HIDDEN)
    model = DistributedDataParallel(config, ddp_config, MLP(config))
    return model, torch.randn(2 * BATCH, HIDDEN)


class Single(torch.nn.Module):
    """The single device's model without DDP, under the names DDP gives (`module.*`)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def build_single():
    return _build(1)


def build_rank(rank):
    model, x = _build(TP)
    d = parallel_state.get_data_parallel_rank()
    return model, x[d * BATCH:(d + 1) * BATCH]


def train_step(model, x):
    if not isinstance(model, Single):
        model.zero_grad_buffer()
    y = model(x)
    loss = (y * y).mean()
    loss.backward()
    if BUG != "no-grad-sync" and not isinstance(model, Single):
        model.finish_grad_sync()
    loss = loss.detach().clone()
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:  # the loss each rank reports: the batch's mean
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    return loss
