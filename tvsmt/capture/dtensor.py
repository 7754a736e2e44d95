"""DTensor (`torch.distributed.tensor`, `parallelize_module`) in the capture.

A parameter that `parallelize_module` (or `distribute_tensor`) made a DTensor declares its
own lineage: its placements on its device mesh say which block of the global tensor this
rank's local tensor is. The capture traces the local tensors: every DTensor parameter becomes
a graph input holding its local shard, re-wrapped inside the traced step as a leaf DTensor
with the same mesh, placements, global shape and stride, so DTensor's dispatch runs exactly
as in training and lowers to local ATen ops and functional collectives (which the converter
already knows). After the step, `p.grad` is a DTensor: its local tensor is the claim, and
its own placements (not the parameter's) say which block of the single gradient it is.

Supported placements: `Shard(d)` with even shards and `Replicate()`, on meshes of any
dimension. `_StridedShard`, uneven shards, and `Partial` parameters or gradients are refused
with one line naming the parameter (never guessed).

On the "fake" backend collectives compute nothing, so `distribute_tensor`'s scatter from
rank 0 would leave every other rank's shard uninitialised. While a rank is built,
`local_distribution()` makes that scatter copy the rank's own block of the tensor it was
given: every rank of the fake world builds the full tensor itself from the same seed, so
that block is what rank 0 would send. The values are checked against the single model's
block anyway (`check_values`), so a script where that is not so is refused, not trusted.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tvsmt.errors import InputError, InternalError

Slice = tuple[tuple[int, int], ...]


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Layout:
    """Where one rank's local tensor sits in its DTensor's global tensor."""

    mesh: Any  # DeviceMesh (kept to re-wrap the traced local tensor)
    placements: tuple
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]  # global
    slice: Slice  # this rank's block of the global tensor

    @property
    def described(self) -> str:
        pl = ", ".join(_placement_name(p) for p in self.placements)
        return f"[{pl}] on mesh {tuple(self.mesh.shape)}"


def _placement_name(p) -> str:
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_replicate():
        return "Replicate()"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return type(p).__name__


@dataclass(frozen=True)
class Spec:
    """What a DTensor says about itself (read while tracing; its block is computed after,
    outside make_fx, because torch computes offsets with tensor ops)."""

    mesh: Any
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def spec_of(t) -> Spec:
    return Spec(t.device_mesh, tuple(t.placements), tuple(int(n) for n in t.shape),
                tuple(int(s) for s in t.stride()))


def layout_of(t, name: str, path: str, what: str = "parameter", uneven: bool = False
              ) -> Layout:
    """The layout of a DTensor (or of a Spec read from one), or a one-line InputError naming
    `name` for a placement the capture does not model; `uneven` (FSDP2's parameters):
    shards of unequal sizes are taken as torch.chunk cuts them (fsdp.py traces FSDP2's
    padding), and `_StridedShard` (FSDP2's rows of rows tp already split) as the block
    torch's offsets give, which `check_values` confirms by the values."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    spec = t if isinstance(t, Spec) else spec_of(t)
    mesh, placements, shape = spec.mesh, spec.placements, spec.shape
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard) and not uneven:  # FSDP2 over tp: fsdp.py
            raise InputError(f"DTensor {what} has a strided shard placement "
                             f"({p!r}): not supported (only "
                             f"Shard(d) and Replicate())", file=path, tensor=name)
        if p.is_partial():
            raise InputError(f"DTensor {what} has a Partial placement: not supported "
                             f"(only Shard(d) and Replicate())", file=path, tensor=name)
        if not (isinstance(p, (Shard, _StridedShard)) or p.is_replicate()):
            raise InputError(f"DTensor {what} has placement {p!r}: not supported",
                             file=path, tensor=name)
    # even shards only: every split dimension divisible by the product of its mesh sizes
    split: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % len(shape) if shape else p.dim
            split[d] = split.get(d, 1) * mesh.size(mesh_dim)
    for d, k in split.items():
        if shape[d] % k and not uneven:
            raise InputError(f"DTensor {what} is sharded unevenly (dimension {d} of size "
                             f"{shape[d]} over {k} ranks): not supported", file=path,
                             tensor=name)
    _check_coordinate(mesh, name)
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    sl = tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local))
    return Layout(mesh, placements, shape, spec.stride, sl)


def _check_coordinate(mesh, name: str) -> None:
    """The mesh's cached coordinate must be this rank's (see reset_caches): a stale one
    would silently give another rank's block."""
    import torch.distributed as dist

    true = (mesh.mesh == dist.get_rank()).nonzero()
    true = tuple(int(c) for c in true[0]) if true.shape[0] == 1 else None
    if tuple(mesh.get_coordinate() or ()) != tuple(true or ()):
        raise InternalError(f"the device mesh of {name} has coordinate "
                            f"{mesh.get_coordinate()} but this is rank {dist.get_rank()} "
                            f"(a DTensor cache kept another rank's mesh)")


