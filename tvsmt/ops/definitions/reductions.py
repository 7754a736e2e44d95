"""Reductions: mean, sum."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tvsmt.ops.definitions._common import (expand, nontrivial, norm_axes, require, sum_axes,
                                           times)
from tvsmt.ops.registry import OpSpec, register


def _reduction(attrs, ndim: int) -> tuple[tuple[int, ...], bool, bool]:
    """(axes, keepdim, total): `total` is sum's no-`dim` form, reducing everything to [1]."""
    total = attrs.get("dim") is None
    return norm_axes(attrs.get("dim"), ndim), bool(attrs.get("keepdim", False)), total


def _count(shape, axes) -> int:
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


def _total_shape(ctx) -> tuple[int, ...]:
    shape = ctx.out_shapes[0] if ctx.out_shapes and ctx.out_shapes[0] is not None else None
    return tuple(shape) if shape is not None else (1,)


def sum_fw(be, ins, attrs, ctx):
    x = ins[0]
    axes, keep, total = _reduction(attrs, x.ndim)
    if total:
        return [sum_axes(x, axes, True).reshape(_total_shape(ctx))]
    return [sum_axes(x, axes, keep)]


def sum_bw(be, ins, attrs, ctx):
    g, x = ins[0], ins[1]
    axes, _, _ = _reduction(attrs, x.ndim)
    return [expand(g, x.shape, axes)]


def mean_fw(be, ins, attrs, ctx):
    x = ins[0]
    axes, keep, _ = _reduction(attrs, x.ndim)
    return [times(be, sum_axes(x, axes, keep), Fraction(1, _count(x.shape, axes)))]


def mean_bw(be, ins, attrs, ctx):
    g, x = ins[0], ins[1]
    axes, _, _ = _reduction(attrs, x.ndim)
    return [times(be, expand(g, x.shape, axes), Fraction(1, _count(x.shape, axes)))]


def reduction_shape(c, ins, outs, attrs):
    x, y = ins[0], outs[0]
    axes, keep, total = _reduction(attrs, len(x))
    nontrivial(c, x, axes)
    if total:  # everything reduced: shape [1] (or [] / all ones)
        require(all(n == 1 for n in y.orig), f"total reduction to {list(y.orig)}, expected [1]")
        for d in y.dims:
            c.eq(d, 1)
        return
    kept = [i for i in range(len(x)) if keep or i not in axes]
    require(len(y) == len(kept), f"reduction of {list(x.orig)} over {list(axes)} "
                                 f"gives rank {len(kept)}, not {list(y.orig)}")
    for o, i in enumerate(kept):
        if i in axes:
            require(y.orig[o] == 1, f"kept reduced axis {i} must have size 1 in {list(y.orig)}")
            c.eq(y[o], 1)
        else:
            require(y.orig[o] == x.orig[i], f"reduction: {list(x.orig)} -> {list(y.orig)}")
            c.eq(y[o], x[i])


register(OpSpec("sum", sum_fw, reduction_shape, sum_bw,
                doc="without attrs.dim: sum of all elements, shape [1] (the loss); with "
                    "dim/keepdim: torch.sum(x, dim, keepdim). bw [g, x] -> [g broadcast to x]"))
register(OpSpec("mean", mean_fw, reduction_shape, mean_bw,
                doc="torch.mean(x, dim, keepdim) (dim null = all axes), 1/N exact with N the "
                    "(reduced) count; bw [g, x] -> [g broadcast to x / N]"))
