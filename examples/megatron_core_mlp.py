"""Megatron-Core's own tensor-parallel layers as shipped (megatron-core 0.16.1), tp2: a
replicated input projection, `ColumnParallelLinear` (weight and bias split by rows, the input
gradient all-reduced in its backward), SiLU, `RowParallelLinear` (weight split by columns,
output all-reduced, replicated bias added after the reduction). Nothing is annotated:
Megatron's parameter attributes and parallel state give the shards, including those of the
biases, which start at zero.

    pip install megatron-core==0.16.1
    tvsmt check examples/megatron_core_mlp.py                        # equivalent
    TVSMT_BUG=disable-grad-reduce tvsmt check examples/megatron_core_mlp.py
    TVSMT_BUG=softmax-over-shard tvsmt check examples/megatron_core_mlp.py

Planted bugs (environment variable TVSMT_BUG):
  disable-grad-reduce  ColumnParallelLinear(..., disable_grad_reduce=True) with nobody
                       all-reducing its input gradient: the replicated projection's
                       gradient is a partial sum on each rank
  softmax-over-shard   a softmax over the hidden features between the two layers: each rank
                       normalises over its own shard only
"""

import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="When using async grad allreduce")  # CUDA advice
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig

WORLD_SIZE = 2
HIDDEN, FFN, BATCH = 8, 16, 4
BUG = os.environ.get("TVSMT_BUG", "")


class MLP(torch.nn.Module):
    def __init__(self, tp):
        super().__init__()
        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                     gradient_accumulation_fusion=False)
        init, group = torch.nn.init.normal_, parallel_state.get_tensor_model_parallel_group()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)  # replicated
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False,
            disable_grad_reduce=BUG == "disable-grad-reduce", tp_group=group)
        self.fc2 = tensor_parallel.RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False, tp_group=group)

    def forward(self, x):
        h, _ = self.fc1(self.proj(x))
        if BUG == "softmax-over-shard":
            h = torch.softmax(h, dim=-1)
        else:
            h = torch.nn.functional.silu(h)
        y, _ = self.fc2(h)
        return y


def _build(tp):
    # tvsmt resets Megatron-Core's parallel state before every build
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    return MLP(tp), torch.randn(BATCH, HIDDEN)


def build_single():
    return _build(1)


def build_rank(rank):
    return _build(dist.get_world_size())


def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    return loss
