"""ATen arithmetic: elementwise ops, comparisons and masks, reductions, matrix products.

Booleans are reals 0/1 (comparisons build `ite(x < y, 1, 0)`, exactly); `where` and
`masked_fill` select with `ite(cond != 0, ...)`. max/amax/maximum/relu/abs/clamp are exact
through ite, so a max over a sharded dim followed by a max all-reduce is provable.
"""

from __future__ import annotations

from fractions import Fraction
from functools import reduce

import numpy as np

from tvsmt.ops.definitions._common import broadcast_rule, nontrivial, require, sum_axes, times
from tvsmt.ops.definitions.aten_call import (
    TensorRef,
    aten,
    axes,
    axis,
    is_bool,
    is_neg_inf,
    number,
    original_count,
    scalar,
)
from tvsmt.ops.definitions.aten_layout import broadcast_to
from tvsmt.ops.registry import AttrError, TShape

# ----------------------------------------------------------------------------- elementwise


def tensors_of(*xs) -> list[TShape]:
    return [x for x in xs if isinstance(x, TShape)]


def broadcast_of(c, outs, *operands, **kwargs):
    broadcast_rule(c, tensors_of(*operands), outs[0])


def arr(be, v):
    """A tensor or scalar operand as an array (scalars 0-d, so numpy broadcasts them)."""
    if isinstance(v, np.ndarray):
        return v
    out = np.empty((), dtype=object if be.symbolic else np.float64)
    out[()] = scalar(be, v)
    return out


def _alpha(alpha) -> Fraction:
    return Fraction(1) if alpha is None else number(alpha)


def _add(be, ctx, x, y, alpha=1):
    return arr(be, x) + times(be, arr(be, y), _alpha(alpha))


def _sub(be, ctx, x, y, alpha=1):
    return arr(be, x) - times(be, arr(be, y), _alpha(alpha))


def _mul(be, ctx, x, y):
    if not isinstance(y, np.ndarray) and not is_neg_inf(y):
        return times(be, arr(be, x), number(y))
    return arr(be, x) * arr(be, y)


def _div(be, ctx, x, y, rounding_mode=None):
    if rounding_mode is not None:
        raise AttrError(f"div: rounding_mode={rounding_mode!r} is not modelled")
    if not isinstance(y, np.ndarray):
        c = number(y)
        if c == 0:
            raise AttrError("division by the constant 0")
        return times(be, arr(be, x), 1 / c)
    return be.div(arr(be, x), y)


for _ov in ("Tensor", "Scalar"):
    aten(f"aten.add.{_ov}", _add, broadcast_of, doc="x + alpha * y (broadcast)")
    aten(f"aten.sub.{_ov}", _sub, broadcast_of, doc="x - alpha * y (broadcast)")
    aten(f"aten.mul.{_ov}", _mul, broadcast_of, doc="x * y (broadcast)")
    aten(f"aten.div.{_ov}", _div, broadcast_of,
         doc="x / y: by a constant exactly (times 1/c), by a tensor with be.div",
         abstracts=("uf_recip",))
aten("aten.div.Tensor_mode", _div, broadcast_of,
     doc="x / y with rounding_mode, which must be None (floor/trunc are not modelled)",
     abstracts=("uf_recip",))
for _ov in ("Tensor", "Scalar"):
    aten(f"aten.rsub.{_ov}", lambda be, ctx, x, y, alpha=1: arr(be, y) - times(be, x, _alpha(
        alpha)), broadcast_of, doc="y - alpha * x (broadcast)")
aten("aten.neg.default", lambda be, ctx, x: be.scale(x, -1), broadcast_of, doc="-x")
aten("aten.reciprocal.default", lambda be, ctx, x: be.div(be.full(x.shape, 1), x), broadcast_of,
     doc="1 / x (be.div)", abstracts=("uf_recip",))


