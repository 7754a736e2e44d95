"""ATen layout and creation ops: views, slices, concatenation, casts, constants.

Attributes that name sizes or positions (view sizes, slice bounds, split sizes, full's size,
arange's range) are written for the original shapes. Forward rules take sizes from the node's
(reduced) output shapes and rescale positions with `scale_position`; shape rules keep every
named position an integer after reduction (`keep_boundary`) or keep the dim unreduced
(`c.eq(d, original)`) where a position cannot be rescaled (select, strided slices).
"""

from __future__ import annotations

import numpy as np

from tvsmt.ops.definitions._common import mul, require
from tvsmt.ops.definitions.aten_call import (
    TensorRef,
    aten,
    axis,
    full_like,
    is_bool,
    is_neg_inf,
    number,
    out_shape,
    scale_position,
)
from tvsmt.ops.definitions.layout import view_shape
from tvsmt.ops.registry import ShapeConstraints, ShapeRuleError, TShape


def same_dims(c: ShapeConstraints, a: TShape, b: TShape, skip: tuple[int, ...] = ()) -> None:
    require(len(a) == len(b), f"rank {len(a)} != {len(b)}")
    for i in range(len(a)):
        if i not in skip:
            require(a.orig[i] == b.orig[i], f"axis {i}: {list(a.orig)} vs {list(b.orig)}")
            c.eq(a[i], b[i])


def fix(c: ShapeConstraints, t: TShape, i: int) -> None:
    """Dim i of t keeps its original size (a position on it cannot be rescaled)."""
    c.eq(t[i], t.orig[i])


def identity_rule(c, outs, x, *args, **kwargs) -> None:
    same_dims(c, x, outs[0])


# ----------------------------------------------------------------------------- views


def _view_fw(be, ctx, x, size):
    return x.reshape(out_shape(ctx, 0, _resolve(size, x.size)))


def _resolve(size, count):
    size = list(size)
    if -1 in size:
        known = int(np.prod([n for n in size if n != -1]))
        size[size.index(-1)] = count // known if known else 0
    return size


def _view_rule(c, outs, x, size):
    view_shape(c, [x], [outs[0]], {})


# (CompositeImplicit ops such as reshape, contiguous, chunk never reach a traced graph.)
for _name in ("aten.view.default", "aten._unsafe_view.default", "aten.view_copy.default",
              "aten._reshape_alias.default"):
    aten(_name, (lambda be, ctx, x, size, *rest: _view_fw(be, ctx, x, size)),
         (lambda c, outs, x, size, *rest: _view_rule(c, outs, x, size)),
         doc="reshape to the node's (reduced) output shape (the size argument is the original "
             "target, used only without output shapes); shape rule: view groupings")


def _perm_rule(c, outs, x, perm):
    y = outs[0]
    require(len(perm) == len(x) == len(y), f"permutation {perm} of a {len(x)}-d tensor")
    for o, i in enumerate(perm):
        require(y.orig[o] == x.orig[i], f"permute: {list(x.orig)} -> {list(y.orig)}")
        c.eq(y[o], x[i])


def _transpose_perm(ndim, d0, d1):
    perm = list(range(ndim))
    if ndim:
        a, b = axis(d0, ndim), axis(d1, ndim)
        perm[a], perm[b] = perm[b], perm[a]
    return perm


def _t_perm(ndim):
    return list(range(ndim))[::-1]


for _suffix in ("", "_copy"):
    aten(f"aten.t{_suffix}.default", lambda be, ctx, x: np.transpose(x),
         lambda c, outs, x: _perm_rule(c, outs, x, _t_perm(len(x))),
         doc="transpose of a <= 2-d tensor")
    aten(f"aten.transpose{_suffix}.int",
         lambda be, ctx, x, d0, d1: np.transpose(x, _transpose_perm(x.ndim, d0, d1)),
         lambda c, outs, x, d0, d1: _perm_rule(c, outs, x, _transpose_perm(len(x), d0, d1)),
         doc="swap two axes")
    aten(f"aten.permute{_suffix}.default",
         lambda be, ctx, x, dims: np.transpose(x, [axis(d, x.ndim) for d in dims]),
         lambda c, outs, x, dims: _perm_rule(c, outs, x, [axis(d, len(x)) for d in dims]),
         doc="permute the axes")


