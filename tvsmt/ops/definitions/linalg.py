"""Linear algebra operators: linear, matmul."""

from __future__ import annotations

import numpy as np

from tvsmt.ops.definitions._common import (broadcast_rule, nontrivial, require, unbroadcast)
from tvsmt.ops.registry import AttrError, OpSpec, TShape, register


def _t(x: np.ndarray) -> np.ndarray:
    """Transpose of the last two axes."""
    return np.swapaxes(x, -1, -2)


def _no_bias_attr(attrs) -> None:
    if attrs.get("bias") not in (None, False):
        raise AttrError("linear: attrs.bias must be null (a bias is the third tensor input)")


def linear_fw(be, ins, attrs, ctx):
    _no_bias_attr(attrs)
    x, w = ins[0], ins[1]
    y = x @ w.T
    if len(ins) > 2 and ins[2] is not None:
        y = y + ins[2]
    return [y]


def linear_bw(be, ins, attrs, ctx):
    _no_bias_attr(attrs)
    g, x, w = ins[0], ins[1], ins[2]
    gx = g @ w
    # g: (..., N), x: (..., K) -> sum over the batch of g^T x: (N, K)
    gw = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    outs = [gx, gw]
    if len(ins) > 3 and ins[3] is not None:
        outs.append(unbroadcast(g, ins[3].shape))
    return outs


def linear_shape(c, ins, outs, attrs):
    x, w = ins[0], ins[1]
    y = outs[0]
    require(len(w) == 2 and len(y) == len(x), "linear: w must be 2-D and y have x's rank")
    require(x.orig[-1] == w.orig[1], f"linear: x {list(x.orig)} does not match w {list(w.orig)}")
    require(tuple(y.orig) == tuple(x.orig[:-1]) + (w.orig[0],),
            f"linear: output {list(y.orig)} is not x {list(x.orig)} @ w^T {list(w.orig)}")
    c.eq(x[-1], w[1])
    nontrivial(c, w, [1])
    for a, b in zip(y.dims[:-1], x.dims[:-1]):
        c.eq(a, b)
    c.eq(y[-1], w[0])
    if len(ins) > 2 and ins[2] is not None:
        require(ins[2].orig[-1] == w.orig[0], "linear: bias does not match w")
        c.eq(ins[2][-1], w[0])


register(OpSpec("linear", linear_fw, linear_shape, linear_bw,
                doc="y = x @ w.T (+ b); bw in [g, x, w(, b)] out [g_x, g_w(, g_b)]",
                reads_mirrors=True))


def matmul_fw(be, ins, attrs, ctx):
    return [ins[0] @ ins[1]]


def matmul_bw(be, ins, attrs, ctx):
    g, a, b = ins[0], ins[1], ins[2]
    return [unbroadcast(g @ _t(b), a.shape), unbroadcast(_t(a) @ g, b.shape)]


def _batch(t: TShape) -> TShape:
    return TShape(t.dims[:-2], tuple(t.orig[:-2]))


def matmul_shape(c, ins, outs, attrs):
    a, b, y = ins[0], ins[1], outs[0]
    require(len(a) >= 2 and len(b) >= 2, "matmul: operands must be at least 2-D")
    require(a.orig[-1] == b.orig[-2], f"matmul: {list(a.orig)} @ {list(b.orig)} do not match")
    require(tuple(y.orig[-2:]) == (a.orig[-2], b.orig[-1]),
            f"matmul: output {list(y.orig)} is not {list(a.orig)} @ {list(b.orig)}")
    broadcast_rule(c, [_batch(a), _batch(b)], _batch(y))
    c.eq(a[-1], b[-2])
    nontrivial(c, a, [len(a) - 1])
    c.eq(y[-2], a[-2])
    c.eq(y[-1], b[-1])


register(OpSpec("matmul", matmul_fw, matmul_shape, matmul_bw,
                doc="y = a @ b (batched, batch dims broadcast like torch; operands >= 2-D); "
                    "bw in [g, a, b] out [g @ b^T, a^T @ g], each reduced to its operand's "
                    "shape", reads_mirrors=True))
