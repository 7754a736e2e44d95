"""The shared plumbing of the ATen entries: rebuild an ATen call from a captured node.

Convention of the PyTorch capture (issue 11; the capture writes it, these entries read it):

* op name = `str(target)` of the ATen OpOverload ("aten.mm.default", "aten.sum.dim_IntList");
* every node has pass "fw": a make_fx joint graph contains the backward as plain ATen ops, so
  no entry has a backward rule of its own;
* node inputs = the tensor arguments in call order (tensor lists flattened in order);
* attrs = {"args": [...], "kwargs": {...}} where each tensor is replaced by {"tensor": k}
  (k = index into the inputs) and non-JSON values are strings ("torch.float32", "-inf");
  a reference to a tensor that is not floating point also carries its dtype,
  {"tensor": k, "dtype": "torch.bool"}: a bool mask and 0/1 integer indices mean different
  things, so index/index_put (and integer casts, bitwise ops, copies into integer tensors)
  refuse a reference without it rather than guess;
* outputs = every tensor output of the schema, in order (null where unused).

`bind` puts the input arrays (or, in shape rules, the `TShape`s) back in place of the
references, so that an entry is an ordinary Python function with the schema's signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from tvsmt.ops.backend import exact
from tvsmt.ops.registry import NodeCtx, OpSpec, ShapeConstraints, TShape, register

NO_BACKWARD = "the trace contains its backward as ATen ops"

# kwargs that never change values on reals (placement, memory layout): dropped by `bind`.
IGNORED_KWARGS = frozenset({"device", "pin_memory", "layout", "memory_format", "non_blocking"})


class TensorRef:
    """An argument that was a tensor, with its optional dtype (strings like "torch.bool")."""

    __slots__ = ("dtype", "value")

    def __init__(self, value: Any, dtype: str | None):
        self.value, self.dtype = value, dtype


def _is_ref(a: Any) -> bool:
    return isinstance(a, dict) and "tensor" in a


def _bind(a: Any, ins, keep_refs: bool):
    if _is_ref(a):
        k = a["tensor"]
        if not isinstance(k, int) or not 0 <= k < len(ins):
            raise ValueError(f"tensor reference {a!r} is not an input index")
        return TensorRef(ins[k], a.get("dtype")) if keep_refs else ins[k]
    if isinstance(a, list):
        return [_bind(b, ins, keep_refs) for b in a]
    return a


def bind(attrs: dict, ins, keep_refs: bool = False) -> tuple[list, dict]:
    """(args, kwargs) of the captured call with the inputs in place of the references."""
    if "args" not in attrs:
        raise ValueError("an ATen node needs attrs.args (the captured call)")
    args = [_bind(a, ins, keep_refs) for a in attrs["args"]]
    kwargs = {k: _bind(v, ins, keep_refs) for k, v in (attrs.get("kwargs") or {}).items()
              if k not in IGNORED_KWARGS}
    return args, kwargs


# ----------------------------------------------------------------------------- scalars

NEG_INF_WORDS = {"-inf", "-infinity", "-Infinity"}


def is_neg_inf(v: Any) -> bool:
    return (isinstance(v, float) and v == -math.inf) or (isinstance(v, str)
                                                         and v in NEG_INF_WORDS)


def number(v: Any) -> Fraction:
    """A scalar argument as an exact rational (bools are 0/1)."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"{v!r} is not a number") from None
    return exact(v)


def scalar(be, v: Any):
    """A scalar argument as a backend element; -inf becomes the backend's -inf."""
    if is_neg_inf(v):
        return be.neg_inf()
    return be.const(number(v))


def full_like(be, shape, v: Any) -> np.ndarray:
    out = np.empty(tuple(shape), dtype=object if be.symbolic else np.float64)
    out.fill(scalar(be, v))
    return out