def _unsqueeze_rule(c, outs, x, dim):
    y = outs[0]
    d = axis(dim, len(x) + 1)
    c.eq(y[d], 1)
    same_dims(c, TShape(list(y.dims[:d]) + list(y.dims[d + 1:]), y.orig[:d] + y.orig[d + 1:]), x)


def _squeezed(shape, dims) -> tuple[int, ...]:
    """Axes that squeeze(dims) removes (only those of size 1)."""
    n = len(shape)
    dims = range(n) if dims is None else [axis(d, n) for d in
                                          ([dims] if isinstance(dims, int) else dims)]
    return tuple(sorted({d for d in dims if n and shape[d] == 1}))


def _squeeze_fw(be, ctx, x, dims=None):
    return np.squeeze(x, axis=_squeezed(ctx.orig_in[0] if ctx.orig_in else x.shape, dims))


def _squeeze_rule(c, outs, x, dims=None):
    drop = _squeezed(x.orig, dims)
    kept = [i for i in range(len(x)) if i not in drop]
    same_dims(c, TShape([x[i] for i in kept], tuple(x.orig[i] for i in kept)), outs[0])


for _suffix in ("", "_copy"):
    aten(f"aten.unsqueeze{_suffix}.default", lambda be, ctx, x, dim: np.expand_dims(
        x, axis(dim, x.ndim + 1)), _unsqueeze_rule, doc="insert an axis of size 1")
    for _ov in ("dim", "dims", "default"):
        aten(f"aten.squeeze{_suffix}.{_ov}", _squeeze_fw, _squeeze_rule,
             doc="remove the named axes (all by default) that have size 1 in the plan")


def _expand_fw(be, ctx, x, size, implicit=False):
    shape = out_shape(ctx, 0, [n if n != -1 else x.shape[i - (len(size) - x.ndim)]
                               for i, n in enumerate(size)])
    return np.array(np.broadcast_to(x, shape))


def broadcast_to(c, operands, out: TShape) -> None:
    """Each operand broadcasts to `out` (torch rules, right-aligned): an axis equal to out's
    stays equal, an axis of size 1 stays 1."""
    for t in operands:
        off = len(out) - len(t)
        require(off >= 0, f"cannot broadcast {list(t.orig)} to {list(out.orig)}")
        for i in range(len(t)):
            n = t.orig[i]
            if n == out.orig[off + i]:
                c.eq(t[i], out[off + i])
            elif n == 1:
                c.eq(t[i], 1)
            else:
                raise ShapeRuleError(f"cannot broadcast {list(t.orig)} to {list(out.orig)}")


def _expand_rule(c, outs, x, size, implicit=False):
    broadcast_to(c, [x], outs[0])


for _name in ("aten.expand.default", "aten.expand_copy.default"):
    aten(_name, _expand_fw, _expand_rule,
         doc="broadcast to the node's (reduced) output shape; shape rule: torch broadcasting")


# ----------------------------------------------------------------------------- identities

for _name, _what in (("aten.clone.default", "copy"),
                     ("aten.detach.default", "autograd cut"), ("aten.alias.default", "alias"),
                     ("aten.alias_copy.default", "alias"), ("aten.detach_copy.default",
                                                             "autograd cut"),
                     ("aten.lift_fresh_copy.default", "constant lift")):
    aten(_name, lambda be, ctx, x, *rest, **kw: x.copy(), identity_rule,
         doc=f"identity ({_what}); memory_format is ignored")

_INT_DTYPES = {"torch.int64", "torch.int32", "torch.int16", "torch.int8", "torch.uint8",
               "torch.long", "torch.int"}


def _cast(be, x: TensorRef, dtype):
    """Casts are identities on reals, except to bool (x != 0); a cast to an integer type is
    only accepted from bool or integer tensors, where it is an identity (a float would be
    truncated, which is not modelled)."""
    if dtype is None or (isinstance(dtype, str) and "float" in dtype or dtype == "torch.double"):
        return x.value.copy()
    if dtype == "torch.bool":
        return be.compare(x.value, be.zeros(()), "ne")
    if dtype in _INT_DTYPES and (is_bool(x) or x.dtype in _INT_DTYPES):
        return x.value.copy()
    raise ValueError(f"cast of a {x.dtype or 'floating'} tensor to {dtype} is not modelled")


