"""Shape rules of the operator registry, checked with z3: the constraints a rule adds must
force the relations between reduced dims that the operator needs."""

from __future__ import annotations

import pytest
import z3

from tvsmt.ops import ShapeConstraints, ShapeRuleError, TShape, all_ops
from tvsmt.ops.definitions.layout import view_groups
from tvsmt.ops.registry import shape_rule

_counter = iter(range(10**9))


def ts(*orig: int) -> TShape:
    """A tensor with fresh solver dims and the given original sizes."""
    k = next(_counter)
    return TShape([z3.Int(f"d{k}_{i}") for i in range(len(orig))], tuple(orig))


def apply(op, ins, outs, attrs=None, backward=False) -> ShapeConstraints:
    c = ShapeConstraints()
    shape_rule(all_ops()[op], backward)(c, ins, outs, attrs or {})
    return c


def implied(c: ShapeConstraints, claim, tensors=()) -> bool:
    """`claim` holds in every solution of the constraints (dims >= 1)."""
    s = z3.Solver()
    s.add(*c.constraints)
    for t in tensors:
        if t is not None:
            s.add(*[d >= 1 for d in t.dims])
    s.add(z3.Not(claim))
    return s.check() == z3.unsat


def test_linear_forces_contracted_dims_equal():
    x, w, y = ts(4, 8, 16), ts(32, 16), ts(4, 8, 32)
    c = apply("linear", [x, w], [y])
    tensors = (x, w, y)
    assert implied(c, x[2] == w[1], tensors)
    assert implied(c, z3.And(y[0] == x[0], y[1] == x[1], y[2] == w[0]), tensors)
    assert implied(c, w[1] >= 2, tensors)  # contraction kept non-trivial
    assert not implied(c, x[0] == w[0], tensors)


def test_linear_rejects_inconsistent_original_shapes():
    with pytest.raises(ShapeRuleError, match="linear"):
        apply("linear", [ts(4, 8, 16), ts(32, 15)], [ts(4, 8, 32)])


def test_chunk_and_all_gather_scale_the_split_axis():
    x, y = ts(4, 8), ts(4, 4)
    c = apply("chunk", [x], [y], {"dim": 1, "ranks": [0, 1], "idx": 1})
    assert implied(c, z3.And(x[1] == 2 * y[1], x[0] == y[0]), (x, y))

    a, b, out = ts(4, 4), ts(4, 4), ts(4, 8)
    c = apply("all_gather", [a, b], [out], {"dim": -1, "ranks": [2, 3]})
    assert implied(c, z3.And(out[1] == 2 * a[1], a[1] == b[1], out[0] == a[0]), (a, b, out))

    with pytest.raises(ShapeRuleError):
        apply("chunk", [ts(4, 7)], [ts(4, 3)], {"dim": 1, "ranks": [0, 1], "idx": 0})


def test_all_to_all_scales_both_axes():
    a, b, out = ts(4, 6), ts(4, 6), ts(8, 3)
    c = apply("all_to_all", [a, b], [out], {"dim": 0, "split_dim": 1, "ranks": [0, 1], "idx": 0})
    assert implied(c, z3.And(out[0] == 2 * a[0], a[1] == 2 * out[1]), (a, b, out))


def test_view_groups_dims_by_original_shapes():
    assert view_groups((8, 16, 4096), (8, 16, 32, 128)) == [([0], [0]), ([1], [1]),
                                                             ([2], [2, 3])]
    assert view_groups((8, 16, 1), (8, 16)) == [([0], [0]), ([1], [1])]
    assert view_groups((6, 4), (2, 12)) == [([0, 1], [0, 1])]

    x, y = ts(8, 16, 4096), ts(8, 16, 32, 128)
    c = apply("view", [x], [y], {"size": [8, 16, 32, 128]})
    tensors = (x, y)
    assert implied(c, z3.And(x[0] == y[0], x[1] == y[1], x[2] == y[2] * y[3]), tensors)
    assert not implied(c, y[2] == 32, tensors)

    x, y = ts(8, 16, 1), ts(8, 16)
    c = apply("view", [x], [y])
    assert implied(c, z3.And(x[2] == 1, x[0] == y[0], x[1] == y[1]), (x, y))

    with pytest.raises(ShapeRuleError, match="element counts"):
        apply("view", [ts(8, 16)], [ts(8, 15)])