def out_shape(ctx: NodeCtx, k: int = 0, default=None) -> tuple[int, ...]:
    """The (reduced) shape output k must have, else `default`."""
    if len(ctx.out_shapes) > k and ctx.out_shapes[k] is not None:
        return tuple(ctx.out_shapes[k])
    if default is None:
        raise ValueError(f"output {k}: the node's output shape is needed")
    return tuple(default)


def axis(d: int, ndim: int) -> int:
    """A dim argument as a non-negative axis (a 0-d tensor counts as 1-d, as in torch)."""
    n = max(ndim, 1)
    if not isinstance(d, int) or isinstance(d, bool) or not -n <= d < n:
        raise ValueError(f"dim={d!r} is not an axis of a {ndim}-d tensor")
    return d % n


def axes(dims: Any, ndim: int) -> tuple[int, ...]:
    """A dim / dim-list argument (None or [] = every axis) as sorted axes."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({axis(d, ndim) for d in dims}))


def is_bool(ref: TensorRef) -> bool:
    return ref.dtype is not None and ref.dtype in ("torch.bool", "bool")


def scale_position(pos: int, orig: int, reduced: int) -> int:
    """A position along a dim of original size `orig`, at its reduced size (shape rules keep
    it an integer, see `keep_boundary`)."""
    if orig == reduced:
        return pos
    scaled = Fraction(pos * reduced, orig)
    if scaled.denominator != 1:
        raise ValueError(f"position {pos} of {orig} is not a whole position at size {reduced}")
    return int(scaled)


# ----------------------------------------------------------------------------- factory

Forward = Callable[..., Any]  # (be, ctx, *args, **kwargs) -> array or list of arrays
Shape = Callable[..., None]  # (c, outs, *args, **kwargs) with TShapes for the tensors


class AtenCtx:
    """The NodeCtx of a node, plus the original shape of each input array (by identity), so
    that an entry can take a count from the original sizes."""

    def __init__(self, ctx: NodeCtx, ins):
        self.out_shapes, self.orig_in, self.orig_out = ctx.out_shapes, ctx.orig_in, ctx.orig_out
        self._orig = {id(x): tuple(o) for x, o in zip(ins, ctx.orig_in)
                      if x is not None and o is not None}

    def orig(self, x) -> tuple[int, ...]:
        """Original shape of input x (its own shape when the plan gives none)."""
        return self._orig.get(id(x), tuple(np.shape(x)))


def original_count(ctx, x, dims) -> int:
    """Number of elements over `dims` of input x at its ORIGINAL size.

    Counts that normalise (mean, layer norm, loss averaging) use the original sizes, like
    every other size-derived constant of a traced graph (mean's backward divides by the
    original count as a plain scalar), so that a reduced stage stays self-consistent."""
    shape = ctx.orig(x) if isinstance(ctx, AtenCtx) else np.shape(x)
    return int(np.prod([shape[a] for a in dims], dtype=np.int64))


def _listify(result) -> list:
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def aten(name: str, forward: Forward, shape: Shape, doc: str, *,
         abstracts: tuple[str, ...] = (), n_outputs: int = 1, refs: bool = False) -> OpSpec:
    """Register an ATen entry from a function with the schema's signature.

    `refs=True` hands the functions `TensorRef`s (array + dtype) instead of bare arrays, for
    the few ops whose meaning depends on a tensor's dtype.
    """

    def fw(be, ins, attrs, ctx):
        args, kwargs = bind(attrs, ins, refs)
        return _listify(forward(be, AtenCtx(ctx, ins), *args, **kwargs))

    def rule(c: ShapeConstraints, ins, outs, attrs):
        args, kwargs = bind(attrs, ins, refs)
        shape(c, outs, *args, **kwargs)

    return register(OpSpec(name, fw, rule, None, n_outputs=lambda attrs, n: n_outputs,
                           doc=doc, abstracts=abstracts, no_backward=NO_BACKWARD))


def tshape_of(x: Any) -> TShape | None:
    return x if isinstance(x, TShape) else None