aten("aten._to_copy.default", lambda be, ctx, x, dtype=None, **kw: _cast(be, x, dtype),
     lambda c, outs, x, **kw: same_dims(c, x.value, outs[0]),
     doc="dtype cast: an identity on reals; to bool: x != 0; to an integer dtype only from "
         "bool/integer inputs (input dtype from the tensor reference), else refused",
     refs=True)


def _integer(ref: TensorRef) -> bool:
    return ref.dtype in _INT_DTYPES


def _copy_fw(be, ctx, self: TensorRef, src: TensorRef, non_blocking=False):
    if _integer(self) and not (_integer(src) or is_bool(src)):
        raise ValueError("copy of a floating tensor into an integer one truncates (not modelled)")
    if is_bool(self) and not is_bool(src):
        return be.compare(np.array(np.broadcast_to(src.value, self.value.shape)),
                          be.zeros(()), "ne")
    return np.array(np.broadcast_to(src.value, self.value.shape))


def _copy_rule(c, outs, self, src, non_blocking=False):
    broadcast_to(c, [src.value], self.value)
    same_dims(c, self.value, outs[0])


aten("aten.copy.default", _copy_fw, _copy_rule, refs=True,
     doc="functional copy_: src broadcast to self's shape, converted to self's dtype (to bool: "
         "!= 0; float into an integer tensor is refused: truncation is not modelled)")


# ----------------------------------------------------------------------------- slices


def _bounds(n: int, start, end, step) -> tuple[int, int, int]:
    """torch's clamped [start, end) of a slice of a dim of size n."""
    step = 1 if step is None else int(step)
    if step <= 0:
        raise ValueError(f"slice step {step} must be positive")
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start, end = (s + n if s < 0 else s for s in (start, end))
    start, end = min(max(start, 0), n), min(max(end, 0), n)
    return start, max(end, start), step


def _slice_positions(full: int, reduced: int, start, end, step) -> slice:
    s, e, st = _bounds(full, start, end, step)
    if full == reduced:
        return slice(s, e, st)
    if st != 1:
        raise ValueError("a strided slice of a reduced dim (its shape rule keeps it whole)")
    return slice(scale_position(s, full, reduced), scale_position(e, full, reduced))


def _orig(ctx, k: int, side: str, fallback) -> tuple[int, ...]:
    shapes = ctx.orig_in if side == "in" else ctx.orig_out
    return tuple(shapes[k]) if len(shapes) > k and shapes[k] is not None else tuple(fallback)


def _slice_fw(be, ctx, x, dim=0, start=None, end=None, step=1):
    d = axis(dim, x.ndim)
    full = _orig(ctx, 0, "in", x.shape)[d]
    idx = [slice(None)] * x.ndim
    idx[d] = _slice_positions(full, x.shape[d], start, end, step)
    return x[tuple(idx)].copy()


def _slice_rule(c, whole: TShape, part: TShape, dim, start, end, step) -> None:
    """`part` is whole[start:end:step] along dim; the other dims are equal."""
    d = axis(dim, len(whole))
    n = whole.orig[d]
    s, e, st = _bounds(n, start, end, step)
    size = len(range(s, e, st))
    require(part.orig[d] == size, f"slice [{s}:{e}:{st}] of {n} has {size} elements, not "
                                  f"{part.orig[d]}")
    same_dims(c, whole, part, skip=(d,))
    if st != 1 or size == 0:
        fix(c, whole, d)
        c.eq(part[d], part.orig[d])
        return
    c.keep_boundary(whole[d], s)
    c.keep_boundary(whole[d], e)
    c.eq(mul(part[d], n), mul(whole[d], size))


for _name in ("aten.slice.Tensor", "aten.slice_copy.Tensor"):
    aten(_name, _slice_fw,
         lambda c, outs, x, dim=0, start=None, end=None, step=1:
         _slice_rule(c, x, outs[0], dim, start, end, step),
         doc="x[start:end:step] along dim; bounds are original positions, rescaled to the "
             "reduced size (kept whole positions by the shape rule; strided slices keep the "
             "dim unreduced)")


