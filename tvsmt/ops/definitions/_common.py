"""Helpers shared by the operator entries: array plumbing, shape-rule building blocks and
factories for the recurring operator shapes (pass-through ops, elementwise unary ops).

Every semantic function treats its input arrays as immutable and keeps arrays on the left of
an operator with a backend scalar (`x + be.const(c)`, never `be.const(c) + x`: a pysmt term on
the left of a numpy array does not broadcast).
"""

from __future__ import annotations

import operator
from fractions import Fraction
from functools import reduce
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tvsmt.ops.backend import exact
from tvsmt.ops.registry import AttrError, OpSpec, ShapeConstraints, ShapeRuleError, TShape, register

# ----------------------------------------------------------------------------- arrays


def present(items: Iterable) -> list:
    """The non-null entries of a slot list."""
    return [x for x in items if x is not None]


def add_all(xs: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise sum of a non-empty list of arrays."""
    if not xs:
        raise AttrError("sum of no tensors")
    return reduce(_add_arrays, xs)


def _add_arrays(a, b):
    """a + b, kept an array: numpy gives 0-d operands' sum as a bare element, and a pysmt
    term plus an array (the third rank's 0-d loss of an average) is not a term."""
    out = a + b
    if isinstance(out, np.ndarray) or not isinstance(a, np.ndarray):
        return out
    return np.asarray(out, dtype=a.dtype)


def norm_axes(dims: Any, ndim: int) -> tuple[int, ...]:
    """`dim` attribute (int, list or None = all) as sorted non-negative axes."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise AttrError(f"dim={d!r} is not an axis of a {ndim}-d tensor")
    return tuple(sorted({d % ndim for d in dims}))


def const_attr(attrs: dict, i: int = 0) -> Fraction:
    """The i-th non-tensor operand (`attrs.consts`) as an exact rational."""
    consts = attrs.get("consts") or []
    if len(consts) <= i:
        raise AttrError(f"missing constant operand #{i} in attrs {attrs!r}")
    try:
        return exact(consts[i])
    except ValueError as e:
        raise AttrError(f"constant operand #{i}: {e}") from None


def times(be, x: np.ndarray, c: Fraction) -> np.ndarray:
    """x * c, without a multiplication by 1."""
    return x if c == 1 else be.scale(x, c)


def sum_axes(x: np.ndarray, axes: tuple[int, ...], keepdim: bool) -> np.ndarray:
    """Sum over `axes` (always an array, also when every axis is reduced)."""
    if not axes:
        return x
    out = np.sum(x, axis=axes, keepdims=True)
    if keepdim:
        return out
    return out.reshape(tuple(n for i, n in enumerate(x.shape) if i not in axes))


def expand(g: np.ndarray, shape: Sequence[int], axes: tuple[int, ...]) -> np.ndarray:
    """Broadcast a reduction's gradient (reduced over `axes`, with or without keepdim) back to
    `shape`."""
    kept = tuple(1 if i in axes else n for i, n in enumerate(shape))
    return np.array(np.broadcast_to(g.reshape(kept), tuple(shape)))


def unbroadcast(g: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Reduce the gradient of a broadcast result back to an operand of `shape` (torch rules):
    sum over the extra leading axes and over the axes where the operand has size 1."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    return np.sum(g, axis=axes, keepdims=True).reshape(shape)


# ----------------------------------------------------------------------------- shape rules


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ShapeRuleError(msg)


def prod(items: Iterable) -> Any:
    items = list(items)
    return reduce(operator.mul, items) if items else 1


def mul(d: Any, k: int) -> Any:
    return d if k == 1 else d * k


def same_shape(c: ShapeConstraints, a: TShape, b: TShape) -> None:
    require(tuple(a.orig) == tuple(b.orig), f"shapes {list(a.orig)} and {list(b.orig)} differ")
    c.same(a, b)


def identity_shape(c, ins, outs, attrs) -> None:
    """Every (non-null) input and output has the same shape."""
    ts = present(list(ins) + list(outs))
    for t in ts[1:]:
        same_shape(c, ts[0], t)


def relate(c: ShapeConstraints, src: TShape, dst: TShape,
           factors: dict[int, tuple[int, int]] | None = None) -> None:
    """dst has src's rank; on an axis listed in `factors` as (m, n): `src * m == dst * n`
    (checked on the original sizes too), elsewhere the dims are equal."""
    factors = factors or {}
    require(len(src) == len(dst), f"rank {len(src)} != {len(dst)}")
    for i in range(len(src)):
        m, n = factors.get(i, (1, 1))
        require(src.orig[i] * m == dst.orig[i] * n,
                f"axis {i}: {src.orig[i]} * {m} != {dst.orig[i]} * {n} ({list(src.orig)} -> "
                f"{list(dst.orig)})")
        c.eq(mul(src[i], m), mul(dst[i], n))


def nontrivial(c: ShapeConstraints, t: TShape, axes: Iterable[int]) -> None:
    """Keep a contracted / reduced axis at least min(2, original size), so that a reduction
    stays a real sum after shape reduction (the reference's BINOP_RX_MIN_UNIT)."""
    for i in axes:
        c.add(t[i] >= min(2, t.orig[i]))


def broadcast_rule(c: ShapeConstraints, operands: Sequence[TShape], out: TShape) -> None:
    """torch broadcasting (right-aligned): an operand axis equal to the output's in the plan
    stays equal, an operand axis of original size 1 stays 1."""
    rank = max(len(t) for t in operands)
    require(len(out) == rank, f"broadcast result has rank {len(out)}, expected {rank}")
    widest = [1] * rank
    for t in operands:
        off = rank - len(t)
        for i in range(len(t)):
            o, n = off + i, t.orig[i]
            widest[o] = max(widest[o], n)
            if n == out.orig[o]:
                c.eq(t[i], out[o])
            elif n == 1:
                c.eq(t[i], 1)
            else:
                raise ShapeRuleError(f"cannot broadcast {list(t.orig)} to {list(out.orig)}")
    require(tuple(widest) == tuple(out.orig),
            f"broadcast of {[list(t.orig) for t in operands]} is not {list(out.orig)}")


# ----------------------------------------------------------------------------- factories


def passthrough(name: str, doc: str, mirrors: bool = True, communication: bool = False) -> OpSpec:
    """An identity operator: fw `[x] -> [x]`, bw `[g(, x)] -> [g]`."""
    return register(OpSpec(
        name, lambda be, ins, attrs, ctx: [ins[0]], identity_shape,
        lambda be, ins, attrs, ctx: [ins[0]],
        bw_shape=None if mirrors else identity_shape, communication=communication, doc=doc))


Elementwise = Callable[[Any, np.ndarray, dict], np.ndarray]


def unary(name: str, f: Elementwise, df: Elementwise, doc: str, *,
          abstracts: tuple[str, ...] = ()) -> OpSpec:
    """An elementwise op `y = f(x)` with derivative `df`: bw `[g, x] -> [g * df(x)]`."""
    return register(OpSpec(
        name, lambda be, ins, attrs, ctx: [f(be, ins[0], attrs)], identity_shape,
        lambda be, ins, attrs, ctx: [ins[0] * df(be, ins[1], attrs)], doc=doc,
        abstracts=abstracts, reads_mirrors=True))
