"""Megatron-Core's GPTModel as shipped (megatron-core 0.16.1, the local transformer layer
spec), tp2: vocabulary-parallel embedding, one transformer layer (fused QKV column-parallel,
attention, row-parallel projection, MLP), LayerNorms, the vocabulary-parallel output layer
and Megatron's vocabulary-parallel cross entropy. No annotation: Megatron's parameter
attributes and parallel state give every shard. The CPU settings below are what Megatron-Core
needs without a GPU (../shared/notes/capture.md in the tvsmt project lists them).

    pip install megatron-core==0.16.1
    tvsmt check examples/megatron_core_gpt.py                       # equivalent
    TVSMT_BUG=loss-over-tp tvsmt check examples/megatron_core_gpt.py
    TVSMT_SP=1 tvsmt check examples/megatron_core_gpt.py            # equivalent
    TVSMT_SP=1 TVSMT_BUG=sp-grads-unsynced tvsmt check examples/megatron_core_gpt.py

GPT_DDP=1 wraps the model in Megatron-Core's DistributedDataParallel over two data-parallel
ranks (tp2 x dp2, four ranks, each with half of the batch): every gradient goes through DDP's
flat buffer, written through one view of it and read back through another
(tests/test_capture_megatron_core.py checks that no correct gradient is refuted; one stage,
the word embedding's gradient, still times out at the default 60 s: docs/capture.md).

TVSMT_SP=1 turns on Megatron's sequence parallelism: activations outside attention and MLP
split along the sequence, all-gathered before the column-parallel layers and reduce-scattered
after the row-parallel ones. The local spec's LayerNorm refuses it, so the LayerNorms here
are torch's, marked `sequence_parallel` as Megatron's own are; their gradients are then
partial on each rank and are summed over the tensor-parallel group, as Megatron's
finalize_model_grads does.

Planted bugs (environment variable TVSMT_BUG):
  loss-over-tp        the loss divided by the tensor-parallel size, as if the ranks' losses
                      were summed (they are one loss, computed on every rank)
  sp-grads-unsynced   with TVSMT_SP=1, the sequence-parallel LayerNorms' gradients left as
                      each rank computed them, over its part of the sequence only
"""

import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="When using async grad allreduce")  # CUDA advice
torch.cuda.current_device = lambda: "cpu"  # Megatron-Core asks for a device in a few places
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

DDP = os.environ.get("GPT_DDP", "") == "1"
TP = 2
WORLD_SIZE = 2 * TP if DDP else TP
VOCAB, SEQ, BATCH, HIDDEN, HEADS = 32, 4, 2, 16, 4  # BATCH per data-parallel rank
BUG = os.environ.get("TVSMT_BUG", "")
SEQUENCE_PARALLEL = os.environ.get("TVSMT_SP", "") == "1"


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with Megatron's mark on its parameters when they live in the
    sequence-parallel region (the local spec's WrappedTorchNorm refuses sequence parallelism)."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def _spec():
    layer = get_gpt_layer_local_spec()
    if not SEQUENCE_PARALLEL:
        return layer
    norm = ModuleSpec(module=SequenceParallelLayerNorm)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    return TransformerBlockSubmodules(layer_specs=[layer], layer_norm=norm)


def _build(tp):
    # tvsmt resets Megatron-Core's parallel state before every build
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
        tensor_model_parallel_size=tp, use_cpu_initialization=True,
        sequence_parallel=SEQUENCE_PARALLEL and tp > 1,
        hidden_dropout=0.0, attention_dropout=0.0,  # no randomness between the programs
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)
    model = GPTModel(config, _spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    if DDP:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    replicas = 2 if DDP else 1  # the single device takes every replica's batch
    tokens = torch.randint(0, VOCAB, (replicas * BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (replicas * BATCH, SEQ))
    return model, (tokens, labels)


def build_single():
    return _build(1)


def build_rank(rank):
    model, (tokens, labels) = _build(TP)
    d = parallel_state.get_data_parallel_rank()
    mine = slice(d * BATCH, (d + 1) * BATCH)
    return model, (tokens[mine], labels[mine])


def train_step(model, batch):
    if DDP:
        model.zero_grad_buffer()
    tokens, labels = batch
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked
    loss = model(tokens, positions, causal, labels=labels).float().mean()
    if BUG == "loss-over-tp":
        loss = loss / parallel_state.get_tensor_model_parallel_world_size()
    loss.backward()
    if DDP:  # each bucket scaled by 1/dp and all-reduced over the data-parallel group
        model.finish_grad_sync()
        loss = loss.detach().clone()
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:  # the loss the ranks report: the batch's mean
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    if BUG != "sp-grads-unsynced":
        # Megatron's finalize_model_grads: a sequence-parallel parameter's gradient is the
        # sum of the ranks' gradients, each over its part of the sequence
        group = parallel_state.get_tensor_model_parallel_group()
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    return loss