def test_broadcast_dims_of_size_one_stay_one():
    x, y, out = ts(4, 8, 16), ts(4, 8, 1), ts(4, 8, 16)
    c = apply("mul", [x, y], [out])
    assert implied(c, z3.And(y[2] == 1, y[0] == x[0], out[2] == x[2]), (x, y, out))

    w = ts(16)
    c = apply("mul", [x, w], [out])
    assert implied(c, w[0] == x[2], (x, w, out))

    with pytest.raises(ShapeRuleError, match="broadcast"):
        apply("add", [ts(4, 8), ts(4, 3)], [ts(4, 8)])


def test_mean_keeps_reduced_axis_and_drops_it_to_one():
    x, y = ts(4, 8, 16), ts(4, 8, 1)
    c = apply("mean", [x], [y], {"dim": [2], "keepdim": True})
    assert implied(c, z3.And(y[2] == 1, y[1] == x[1], x[2] >= 2), (x, y))

    with pytest.raises(ShapeRuleError):
        apply("mean", [ts(4, 8, 16)], [ts(4, 8)], {"dim": [2], "keepdim": True})


def test_derived_backward_rule():
    """linear bw [g, x, w] -> [g_x, g_w]: the forward rule on the mirrors, grads take the
    mirrors' shapes."""
    g, x, w, gx, gw = ts(4, 32), ts(4, 16), ts(32, 16), ts(4, 16), ts(32, 16)
    c = apply("linear", [g, x, w], [gx, gw], backward=True)
    tensors = (g, x, w, gx, gw)
    assert implied(c, z3.And(g[1] == w[0], g[0] == x[0], x[1] == w[1]), tensors)
    assert implied(c, z3.And(gx[0] == x[0], gx[1] == x[1], gw[0] == w[0], gw[1] == w[1]),
                   tensors)


def test_backward_rules_with_null_slots_and_without_mirrors():
    # apply_rotary_emb: two gradient inputs, the angles get no gradient (null output)
    gq, gk, xq, xk, f = ts(2, 8, 4, 16), ts(2, 8, 2, 16), ts(2, 8, 4, 16), ts(2, 8, 2, 16), ts(8, 8)
    oq, ok = ts(2, 8, 4, 16), ts(2, 8, 2, 16)
    c = apply("apply_rotary_emb", [gq, gk, xq, xk, f], [oq, ok, None], backward=True)
    tensors = (gq, gk, xq, xk, f, oq, ok)
    assert implied(c, z3.And(xq[3] == 2 * f[1], xk[1] == f[0], gq[2] == xq[2], ok[2] == xk[2]),
                   tensors)
    assert not implied(c, xq[2] == xk[2], tensors)  # GQA: head counts are independent

    # multiref bw: only the gradients of the used copies, no mirror
    g1, g2, out = ts(4, 8), ts(4, 8), ts(4, 8)
    c = apply("multiref", [g1, g2], [out], backward=True)
    assert implied(c, z3.And(g1[0] == out[0], g2[1] == out[1]), (g1, g2, out))

    g, out = ts(4, 8), ts(4, 8)
    c = apply("identity", [g], [out], backward=True)
    assert implied(c, z3.And(g[0] == out[0], g[1] == out[1]), (g, out))


def test_embedding_and_mask_rules():
    tok, w, y = ts(4, 16), ts(100, 8), ts(4, 16, 8)
    c = apply("embedding", [tok, w], [y], {"start": 0, "stop": 100})
    assert implied(c, z3.And(y[1] == tok[1], y[2] == w[1]), (tok, w, y))
    with pytest.raises(ShapeRuleError, match="range"):
        apply("embedding", [tok, w], [y], {"start": 0, "stop": 200})

    tok, h, m = ts(4, 16), ts(4, 16, 8), ts(1, 1, 16, 16)
    c = apply("create_mask", [tok, h], [m])
    assert implied(c, z3.And(m[0] == 1, m[2] == tok[1], m[3] == tok[1]), (tok, h, m))

    x, out = ts(4, 2, 16, 16), ts(4, 2, 16, 16)
    c = apply("apply_mask", [x, m], [out])
    assert implied(c, z3.And(m[1] == 1, m[3] == x[3]), (x, m, out))