def _pow_scalar_exponent(be, x, p: Fraction):
    """x ** p: repeated products for integers >= 0, rsqrt/sqrt/reciprocal for -1/2, 1/2, -1
    (the same terms as those ops), else be.powc."""
    if p.denominator == 1 and p >= 0:
        return be.ipow(x, int(p))
    if p == Fraction(-1, 2):
        return be.rsqrt(x)
    if p == Fraction(1, 2):
        return be.sqrt(x)
    if p == -1:
        return be.div(be.full(x.shape, 1), x)
    return be.powc(x, p)


aten("aten.pow.Tensor_Scalar", lambda be, ctx, x, exponent: _pow_scalar_exponent(
    be, x, number(exponent)), broadcast_of,
     doc="x ** p for a constant p (ipow for integers >= 0; rsqrt, sqrt, 1/x for -1/2, 1/2, -1; "
         "else uf_pow)", abstracts=("uf_pow", "uf_rsqrt", "uf_sqrt", "uf_recip"))
aten("aten.pow.Scalar", lambda be, ctx, base, exponent: be.apply_uf2(
    "uf_pow", arr(be, base) + be.zeros(exponent.shape), exponent), broadcast_of,
     doc="c ** x for a constant base c (uf_pow)", abstracts=("uf_pow",))
aten("aten.pow.Tensor_Tensor", lambda be, ctx, x, y: be.apply_uf2("uf_pow", x, y), broadcast_of,
     doc="x ** y (uf_pow, broadcast)", abstracts=("uf_pow",))


def _unary(name, f, doc, abstracts=()):
    aten(name, lambda be, ctx, x: f(be, x), broadcast_of, doc=doc, abstracts=abstracts)


_unary("aten.rsqrt.default", lambda be, x: be.rsqrt(x), "1 / sqrt(x) (uf_rsqrt)", ("uf_rsqrt",))
_unary("aten.sqrt.default", lambda be, x: be.sqrt(x), "sqrt(x) (uf_sqrt)", ("uf_sqrt",))
_unary("aten.exp.default", lambda be, x: be.exp(x), "exp(x) (uf_exp)", ("uf_exp",))
_unary("aten.log.default", lambda be, x: be.log(x), "log(x) (uf_log)", ("uf_log",))
_unary("aten.tanh.default", lambda be, x: be.tanh(x), "tanh(x) (uf_tanh)", ("uf_tanh",))
_unary("aten.sigmoid.default", lambda be, x: be.sigmoid(x), "sigmoid(x) (uf_sigmoid)",
       ("uf_sigmoid",))
_unary("aten.cos.default", lambda be, x: be.cos(x), "cos(x) (uf_cos)", ("uf_cos",))
_unary("aten.sin.default", lambda be, x: be.sin(x), "sin(x) (uf_sin)", ("uf_sin",))
_unary("aten.erf.default", lambda be, x: be.apply_uf("uf_erf", x), "erf(x) (uf_erf)",
       ("uf_erf",))
_unary("aten.silu.default", lambda be, x: x * be.sigmoid(x), "x * sigmoid(x)", ("uf_sigmoid",))
_unary("aten.relu.default", lambda be, x: be.maximum(x, be.zeros(x.shape)),
       "max(x, 0), exact (ite)")
_unary("aten.abs.default", lambda be, x: be.maximum(x, be.scale(x, -1)), "max(x, -x), exact")
_unary("aten.sgn.default", lambda be, x: be.compare(x, be.zeros(()), "gt")
       - be.compare(x, be.zeros(()), "lt"), "sign of x (1, 0, -1), exact")
_unary("aten.sign.default", lambda be, x: be.compare(x, be.zeros(()), "gt")
       - be.compare(x, be.zeros(()), "lt"), "sign of x (1, 0, -1), exact")