def local_value(t) -> torch.Tensor:
    """A detached copy of this rank's local tensor (of a DTensor or a plain tensor)."""
    if is_dtensor(t):
        return t.to_local().detach().clone()
    return t.detach().clone()


def wrapped(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The traced local tensor as a DTensor with `layout` (no communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.detach(), layout.mesh, layout.placements, run_check=False,
                              shape=torch.Size(layout.shape), stride=layout.stride)


def leaf_parameter(local: torch.Tensor, layout: Layout, requires_grad: bool = True
                   ) -> torch.Tensor:
    """The traced local tensor as a leaf DTensor parameter with `layout` (what
    parallelize_module made), requiring grad (as the parameter does) so that `.grad` is a
    DTensor after backward."""
    return wrapped(local, layout).requires_grad_(requires_grad)


def grad_result(grad, layout: Layout | None) -> tuple[Any, Spec | None]:
    """(the local tensor the optimizer's shard reads, what the DTensor says about it) of a
    parameter's `.grad`: a DTensor grad is described by its own placements, which
    `grad_slice` turns into its block of the single gradient once tracing is done.

    A Partial gradient (a replicated parameter used on a shard, as SequenceParallel's norm
    weights are) is only a term of the gradient: the optimizer's first operation on it
    (`p.add_(g, ...)`, in place on the parameter) makes DTensor redistribute it to the
    parameter's placements, so that redistribution is what is traced and claimed."""
    if not is_dtensor(grad):
        return grad, None
    if layout is not None and any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(layout.mesh, layout.placements)
    return grad._local_tensor, spec_of(grad)  # the very tensor an optimizer reads


def grad_slice(spec: Spec, name: str, path: str, uneven: bool = False) -> Slice:
    return layout_of(spec, name, path, what="gradient", uneven=uneven).slice


def loss_result(loss, path: str):
    """A DTensor loss must be replicated: its local tensor is then the loss."""
    if not is_dtensor(loss):
        return loss
    if not all(p.is_replicate() for p in loss.placements):
        raise InputError(f"train_step returns a DTensor loss with placements "
                         f"{list(loss.placements)}: return a replicated loss (or "
                         f".full_tensor())", file=path, tensor="loss")
    return loss.to_local()


def refuse_dtensor(t, name: str, path: str) -> None:
    """Buffers and batch leaves are plain tensors in the capture (DTensor ones are not
    modelled yet): one line naming them."""
    if is_dtensor(t):
        raise InputError("a DTensor buffer or batch leaf is not supported (only DTensor "
                         "parameters)", file=path, tensor=name)


def check_values(single_draws, rank_draws, layout: Layout, rank: int, name: str, path: str,
                 degenerate) -> None:
    """The DTensor placement is the lineage; its global shape must be the single tensor's,
    and the values must agree with it wherever they can say something (non-degenerate
    draws), or the script's models do not correspond."""
    shape = tuple(single_draws[0].shape)
    if layout.shape != shape:
        raise InputError(f"the DTensor's global shape {list(layout.shape)} is not the single "
                         f"model's {list(shape)}", file=path, tensor=name)
    sl = layout.slice
    view = tuple(slice(a, b) for a, b in sl)
    for s, r in zip(single_draws, rank_draws):
        if degenerate(r) or degenerate(s):
            continue
        if tuple(s[view].shape) != tuple(r.shape) or not torch.equal(s[view], r):
            raise InputError(f"rank {rank}'s local tensor is not the block "
                             f"{[list(x) for x in sl]} of the single model's tensor that its "
                             f"DTensor placement names (does build_rank build the same model "
                             f"as build_single before parallelising it?)", file=path,
                             tensor=name)


@contextmanager
def local_distribution():
    """While a rank of the fake world is built: distribute_tensor's scatter from the source
    rank copies this rank's own block (see the module docstring)."""
    import torch.distributed.tensor.placement_types as pt

    original = pt.mesh_scatter

    def scatter_own_block(output, scatter_list, mesh, mesh_dim=0, async_op=False, *,
                          group_src=0):
        coordinate = mesh.get_coordinate()
        if coordinate is None or output.is_meta:
            return None
        with torch.no_grad():
            output.copy_(scatter_list[coordinate[mesh_dim]])
        return None

    pt.mesh_scatter = scatter_own_block
    try:
        yield
    finally:
        pt.mesh_scatter = original


def reset_caches() -> None:
    """Forget what DTensor cached for the previous rank's world.

    DTensor caches sharding propagation and redistribution plans by specs whose meshes
    compare equal on every rank, and the cached results hold the mesh of the rank that filled
    them: rank 1 would then compute with rank 0's mesh coordinate (its block offsets, its
    local chunks). In a real job a process is one rank; here one process is every rank, so
    the caches are cleared between ranks (private API of the pinned torch, exercised by
    tests/test_capture_dtensor.py, whose rank-1 blocks would be rank 0's otherwise).
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch.distributed.tensor._collective_utils as collective_utils
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    redistribute._gen_transform_infos.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