def _slice_bw_fw(be, ctx, g, input_sizes, dim, start, end, step):
    shape = out_shape(ctx, 0, input_sizes)
    d = axis(dim, len(shape))
    out = be.zeros(shape)
    idx = [slice(None)] * len(shape)
    idx[d] = _slice_positions(_orig(ctx, 0, "out", input_sizes)[d], shape[d], start, end, step)
    out[tuple(idx)] = g
    return out


aten("aten.slice_backward.default", _slice_bw_fw,
     lambda c, outs, g, input_sizes, dim, start, end, step:
     _slice_rule(c, outs[0], g, dim, start, end, step),
     doc="zeros of input_sizes with g written at [start:end:step] along dim (the gradient of "
         "slice); positions rescaled as for slice")


def _select_fw(be, ctx, x, dim, index):
    d = axis(dim, x.ndim)
    return np.take(x, int(index) % x.shape[d], axis=d)


def _select_rule(c, whole: TShape, part: TShape, dim, index) -> None:
    d = axis(dim, len(whole))
    require(-whole.orig[d] <= index < whole.orig[d], f"select index {index} out of range")
    fix(c, whole, d)
    rest = TShape(list(whole.dims[:d]) + list(whole.dims[d + 1:]),
                  whole.orig[:d] + whole.orig[d + 1:])
    same_dims(c, rest, part)


for _name in ("aten.select.int", "aten.select_copy.int"):
    aten(_name, _select_fw, lambda c, outs, x, dim, index: _select_rule(c, x, outs[0], dim, index),
         doc="x[..., index, ...] along dim; the selected dim keeps its original size")


def _select_bw_fw(be, ctx, g, input_sizes, dim, index):
    shape = out_shape(ctx, 0, input_sizes)
    d = axis(dim, len(shape))
    out = be.zeros(shape)
    idx = [slice(None)] * len(shape)
    idx[d] = int(index) % shape[d]
    out[tuple(idx)] = g
    return out


aten("aten.select_backward.default", _select_bw_fw,
     lambda c, outs, g, input_sizes, dim, index: _select_rule(c, outs[0], g, dim, index),
     doc="zeros of input_sizes with g written at index along dim (the gradient of select)")


# ----------------------------------------------------------------------------- cat, stack, split


def _cat_rule(c, outs, tensors, dim=0):
    y = outs[0]
    parts = [t for t in tensors if not (len(t) == 1 and t.orig[0] == 0)]  # torch skips [0]
    d = axis(dim, len(y))
    n, offset = y.orig[d], 0
    for t in parts:
        same_dims(c, t, y, skip=(d,))
        c.keep_boundary(y[d], offset)
        c.eq(mul(t[d], n), mul(y[d], t.orig[d]))
        offset += t.orig[d]
    require(offset == n, f"cat of {[list(t.orig) for t in parts]} is not {list(y.orig)}")


aten("aten.cat.default", lambda be, ctx, tensors, dim=0: np.concatenate(
    [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)], axis=axis(dim, tensors[0].ndim)),
     _cat_rule, doc="concatenate along dim; every part keeps its share of the dim")


def _stack_rule(c, outs, tensors, dim=0):
    y = outs[0]
    d = axis(dim, len(y))
    require(y.orig[d] == len(tensors), f"stack of {len(tensors)} tensors has {y.orig[d]} rows")
    c.eq(y[d], len(tensors))
    rest = TShape(list(y.dims[:d]) + list(y.dims[d + 1:]), y.orig[:d] + y.orig[d + 1:])
    for t in tensors:
        same_dims(c, t, rest)


aten("aten.stack.default", lambda be, ctx, tensors, dim=0: np.stack(
    tensors, axis=axis(dim, tensors[0].ndim + 1)), _stack_rule,
     doc="stack along a new axis dim (of the number of tensors, never reduced)")


def _pieces(n: int, sizes) -> list[tuple[int, int]]:
    out, o = [], 0
    for s in sizes:
        out.append((o, o + s))
        o += s
    require(o == n, f"split sizes {list(sizes)} do not add up to {n}")
    return out


