"""Layout and pass-through operators: view, transpose, contiguous, float, to, identity,
multiref."""

from __future__ import annotations

import numpy as np

from tvsmt.ops.definitions._common import (add_all, identity_shape, norm_axes, passthrough,
                                           present, prod, require, same_shape)
from tvsmt.ops.registry import AttrError, OpSpec, register

passthrough("contiguous", "identity; bw [g, x] -> [g]")
passthrough("float", "dtype cast, an identity on reals; bw [g, x] -> [g]")
passthrough("to", "dtype/device move (attrs.dtype_or_device ignored), an identity on reals; "
                  "bw [g, x] -> [g]")
passthrough("identity", "identity (fw, bw and pass null: the identity half of a fused "
                        "nnScaler adapter); bw [g] -> [g], no mirror input", mirrors=False)


# ----------------------------------------------------------------------------- view


def view_fw(be, ins, attrs, ctx):
    shape = ctx.out_shapes[0] if ctx.out_shapes and ctx.out_shapes[0] is not None else None
    return [ins[0].reshape(attrs["size"] if shape is None else shape)]


def view_bw(be, ins, attrs, ctx):
    return [ins[0].reshape(ins[1].shape)]


def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Group the non-1 axes of two shapes with equal element counts into minimal runs of
    consecutive axes with equal products: [b, s, 4096] / [b, s, 32, 128] gives
    ([0], [0]), ([1], [1]), ([2], [2, 3])."""
    ia = [i for i, n in enumerate(a) if n != 1]
    ib = [i for i, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[i])
                pa, i = pa * a[ia[i]], i + 1
            else:
                gb.append(ib[j])
                pb, j = pb * b[ib[j]], j + 1
        groups.append((ga, gb))
    return groups


def view_shape(c, ins, outs, attrs):
    x, y = ins[0], outs[0]
    require(prod(x.orig) == prod(y.orig), f"view: {list(x.orig)} and {list(y.orig)} have "
                                          "different element counts")
    for t in (x, y):
        for i, n in enumerate(t.orig):
            if n == 1:
                c.eq(t[i], 1)
    for ga, gb in view_groups(tuple(x.orig), tuple(y.orig)):
        if len(ga) == 1 and len(gb) == 1:
            c.eq(x[ga[0]], y[gb[0]])
        else:
            # Only the outermost axis of a merged or split run is reduced; the inner ones
            # keep their sizes, so the reduced view keeps a prefix of the run's elements
            # with the original strides. Any split of the inner axes is a reshape of its
            # own, and two views of one buffer could then decode its elements differently
            # (a gradient written into Megatron DDP's flat buffer as [2, 16] and read back
            # as [8, 4]: not an instance of the program; tests/test_capture_megatron_core.py::
            # test_no_gradient_of_a_gpt_model_under_megatron_ddp_is_refuted).
            for t, group in ((x, ga), (y, gb)):
                for i in group[1:]:
                    c.eq(t[i], t.orig[i])
            c.eq(prod(x[i] for i in ga), prod(y[i] for i in gb))


register(OpSpec("view", view_fw, view_shape, view_bw,
                doc="reshape to the node's (reduced) output shape (attrs.size is the original "
                    "target and only a fallback); bw [g, x] -> [g reshaped to x]"))


# ----------------------------------------------------------------------------- transpose


def _dims(attrs) -> tuple[int, int]:
    d0, d1 = attrs["dim0"], attrs["dim1"]
    if type(d0) is not int or type(d1) is not int:
        raise AttrError(f"transpose: dim0={d0!r}, dim1={d1!r} must be ints")
    return d0, d1


def transpose_fw(be, ins, attrs, ctx):
    return [np.swapaxes(ins[0], *_dims(attrs))]


def transpose_bw(be, ins, attrs, ctx):
    return [np.swapaxes(ins[0], *_dims(attrs))]


def transpose_shape(c, ins, outs, attrs):
    x, y = ins[0], outs[0]
    require(len(x) == len(y), "transpose: rank changes")
    perm = list(range(len(x)))
    d0, d1 = (norm_axes(d, len(x))[0] for d in _dims(attrs))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    for o, i in enumerate(perm):
        require(y.orig[o] == x.orig[i], f"transpose: {list(x.orig)} -> {list(y.orig)}")
        c.eq(y[o], x[i])


register(OpSpec("transpose", transpose_fw, transpose_shape, transpose_bw,
                doc="swap axes attrs.dim0 and attrs.dim1; bw [g, x] -> [g with the axes swapped "
                    "back]"))


# ----------------------------------------------------------------------------- multiref


def _times(attrs, n_in: int) -> int:
    return attrs.get("times", n_in)


def multiref_fw(be, ins, attrs, ctx):
    n = attrs.get("times") or len(ctx.out_shapes) or 1
    if type(n) is not int or n < 1:
        raise AttrError(f"multiref: attrs.times={n!r} is not a positive int")
    return [ins[0].copy() for _ in range(n)]


def multiref_bw(be, ins, attrs, ctx):
    return [add_all(present(ins))]


def multiref_shape(c, ins, outs, attrs):
    for y in present(outs):
        same_shape(c, ins[0], y)


register(OpSpec("multiref", multiref_fw, multiref_shape, multiref_bw,
                n_outputs=_times, bw_shape=identity_shape,
                doc="fw [x] -> attrs.times copies of x; bw inputs are only the gradients of "
                    "the copies that are used (no mirror, no attrs), output [their sum]"))