def _gelu(be, ctx, x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise AttrError(f"gelu: approximate={approximate!r}")
    return be.apply_uf("uf_gelu" if approximate == "none" else "uf_gelu_tanh", x)


def _gelu_backward(be, ctx, g, x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise AttrError(f"gelu_backward: approximate={approximate!r}")
    return g * be.apply_uf("uf_gelu_grad" if approximate == "none" else "uf_gelu_tanh_grad", x)


_GELU_UFS = ("uf_gelu", "uf_gelu_grad", "uf_gelu_tanh", "uf_gelu_tanh_grad")
aten("aten.gelu.default", _gelu, broadcast_of,
     doc="gelu(x): one uninterpreted function per variant (erf: uf_gelu, tanh: uf_gelu_tanh), "
         "whose real function is torch's formula (irrational constants are not exact "
         "rationals)", abstracts=_GELU_UFS)
aten("aten.gelu_backward.default", _gelu_backward, broadcast_of,
     doc="g * gelu'(x) (uf_gelu_grad / uf_gelu_tanh_grad)", abstracts=_GELU_UFS)


def _silu_backward(be, ctx, g, x):
    sig, one = be.sigmoid(x), be.const(1)
    return g * (sig * (x * (be.scale(sig, -1) + one) + one))


aten("aten.silu_backward.default", _silu_backward, broadcast_of,
     doc="g * sig(x) * (1 + x * (1 - sig(x)))", abstracts=("uf_sigmoid",))
aten("aten.sigmoid_backward.default", lambda be, ctx, g, y: g * (y * (be.scale(y, -1)
                                                                       + be.const(1))),
     broadcast_of, doc="g * y * (1 - y), y the sigmoid OUTPUT")
aten("aten.tanh_backward.default", lambda be, ctx, g, y: g * (be.scale(y * y, -1)
                                                               + be.const(1)),
     broadcast_of, doc="g * (1 - y^2), y the tanh OUTPUT")
aten("aten.threshold_backward.default", lambda be, ctx, g, x, threshold: be.where(
    be.compare(x, arr(be, threshold), "le"), be.zeros(np.broadcast(g, x).shape), g),
     broadcast_of, doc="0 where x <= threshold, else g (relu's gradient), exact")


def _clamp(be, ctx, x, min=None, max=None):
    out = x
    if min is not None:
        out = be.maximum(out, arr(be, min))
    if max is not None:
        out = be.scale(be.maximum(be.scale(out, -1), be.scale(arr(be, max), -1)), -1)
    if not isinstance(out, np.ndarray):  # numpy gives a 0-d operand's result as a scalar
        out = np.asarray(out, dtype=object if np.asarray(x).dtype == object else None)
    return np.array(np.broadcast_to(out, x.shape)) if out.shape != x.shape else out


aten("aten.clamp.default", _clamp, broadcast_of, doc="min(max(x, min), max), exact (ite)")
aten("aten.clamp.Tensor", _clamp, broadcast_of, doc="min(max(x, min), max), exact (ite)")
aten("aten.maximum.default", lambda be, ctx, x, y: be.maximum(x, y), broadcast_of,
     doc="elementwise max, exact (ite(x >= y, x, y))")
aten("aten.minimum.default", lambda be, ctx, x, y: be.scale(be.maximum(
    be.scale(x, -1), be.scale(y, -1)), -1), broadcast_of, doc="elementwise min, exact")

# ----------------------------------------------------------------------------- comparisons

def _comparison(op: str):
    return lambda be, ctx, x, y: be.compare(x, arr(be, y), op)


for _op in ("lt", "le", "gt", "ge", "eq", "ne"):
    for _ov in ("Scalar", "Tensor"):
        aten(f"aten.{_op}.{_ov}", _comparison(_op), broadcast_of,
             doc=f"1 where x {_op} y else 0 (exact ite on the real values; token ids are "
                 "compared as the values they are, so a vocabulary-range mask is exact)")


def _truth(be, x):
    return be.compare(x, be.zeros(()), "ne")


def _and(be, a, b):
    return be.where(a, _truth(be, b), be.zeros(np.broadcast(a, b).shape))


def _or(be, a, b):
    return be.where(a, be.full(np.broadcast(a, b).shape, 1), _truth(be, b))


def _xor(be, a, b):
    return be.compare(_truth(be, a), _truth(be, b), "ne")


def _logical(f):
    return lambda be, ctx, a, b: f(be, a, b)


def _bitwise(f, what):
    """A bitwise op on bool tensors (the only dtype where it is the logical op)."""

    def fw(be, ctx, a: TensorRef, b: TensorRef):
        for r in (a, b):
            if isinstance(r, TensorRef) and not is_bool(r):
                raise AttrError(f"bitwise_{what} of a non-bool tensor is not modelled")
        return f(be, arr(be, getattr(a, "value", a)), arr(be, getattr(b, "value", b)))

    return fw


for _name, _f, _what in (("and", _and, "and"), ("or", _or, "or"), ("xor", _xor, "xor")):
    aten(f"aten.logical_{_name}.default", _logical(_f), broadcast_of, doc=f"logical {_what} of x != 0 and y != 0 (0/1)")
    aten(f"aten.bitwise_{_name}.Tensor", _bitwise(_f, _name),
         lambda c, outs, a, b: broadcast_rule(c, [getattr(r, "value", r) for r in (a, b)
                                                  if isinstance(getattr(r, "value", r), TShape)],
                                              outs[0]),
         doc=f"bitwise {_what} of bool tensors (= logical {_what}); other dtypes are refused "
             "(dtype from the tensor reference)", refs=True)
aten("aten.logical_not.default", lambda be, ctx, x: be.compare(x, be.zeros(()), "eq"),
     broadcast_of, doc="1 where x == 0 else 0")
aten("aten.bitwise_not.default", lambda be, ctx, x: _bitwise_not(be, x),
     lambda c, outs, x: broadcast_rule(c, [x.value], outs[0]),
     doc="not of a bool tensor; other dtypes are refused", refs=True)


def _bitwise_not(be, x: TensorRef):
    if not is_bool(x):
        raise AttrError("bitwise_not of a non-bool tensor is not modelled")
    return be.compare(x.value, be.zeros(()), "eq")


def _where(be, ctx, cond, x, y):
    x, y = arr(be, x), arr(be, y)
    shape = np.broadcast(cond, x, y).shape
    b = lambda v: np.array(np.broadcast_to(v, shape))
    return be.where(b(cond), b(x), b(y))


for _ov in ("self",):
    aten(f"aten.where.{_ov}", _where, broadcast_of,
         doc="x where cond != 0 else y (exact ite, broadcast)")
for _ov in ("Scalar", "Tensor"):
    aten(f"aten.masked_fill.{_ov}", lambda be, ctx, x, mask, value: _where(be, ctx, mask, value, x),
         lambda c, outs, x, mask, value: (broadcast_rule(c, tensors_of(x, mask), outs[0]),
                                          require(tuple(x.orig) == tuple(outs[0].orig),
                                                  "masked_fill changes the shape")),
         doc="value where mask != 0 else x (exact ite; value may be -inf)")

# ----------------------------------------------------------------------------- reductions


def _reduced(c, outs, x, dims, keepdim):
    """Shape rule of a reduction of x over `dims` (None/[] = all)."""
    y = outs[0]
    red = axes(dims, len(x))
    nontrivial(c, x, red)
    kept = [i for i in range(len(x)) if keepdim or i not in red]
    require(len(y) == len(kept), f"reduction of {list(x.orig)} over {list(red)} is not "
                                 f"{list(y.orig)}")
    for o, i in enumerate(kept):
        if i in red:
            c.eq(y[o], 1)
        else:
            require(y.orig[o] == x.orig[i], f"reduction: {list(x.orig)} -> {list(y.orig)}")
            c.eq(y[o], x[i])


def _sum(be, ctx, x, dim=None, keepdim=False, dtype=None):
    return sum_axes(x, axes(dim, x.ndim), bool(keepdim))


def _mean(be, ctx, x, dim=None, keepdim=False, dtype=None):
    red = axes(dim, x.ndim)
    return times(be, sum_axes(x, red, bool(keepdim)), Fraction(1, original_count(ctx, x, red)))


aten("aten.sum.dim_IntList", _sum, lambda c, outs, x, dim=None, keepdim=False, dtype=None:
     _reduced(c, outs, x, dim, keepdim), doc="sum over dim (None/[] = all), keepdim")
aten("aten.sum.default", _sum, lambda c, outs, x, dtype=None: _reduced(c, outs, x, None, False),
     doc="sum of all elements (0-d)")
aten("aten.mean.dim", _mean, lambda c, outs, x, dim=None, keepdim=False, dtype=None:
     _reduced(c, outs, x, dim, keepdim),
     doc="mean over dim, 1/N exact, N the ORIGINAL count (aten_call.original_count)")
aten("aten.mean.default", _mean, lambda c, outs, x, dtype=None: _reduced(c, outs, x, None, False),
     doc="mean of all elements (0-d), 1/N exact, N the original count")


def _max_over(be, x, red, keepdim):
    """Max over the axes `red`, exact (a chain of ite)."""
    out = x
    for a in red:
        rows = [np.take(out, i, axis=a) for i in range(out.shape[a])]
        out = np.expand_dims(reduce(be.maximum, rows), a)
    if not keepdim:
        out = out.reshape(tuple(n for i, n in enumerate(x.shape) if i not in red))
    return out


def _amax(be, ctx, x, dim=(), keepdim=False):
    return _max_over(be, x, axes(dim, x.ndim), bool(keepdim))


def _amin(be, ctx, x, dim=(), keepdim=False):
    return be.scale(_max_over(be, be.scale(x, -1), axes(dim, x.ndim), bool(keepdim)), -1)


def _max_dim(be, ctx, x, dim, keepdim=False):
    d = axis(dim, x.ndim)
    values = _max_over(be, x, (d,), True)
    n = x.shape[d]
    index = be.full(values.shape, n - 1)
    for i in reversed(range(n - 1)):  # the first position holding the max
        row = np.take(x, [i], axis=d)
        index = be.where(be.compare(row, values, "eq"), be.full(values.shape, i), index)
    if not keepdim:
        values, index = np.squeeze(values, d), np.squeeze(index, d)
    return [values, index]


def _max_dim_rule(c, outs, x, dim, keepdim=False):
    for y in outs:
        if y is not None:
            _reduced(c, [y], x, dim, keepdim)


aten("aten.amax.default", _amax, lambda c, outs, x, dim=(), keepdim=False:
     _reduced(c, outs, x, dim, keepdim), doc="max over dim, exact (ite chain)")
aten("aten.amin.default", _amin, lambda c, outs, x, dim=(), keepdim=False:
     _reduced(c, outs, x, dim, keepdim), doc="min over dim, exact (ite chain)")
aten("aten.max.dim", _max_dim, _max_dim_rule, n_outputs=2,
     doc="(max over dim, index of its first occurrence), exact (ite chains); torch leaves "
         "the index of tied maxima unspecified, this takes the first")
aten("aten.max.default", lambda be, ctx, x: _max_over(be, x, axes(None, x.ndim), False),
     lambda c, outs, x: _reduced(c, outs, x, None, False), doc="max of all elements, exact")

# ----------------------------------------------------------------------------- matrix products


def _mm_rule(c, a: TShape, b: TShape, y: TShape, batch: int):
    require(len(a) == len(b) == len(y) == batch + 2, "matrix operands of the wrong rank")
    require(a.orig[-1] == b.orig[-2], f"{list(a.orig)} @ {list(b.orig)} do not match")
    require(tuple(y.orig[-2:]) == (a.orig[-2], b.orig[-1]),
            f"output {list(y.orig)} is not {list(a.orig)} @ {list(b.orig)}")
    for i in range(batch):
        require(a.orig[i] == b.orig[i] == y.orig[i], "batch dims differ")
        c.eq(a[i], y[i])
        c.eq(b[i], y[i])
    c.eq(a[-1], b[-2])
    nontrivial(c, a, [len(a) - 1])
    c.eq(y[-2], a[-2])
    c.eq(y[-1], b[-1])


def _scaled_sum(be, self, prod, beta, alpha):
    return times(be, self, number(beta)) + times(be, prod, number(alpha))


aten("aten.mm.default", lambda be, ctx, a, b: a @ b,
     lambda c, outs, a, b: _mm_rule(c, a, b, outs[0], 0), doc="a @ b (2-d)")
aten("aten.bmm.default", lambda be, ctx, a, b: a @ b,
     lambda c, outs, a, b: _mm_rule(c, a, b, outs[0], 1), doc="batched a @ b (3-d)")


def _addmm_rule(batch):
    def rule(c, outs, self, a, b, beta=1, alpha=1):
        _mm_rule(c, a, b, outs[0], batch)
        broadcast_to(c, [self], outs[0])
    return rule


aten("aten.addmm.default", lambda be, ctx, self, a, b, beta=1, alpha=1: _scaled_sum(
    be, self, a @ b, beta, alpha), _addmm_rule(0),
     doc="beta * self + alpha * (a @ b), self broadcast (the bias of a linear layer)")
aten("aten.baddbmm.default", lambda be, ctx, self, a, b, beta=1, alpha=1: _scaled_sum(
    be, self, a @ b, beta, alpha), _addmm_rule(1),
     doc="beta * self + alpha * (a @ b) batched, self broadcast")

# ----------------------------------------------------------------------------- statistics


def _logsumexp(be, ctx, x, dim, keepdim=False):
    return be.log(sum_axes(be.exp(x), axes(dim, x.ndim), bool(keepdim)))


aten("aten.logsumexp.default", _logsumexp, lambda c, outs, x, dim, keepdim=False: _reduced(
    c, outs, x, dim, keepdim), doc="log(sum(exp(x), dim)) (no max shift: equal on reals)",
     abstracts=("uf_exp", "uf_log"))


def _variance(be, ctx, x, dim=None, correction=None, keepdim=False):
    """(var, mean) over dim with Bessel's correction (default 1), counts at their original
    value (aten_call.original_count)."""
    red = axes(dim, x.ndim)
    n = original_count(ctx, x, red)
    corr = Fraction(1) if correction is None else number(correction)
    if n - corr <= 0:
        raise AttrError(f"variance of {n} elements with correction {corr}")
    mean = times(be, sum_axes(x, red, True), Fraction(1, n))
    xc = x - mean
    var = times(be, sum_axes(xc * xc, red, bool(keepdim)), 1 / (n - corr))
    if not keepdim:
        mean = mean.reshape(var.shape)
    return var, mean


def _stat_rule(c, outs, x, dim=None, *rest, correction=None, keepdim=False):
    for y in outs:
        if y is not None:
            _reduced(c, [y], x, dim, keepdim)


aten("aten.var.correction", lambda be, ctx, x, dim=None, *, correction=None, keepdim=False:
     _variance(be, ctx, x, dim, correction, keepdim)[0], _stat_rule,
     doc="variance over dim with correction (default 1), exact")
aten("aten.var_mean.correction", lambda be, ctx, x, dim=None, *, correction=None,
     keepdim=False: list(_variance(be, ctx, x, dim, correction, keepdim)), _stat_rule,
     n_outputs=2, doc="(variance, mean) over dim, exact")
aten("aten.std.correction", lambda be, ctx, x, dim=None, *, correction=None, keepdim=False:
     be.sqrt(_variance(be, ctx, x, dim, correction, keepdim)[0]), _stat_rule,
     doc="sqrt of the variance (uf_sqrt)", abstracts=("uf_sqrt",))
_unary("aten.log1p.default", lambda be, x: be.log(x + be.const(1)), "log(1 + x) (uf_log)",
       ("uf_log",))
_unary("aten.expm1.default", lambda be, x: be.exp(x) - be.const(1), "exp(x) - 1 (uf_exp)",
       ("uf_exp",))
