"""Megatron-Core's DistributedDataParallel in the capture: its gradient buffers, traced.

Megatron-Core's DDP (`megatron.core.distributed.DistributedDataParallel`) allocates, when
it is built, one flat gradient buffer per dtype (`_ParamAndGradBuffer.grad_data`); each
parameter's `main_grad` is a view of it and each bucket's `grad_data` a view of a range.
Its backward hooks add `param.grad` into `main_grad` and set `param.grad` to None;
`finish_grad_sync` scales every bucket and all-reduces it over the data-parallel group. So the
gradient a rank holds after the step is `main_grad`, a view of a tensor made before the step.

While the step is traced, each buffer is a tensor made inside the trace (zeros, as Megatron
made it: `zero_grad_buffer` zeroes it again) and every `main_grad` and bucket view is taken
of it again (`traced_buffers`); afterwards everything is as it was. The gradient of a
parameter whose `.grad` the hooks cleared is its `main_grad` (`gradient_of`).

With Megatron's distributed optimizer (`use_distributed_optimizer`) each bucket is
reduce-scattered instead: a rank holds the reduced gradients of its shard of each bucket
only (the rest of its buffer keeps its own, unreduced), and those shards are what its
optimizer steps. The claims are then the pieces of each parameter that the rank's shards
cover (`gradient_pieces`), as DeepSpeed ZeRO's partitions are."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tvsmt.errors import InputError


@dataclass
class Buffers:
    """The Megatron-Core DDP modules of a model and their gradient buffers."""

    modules: list
    buffers: list

    def bucket_groups(self) -> list:
        return [g for m in self.modules for g in list(getattr(m, "bucket_groups", []) or []) +
                list(getattr(m, "expert_parallel_bucket_groups", []) or [])]

    def sharded(self) -> bool:
        """Are the gradients reduce-scattered (Megatron's distributed optimizer)?"""
        return any(b.ddp_config.use_distributed_optimizer for b in self.buffers)

    @cached_property
    def params(self) -> set[int]:
        """ids of the parameters whose gradients live in a buffer."""
        return {id(p) for buffer in self.buffers for p in buffer.param_index_map}


def grad_buffers(model: Any) -> Buffers:
    """The gradient buffers of every Megatron-Core DDP module in `model` (none for any other
    model)."""
    modules, found = [], []
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        if not type(module).__module__.startswith("megatron.core.distributed") or \
                not hasattr(module, "_make_backward_post_hook"):
            continue
        modules.append(module)
        found += list(getattr(module, "buffers", []) or []) + \
            list(getattr(module, "expert_parallel_buffers", []) or [])
    return Buffers(modules, found)


@contextmanager
def traced_buffers(held: Buffers):
    """While the step is traced: each buffer's `grad_data` a tensor of the trace (zeros),
    every parameter's `main_grad` and every bucket's `grad_data` views of it at the offsets
    Megatron gave them, and DDP's backward hook of each parameter registered on the traced
    tensor (Megatron registers it on the gradient accumulator of the tensor the parameter
    was when built, which the trace does not run: `trace.parameters_kept`); restored
    afterwards. Megatron-Core 0.16's private `_make_backward_post_hook`, exercised by
    tests/test_capture_megatron_core.py."""
    saved: list = []
    handles: list = []
    try:
        for buffer in held.buffers:
            fresh = torch.zeros(buffer.grad_data.shape, dtype=buffer.grad_data.dtype)
            saved.append((buffer, "grad_data", buffer.grad_data))
            buffer.grad_data = fresh
            for param, (start, end, _) in buffer.param_index_map.items():
                saved.append((param, "main_grad", param.main_grad))
                param.main_grad = fresh[start:end].view(param.shape)
            for bucket in buffer.buckets:
                saved.append((bucket, "grad_data", bucket.grad_data))
                bucket.grad_data = fresh[bucket.offset:bucket.offset + bucket.grad_data.numel()]
        for group in held.bucket_groups():  # the distributed optimizer's views of the shards,
            # cached at their first use: of the buffers as they were
            saved.append((group, "cached_grad_buffer_shard_list",
                          group.cached_grad_buffer_shard_list))
            group.cached_grad_buffer_shard_list = [None] * len(group.buckets)
        for module in held.modules:
            for param in module.param_to_bucket_group:
                hook = module._make_backward_post_hook(param)
                handles.append(param.register_post_accumulate_grad_hook(
                    lambda p, hook=hook: hook()))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def gradient_of(param: torch.Tensor, held: Buffers) -> torch.Tensor | None:
    """The gradient a rank holds for `param` after the step: `.grad`, else, for a parameter
    of a Megatron-Core DDP buffer, its `main_grad`."""
    if param.grad is not None or not held.buffers or id(param) not in held.params:
        return param.grad
    return param.main_grad


def gradient_pieces(held: Buffers, names: dict[int, str], path: str
                    ) -> dict[str, list[tuple[torch.Tensor, tuple]]] | None:
    """Under Megatron's distributed optimizer, after finish_grad_sync: parameter name ->
    [(piece of its reduced gradient this rank's shards hold, its block of the rank's
    parameter)], read from the traced buffers; None without that optimizer (the gradients
    are then `gradient_of`'s). A bucket's shard of rank r is its r-th equal part over the
    bucket group's data-parallel ranks (Megatron's `shard_buffer`); with one rank (the
    single device) it is the whole bucket, and the gradients are `gradient_of`'s."""
    from tvsmt.capture.zero import range_blocks

    if not held.sharded() or all(g.intra_distributed_optimizer_instance_size == 1
                                 for g in held.bucket_groups()):
        return None  # one data-parallel rank: its shard is the whole, `main_grad`
    where = {id(p): (buffer, start, end) for buffer in held.buffers
             for p, (start, end, _) in buffer.param_index_map.items()}
    out: dict[str, list[tuple[torch.Tensor, tuple]]] = {}
    for group in held.bucket_groups():
        rank, size = (group.intra_distributed_optimizer_instance_rank,
                      group.intra_distributed_optimizer_instance_size)
        for bucket in group.buckets:
            numel = bucket.grad_data.numel()
            lo = bucket.offset + rank * (numel // size)
            hi = lo + numel // size
            for param in bucket.params_list:
                buffer, start, end = where[id(param)]
                a, b = max(start, lo), min(end, hi)
                if a >= b:
                    continue
                name = names.get(id(param))
                if name is None:
                    raise InputError("Megatron-Core's DDP buffer holds the gradient of a "
                                     "tensor that is not a parameter of the model", file=path)
                out.setdefault(name, []).extend(range_blocks(
                    buffer.grad_data[a:b], tuple(param.shape), a - start, b - start))
    return out