def _split_sizes(n: int, split_size: int) -> list[int]:
    if split_size <= 0:
        raise ValueError(f"split size {split_size}")
    return [min(split_size, n - o) for o in range(0, n, split_size)] or [0]


def _split_fw(be, ctx, x, sizes_of, dim):
    d = axis(dim, x.ndim)
    full = _orig(ctx, 0, "in", x.shape)[d]
    out = []
    for s, e in _pieces(full, sizes_of(full)):
        idx = [slice(None)] * x.ndim
        idx[d] = slice(scale_position(s, full, x.shape[d]), scale_position(e, full, x.shape[d]))
        out.append(x[tuple(idx)].copy())
    return out


def _split_rule(c, outs, x, sizes, dim):
    d = axis(dim, len(x))
    n = x.orig[d]
    pieces = _pieces(n, sizes)
    require(len(outs) == len(pieces), f"split makes {len(pieces)} pieces, the node lists "
                                      f"{len(outs)}")
    for (s, e), y in zip(pieces, outs):
        c.keep_boundary(x[d], s)
        if y is not None:
            same_dims(c, x, y, skip=(d,))
            require(y.orig[d] == e - s, f"split piece [{s}, {e}) is not {list(y.orig)}")
            c.eq(mul(y[d], n), mul(x[d], e - s))


for _name in ("aten.split.Tensor", "aten.split_copy.Tensor"):
    aten(_name, lambda be, ctx, x, split_size, dim=0: _split_fw(
        be, ctx, x, lambda n: _split_sizes(n, split_size), dim),
         lambda c, outs, x, split_size, dim=0: _split_rule(
             c, outs, x, _split_sizes(x.orig[axis(dim, len(x))], split_size), dim),
         doc="pieces of split_size (the last one shorter) along dim; piece bounds are kept "
             "whole positions under reduction")
aten("aten.split_with_sizes.default", lambda be, ctx, x, split_sizes, dim=0: _split_fw(
    be, ctx, x, lambda n: list(split_sizes), dim),
     lambda c, outs, x, split_sizes, dim=0: _split_rule(c, outs, x, list(split_sizes), dim),
     doc="pieces of the given sizes along dim; bounds kept whole under reduction")


def _unbind_rule(c, outs, x, dim=0):
    d = axis(dim, len(x))
    require(len(outs) == x.orig[d], f"unbind of {x.orig[d]} rows lists {len(outs)} outputs")
    fix(c, x, d)
    rest = TShape(list(x.dims[:d]) + list(x.dims[d + 1:]), x.orig[:d] + x.orig[d + 1:])
    for y in outs:
        if y is not None:
            same_dims(c, rest, y)


aten("aten.unbind.int", lambda be, ctx, x, dim=0: [np.take(x, i, axis=axis(dim, x.ndim))
                                                    for i in range(x.shape[axis(dim, x.ndim)])],
     _unbind_rule, doc="the rows along dim as separate outputs (the dim is never reduced)")


# ----------------------------------------------------------------------------- constants


def _created_rule(size_of):
    """Shape rule of a factory: the output has the size the call names (no relation)."""

    def rule(c, outs, *args, **kwargs):
        size = size_of(*args, **kwargs)
        if size is not None:
            require(tuple(outs[0].orig) == tuple(size),
                    f"created tensor {list(outs[0].orig)} is not of size {list(size)}")

    return rule


def _fill(value):
    return lambda be, ctx, size, *rest, **kw: full_like(be, out_shape(ctx, 0, size), value)


def _integral_fill(value, dtype) -> None:
    """A non-integer value in an integer tensor would be truncated: refused."""
    if dtype in _INT_DTYPES and not is_neg_inf(value) and number(value).denominator != 1:
        raise ValueError(f"filling a {dtype} tensor with {value!r} truncates (not modelled)")


def _full_fw(be, ctx, size, fill_value, dtype=None, **kw):
    _integral_fill(fill_value, dtype)
    return full_like(be, out_shape(ctx, 0, size), fill_value)


