"""Elementwise arithmetic: add, sub, mul, div (broadcast binary ops), pow, rsqrt.

Binary ops take two tensors (broadcast like torch), or one tensor and a constant
`attrs.consts[0]`, which is always the second operand (`x op c`). Their backward inputs are
`[g, x, y]` (outputs `[g_x, g_y]`, each reduced to its operand's shape) or `[g, x]` in the
constant form (output `[g_x]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from tvsmt.ops.backend import exact
from tvsmt.ops.definitions._common import (broadcast_rule, const_attr, present, times,
                                           unary, unbroadcast)
from tvsmt.ops.registry import AttrError, OpSpec, register


def _alpha(attrs) -> Fraction:
    alpha = attrs.get("alpha")
    try:
        return Fraction(1) if alpha is None else exact(alpha)
    except ValueError as e:
        raise AttrError(f"alpha: {e}") from None


@dataclass(frozen=True)
class Binary:
    """The four pieces of a binary op; `c` is the exact constant operand."""

    tensor_fw: Callable  # (be, x, y, attrs) -> out
    const_fw: Callable  # (be, x, c, attrs) -> out
    tensor_bw: Callable  # (be, g, x, y, attrs) -> (g_x, g_y) before unbroadcast
    const_bw: Callable  # (be, g, x, c, attrs) -> g_x


def _is_const_form(tensors) -> bool:
    return len(present(tensors)) == 1


def binary_shape(c, ins, outs, attrs):
    broadcast_rule(c, present(ins), outs[0])


def register_binary(name: str, op: Binary, doc: str, **facts) -> OpSpec:
    def forward(be, ins, attrs, ctx):
        if _is_const_form(ins):
            return [op.const_fw(be, ins[0], const_attr(attrs), attrs)]
        return [op.tensor_fw(be, ins[0], ins[1], attrs)]

    def backward(be, ins, attrs, ctx):
        g, xs = ins[0], ins[1:]
        if _is_const_form(xs):
            return [unbroadcast(op.const_bw(be, g, xs[0], const_attr(attrs), attrs), xs[0].shape)]
        x, y = xs[0], xs[1]
        gx, gy = op.tensor_bw(be, g, x, y, attrs)
        return [unbroadcast(gx, x.shape), unbroadcast(gy, y.shape)]

    return register(OpSpec(name, forward, binary_shape, backward, doc=doc, **facts))


register_binary("add", Binary(
    tensor_fw=lambda be, x, y, a: x + times(be, y, _alpha(a)),
    const_fw=lambda be, x, c, a: x + be.const(c * _alpha(a)),
    tensor_bw=lambda be, g, x, y, a: (g, times(be, g, _alpha(a))),
    const_bw=lambda be, g, x, c, a: g),
    doc="x + alpha*y (alpha defaults to 1) or x + alpha*c")

register_binary("sub", Binary(
    tensor_fw=lambda be, x, y, a: x - times(be, y, _alpha(a)),
    const_fw=lambda be, x, c, a: x + be.const(-c * _alpha(a)),
    tensor_bw=lambda be, g, x, y, a: (g, be.scale(g, -_alpha(a))),
    const_bw=lambda be, g, x, c, a: g),
    doc="x - alpha*y (alpha defaults to 1) or x - alpha*c")

register_binary("mul", Binary(
    tensor_fw=lambda be, x, y, a: x * y,
    const_fw=lambda be, x, c, a: times(be, x, c),
    tensor_bw=lambda be, g, x, y, a: (g * y, g * x),
    const_bw=lambda be, g, x, c, a: times(be, g, c)),
    doc="x * y or x * c", reads_mirrors=True)


def _no_rounding(attrs) -> None:
    if attrs.get("rounding_mode") is not None:
        raise AttrError(f"div: rounding_mode={attrs['rounding_mode']!r} is not supported")


def _div_tensor_fw(be, x, y, attrs):
    _no_rounding(attrs)
    return be.div(x, y)


def _reciprocal(c: Fraction) -> Fraction:
    if c == 0:
        raise AttrError("div: division by the constant 0")
    return 1 / c


def _div_const_fw(be, x, c, attrs):
    _no_rounding(attrs)
    return times(be, x, _reciprocal(c))


register_binary("div", Binary(
    tensor_fw=_div_tensor_fw,
    const_fw=_div_const_fw,
    tensor_bw=lambda be, g, x, y, a: (be.div(g, y), be.scale(be.div(g * x, y * y), -1)),
    const_bw=lambda be, g, x, c, a: times(be, g, _reciprocal(c))),
    doc="x / y (be.div) or x / c (exact 1/c); rounding_mode must be null",
    abstracts=("uf_recip",))


def power(be, x, p: Fraction):
    """x ** p: repeated multiplication for an integer p >= 0, else the backend's powc."""
    if p.denominator == 1 and p >= 0:
        return be.ipow(x, int(p))
    return be.powc(x, p)


def _pow_grad(be, x, attrs):
    p = const_attr(attrs)
    if p == 0:
        return be.zeros(x.shape)
    return times(be, power(be, x, p - 1), p)


unary("pow", lambda be, x, a: power(be, x, const_attr(a)), _pow_grad,
      doc="x ** p, p = attrs.consts[0] (ipow for integer p >= 0, else powc); "
          "bw [g, x] -> [g * p * x**(p-1)]", abstracts=("uf_pow",))

unary("rsqrt", lambda be, x, a: be.rsqrt(x),
      lambda be, x, a: be.scale(be.ipow(be.rsqrt(x), 3), Fraction(-1, 2)),
      doc="1 / sqrt(x) (be.rsqrt); bw [g, x] -> [g * -1/2 * rsqrt(x)**3]",
      abstracts=("uf_rsqrt",))
