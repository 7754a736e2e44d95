"""DeepSpeed ZeRO: the reduced gradient is where the optimizer reads it, and under ZeRO-3
the parameters are where DeepSpeed keeps them.

After `engine.backward(loss)` under ZeRO-1 or ZeRO-2, every parameter's `.grad` is None:
DeepSpeed has reduced the gradients in buckets (flattened, divided by the data-parallel size,
all-reduced or reduce-scattered) and kept, per parameter group, only this rank's partition of
the flattened gradients, `optimizer.averaged_gradients[group]`: one piece per parameter of
`optimizer.params_in_partition[group]`, in order, the first starting `first_offset[group]`
elements into its parameter. That partition is what the rank's optimizer step reads, so it
is what the capture claims: each piece, a range of its parameter's elements in row-major
order, as the rectangular blocks of the single-device gradient it covers (`flat_blocks`).
Every element of every gradient must still be held by some rank (lineages.py).

Under ZeRO-3 each parameter is flattened and cut into one equal range of elements per rank,
which the rank keeps (`param.ds_tensor`); the parameter itself has no elements between its
uses, and DeepSpeed's hooks all-gather it before each module runs and reduce-scatter its
gradient after. The capture traces those hooks as shipped: each rank's inputs are the blocks
of its range (`stage3_partitions`; a range that cuts a row is several blocks), `ds_tensor` is
made of the traced blocks while the step runs (`traced_partitions`), and the claims are the
rank's pieces of `averaged_gradients` as under ZeRO-1/2. Refused in one line: parameters
DeepSpeed pads (elements not divisible by the ranks: its reduce-scatter pads with
uninitialised memory), secondary partitions (hpZ), and partitions ZeRO-1/2 pad or pack into
one buffer (round-robin padding, the compact partition buffer): their pieces do not follow
parameters.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tvsmt.errors import InputError

Slice = tuple[tuple[int, int], ...]


def zero_stage(model: Any) -> int | None:
    """The ZeRO stage of a DeepSpeed engine (0 when ZeRO is off), None for anything else."""
    if not type(model).__module__.startswith("deepspeed"):
        return None
    stage = getattr(model, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else None


@dataclass
class Stage3Partition:
    """What ZeRO-3 keeps of one parameter on this rank: elements [start, end) of the
    flattened parameter, which are the rectangular `blocks` of the parameter (row-major
    order), each with its values on this draw."""

    param: Any
    start: int
    end: int
    blocks: list[tuple[Slice, torch.Tensor]]

    def input_ids(self, name: str) -> list[str]:
        """The traced inputs that stand for the blocks (`param.<name>` is the released
        parameter itself, of no elements, as DeepSpeed leaves it between its uses)."""
        return [f"param.{name}@zero3.{k}" for k in range(len(self.blocks))]


def stage3_partitions(model: Any, params: dict[str, torch.Tensor], path: str
                      ) -> dict[str, Stage3Partition]:
    """Parameter name -> this rank's ZeRO-3 partition of it, for a DeepSpeed engine under
    ZeRO-3 (empty for any other model)."""
    if zero_stage(model) != 3:
        return {}
    import torch.distributed as dist

    out = {}
    for name, p in params.items():
        held = getattr(p, "ds_tensor", None)
        if held is None:
            raise InputError("DeepSpeed ZeRO-3 left a parameter unpartitioned", file=path,
                             tensor=name)
        if getattr(p, "ds_secondary_tensor", None) is not None:
            raise InputError("DeepSpeed ZeRO-3's secondary partitions (hpZ) are not "
                             "supported", file=path, tensor=name)
        if getattr(getattr(p, "ds_status", None), "name", "NOT_AVAILABLE") != "NOT_AVAILABLE":
            raise InputError(f"DeepSpeed ZeRO-3 holds {name} gathered when train_step starts "
                             f"(did build_rank run the model?): its partition is not all the "
                             f"rank keeps", file=path, tensor=name)
        shape, numel, size = tuple(p.ds_shape), int(p.ds_numel), int(held.ds_numel)
        world = dist.get_world_size(group=p.ds_process_group)
        if numel % world:
            raise InputError(f"DeepSpeed ZeRO-3 pads the partitions of {name} ({numel} "
                             f"elements over {world} ranks) and reduce-scatters its gradient "
                             f"with uninitialised padding (torch.empty), which the capture "
                             f"does not model: not supported", file=path, tensor=name)
        start = min(dist.get_rank(group=p.ds_process_group) * size, numel)
        end = min(start + size, numel)
        blocks = [(block, values.clone()) for values, block
                  in range_blocks(held.detach().reshape(-1), shape, start, end)]
        out[name] = Stage3Partition(p, start, end, blocks)
    return out


@contextmanager
def traced_partitions(model: Any, parts: dict[str, Stage3Partition],
                      traced: dict[str, list[torch.Tensor]]):
    """While the step is traced: ZeRO-3's partition of each parameter (`ds_tensor`) is made
    of this rank's traced blocks (`traced`: name -> one tensor per block) and the optimizer's
    gradient buffers are traced zeros and empties, as DeepSpeed made them; DeepSpeed's
    cross-rank checks of its own bookkeeping (ids and sizes it broadcasts as tensors built
    from Python lists) are skipped, the pairing of the collectives across ranks checks what
    they check. Everything is restored afterwards."""
    if not parts:
        yield
        return
    import deepspeed.runtime.zero.partition_parameters as partitioning
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3

    checks = [(m, "assert_ints_same_as_other_ranks") for m in (partitioning, coordinator, stage3)
              if hasattr(m, "assert_ints_same_as_other_ranks")]
    saved_checks = [(m, a, getattr(m, a)) for m, a in checks]
    opt = model.optimizer
    grads_attr = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
    grad_buffers = getattr(opt, grads_attr)
    buckets = getattr(opt, "ipg_buckets", {})
    saved = [(part.param, part.param.ds_tensor) for part in parts.values()]
    saved_buckets = {k: b.buffer for k, b in buckets.items()}
    try:
        for m, a in checks:
            setattr(m, a, lambda ints: None)
        for name, part in parts.items():
            old = part.param.ds_tensor
            with torch.no_grad():  # (no padding: refused in stage3_partitions)
                flat = torch.cat([t.reshape(-1) for t in traced[name]])
            flat.__dict__.update(vars(old))  # DeepSpeed's marks (ds_numel, status)
            part.param.ds_tensor = flat
        setattr(opt, grads_attr, {k: torch.zeros(v.shape, dtype=v.dtype)
                                  for k, v in grad_buffers.items()})
        for b in buckets.values():
            if getattr(b, "buffer", None) is not None:  # DeepSpeed's is a torch.empty too
                b.buffer = torch.empty(b.buffer.shape, dtype=b.buffer.dtype)
        yield
    finally:
        for m, a, f in saved_checks:
            setattr(m, a, f)
        for param, held in saved:
            param.ds_tensor = held
        setattr(opt, grads_attr, grad_buffers)
        for k, b in buckets.items():
            b.buffer = saved_buckets[k]


def release(model: Any) -> None:
    """Drop what a DeepSpeed ZeRO-3 engine allocated at initialisation for its reduce bucket
    (`reduce_bucket_size` elements: 2 GB of float32 by default, never touched on CPU) once
    the capture is done with the engine. DeepSpeed keeps its engines reachable, and a
    process holding a few such reservations could no longer fork (ENOMEM: four checks of
    the example reserved 16 GB)."""
    if zero_stage(model) != 3:
        return
    for bucket in getattr(model.optimizer, "ipg_buckets", {}).values():
        if getattr(bucket, "buffer", None) is not None:
            bucket.buffer = torch.empty(0, dtype=bucket.buffer.dtype)


def step_not_traced(model: Any, e: BaseException) -> str | None:
    """Why a DeepSpeed step failed under tracing, when it is the step: under ZeRO-1/2/3, and
    with DeepSpeed's `bf16` or `fp16` optimizer wrappers at any stage, `engine.step()`
    branches on the gradients' values (its overflow check, its clipping coefficient), which
    one trace cannot take for every input. None for any other failure."""
    import traceback

    stage = zero_stage(model)
    precision = _reduced_precision(model)
    if stage is None or not (stage or precision) or "DataDependent" not in type(e).__name__:
        return None
    frames = traceback.extract_tb(e.__traceback__)
    if not any(f.name == "step" and f"{os.sep}deepspeed{os.sep}" in f.filename for f in frames):
        return None
    what = f"under ZeRO stage {stage}" if stage else f"with {precision} enabled"
    return (f"DeepSpeed's engine.step() {what} is not captured: it branches on the "
            f"gradients' values (overflow check, clipping), which a trace cannot follow for "
            f"every input; end train_step after engine.backward(loss) (stage 0's step in "
            f"float32 is captured)")


def _reduced_precision(model: Any) -> str | None:
    """"bf16" or "fp16" when the engine's optimizer is DeepSpeed's mixed-precision wrapper."""
    for name, enabled in (("bf16", "bfloat16_enabled"), ("fp16", "fp16_enabled")):
        check = getattr(model, enabled, None)
        if callable(check) and check():
            return name
    return None


def gradient_pieces(model: Any, names: dict[int, str], path: str
                    ) -> dict[str, list[tuple[torch.Tensor, Slice]]] | None:
    """For a DeepSpeed engine under ZeRO-1 or ZeRO-2 after its backward: parameter name ->
    [(piece of the reduced gradient this rank holds, its block of the parameter)], for the
    parameters of this rank's partitions; None for any other model (their `.grad` is read).
    `names`: id of each parameter object -> its name (the tracer keeps parameters' identity)."""
    stage = zero_stage(model)
    if stage and getattr(model, "global_steps", 0):
        raise InputError(f"DeepSpeed's engine.step() under ZeRO stage {stage} is not "
                         "captured (its update of the parameters is not verified; stage 0's "
                         "is): end train_step after engine.backward(loss)", file=path)
    if stage is None or stage == 0:
        return None
    if stage not in (1, 2, 3):
        raise InputError(f"DeepSpeed ZeRO stage {stage} is not supported (stages 0 to 3 "
                         "are)", file=path)
    opt = model.optimizer
    if stage == 3:
        return _stage3_pieces(opt, names, path)
    held = getattr(opt, "averaged_gradients", None)
    groups = getattr(opt, "params_in_partition", None)
    offsets = getattr(opt, "first_offset", None)
    if held is None or groups is None or offsets is None:
        raise InputError(f"DeepSpeed ZeRO stage {stage}: the optimizer "
                         f"{type(opt).__name__} keeps no averaged_gradients partition",
                         file=path)
    out: dict[str, list[tuple[torch.Tensor, Slice]]] = {}
    for group, params in enumerate(groups):
        pieces = held.get(group) if isinstance(held, dict) else (
            held[group] if group < len(held) else None)
        if not params:
            continue
        if pieces is None:
            raise InputError(f"DeepSpeed ZeRO holds no reduced gradient of parameter group "
                             f"{group} after train_step (is engine.backward called, at a "
                             f"gradient accumulation boundary?)", file=path)
        if not isinstance(pieces, (list, tuple)) or len(pieces) != len(params):
            raise InputError(f"DeepSpeed ZeRO's gradient partition of parameter group {group} "
                             f"does not follow its parameters (padded or packed partitions "
                             f"are not supported)", file=path)
        for k, (param, piece) in enumerate(zip(params, pieces)):
            name = names.get(id(param))
            if name is None:
                raise InputError(f"DeepSpeed ZeRO partitions a tensor that is not a "
                                 f"parameter of the model (group {group})", file=path)
            start = int(offsets[group]) if k == 0 else 0
            end = start + piece.numel()
            if end > param.numel():
                raise InputError(f"DeepSpeed ZeRO's gradient piece of {name} ends past the "
                                 f"parameter ({end} > {param.numel()} elements)", file=path,
                                 tensor=name)
            out.setdefault(name, []).extend(
                range_blocks(piece.reshape(-1), tuple(param.shape), start, end))
    return out


def _stage3_pieces(opt: Any, names: dict[int, str], path: str
                   ) -> dict[str, list[tuple[torch.Tensor, Slice]]]:
    """ZeRO-3: one piece per parameter of each sub-group, elements [rank * size, ...) of it."""
    import torch.distributed as dist

    held = getattr(opt, "averaged_gradients", {})
    out: dict[str, list[tuple[torch.Tensor, Slice]]] = {}
    for group, params in enumerate(opt.fp16_groups):
        pieces = held.get(group)
        if pieces is None or len(pieces) != len(params):
            raise InputError(f"DeepSpeed ZeRO-3 holds no reduced gradient of parameter "
                             f"sub-group {group} after train_step (is engine.backward called, "
                             f"at a gradient accumulation boundary?)", file=path)
        for param, piece in zip(params, pieces):
            name = names.get(id(param))
            if name is None:
                raise InputError("DeepSpeed ZeRO partitions a tensor that is not a parameter "
                                 "of the model", file=path)
            size, numel = piece.numel(), int(param.ds_numel)
            start = min(dist.get_rank(group=param.ds_process_group) * size, numel)
            end = min(start + size, numel)
            out.setdefault(name, []).extend(
                range_blocks(piece.reshape(-1), tuple(param.ds_shape), start, end))
    return out


def range_blocks(flat: torch.Tensor, shape: tuple[int, ...], start: int, end: int
                 ) -> list[tuple[torch.Tensor, Slice]]:
    """A flat range [start, end) of a tensor of this shape, held as `flat` (its first
    element the range's first), cut into the rectangular blocks it covers: [(a view of
    `flat` in the block's shape, the block)], in order."""
    out = []
    for block, at in flat_blocks(shape, start, end):
        size = [e - s for s, e in block]
        out.append((flat[at - start:at - start + math.prod(size)].view(size), block))
    return out


def flat_blocks(shape: tuple[int, ...], start: int, end: int) -> list[tuple[Slice, int]]:
    """The elements [start, end) of a tensor of this shape in row-major order, as
    rectangular blocks, each contiguous in that order: [(block, its first flat index)], in
    order. At most two blocks per dimension plus one (a partial row at each end, whole rows
    between)."""
    if start >= end:
        return []
    if not shape:
        return [((), start)]
    row = math.prod(shape[1:])
    out: list[tuple[Slice, int]] = []
    first, last = start // row, (end - 1) // row
    if start % row or (first == last and end - first * row < row):  # a partial first row
        stop = min(end, (first + 1) * row)
        for block, at in flat_blocks(shape[1:], start - first * row, stop - first * row):
            out.append((((first, first + 1),) + block, first * row + at))
        first += 1
        if first * row >= end:
            return out
    full_end = end // row  # rows [first, full_end) are whole
    if full_end > first:
        out.append((((first, full_end),) + tuple((0, d) for d in shape[1:]), first * row))
    if end % row and full_end >= first:  # a partial last row
        for block, at in flat_blocks(shape[1:], 0, end - full_end * row):
            out.append((((full_end, full_end + 1),) + block, full_end * row + at))
    return out