def _fill_fw(be, ctx, x: TensorRef, value):
    _integral_fill(value, x.dtype)
    if is_bool(x):
        return be.compare(full_like(be, x.value.shape, value), be.zeros(()), "ne")
    return full_like(be, x.value.shape, value)


aten("aten.full.default", _full_fw,
     _created_rule(lambda size, fill_value, **kw: size),
     doc="a tensor of the (reduced) output shape filled with fill_value (-inf allowed)")
aten("aten.zeros.default", _fill(0), _created_rule(lambda size, **kw: size),
     doc="zeros of the (reduced) output shape")
aten("aten.ones.default", _fill(1), _created_rule(lambda size, **kw: size),
     doc="ones of the (reduced) output shape")
aten("aten.scalar_tensor.default", lambda be, ctx, s, **kw: full_like(be, (), s),
     _created_rule(lambda s, **kw: ()), doc="a 0-d tensor holding s")
aten("aten.fill.Scalar", _fill_fw, lambda c, outs, x, value: same_dims(c, x.value, outs[0]),
     refs=True, doc="functional fill_: x's shape filled with value (in x's dtype: a bool tensor "
                    "gets value != 0, a non-integer value for an integer tensor is refused)")
aten("aten.zero.default", lambda be, ctx, x: be.zeros(x.shape), identity_rule,
     doc="functional zero_: zeros of x's shape")
aten("aten.zeros_like.default", lambda be, ctx, x, **kw: be.zeros(x.shape), identity_rule,
     doc="zeros of x's shape")
aten("aten.ones_like.default", lambda be, ctx, x, **kw: full_like(be, x.shape, 1), identity_rule,
     doc="ones of x's shape")
aten("aten.full_like.default", lambda be, ctx, x, fill_value, **kw: full_like(
    be, x.shape, fill_value), identity_rule, doc="x's shape filled with fill_value")
aten("aten.new_zeros.default", lambda be, ctx, x, size, **kw: be.zeros(out_shape(ctx, 0, size)),
     _created_rule(lambda x, size, **kw: size), doc="zeros of the (reduced) output shape")
aten("aten.new_ones.default", lambda be, ctx, x, size, **kw: full_like(
    be, out_shape(ctx, 0, size), 1), _created_rule(lambda x, size, **kw: size),
     doc="ones of the (reduced) output shape")
aten("aten.new_full.default", lambda be, ctx, x, size, fill_value, **kw: full_like(
    be, out_shape(ctx, 0, size), fill_value), _created_rule(lambda x, size, fill_value, **kw: size),
     doc="the (reduced) output shape filled with fill_value")


def _arange_args(*args):
    """(start, end, step) of the three arange overloads' positional arguments."""
    if len(args) == 1:
        return 0, args[0], 1
    if len(args) == 2:
        return args[0], args[1], 1
    return args[0], args[1], args[2]


def _arange_fw(be, ctx, *args, dtype=None, **kw):
    start, end, step = (number(a) for a in _arange_args(*args))
    n = len(np.arange(float(start), float(end), float(step)))
    orig = _orig(ctx, 0, "out", (n,))[0]
    reduced = out_shape(ctx, 0, (n,))[0]
    first = start / step  # the first value in steps
    if reduced != orig:
        first = scale_position(int(first), orig, reduced)
    return np.array([be.const((first + k) * step) for k in range(reduced)],
                    dtype=object if be.symbolic else np.float64)


def _arange_rule(c, outs, *args, dtype=None, **kw):
    start, end, step = (number(a) for a in _arange_args(*args))
    y = outs[0]
    n = len(np.arange(float(start), float(end), float(step)))
    require(tuple(y.orig) == (n,), f"arange({start}, {end}, {step}) has {n} values, not "
                                   f"{list(y.orig)}")
    first = start / step
    if first.denominator != 1:
        fix(c, y, 0)
    else:
        c.keep_boundary(y[0], int(first))


for _ov in ("default", "start", "start_step"):
    aten(f"aten.arange.{_ov}", _arange_fw, _arange_rule,
         doc="step * (start/step + k) for k < length. Under reduction the values stay "
             "positions: start/step is rescaled like a slice bound (kept a whole position by "
             "the shape rule; the dim is not reduced when start is not a multiple of step), so "
             "a shard's arange(a, b) matches the slice [a, b) of the full arange")


