"""Linear algebra operators: linear, matmul."""

from __future__ import annotations

import numpy as np

from tvsmt.ops.registry import OpSpec, register


def _sum_to_leading(x: np.ndarray, ndim: int) -> np.ndarray:
    """Sum the leading (batch) axes of x away so that it keeps its last `ndim` axes."""
    lead = x.ndim - ndim
    return np.sum(x, axis=tuple(range(lead))) if lead > 0 else x


def linear_fw(be, ins, attrs, ctx):
    x, w = ins[0], ins[1]
    y = x @ w.T
    if len(ins) > 2 and ins[2] is not None:
        y = y + ins[2]
    return [y]


def linear_bw(be, ins, attrs, ctx):
    g, x, w = ins[0], ins[1], ins[2]
    gx = g @ w
    # g: (..., N), x: (..., K) -> sum over batch of g^T x: (N, K)
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    gw = g2.T @ x2
    outs = [gx, gw]
    if len(ins) > 3 and ins[3] is not None:
        outs.append(_sum_to_leading(g, 1))
    return outs


def linear_shape(c, ins, outs, attrs):
    x, w = ins[0], ins[1]
    (y,) = outs[:1]
    c.eq(x[-1], w[1])
    c.eq(len(y), len(x))
    for a, b in zip(y.dims[:-1], x.dims[:-1]):
        c.eq(a, b)
    c.eq(y[-1], w[0])
    if len(ins) > 2 and ins[2] is not None:
        c.eq(ins[2][-1], w[0])


register(OpSpec("linear", linear_fw, linear_shape, linear_bw,
                doc="y = x @ w.T (+ b); bw in [g, x, w(, b)] out [g_x, g_w(, g_b)]"))
