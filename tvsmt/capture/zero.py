"""DeepSpeed ZeRO stages 1 and 2: the reduced gradient is where the optimizer reads it.

After `engine.backward(loss)` under ZeRO-1 or ZeRO-2, every parameter's `.grad` is None:
DeepSpeed has reduced the gradients in buckets (flattened, divided by the data-parallel size,
all-reduced or reduce-scattered) and kept, per parameter group, only this rank's partition of
the flattened gradients, `optimizer.averaged_gradients[group]`: one piece per parameter of
`optimizer.params_in_partition[group]`, in order, the first starting `first_offset[group]`
elements into its parameter. That partition is what the rank's optimizer step reads, so it
is what the capture claims: each piece, a range of its parameter's elements in row-major
order, as the rectangular blocks of the single-device gradient it covers (`flat_blocks`).
Every element of every gradient must still be held by some rank (lineages.py).

ZeRO-3, and partitions DeepSpeed pads or packs into one buffer (round-robin padding, the
compact partition buffer), are refused in one line: their pieces do not follow parameters.
"""

from __future__ import annotations

import math
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


def gradient_pieces(model: Any, names: dict[int, str], path: str
                    ) -> dict[str, list[tuple[torch.Tensor, Slice]]] | None:
    """For a DeepSpeed engine under ZeRO-1 or ZeRO-2 after its backward: parameter name ->
    [(piece of the reduced gradient this rank holds, its block of the parameter)], for the
    parameters of this rank's partitions; None for any other model (their `.grad` is read).
    `names`: id of each parameter object -> its name (the tracer keeps parameters' identity)."""
    stage = zero_stage(model)
    if stage is not None and getattr(model, "global_steps", 0):
        raise InputError("DeepSpeed's engine.step() is not captured (its update of the "
                         "parameters is not verified): end train_step after "
                         "engine.backward(loss)", file=path)
    if stage is None or stage == 0:
        return None
    if stage not in (1, 2):
        raise InputError(f"DeepSpeed ZeRO stage {stage} is not supported (stages 0, 1 and 2 "
                         "are)", file=path)
    opt = model.optimizer
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
            flat = piece.reshape(-1)
            for block, at in flat_blocks(tuple(param.shape), start, end):
                size = [e - s for s, e in block]
                numel = math.prod(size)
                out.setdefault(name, []).append(
                    (flat[at - start:at - start + numel].view(size), block))
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
