"""ATen neural-network ops: softmax family, layer norm, embedding, nll loss, and indexing by
values (index, index_put, gather).

Indexing by values. A tensor of indices (token ids, targets, positions) is a tensor of reals
like any other. Where every index is a known integer constant (an arange, a constant target)
the entry indexes directly; otherwise it selects exactly with a chain of
`ite(idx == r, x[r], ...)` over the rows r of the indexed dim (an index that names no row
gives 0, where torch would raise). Either way the result is exact for every in-range index.
The indexed dim of the source (the vocabulary of an embedding or a loss, the rows an index
names) is NEVER reduced by shape reduction: an index value is a position in it, and the
constants compared with token ids in a vocabulary-parallel shard (`ids < start`, `ids - start`)
stay right only at the original size. So shape reduction keeps such a stage faithful at
the cost of the vocabulary's size.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

from tvsmt.ops.definitions._common import broadcast_rule, nontrivial, require, sum_axes, times
from tvsmt.ops.definitions.aten_call import (
    TensorRef,
    aten,
    axes,
    axis,
    full_like,
    is_bool,
    number,
    original_count,
    scalar,
)
from tvsmt.ops.definitions.aten_layout import broadcast_to, fix, same_dims
from tvsmt.ops.registry import AttrError, TShape

# ----------------------------------------------------------------------------- softmax family


def _softmax(be, ctx, x, dim, half_to_float=False):
    e = be.exp(x)
    return be.div(e, sum_axes(e, axes(dim, x.ndim), True))


def _softmax_rule(c, outs, x, dim, *rest):
    same_dims(c, x, outs[0])
    nontrivial(c, x, axes(dim, len(x)))


def _softmax_bw(be, ctx, g, y, dim, input_dtype=None):
    return y * (g - sum_axes(g * y, axes(dim, y.ndim), True))


def _log_softmax(be, ctx, x, dim, half_to_float=False):
    return x - be.log(sum_axes(be.exp(x), axes(dim, x.ndim), True))


def _log_softmax_bw(be, ctx, g, y, dim, input_dtype=None):
    return g - be.exp(y) * sum_axes(g, axes(dim, y.ndim), True)


def _bw_rule(c, outs, g, y, dim, *rest):
    same_dims(c, g, y)
    _softmax_rule(c, outs, y, dim)


aten("aten._softmax.default", _softmax, _softmax_rule,
     doc="exp(x) / sum(exp(x), dim) (torch's max subtraction cancels on reals)",
     abstracts=("uf_exp", "uf_recip"))
def _safe_softmax(be, ctx, x, dim, dtype=None):
    """softmax, but 0 on a slice that is -inf everywhere (a fully masked row)."""
    red = axes(dim, x.ndim)
    masked = be.compare(x, full_like(be, x.shape, "-inf"), "eq")
    every = masked
    for a in red:
        rows = [np.take(every, i, axis=a) for i in range(every.shape[a])]
        acc = rows[0]
        for r in rows[1:]:
            acc = be.where(acc, r, be.zeros(acc.shape))
        every = np.expand_dims(acc, a)
    every = np.array(np.broadcast_to(every, x.shape))
    return be.where(every, be.zeros(x.shape), _softmax(be, ctx, x, dim))


aten("aten._safe_softmax.default", _safe_softmax, _softmax_rule,
     doc="softmax over dim, 0 on slices that are -inf everywhere (attention's fully masked "
         "rows; exact ite on x == -inf)", abstracts=("uf_exp", "uf_recip"))
aten("aten._softmax_backward_data.default", _softmax_bw, _bw_rule,
     doc="[g, y = softmax OUTPUT] -> y * (g - sum(g * y, dim)), exact polynomial")
aten("aten._log_softmax.default", _log_softmax, _softmax_rule,
     doc="x - log(sum(exp(x), dim))", abstracts=("uf_exp", "uf_log"))
aten("aten._log_softmax_backward_data.default", _log_softmax_bw, _bw_rule,
     doc="[g, y = log_softmax OUTPUT] -> g - exp(y) * sum(g, dim)", abstracts=("uf_exp",))

# ----------------------------------------------------------------------------- layer norm


def _norm_axes(x_ndim: int, normalized_shape) -> tuple[int, ...]:
    k = len(normalized_shape)
    require(0 < k <= x_ndim, f"normalized_shape {list(normalized_shape)} of a {x_ndim}-d input")
    return tuple(range(x_ndim - k, x_ndim))


def _count(ctx, x, red) -> Fraction:
    return Fraction(1, original_count(ctx, x, red))


def _layer_norm(be, ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    red = _norm_axes(x.ndim, normalized_shape)
    inv = _count(ctx, x, red)
    mean = times(be, sum_axes(x, red, True), inv)
    xc = x - mean
    rstd = be.rsqrt(times(be, sum_axes(xc * xc, red, True), inv) + be.const(number(eps)))
    out = xc * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return [out, mean, rstd]


def _layer_norm_rule(c, outs, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    red = _norm_axes(len(x), normalized_shape)
    nontrivial(c, x, red)
    same_dims(c, x, outs[0])
    lead = TShape(list(x.dims[:red[0]]), x.orig[:red[0]])
    for stat in outs[1:]:
        if stat is not None:
            require(len(stat) == len(x), "layer norm statistics keep the rank")
            same_dims(c, lead, TShape(list(stat.dims[:red[0]]), stat.orig[:red[0]]))
            for i in red:
                c.eq(stat[i], 1)
    tail = TShape(list(x.dims[red[0]:]), x.orig[red[0]:])
    for p in (weight, bias):
        if p is not None:
            same_dims(c, p, tail)


aten("aten.native_layer_norm.default", _layer_norm, _layer_norm_rule, n_outputs=3,
     doc="[x, w?, b?] -> [(x - mean) * rstd * w + b, mean, rstd] over the trailing "
         "normalized_shape dims, rstd = rsqrt(biased var + eps), 1/N exact with N the "
         "original count",
     abstracts=("uf_rsqrt",))


def _layer_norm_bw(be, ctx, g, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    red = _norm_axes(x.ndim, normalized_shape)
    lead = tuple(range(red[0]))
    inv = _count(ctx, x, red)
    xhat = (x - mean) * rstd
    gxhat = g if weight is None else g * weight
    gx = rstd * (gxhat - times(be, sum_axes(gxhat, red, True), inv)
                 - xhat * times(be, sum_axes(gxhat * xhat, red, True), inv))
    gw = None if weight is None else sum_axes(g * xhat, lead, False)
    gb = None if bias is None else sum_axes(g, lead, False)
    mask = list(output_mask) + [True] * (3 - len(output_mask))
    return [v if m else None for v, m in zip((gx, gw, gb), mask)]


def _layer_norm_bw_rule(c, outs, g, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    same_dims(c, g, x)
    # grad_input is absent (null) when the input needs no gradient: g has its shape
    y = outs[0] if outs and outs[0] is not None else g
    _layer_norm_rule(c, [y, mean, rstd], x, normalized_shape, weight, bias)
    for p, gp in ((weight, outs[1] if len(outs) > 1 else None),
                  (bias, outs[2] if len(outs) > 2 else None)):
        if p is not None and gp is not None:
            same_dims(c, p, gp)


aten("aten.native_layer_norm_backward.default", _layer_norm_bw, _layer_norm_bw_rule,
     n_outputs=3,
     doc="[g, x, mean, rstd, w?, b?] -> [g_x, g_w, g_b] (null where output_mask is False "
         "or the parameter is absent): g_x = rstd * (gh - mean(gh) - xh * mean(gh * xh)), "
         "gh = g * w, xh = (x - mean) * rstd; g_w = sum(g * xh), g_b = sum(g) over the "
         "leading dims", abstracts=())

# ----------------------------------------------------------------------------- value indexing


def select_rows(be, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """out[p, ...] = x[idx[p], ...] (x indexed along its first axis), exact for symbolic
    indices: ite(idx == r, x[r], ...) over every row r (no row: 0)."""
    ints = be.constant_ints(idx)
    if ints is not None:
        if ints.size and (ints.min() < 0 or ints.max() >= x.shape[0]):
            raise AttrError(f"index {int(ints.min())}..{int(ints.max())} out of range "
                             f"[0, {x.shape[0]})")
        return x[ints].copy()
    shape = idx.shape + x.shape[1:]
    sel = idx.reshape(idx.shape + (1,) * (x.ndim - 1))
    out = be.zeros(shape)
    for r in range(x.shape[0]):
        out = be.select_eq(sel, r, np.array(np.broadcast_to(x[r], shape)), out)
    return out


def _embedding(be, ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
               sparse=False):
    return select_rows(be, weight, indices)


def _embedding_rule(c, outs, weight, indices, *rest):
    y = outs[0]
    require(len(weight) == 2, "embedding: the weight must be 2-d")
    require(tuple(y.orig) == tuple(indices.orig) + (weight.orig[1],),
            f"embedding: {list(indices.orig)} ids of {list(weight.orig)} is not {list(y.orig)}")
    fix(c, weight, 0)  # value-indexed: the vocabulary is never reduced
    same_dims(c, indices, TShape(list(y.dims[:-1]), y.orig[:-1]))
    c.eq(y[-1], weight[1])


aten("aten.embedding.default", _embedding, _embedding_rule,
     doc="weight[ids] (exact selection by value, see the module doc; the vocabulary dim is "
         "never reduced); padding_idx only matters for the backward")


def _embedding_bw(be, ctx, g, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    if scale_grad_by_freq:
        raise AttrError("embedding_dense_backward: scale_grad_by_freq is not modelled")
    d = g.shape[-1]
    flat_g, flat_i = g.reshape(-1, d), indices.reshape(-1)
    ints = be.constant_ints(flat_i)
    out = be.zeros((int(num_weights), d))
    zero = be.zeros((d,))
    for r in range(int(num_weights)):
        if r == padding_idx:
            continue
        if ints is not None:
            rows = [flat_g[p] for p in range(len(flat_i)) if ints[p] == r]
        else:
            rows = [be.select_eq(np.full(d, flat_i[p], dtype=flat_i.dtype), r, flat_g[p], zero)
                    for p in range(len(flat_i))]
        if rows:
            out[r] = np.sum(np.stack(rows), axis=0)
    return out


def _embedding_bw_rule(c, outs, g, indices, num_weights, *rest):
    y = outs[0]
    require(tuple(y.orig) == (num_weights, g.orig[-1]),
            f"embedding_dense_backward: output {list(y.orig)} is not [{num_weights}, "
            f"{g.orig[-1]}]")
    fix(c, y, 0)
    same_dims(c, indices, TShape(list(g.dims[:-1]), g.orig[:-1]))
    c.eq(y[1], g[-1])


aten("aten.embedding_dense_backward.default", _embedding_bw, _embedding_bw_rule,
     doc="[g, ids] -> g_W with g_W[r] = sum_p [ids[p] == r] g[p] (exact), row padding_idx "
         "zero; num_weights is the (never reduced) vocabulary")


def _index_layout(x_ndim: int, dims: list[int], p_ndim: int) -> tuple[int, bool]:
    """Where the broadcast index dims go in the result: at the first indexed dim when the
    indexed dims are consecutive, else first (torch and numpy advanced indexing)."""
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    return (dims[0] if adjacent else 0), adjacent


def _require_dtypes(refs) -> None:
    """Index tensors must say their dtype: a bool mask and integer indices of the same values
    mean different things."""
    for r in refs:
        if r is not None and r.dtype is None:
            raise AttrError("an index tensor reference lacks its dtype (the capture writes "
                             "{'tensor': k, 'dtype': ...} for non-floating tensors)")


def _index_parts(x, indices):
    """(indexed dims, index arrays broadcast together, their shape)."""
    refs = list(indices)
    _require_dtypes(refs)
    for r in refs:
        if r is not None and is_bool(r):
            raise AttrError("indexing by a boolean mask has a data-dependent shape")
    dims = [d for d, r in enumerate(refs) if r is not None]
    require(bool(dims) and len(refs) <= x.ndim, "index: no index tensors")
    shape = np.broadcast_shapes(*(refs[d].value.shape for d in dims))
    return dims, [np.broadcast_to(refs[d].value, shape) for d in dims], shape


def _gather_all(be, x, dims, arrays, shape):
    """x indexed at the given dims by the arrays (result: index dims first, then the rest)."""
    rest = [d for d in range(x.ndim) if d not in dims]
    xt = np.transpose(x, dims + rest)
    rest_shape = tuple(x.shape[d] for d in rest)
    ints = [be.constant_ints(a) for a in arrays]
    if all(i is not None for i in ints):
        for d, i in zip(dims, ints):
            if i.size and (i.min() < -x.shape[d] or i.max() >= x.shape[d]):
                raise AttrError(f"index out of range for dim {d} of size {x.shape[d]}")
        return xt[tuple(ints)].copy()
    full = tuple(shape) + rest_shape
    sel = [np.broadcast_to(a.reshape(tuple(shape) + (1,) * len(rest)), full) for a in arrays]
    out = be.zeros(full)
    for combo in itertools.product(*(range(x.shape[d]) for d in dims)):
        val = np.array(np.broadcast_to(xt[combo], full))
        hit = val
        for s, r in reversed(list(zip(sel, combo))):
            hit = be.select_eq(s, r, hit, out)
        out = hit
    return out


def _index(be, ctx, x: TensorRef, indices):
    dims, arrays, shape = _index_parts(x.value, indices)
    out = _gather_all(be, x.value, dims, arrays, shape)
    pos, _ = _index_layout(x.value.ndim, dims, len(shape))
    return np.moveaxis(out, list(range(len(shape))), list(range(pos, pos + len(shape))))


def _index_rule(c, outs, x: TensorRef, indices):
    xs, y = x.value, outs[0]
    refs = list(indices)
    _require_dtypes(refs)
    require(not any(r is not None and is_bool(r) for r in refs),
            "indexing by a boolean mask has a data-dependent shape")
    dims = [d for d, r in enumerate(refs) if r is not None]
    rest = [d for d in range(len(xs)) if d not in dims]
    p = max(len(refs[d].value) for d in dims)
    pos, _ = _index_layout(len(xs), dims, p)
    require(len(y) == p + len(rest), f"index result {list(y.orig)} has the wrong rank")
    pdims = TShape(list(y.dims[pos:pos + p]), y.orig[pos:pos + p])
    broadcast_rule(c, [refs[d].value for d in dims], pdims)
    for d in dims:
        fix(c, xs, d)  # index values are positions in these dims
    ydims = [i for i in range(len(y)) if not pos <= i < pos + p]
    for i, d in zip(ydims, rest):
        require(y.orig[i] == xs.orig[d], f"index: {list(xs.orig)} -> {list(y.orig)}")
        c.eq(y[i], xs[d])


aten("aten.index.Tensor", _index, _index_rule, refs=True,
     doc="advanced indexing x[i0, i1, ...] by integer index tensors (torch placement of the "
         "index dims); exact selection by value (module doc); the indexed dims are never "
         "reduced; boolean masks are refused (data-dependent shape)")


def _index_put(be, ctx, x: TensorRef, indices, values: TensorRef, accumulate=False):
    xv, vv = x.value, values.value
    refs = list(indices)
    _require_dtypes(refs)
    if len(refs) == 1 and refs[0] is not None and is_bool(refs[0]):
        mask = refs[0].value
        k = mask.ndim
        m = mask.reshape(mask.shape + (1,) * (xv.ndim - k))
        require(vv.ndim <= xv.ndim - k, "index_put with a mask: values must be a scalar or "
                                        "broadcast over the unmasked dims")
        v = np.array(np.broadcast_to(vv, xv.shape))
        m = np.array(np.broadcast_to(m, xv.shape))
        if accumulate:
            return xv + be.where(m, v, be.zeros(xv.shape))
        return be.where(m, v, xv)
    dims, arrays, shape = _index_parts(xv, refs)
    pos, _ = _index_layout(xv.ndim, dims, len(shape))
    rest = [d for d in range(xv.ndim) if d not in dims]
    res_shape = tuple(xv.shape[d] for d in rest[:pos]) + tuple(shape) + tuple(
        xv.shape[d] for d in rest[pos:])
    v = np.moveaxis(np.broadcast_to(vv, res_shape), list(range(pos, pos + len(shape))),
                    list(range(len(shape))))  # index dims first
    xt = np.transpose(xv, dims + rest).copy()
    ints = [be.constant_ints(a) for a in arrays]
    if all(i is not None for i in ints):
        key = tuple(ints)
        if accumulate:
            np.add.at(xt, key, v)
        else:
            xt[key] = v
    else:
        for p in itertools.product(*(range(n) for n in shape)):
            for combo in itertools.product(*(range(xv.shape[d]) for d in dims)):
                # position combo of xt gets v[p] where every index at p names it (the
                # Ellipsis keeps a 0-d array when every dim is indexed)
                cell = xt[combo + (Ellipsis,)]
                hit = np.array(np.broadcast_to(cell + v[p] if accumulate else v[p], cell.shape))
                for a, r in reversed(list(zip(arrays, combo))):
                    hit = be.select_eq(np.full(cell.shape, a[p], dtype=a.dtype), r, hit, cell)
                xt[combo + (Ellipsis,)] = hit
    return np.transpose(xt, np.argsort(dims + rest))


def _index_put_rule(c, outs, x: TensorRef, indices, values: TensorRef, accumulate=False):
    xs, y = x.value, outs[0]
    same_dims(c, xs, y)
    refs = list(indices)
    _require_dtypes(refs)
    if len(refs) == 1 and refs[0] is not None and is_bool(refs[0]):
        m = refs[0].value
        same_dims(c, m, TShape(list(xs.dims[:len(m)]), xs.orig[:len(m)]))
        tail = TShape(list(xs.dims[len(m):]), xs.orig[len(m):])
        broadcast_to(c, [values.value], tail)
        return
    for d, r in enumerate(refs):
        if r is not None:
            fix(c, xs, d)


aten("aten.index_put.default", _index_put, _index_put_rule, refs=True,
     doc="functional x[indices] = values (accumulate: +=). A single boolean mask over the "
         "leading dims selects elementwise (exact ite, values a scalar or broadcast); integer "
         "indices select by value exactly (module doc; duplicates without accumulate: the "
         "last write wins, which torch leaves unspecified); indexed dims never reduced")


def _gather(be, ctx, x, dim, index, sparse_grad=False):
    d = axis(dim, x.ndim)
    require(all(index.shape[i] == x.shape[i] for i in range(x.ndim) if i != d),
            "gather: index and input differ outside dim")
    xm, im = np.moveaxis(x, d, -1), np.moveaxis(index, d, -1)
    ints = be.constant_ints(im)
    if ints is not None:
        out = np.take_along_axis(xm, ints, axis=-1)
    else:
        out = be.zeros(im.shape)
        for r in range(xm.shape[-1]):
            row = np.array(np.broadcast_to(xm[..., r:r + 1], im.shape))
            out = be.select_eq(im, r, row, out)
    return np.moveaxis(out, -1, d)


def _gather_rule(c, outs, x, dim, index, sparse_grad=False):
    d = axis(dim, len(x))
    same_dims(c, index, outs[0])
    same_dims(c, x, index, skip=(d,))
    fix(c, x, d)


aten("aten.gather.default", _gather, _gather_rule,
     doc="out[..., j, ...] = x[..., index[..., j, ...], ...] along dim (exact selection by "
         "value; the gathered dim is never reduced; index must match x outside dim)")

# ----------------------------------------------------------------------------- nll loss


def _pick(be, table: np.ndarray, t: np.ndarray, absent) -> np.ndarray:
    """table[n, t_n] for every n (`absent` where t_n names no column), exact by value."""
    n, classes = table.shape
    ints = be.constant_ints(t)
    if ints is not None:
        return np.array([table[i, k] if 0 <= k < classes else absent
                         for i, k in enumerate(ints)], dtype=table.dtype)
    out = be.full((n,), 0)
    out[:] = absent
    for c_ in range(classes):
        out = be.select_eq(t, c_, table[:, c_], out)
    return out


def _nll_parts(be, x, target, weight, ignore_index):
    """Per-sample picked log-probability x[n, t_n] and weight w_n (0 where t_n is ignored)."""
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    t = target.reshape(-1)
    n, classes = x2.shape
    picked = _pick(be, x2, t, be.const(0))
    if weight is None:
        w = be.full((n,), 1)
    else:
        w = _pick(be, np.broadcast_to(weight, (n, classes)), t, be.const(0))
    ignored = be.compare(t, be.full((n,), int(ignore_index)), "eq")
    w = be.where(ignored, be.zeros((n,)), w)
    return picked, w


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _nll_forward(be, ctx, x, target, weight, reduction, ignore_index):
    picked, w = _nll_parts(be, x, target, weight, ignore_index)
    losses = be.scale(picked * w, -1)
    total = np.sum(w)
    red = _REDUCTIONS.get(int(reduction))
    if red is None:
        raise AttrError(f"nll_loss: reduction={reduction!r}")
    total_arr = np.array(total, dtype=object if be.symbolic else np.float64)
    # at the original count, like every other normalising count (aten_call.original_count)
    n_orig, n_now = original_count(ctx, target, range(target.ndim)), max(target.size, 1)
    total_arr = times(be, total_arr, Fraction(n_orig, n_now))
    if red == "none":
        out = losses.reshape(target.shape)
        return [out, be.zeros(())]
    s = np.array(np.sum(losses), dtype=object if be.symbolic else np.float64)
    if red == "sum":
        return [s, total_arr]
    return [be.div(s, total_arr), total_arr]


def _nll_backward(be, ctx, g, x, target, weight, reduction, ignore_index, total_weight):
    _, w = _nll_parts(be, x, target, weight, ignore_index)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    n, classes = x2.shape
    red = _REDUCTIONS.get(int(reduction))
    if red == "none":
        scale = be.scale(w * g.reshape(-1), -1)
    elif red == "sum":
        scale = be.scale(w * g.reshape(()), -1)
    else:
        scale = be.scale(be.div(w * g.reshape(()), np.broadcast_to(total_weight, w.shape)), -1)
    t = target.reshape(-1)
    out = be.zeros((n, classes))
    for c_ in range(classes):
        out[:, c_] = be.select_eq(t, c_, scale, be.zeros((n,)))
    return out.reshape(x.shape)


def _nll_rule(c, outs, x, target, weight, reduction, ignore_index, *rest):
    require(len(x) in (1, 2), "nll_loss: input must be (C,) or (N, C)")
    fix(c, x, len(x) - 1)  # the classes are indexed by target values
    if len(x) == 2:
        require(tuple(target.orig) == (x.orig[0],), f"nll_loss: targets {list(target.orig)} "
                                                    f"for input {list(x.orig)}")
        c.eq(target[0], x[0])
    if weight is not None:
        same_dims(c, weight, TShape([x[-1]], (x.orig[-1],)))


def _nll_forward_rule(c, outs, x, target, weight, reduction, ignore_index):
    _nll_rule(c, outs, x, target, weight, reduction, ignore_index)
    if int(reduction) == 0 and outs[0] is not None:
        same_dims(c, outs[0], target)


def _nll_backward_rule(c, outs, g, x, target, weight, reduction, ignore_index, total_weight):
    _nll_rule(c, outs, x, target, weight, reduction, ignore_index)
    same_dims(c, outs[0], x)
    if int(reduction) == 0:
        same_dims(c, g, target)


aten("aten.nll_loss_forward.default", _nll_forward, _nll_forward_rule, n_outputs=2,
     doc="[x (N, C) log-probs, targets, w?] -> [loss, total_weight]: loss_n = -w[t_n] x[n, t_n] "
         "(0 where t_n == ignore_index; exact selection by target value, the class dim is "
         "never reduced), reduced by none/mean/sum; mean divides by total_weight = sum of the "
         "weights (be.div), exactly as torch normalises; under shape reduction total_weight "
         "is scaled by original / reduced samples (counts at their original value)",
     abstracts=("uf_recip",))
aten("aten.nll_loss_backward.default", _nll_backward, _nll_backward_rule,
     doc="[g, x, targets, w?, total_weight] -> g_x with g_x[n, t_n] = -w_n g (/ total_weight "
         "for mean), 0 elsewhere and for ignored targets", abstracts=("uf_recip",))


def _scatter(be, ctx, x, dim, index, src):
    d = axis(dim, x.ndim)
    if not isinstance(src, np.ndarray):
        src = be.full((), 0) + scalar(be, src)
    src = np.array(np.broadcast_to(src, index.shape))
    require(all(index.shape[i] == x.shape[i] for i in range(x.ndim) if i != d),
            "scatter: index and input differ outside dim")
    xm, im, sm = (np.moveaxis(a, d, -1) for a in (x, index, src))
    out = xm.copy()
    ints = be.constant_ints(im)
    if ints is not None:
        np.put_along_axis(out, ints, sm, axis=-1)
    else:
        for r in range(xm.shape[-1]):  # in order: a later write to the same place wins
            col = out[..., r]
            for p in range(im.shape[-1]):
                col = be.select_eq(im[..., p], r, sm[..., p], col)
            out[..., r] = col
    return np.moveaxis(out, -1, d)


def _scatter_rule(c, outs, x, dim, index, src):
    d = axis(dim, len(x))
    same_dims(c, x, outs[0])
    same_dims(c, x, index, skip=(d,))
    if isinstance(src, TShape):
        same_dims(c, src, index)
    fix(c, x, d)


for _ov in ("src", "value"):
    aten(f"aten.scatter.{_ov}", _scatter, _scatter_rule,
         doc="x with x[..., index[..., p], ...] = src[..., p, ...] along dim (exact selection "
             "by value, duplicates: the last write wins, which torch leaves unspecified; the "
             "dim is never reduced; index must match x outside dim)")


# ----------------------------------------------------------------------------- attention


def _sdpa_scores(be, q, k, is_causal, attn_mask, scale, ref_mask):
    """scale * q @ k^T with the causal (top-left) mask and an additive or boolean mask."""
    e = q.shape[-1]
    sc = number(scale) if scale is not None else None
    s = q @ np.swapaxes(k, -1, -2)
    s = times(be, s, sc) if sc is not None else times(be, s, number(1 / math.sqrt(e)))
    rows, cols = s.shape[-2], s.shape[-1]
    if is_causal:
        keep = np.broadcast_to(np.tril(np.ones((rows, cols), dtype=bool)), s.shape)
        s = np.where(keep, s, full_like(be, s.shape, "-inf"))
    if attn_mask is not None:
        m = np.array(np.broadcast_to(attn_mask, s.shape))
        if ref_mask is not None and is_bool(ref_mask):
            s = be.where(m, s, full_like(be, s.shape, "-inf"))
        else:
            s = s + m
    return s


def _sdpa_args(dropout_p, scale):
    if dropout_p not in (0, 0.0):
        raise AttrError(f"attention dropout {dropout_p} is random and not modelled")


def _sdpa_fw(be, ctx, q: TensorRef, k: TensorRef, v: TensorRef, dropout_p=0.0,
             is_causal=False, attn_mask=None, scale=None):
    _sdpa_args(dropout_p, scale)
    mask = getattr(attn_mask, "value", None)
    s = _sdpa_scores(be, q.value, k.value, is_causal, mask, scale, attn_mask)
    e = be.exp(s)
    total = sum_axes(e, (s.ndim - 1,), True)
    p = be.div(e, total)
    return [p @ v.value, be.log(total).reshape(total.shape[:-1])]


def _sdpa_bw(be, ctx, g: TensorRef, q: TensorRef, k: TensorRef, v: TensorRef, out, lse,
             dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    _sdpa_args(dropout_p, scale)
    qv, kv, vv, gv = q.value, k.value, v.value, g.value
    mask = getattr(attn_mask, "value", None)
    s = _sdpa_scores(be, qv, kv, is_causal, mask, scale, attn_mask)
    e = be.exp(s)
    p = be.div(e, sum_axes(e, (s.ndim - 1,), True))
    t = lambda a: np.swapaxes(a, -1, -2)
    gp = gv @ t(vv)
    gs = p * (gp - sum_axes(gp * p, (p.ndim - 1,), True))
    sc = number(scale) if scale is not None else number(1 / math.sqrt(qv.shape[-1]))
    return [times(be, gs @ kv, sc), times(be, t(gs) @ qv, sc), t(p) @ gv]


def _sdpa_rule_core(c, q: TShape, k: TShape, v: TShape, out, is_causal, attn_mask):
    require(len(q) == len(k) == len(v) >= 2, "attention: q, k, v of the same rank >= 2")
    require(q.orig[-1] == k.orig[-1] and k.orig[-2] == v.orig[-2],
            f"attention: q {list(q.orig)}, k {list(k.orig)}, v {list(v.orig)} do not match")
    for i in range(len(q) - 2):
        require(q.orig[i] == k.orig[i] == v.orig[i], "attention: batch dims differ")
        c.eq(q[i], k[i])
        c.eq(k[i], v[i])
    c.eq(q[-1], k[-1])
    c.eq(k[-2], v[-2])
    nontrivial(c, q, [len(q) - 1])
    nontrivial(c, k, [len(k) - 2])
    if is_causal:  # the mask relates query and key positions
        require(q.orig[-2] == k.orig[-2], "causal attention with different query/key lengths")
        c.eq(q[-2], k[-2])
    if attn_mask is not None:
        lead = TShape(list(q.dims[:-1]) + [k[-2]], tuple(q.orig[:-1]) + (k.orig[-2],))
        broadcast_rule(c, [attn_mask.value, lead], lead)
    if out is not None:
        same_dims(c, TShape(list(q.dims[:-1]), q.orig[:-1]), TShape(list(out.dims[:-1]),
                                                                   out.orig[:-1]))
        c.eq(out[-1], v[-1])


def _sdpa_rule(c, outs, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    _sdpa_rule_core(c, q.value, k.value, v.value, outs[0], is_causal, attn_mask)
    if len(outs) > 1 and outs[1] is not None:
        same_dims(c, TShape(list(q.value.dims[:-1]), q.value.orig[:-1]), outs[1])


def _sdpa_bw_rule(c, outs, g, q, k, v, out, lse, dropout_p=0.0, is_causal=False,
                  attn_mask=None, scale=None):
    _sdpa_rule_core(c, q.value, k.value, v.value, g.value, is_causal, attn_mask)
    for x, gx in zip((q, k, v), outs):
        if gx is not None:
            same_dims(c, x.value, gx)


aten("aten._scaled_dot_product_flash_attention_for_cpu.default", _sdpa_fw, _sdpa_rule,
     n_outputs=2, refs=True,
     doc="[q, k, v, mask?] -> [softmax(scale * q k^T + mask) v, logsumexp of the scores]; "
         "scale defaults to 1/sqrt(E) (its float value as an exact rational); is_causal masks "
         "j > i with -inf; a bool mask keeps where true, a float mask is added; dropout_p "
         "must be 0", abstracts=("uf_exp", "uf_recip", "uf_log"))
aten("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", _sdpa_bw,
     _sdpa_bw_rule, n_outputs=3, refs=True,
     doc="[g, q, k, v, out, logsumexp, mask?] -> [g_q, g_k, g_v], probabilities recomputed "
         "from q, k (out and logsumexp unused): g_v = p^T g, g_s = p * (g v^T - rowsum), "
         "g_q = scale g_s k, g_k = scale g_s^T q", abstracts=("uf_exp", "uf_recip"))
