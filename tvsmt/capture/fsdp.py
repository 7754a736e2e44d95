"""FSDP2 (`torch.distributed.fsdp.fully_shard`) in the capture.

`fully_shard` makes every parameter of the modules it wraps a DTensor sharded by rows
(`Shard(0)`) over the data-parallel mesh, which is the parameter's lineage, as for any
DTensor parameter (dtensor.py). FSDP2 does not compute with that DTensor, though: before a
module's forward it all-gathers the rows from its own padded, flat copy of the local shard
(`FSDPParam._sharded_param_data`) into a plain unsharded parameter, and after the backward
it reduce-scatters (averages) the unsharded gradients into the sharded parameter's `.grad`.

So the capture leaves FSDP2's parameters on their modules (FSDP2 swaps them itself) and
points FSDP2's own shard storage at the traced local tensors instead (`traced_shards`): the
all-gather then reads graph inputs, and the gradients the optimizer would read are the
sharded parameters' `.grad`, claimed by their DTensor placements. FSDP2's copy-in and
copy-out kernels (ops of the `fsdp` library, which read data pointers) are traced as the
ATen ops they stand for (`decompositions`).

FSDP2's lazy initialisation runs once on the real tensors before tracing. Uneven rows (a
first dimension not divisible by the data-parallel size) are FSDP2's as torch.chunk cuts
them: each rank's shard padded with zeros to the first one's size, all-gathered padded, the
padding cut off the unsharded parameter and zeros added to the gradients before their
reduce-scatter. A mixed precision policy (bf16 parameters all-gathered, float32 gradient
reductions) is captured as torch runs it: its casts are the values themselves over the
reals, and the concrete run checks in float64 (execute.py). CPU offloading, which changes
where the shards live, is refused in one line.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any

import torch

from tvsmt.errors import InputError


def _fsdp_module_class():
    """FSDP2's module class, None when the user's code never imported FSDP (then no module
    of theirs is one, and the import is not paid)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def managed(model, params: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    """Parameter name -> the FSDPParam that manages it, for every parameter of a module
    `fully_shard` wrapped (empty for any other model). Runs FSDP2's lazy initialisation."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(model, torch.nn.Module):
        return {}
    wrapped = [m for m in model.modules() if isinstance(m, cls)]
    if not wrapped:
        return {}
    inner = {id(sub) for m in wrapped for sub in m.modules() if sub is not m}
    for root in (m for m in wrapped if id(m) not in inner):  # each outermost one is a root
        root._get_fsdp_state()._lazy_init()  # on real tensors (it reads data pointers)
    names = {id(p): n for n, p in params.items()}
    out: dict[str, Any] = {}
    for m in wrapped:
        state = m._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                name = names.get(id(fp.sharded_param))
                if name is None:
                    raise InputError("FSDP2 manages a tensor that is not a parameter of the "
                                     "model", file=path)
                if fp.offload_to_cpu:
                    raise InputError("FSDP2's CPU offloading is not supported", file=path,
                                     tensor=name)
                if fp.fsdp_placement.dim != 0:
                    raise InputError(f"FSDP2 sharding by dimension {fp.fsdp_placement.dim} "
                                     f"is not supported (only by rows, Shard(0))",
                                     file=path, tensor=name)
                out[name] = fp
    return out


@contextmanager
def traced_shards(fsdp_params: dict[str, Any], locals_: dict[str, torch.Tensor]):
    """FSDP2's shard storage of each managed parameter becomes the traced local tensor (see
    the module docstring); restored afterwards, the gradients dropped."""
    saved = []
    try:
        for name, fp in fsdp_params.items():
            local = locals_[name]
            saved.append((fp, fp._sharded_param_data, fp.sharded_param._local_tensor))
            padded = local
            if tuple(local.shape) != tuple(fp.padded_sharded_param_size):
                # uneven rows: FSDP2 keeps the shard padded with zeros to the first one's size
                padded = local.new_zeros(fp.padded_sharded_param_size)
                padded.narrow(0, 0, local.size(0)).copy_(local)
            fp._sharded_param_data = padded.view(-1)
            fp.sharded_param._local_tensor = padded.narrow(0, 0, local.size(0))
        yield
    finally:
        for fp, data, local in saved:
            fp._sharded_param_data = data
            fp.sharded_param._local_tensor = local
            fp.sharded_param.grad = None


def _all_gather_copy_in(all_gather_inputs, all_gather_output, inp_split_sizes,
                        all_gather_input_numel, rank):
    """fsdp::all_gather_copy_in: this rank's shards, concatenated, into its block of the
    all-gather's flat output buffer."""
    block = all_gather_output.narrow(0, all_gather_input_numel * rank, all_gather_input_numel)
    block.copy_(torch.cat([t.reshape(-1) for t in all_gather_inputs]))
    return block, all_gather_output


def _split_with_sizes_copy(all_gather_output, all_gather_input_split_sizes, dim=0, *, out):
    """fsdp::split_with_sizes_copy: the gathered buffer's pieces into each parameter's
    unsharded storage."""
    for piece, dst in zip(torch.split(all_gather_output, all_gather_input_split_sizes, dim),
                          out):
        dst.copy_(piece)


def _chunk_cat(tensors, dim, num_chunks, *, out):
    """fsdp::chunk_cat (as torch._chunk_cat): each gradient cut into `num_chunks` chunks of
    rows, the last ones padded with zeros to the first one's size; the k-th chunks of all
    gradients side by side in row k of `out` (the reduce-scatter's input). FSDP2 cuts by
    rows only."""
    if dim != 0:
        raise NotImplementedError(f"fsdp::chunk_cat along dimension {dim} (only rows)")
    rows = []
    for t in tensors:
        n = t.size(0)
        size = -(-n // num_chunks)
        if size * num_chunks != n:
            t = torch.cat([t, t.new_zeros((size * num_chunks - n, *t.shape[1:]))])
        rows.append(t.reshape(num_chunks, -1))
    out.copy_(torch.cat(rows, dim=1).view(out.shape))


def decompositions() -> dict:
    """The fsdp library's ops as ATen (empty when FSDP2 was never imported)."""
    ops = getattr(torch.ops, "fsdp", None)
    if ops is None:
        return {}
    table = {}
    for name, fn in (("all_gather_copy_in", _all_gather_copy_in),
                     ("split_with_sizes_copy", _split_with_sizes_copy),
                     ("chunk_cat", _chunk_cat)):
        try:
            table[getattr(ops, name).default] = fn
        except AttributeError:
            continue
    return table