def _tri(be, ctx, x, diagonal, upper: bool):
    rows, cols = x.shape[-2], x.shape[-1]
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    keep = (j - i >= diagonal) if upper else (j - i <= diagonal)
    return np.where(np.broadcast_to(keep, x.shape), x, be.zeros(x.shape))


def _tri_rule(c, outs, x, diagonal=0):
    same_dims(c, x, outs[0])
    if diagonal not in (0, 1, -1):  # an offset names a position: keep both dims whole
        fix(c, x, len(x) - 1)
        fix(c, x, len(x) - 2)


aten("aten.triu.default", lambda be, ctx, x, diagonal=0: _tri(be, ctx, x, diagonal, True),
     _tri_rule, doc="zero below the diagonal-th diagonal (j - i >= diagonal kept); with "
                    "|diagonal| > 1 the two matrix dims are not reduced")
aten("aten.tril.default", lambda be, ctx, x, diagonal=0: _tri(be, ctx, x, diagonal, False),
     _tri_rule, doc="zero above the diagonal-th diagonal (j - i <= diagonal kept); with "
                    "|diagonal| > 1 the two matrix dims are not reduced")


# ----------------------------------------------------------------------------- as_strided


def _contiguous_whole(x_orig, size, stride, offset) -> None:
    """as_strided is modelled only where it is a reshape: the whole tensor, contiguous
    strides, offset 0 (what functionalized in-place writes through views produce)."""
    size, stride = list(size), list(stride)
    want, acc = [], 1
    for n in reversed(size):
        want.append(acc)
        acc *= n
    want.reverse()
    ok = (offset or 0) == 0 and int(np.prod(size)) == int(np.prod(x_orig)) and all(
        s == w for s, w, n in zip(stride, want, size) if n != 1)
    if not ok:
        raise ValueError(f"as_strided(size={size}, stride={stride}, offset={offset}) is not a "
                         "reshape of the whole tensor (only that form is modelled)")


def _as_strided_fw(be, ctx, x, size, stride, storage_offset=0):
    _contiguous_whole(_orig(ctx, 0, "in", x.shape), size, stride, storage_offset)
    return x.reshape(out_shape(ctx, 0, size))


def _as_strided_rule(c, outs, x, size, stride, storage_offset=0):
    _contiguous_whole(x.orig, size, stride, storage_offset)
    view_shape(c, [x], [outs[0]], {})


for _name in ("aten.as_strided.default", "aten.as_strided_copy.default"):
    aten(_name, _as_strided_fw, _as_strided_rule,
         doc="a reshape, accepted only with the whole tensor's contiguous strides and offset 0 "
             "(any other striding is refused)")


def _as_strided_scatter_fw(be, ctx, x, src, size, stride, storage_offset=0):
    _contiguous_whole(_orig(ctx, 0, "in", x.shape), size, stride, storage_offset)
    return src.reshape(x.shape).copy()


def _as_strided_scatter_rule(c, outs, x, src, size, stride, storage_offset=0):
    _contiguous_whole(x.orig, size, stride, storage_offset)
    view_shape(c, [src], [x], {})
    same_dims(c, x, outs[0])


aten("aten.as_strided_scatter.default", _as_strided_scatter_fw, _as_strided_scatter_rule,
     doc="x with the strided view overwritten by src; accepted only when the view is the "
         "whole tensor, contiguous, offset 0 (then: src reshaped to x)")
aten("aten.new_empty_strided.default", lambda be, ctx, x, size, stride, **kw: be.zeros(
    out_shape(ctx, 0, size)), _created_rule(lambda x, size, stride, **kw: size),
     doc="uninitialised memory in torch, zeros here: functionalized in-place writes create "
         "it and overwrite it whole (as_strided_scatter); a program that reads it unwritten "
         "has no defined result in torch")
aten("aten._efficientzerotensor.default", lambda be, ctx, size, **kw: be.zeros(
    out_shape(ctx, 0, size)), _created_rule(lambda size, **kw: size),
     doc="zeros of the (reduced) output shape (autograd's zero gradient)")
