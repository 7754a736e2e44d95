"""A stop-gap: the few ATen entries the capture's own tests need, registered only where the
registry has no entry of that name (the real entries are tvsmt/ops/definitions/aten*.py,
written in parallel; once they are merged these are never registered).

Same conventions as the real ones: node inputs are the tensor arguments, attrs.args /
attrs.kwargs the call with {"tensor": k} markers; pass "fw"; no backward (a joint trace
holds its backward as ATen nodes). Forward semantics are checked against torch in
tests/test_capture.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tvsmt.ops.definitions._common import broadcast_rule, nontrivial, present, require
from tvsmt.ops.definitions.layout import view_shape
from tvsmt.ops.definitions.linalg import matmul_shape
from tvsmt.ops.registry import REGISTRY, OpSpec, all_ops, register

NO_BW = "the trace contains its backward as ATen ops"


def _arg(be, ins, v: Any):
    if isinstance(v, dict) and set(v) == {"tensor"}:
        return ins[v["tensor"]]
    return v


def _args(be, ins, attrs) -> list:
    return [_arg(be, ins, v) for v in attrs.get("args", [])]


def _operand(be, v, like):
    if isinstance(v, np.ndarray):
        return v
    return be.full(np.shape(like), v)


def _binary(fn):
    def forward(be, ins, attrs, ctx):
        a = _args(be, ins, attrs)
        x, y = a[0], a[1]
        return [fn(be, _operand(be, x, y), _operand(be, y, x))]
    return forward


def _bin_shape(c, ins, outs, attrs):
    broadcast_rule(c, present(ins), outs[0])


def _t_shape(c, ins, outs, attrs):
    x, y = ins[0], outs[0]
    require(len(x) == 2 and tuple(y.orig) == tuple(x.orig[::-1]), "t: not a 2-D transpose")
    c.eq(x[0], y[1])
    c.eq(x[1], y[0])


def _sum_shape(c, ins, outs, attrs):
    require(len(outs[0]) == 0, "sum.default: the result is a scalar")
    nontrivial(c, ins[0], range(len(ins[0])))


def _same_shape(c, ins, outs, attrs):
    ts = present(list(ins) + list(outs))
    for t in ts[1:]:
        c.same(ts[0], t)


def _expand_shape(c, ins, outs, attrs):
    x, y = ins[0], outs[0]
    off = len(y) - len(x)
    require(off >= 0, "expand: the result has fewer dimensions than the input")
    for i in range(len(x)):
        if x.orig[i] == 1:
            c.eq(x[i], 1)
        else:
            require(x.orig[i] == y.orig[off + i], "expand: a non-1 dimension changes")
            c.eq(x[i], y[off + i])


def _silu_bw(be, ins, attrs, ctx):
    g, x = ins[0], ins[1]
    s = be.sigmoid(x)
    one = be.full(x.shape, 1)
    return [g * s * (one + x * (one - s))]


_ENTRIES = [
    ("aten.mm.default", lambda be, ins, attrs, ctx: [ins[0] @ ins[1]], matmul_shape, (),
     "a @ b (2-D)"),
    ("aten.t.default", lambda be, ins, attrs, ctx: [np.transpose(ins[0])], _t_shape, (),
     "2-D transpose"),
    ("aten.view.default", lambda be, ins, attrs, ctx: [ins[0].reshape(ctx.out_shapes[0])],
     view_shape, (), "reshape to the node's (reduced) output shape"),
    ("aten._unsafe_view.default", lambda be, ins, attrs, ctx: [ins[0].reshape(
        ctx.out_shapes[0])], view_shape, (), "reshape to the node's (reduced) output shape"),
    ("aten.expand.default", lambda be, ins, attrs, ctx: [np.array(np.broadcast_to(
        ins[0], ctx.out_shapes[0]))], _expand_shape, (), "broadcast to the (reduced) output"),
    ("aten.ones_like.default", lambda be, ins, attrs, ctx: [be.full(ins[0].shape, 1)],
     _same_shape, (), "ones of x's shape"),
    ("aten.sum.default", lambda be, ins, attrs, ctx: [np.array(np.sum(ins[0]))], _sum_shape,
     (), "sum of every element"),
    ("aten.mul.Tensor", _binary(lambda be, x, y: x * y), _bin_shape, (), "x * y (broadcast)"),
    ("aten.add.Tensor", _binary(lambda be, x, y: x + y), _bin_shape, (), "x + y (broadcast; "
     "alpha unsupported)"),
    ("aten.silu.default", lambda be, ins, attrs, ctx: [ins[0] * be.sigmoid(ins[0])],
     _same_shape, ("uf_sigmoid",), "x * sigmoid(x)"),
    ("aten.silu_backward.default", _silu_bw, _same_shape, ("uf_sigmoid",),
     "g * s * (1 + x (1 - s)), s = sigmoid(x)"),
]


def register_missing() -> list[str]:
    """Register the entries the registry lacks; returns their names."""
    all_ops()
    added = []
    for name, fw, shape, abstracts, doc in _ENTRIES:
        if name not in REGISTRY:
            register(OpSpec(name, fw, shape, doc=doc + " (capture fallback)",
                            abstracts=abstracts, no_backward=NO_BW))
            added.append(name)
    return added
