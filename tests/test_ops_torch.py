"""Every registered operator against PyTorch (float64): forward values and the backward rule
against `torch.autograd.grad` (vector-Jacobian product), all with `NumericBackend`; then the
same semantic functions under `SymbolicBackend`, evaluated on the same values, must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import z3
from op_contracts import assert_declared_abstractions, assert_inputs_kept, assert_same_terms
from pysmt.shortcuts import Symbol
from pysmt.typing import REAL

from tvsmt.ops import NodeCtx, NumericBackend, ShapeConstraints, SymbolicBackend, TShape, all_ops
from tvsmt.ops.registry import shape_rule

NB = NumericBackend()
RNG = np.random.default_rng(1234)


def rand(*shape, low=-2.0, high=2.0):
    return RNG.uniform(low, high, size=shape)


def pos(*shape):
    return rand(*shape, low=0.5, high=2.0)


def ids(shape, vocab):
    return RNG.integers(0, vocab, size=shape).astype(np.int64)


@dataclass
class Case:
    op: str
    inputs: list
    torch_fn: Callable  # list of torch tensors -> list of torch tensors
    attrs: dict = field(default_factory=dict)
    grad: list | None = None  # which inputs get a gradient (default: every float input)
    mirrors: bool = True  # bw inputs are grads + forward inputs (else grads only)
    bw_attrs: dict | None = None  # default: the forward attrs (the plans copy them)
    ctx: NodeCtx = NodeCtx()
    bw_ctx: NodeCtx = NodeCtx()
    label: str = ""

    @property
    def id(self):
        return f"{self.op}-{self.label}" if self.label else self.op

    def grads(self):
        if self.grad is not None:
            return self.grad
        return [np.issubdtype(x.dtype, np.floating) for x in self.inputs]


def one(fn):
    """torch function with one output -> list."""
    return lambda ts: [fn(*ts)]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype an attribute names ("torch.float32")."""
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype), name
    return dtype


def rotary_ref(x, f):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.polar(torch.ones_like(f), f)[None, :, None, :]).flatten(-2)


def vocab_ref(start, stop):
    """torch reference of a vocabulary-parallel embedding shard holding rows [start, stop)."""
    def fn(i, w):
        inside = (i >= start) & (i < stop)
        return F.embedding((i - start).clamp(0, stop - start - 1), w) * inside[..., None]
    return one(fn)


def piece(x, n, idx, dim):
    return torch.chunk(x, n, dim)[idx]


MASK = np.triu(np.full((4, 4), -np.inf), 1)[None, None]

CASES = [
    Case("linear", [rand(2, 3, 4), rand(5, 4)], one(F.linear)),
    Case("linear", [rand(2, 3, 4), rand(5, 4), rand(5)], one(F.linear), label="bias"),
    Case("matmul", [rand(2, 3, 4, 5), rand(2, 3, 5, 2)], one(torch.matmul)),
    Case("matmul", [rand(2, 1, 3, 4), rand(3, 4, 2)], one(torch.matmul), label="broadcast"),
    Case("embedding", [ids((2, 3), 6), rand(6, 4)], one(F.embedding)),
    Case("embedding", [ids((2, 5), 8), rand(4, 3)], vocab_ref(4, 8), {"start": 4, "stop": 8},
         label="vocab-parallel"),
    # reduced shapes: full vocabulary 16 -> 4, this shard's rows [8, 16) -> 2 rows = [2, 4)
    Case("embedding", [ids((2, 5), 4), rand(2, 3)], vocab_ref(2, 4), {"start": 8, "stop": 16},
         ctx=NodeCtx(orig_in=((2, 5), (8, 3))), bw_ctx=NodeCtx(orig_in=((2, 5, 3), (2, 5), (8, 3))),
         label="vocab-parallel-reduced"),
    Case("create_mask", [ids((2, 4), 9), rand(2, 4, 3)],
         lambda ts: [torch.full((4, 4), -math.inf, dtype=torch.float64).triu(1)[None, None]],
         ctx=NodeCtx(out_shapes=((1, 1, 4, 4),))),
    Case("create_mask", [ids((2, 3), 9), rand(2, 3, 3)],
         lambda ts: [torch.full((3, 3), -math.inf, dtype=torch.float64).triu(1)[None, None]],
         label="no-ctx"),
    Case("apply_mask", [rand(2, 2, 4, 4), MASK], one(torch.add), grad=[True, False]),
    Case("apply_rotary_emb", [rand(2, 3, 2, 4), rand(2, 3, 1, 4), rand(3, 2, low=-3, high=3)],
         lambda ts: [rotary_ref(ts[0], ts[2]), rotary_ref(ts[1], ts[2])],
         grad=[True, True, False]),
    Case("multiref", [rand(2, 3)], lambda ts: [ts[0] * 1.0 for _ in range(3)], {"times": 3},
         mirrors=False, bw_attrs={}),
    Case("identity", [rand(2, 3)], one(lambda x: x * 1.0), mirrors=False),
    # casts: torch's own operators with the dtype the attrs name (a real-valued model makes
    # them identities; float32 rounding stays within the comparison tolerance)
    Case("float", [rand(2, 3)], one(lambda x: x.float())),
    Case("to", [rand(2, 3)], one(lambda x: x.to(torch_dtype("torch.float32"))),
         {"dtype_or_device": "torch.float32"}),
    Case("contiguous", [rand(2, 3)], one(lambda x: x.contiguous())),
    Case("pow", [rand(2, 3)], one(lambda x: x ** 2), {"consts": [2]}),
    Case("pow", [rand(2, 3)], one(lambda x: x ** 3), {"consts": [3.0]}, label="cube"),
    Case("pow", [pos(2, 3)], one(lambda x: x ** 1.5), {"consts": [1.5]}, label="real"),
    Case("pow", [pos(2, 3)], one(lambda x: x ** -1), {"consts": [-1]}, label="negative"),
    Case("mean", [rand(2, 3, 4)], one(lambda x: x.mean(dim=[2], keepdim=True)),
         {"dim": [2], "keepdim": True}),
    Case("mean", [rand(2, 3, 4)], one(lambda x: x.mean(dim=-2)), {"dim": -2}, label="drop"),
    Case("rsqrt", [pos(2, 3)], one(torch.rsqrt)),
    Case("add", [rand(2, 3, 4), rand(2, 3, 4)], one(torch.add), {"alpha": 1}),
    Case("add", [rand(3, 1), rand(2, 1, 4)], one(lambda x, y: torch.add(x, y, alpha=2.5)),
         {"alpha": 2.5}, label="broadcast-alpha"),
    Case("add", [rand(2, 3, 1)], one(lambda x: x + 1e-05), {"alpha": 1, "consts": [1e-05]},
         label="const"),
    Case("sub", [rand(2, 3, 4), rand(4)], one(torch.sub), label="broadcast"),
    Case("sub", [rand(2, 3)], one(lambda x: x - 0.25), {"consts": [0.25]}, label="const"),
    Case("mul", [rand(2, 3, 4), rand(2, 3, 1)], one(torch.mul)),
    Case("mul", [rand(4), rand(2, 3, 4)], one(torch.mul), label="broadcast-first"),
    Case("mul", [rand(2, 3)], one(lambda x: x * 3), {"consts": [3]}, label="const"),
    Case("div", [rand(2, 3, 4)], one(lambda x: x / 11.313708498984761),
         {"rounding_mode": None, "consts": [11.313708498984761]}, label="const"),
    Case("div", [rand(2, 3, 4), pos(3, 1)], one(torch.div), label="tensor"),
    Case("softmax", [rand(2, 3, 4)], one(lambda x: torch.softmax(x, -1)), {"dim": -1}),
    Case("softmax", [rand(2, 3, 4)], one(lambda x: torch.softmax(x, 1)), {"dim": 1}, label="dim1"),
    Case("silu", [rand(2, 3, 4)], one(F.silu), {"inplace": False}),
    Case("sum", [rand(2, 3, 4)], one(lambda x: x.sum().reshape(1))),
    Case("sum", [rand(2, 3, 4)], one(lambda x: x.sum(dim=[1], keepdim=True)),
         {"dim": [1], "keepdim": True}, label="dim"),
    Case("transpose", [rand(2, 3, 4, 5)], one(lambda x: x.transpose(1, 2)),
         {"dim0": 1, "dim1": 2}),
    Case("view", [rand(2, 3, 4)], one(lambda x: x.view(2, 3, 2, 2)), {"size": [2, 3, 2, 2]},
         ctx=NodeCtx(out_shapes=((2, 3, 2, 2),))),
    Case("view", [rand(2, 3, 2, 2)], one(lambda x: x.view(2, 3, -1)), {"size": [2, 3, -1]},
         label="attrs-size"),
    # communication / finalization (forward only)
    Case("all_reduce", [rand(2, 3), rand(2, 3), rand(2, 3)], one(lambda *xs: sum(xs)),
         {"ranks": [0, 1, 2]}),
    Case("all_reduce_avg", [rand(2, 3), rand(2, 3), rand(2, 3)],
         one(lambda *xs: sum(xs) / 3), {"ranks": [0, 1, 2]}),
    # a 0-d loss averaged over three ranks or more (numpy adds 0-d arrays into a bare term)
    Case("all_reduce_avg", [rand(), rand(), rand(), rand()],
         one(lambda *xs: sum(xs) / 4), {"ranks": [0, 1, 2, 3]}, label="0-d"),
    Case("all_reduce", [rand(), rand(), rand()], one(lambda *xs: sum(xs)),
         {"ranks": [0, 1, 2]}, label="0-d"),
    Case("all_reduce_max", [rand(2, 3), rand(2, 3), rand(2, 3)],
         one(lambda *xs: torch.stack(xs).amax(0)), {"ranks": [0, 1, 2]}),
    Case("reduce_scatter_avg", [rand(4, 3), rand(4, 3)],
         one(lambda a, b: piece((a + b) / 2, 2, 1, 0)), {"dim": 0, "ranks": [0, 1], "idx": 1}),
    Case("reducer", [rand(2, 3), rand(2, 3)], one(torch.add)),
    Case("grad_accum", [rand(2, 3), rand(2, 3)], one(torch.add)),
    Case("all_gather", [rand(2, 3), rand(2, 3)], one(lambda *xs: torch.cat(xs, 1)),
         {"dim": 1, "ranks": [2, 3]}),
    Case("chunk", [rand(2, 6)], one(lambda x: piece(x, 3, 1, 1)),
         {"dim": 1, "ranks": [0, 1, 2], "idx": 1}),
    Case("reduce_scatter", [rand(4, 3), rand(4, 3)], one(lambda a, b: piece(a + b, 2, 1, 0)),
         {"dim": 0, "ranks": [0, 1], "idx": 1}),
    Case("all_to_all", [rand(2, 4), rand(2, 4)],
         one(lambda *xs: torch.cat([piece(x, 2, 1, 1) for x in xs], 0)),
         {"dim": 0, "split_dim": 1, "ranks": [0, 1], "idx": 1}),
    Case("all_to_all", [rand(4, 3), rand(4, 3)],
         one(lambda *xs: torch.cat([piece(x, 2, 0, 0) for x in xs], 0)),
         {"dim": 0, "ranks": [0, 1], "idx": 0}, label="same-dim"),
    Case("broadcast", [rand(2, 3)], one(lambda x: x), {"src": 0, "ranks": [0, 1]}),
    Case("broadcast", [rand(2, 3), rand(2, 3)], one(lambda a, b: b), {"src": 5, "ranks": [3, 5]},
         label="src"),
    Case("move", [rand(2, 3)], one(lambda x: x), {"src": 0, "dst": 2}),
]


def to_torch(x, requires_grad=False):
    t = torch.from_numpy(np.array(x))
    return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t


def assert_close(actual, expected):
    assert actual.shape == tuple(expected.shape), (actual.shape, tuple(expected.shape))
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=1e-5,
                               atol=1e-5)


def backward_inputs(case, grads_out):
    return list(grads_out) + (list(case.inputs) if case.mirrors else [])


def bw_attrs(case):
    return case.attrs if case.bw_attrs is None else case.bw_attrs


def random_grads(outs):
    return [rand(*np.shape(y)) for y in outs]


# ----------------------------------------------------------------------------- coverage


def test_every_operator_has_a_torch_case():
    from test_ops_moe import TESTED_OPS as MOE_OPS  # MoE ops: their own references there

    tested = {c.op for c in CASES} | MOE_OPS
    # the ATen entries of the PyTorch capture are checked on traced graphs in test_ops_aten.py
    missing = sorted(op for op in set(all_ops()) - tested if not op.startswith("aten."))
    assert not missing, f"operators without a torch test case: {missing}"
    for name, spec in all_ops().items():
        assert spec.doc, f"{name} has no doc"
        if spec.communication:
            assert spec.backward is None, f"{name}: communication ops have no backward"


# ----------------------------------------------------------------------------- numeric vs torch


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_matches_torch(case):
    spec = all_ops()[case.op]
    outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    expected = case.torch_fn([to_torch(x) for x in case.inputs])
    assert len(outs) == len(expected)
    for y, e in zip(outs, expected):
        assert_close(y, e.detach().numpy())


BW_CASES = [c for c in CASES if all_ops()[c.op].backward is not None]


@pytest.mark.parametrize("case", BW_CASES, ids=lambda c: c.id)
def test_backward_matches_autograd(case):
    spec = all_ops()[case.op]
    mask = case.grads()
    ts = [to_torch(x, g) for x, g in zip(case.inputs, mask)]
    outs = case.torch_fn(ts)
    gs = random_grads([o.detach().numpy() for o in outs])
    wrt = [t for t, g in zip(ts, mask) if g]
    expected = iter(torch.autograd.grad(outs, wrt,
                                        grad_outputs=[to_torch(g).to(o.dtype)
                                                      for g, o in zip(gs, outs)],
                                        allow_unused=True))
    got = spec.backward(NB, backward_inputs(case, gs), bw_attrs(case), case.bw_ctx)
    assert len(got) == len(case.inputs)
    for x, g, needs in zip(case.inputs, got, mask):
        if not needs:
            assert g is None
            continue
        e = next(expected)
        assert_close(g, np.zeros(x.shape) if e is None else e.numpy())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_shape_only_is_said_by_exactly_the_operators_that_ignore_their_inputs_values(case):
    """The registry's `shape_only` (outputs depend on the inputs' shapes alone): its forward
    gives the same outputs for other values of the same shapes, and every other operator's
    does not (float inputs moved up by random amounts, staying in their operator's domain;
    integer ones shuffled)."""
    spec = all_ops()[case.op]
    rng = np.random.default_rng(7)
    other = [x + rng.uniform(0.1, 0.5, x.shape) if np.issubdtype(x.dtype, np.floating)
             else rng.permutation(x.ravel()).reshape(x.shape)
             for x in map(np.asarray, case.inputs)]
    first = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    again = spec.forward(NB, other, case.attrs, case.ctx)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again))
    assert same == spec.shape_only, f"{case.op}: shape_only={spec.shape_only}, same={same}"


def test_multiref_backward_sums_only_the_listed_gradients():
    spec = all_ops()["multiref"]
    g1, g2 = rand(2, 3), rand(2, 3)
    (out,) = spec.backward(NB, [g1, None, g2], {}, NodeCtx())
    assert_close(out, g1 + g2)
    assert spec.n_outputs({}, 2) == 2 and spec.n_outputs({"times": 3}, 1) == 3


def test_mask_then_softmax_matches_torch_with_minus_infinity():
    """create_mask -> apply_mask -> softmax, forward and backward, against torch."""
    ops = all_ops()
    tokens, x = ids((2, 4), 9), rand(2, 3, 4, 4)
    (mask,) = ops["create_mask"].forward(NB, [tokens, x], {}, NodeCtx(out_shapes=((1, 1, 4, 4),)))
    (masked,) = ops["apply_mask"].forward(NB, [x, mask], {}, NodeCtx())
    (probs,) = ops["softmax"].forward(NB, [masked], {"dim": -1}, NodeCtx())
    g = rand(*probs.shape)
    (g_masked,) = ops["softmax"].backward(NB, [g, masked], {"dim": -1}, NodeCtx())
    g_x, g_mask = ops["apply_mask"].backward(NB, [g_masked, x, mask], {}, NodeCtx())

    xt = to_torch(x, True)
    tmask = torch.full((4, 4), -math.inf, dtype=torch.float64).triu(1)[None, None]
    pt = torch.softmax(xt + tmask, -1)
    (gt,) = torch.autograd.grad(pt, [xt], grad_outputs=[to_torch(g)])
    assert np.isneginf(mask[0, 0, 0, 1]) and mask[0, 0, 1, 0] == 0
    assert_close(probs, pt.detach().numpy())
    assert np.all(probs[..., 0, 1:] == 0)
    assert_close(g_x, gt.numpy())
    assert g_mask is None


# ----------------------------------------------------------------------------- shape rules


def _tshapes(arrays, origs, prefix):
    """Solver dims for the arrays, with the original sizes from the context where given (the
    arrays may already be shape-reduced) and else the arrays' own shapes."""
    out = []
    for k, a in enumerate(arrays):
        if a is None:
            out.append(None)
            continue
        orig = origs[k] if k < len(origs) and origs[k] is not None else np.shape(a)
        out.append(TShape([z3.Int(f"{prefix}{k}_{i}") for i in range(np.ndim(a))], tuple(orig)))
    return out


def _assert_rule_accepts(rule, ins, outs, attrs, ctx):
    """The rule holds with the dims set to the arrays' actual shapes."""
    c = ShapeConstraints()
    tins, touts = _tshapes(ins, ctx.orig_in, "i"), _tshapes(outs, ctx.orig_out, "o")
    rule(c, tins, touts, attrs)
    solver = z3.Solver()
    solver.add(*c.constraints)
    for t, a in zip(tins + touts, list(ins) + list(outs)):
        if t is not None:
            solver.add(*[d == n for d, n in zip(t.dims, np.shape(a))])
    assert solver.check() == z3.sat


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_shape_rules_accept_the_case_shapes(case):
    """Forward and (derived) backward shape rules accept every case's shapes."""
    spec = all_ops()[case.op]
    outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    _assert_rule_accepts(shape_rule(spec, False), case.inputs, outs, case.attrs, case.ctx)
    if spec.backward is not None:
        bw_ins = backward_inputs(case, random_grads(outs))
        bw_outs = spec.backward(NB, bw_ins, bw_attrs(case), case.bw_ctx)
        _assert_rule_accepts(shape_rule(spec, True), bw_ins, bw_outs, bw_attrs(case),
                             case.bw_ctx)


# ----------------------------------------------------------------------------- symbolic backend


def evaluate(term, env: dict, cache: dict) -> float:
    """Value of a pysmt term, with the backend's uninterpreted functions read as the real
    functions (as NumericBackend computes them)."""
    if term in cache:
        return cache[term]
    args = [evaluate(a, env, cache) for a in term.args()]
    if term.is_symbol():
        v = env[term]
    elif term.is_constant():
        v = float(term.constant_value())
    elif term.is_plus():
        v = sum(args)
    elif term.is_times():
        v = math.prod(args)
    elif term.is_minus():
        v = args[0] - args[1]
    elif term.is_ite():
        v = args[1] if args[0] else args[2]
    elif term.is_equals():
        v = args[0] == args[1]
    elif term.is_le():
        v = args[0] <= args[1]
    elif term.is_function_application():
        v = UF[term.function_name().symbol_name()](*args)
    else:
        raise AssertionError(f"unexpected term {term}")
    cache[term] = v
    return v


UF = {
    "uf_exp": lambda a: NB.exp(np.float64(a)),
    "uf_rsqrt": lambda a: NB.rsqrt(np.float64(a)),
    "uf_sigmoid": lambda a: NB.sigmoid(np.float64(a)),
    "uf_cos": math.cos,
    "uf_sin": math.sin,
    "uf_pow": lambda a, p: NB.powc(np.float64(a), p),
    "uf_recip": lambda a: NB.div(np.float64(1.0), np.float64(a)),
}


def symbolize(arrays, prefix, env):
    out = []
    for k, a in enumerate(arrays):
        if a is None:
            out.append(None)
            continue
        a = np.asarray(a)
        s = np.empty(a.shape, dtype=object)
        for idx in np.ndindex(a.shape):
            name = f"{prefix}{k}_" + "_".join(map(str, idx))
            s[idx] = Symbol(name, REAL)
            env[s[idx]] = a[idx].item()
        out.append(s)
    return out


def assert_symbolic_agrees(sym_outs, num_outs, env):
    assert len(sym_outs) == len(num_outs)
    cache: dict = {}
    for s, n in zip(sym_outs, num_outs):
        if n is None:
            assert s is None
            continue
        # a 0-d result may be a bare term: the interpreter makes every result an array
        s = np.asarray(s, dtype=object) if np.shape(n) == () else s
        assert s.dtype == object and s.shape == n.shape
        values = np.array([evaluate(t, env, cache) for t in s.reshape(-1)]).reshape(s.shape)
        np.testing.assert_allclose(values, n, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_symbolic_matches_numeric(case):
    """Forward and backward under SymbolicBackend on symbols, evaluated at the case's values
    (uninterpreted functions read as the real ones), agree with NumericBackend."""
    be, spec = SymbolicBackend(), all_ops()[case.op]
    env = {be.neg_inf(): -math.inf}
    fw_num = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    assert_symbolic_agrees(spec.forward(be, symbolize(case.inputs, "x", env), case.attrs,
                                        case.ctx), fw_num, env)
    if spec.backward is None:
        return
    bw_ins = backward_inputs(case, random_grads(fw_num))
    bw_num = spec.backward(NB, bw_ins, bw_attrs(case), case.bw_ctx)
    bw_sym = spec.backward(be, symbolize(bw_ins, "b", env), bw_attrs(case), case.bw_ctx)
    assert_symbolic_agrees(bw_sym, bw_num, env)


def _constants(term, acc):
    if term.is_constant():
        acc.add(term.constant_value())
    for a in term.args():
        _constants(a, acc)
    return acc


def test_symbolic_constants_are_exact():
    be, ops = SymbolicBackend(), all_ops()
    x = symbolize([np.zeros((1,))], "k", {})
    (y,) = ops["add"].forward(be, x, {"alpha": 1, "consts": [1e-05]}, NodeCtx())
    assert Fraction(1, 100000) in _constants(y[0], set())
    (z,) = ops["div"].forward(be, x, {"consts": [11.313708498984761]}, NodeCtx())
    assert 1 / Fraction("11.313708498984761") in _constants(z[0], set())
    (m,) = ops["mean"].forward(be, symbolize([np.zeros((1, 3))], "m", {}),
                               {"dim": [1], "keepdim": True}, NodeCtx())
    assert Fraction(1, 3) in _constants(m[0, 0], set())


def test_unsupported_attributes_are_refused():
    ops, ctx = all_ops(), NodeCtx()
    with pytest.raises(ValueError, match="padding_idx"):
        ops["embedding"].forward(NB, [ids((2, 3), 4), rand(4, 2)], {"padding_idx": 0}, ctx)
    with pytest.raises(ValueError, match="range"):
        ops["embedding"].forward(NB, [ids((2, 3), 4), rand(4, 2)], {"start": 4, "stop": 12},
                                 NodeCtx(orig_in=((2, 3), (4, 2))))
    with pytest.raises(ValueError, match="bias"):
        ops["linear"].forward(NB, [rand(2, 3), rand(4, 3)], {"bias": 0.5}, ctx)
    with pytest.raises(ValueError, match="rounding_mode"):
        ops["div"].forward(NB, [rand(2, 3)], {"consts": [2], "rounding_mode": "floor"}, ctx)


# ----------------------------------------------------------------------------- semantic keys
# `OpSpec.semantic_attrs` says which attributes an operator's rules read. Three shortcuts rest
# on it: stage templates (tvsmt/stages/signature.py), the interpreter's node memo
# (tvsmt/encoding/interpreter.py) and the fold's comparison of units (tvsmt/fold/table.py)
# treat two nodes whose keys are equal as computing the same thing. A rule that read an
# attribute its key leaves out would let a wrong value of it pass unseen.

# attributes the plans and captures write, tried on operators whose cases lack them
_EXTRA_ATTRS = {"ranks": [0, 1], "src": 0, "dst": 1, "idx": 0, "dim": 0, "split_dim": 0,
                "start": 0, "stop": 4, "padding_idx": 0, "dp": 2, "mb": 1, "batch_index": 1,
                "num_batches": 2, "pieces": 2}


def _other_values(value) -> list:
    """Plausible other values of one attribute (another rank group of the same size among
    them)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, value + 8, 0, 1, None]
    if isinstance(value, float):
        return [value * 2, None]
    if isinstance(value, str):
        return [value + "_other", None]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [[v + 8 for v in value], value[::-1], value[:-1], value + [max(value, default=0) + 1],
                None]
    return [None]


def _attr_variants(attrs: dict) -> list[dict]:
    """`attrs` with one attribute changed, removed (None: removed) or added."""
    out = []
    for k, v in attrs.items():
        for w in _other_values(v):
            out.append({**{a: b for a, b in attrs.items() if a != k},
                        **({} if w is None else {k: w})})
    out += [{**attrs, k: v} for k, v in _EXTRA_ATTRS.items() if k not in attrs]
    return out


def _outcome(fn, *args):
    """What `fn(*args)` gives: its outputs, or the type of what it raised."""
    try:
        return "ok", fn(*args)
    except Exception as e:  # noqa: BLE001 - compared, not hidden
        return "raised", type(e).__name__


def _same_outcome(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "raised":
        return a[1] == b[1]
    return len(a[1]) == len(b[1]) and all(
        (x is None) == (y is None) and (x is None or np.array_equal(np.asarray(x), np.asarray(y)))
        for x, y in zip(a[1], b[1]))


def _shape_outcome(spec, backward: bool, ins, outs, attrs, ctx):
    def constraints():
        c = ShapeConstraints()
        shape_rule(spec, backward)(c, _tshapes(ins, ctx.orig_in, "i"),
                                   _tshapes(outs, ctx.orig_out, "o"), attrs)
        return [str(x) for x in c.constraints] + [repr(b) for b in c.boundaries]

    got = _outcome(constraints)
    return got if got[0] == "raised" else ("ok", [np.array(got[1], dtype=object)])


KEYED_CASES = [c for c in CASES if all_ops()[c.op].semantic_attrs is not None]


def test_every_operator_with_a_semantic_key_has_a_case():
    keyed = {name for name, spec in all_ops().items() if spec.semantic_attrs is not None}
    assert keyed and keyed <= {c.op for c in KEYED_CASES}


@pytest.mark.parametrize("case", KEYED_CASES, ids=lambda c: c.id)
def test_attributes_outside_the_semantic_key_change_nothing(case):
    """Every variant of the case's attributes with the same key (one attribute changed,
    dropped or added) gives the same forward and backward values and the same shape
    constraints, or the same error; and some variants do share the key, so this checks
    something."""
    from tvsmt.ops.registry import attrs_key

    spec = all_ops()[case.op]

    def key(attrs):
        return attrs_key(spec.semantic_attrs(attrs))

    outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    grads = random_grads(outs)
    checked = 0
    for backward, base in ((False, case.attrs), (True, bw_attrs(case))):
        if backward and spec.backward is None:
            continue
        ins = backward_inputs(case, grads) if backward else case.inputs
        rule = spec.backward if backward else spec.forward
        ctx = case.bw_ctx if backward else case.ctx
        want = _outcome(rule, NB, ins, base, ctx)
        rule_outs = want[1] if want[0] == "ok" else outs
        want_shapes = _shape_outcome(spec, backward, ins, rule_outs, base, ctx)
        for attrs in _attr_variants(base):
            if key(attrs) != key(base):
                continue
            checked += 1
            got = _outcome(rule, NB, ins, attrs, ctx)
            assert _same_outcome(got, want), (
                f"{case.op} ({'backward' if backward else 'forward'}): attrs {attrs} have "
                f"the key of {base} but give {got[0]} {got[1] if got[0] == 'raised' else ''}")
            got_shapes = _shape_outcome(spec, backward, ins, rule_outs, attrs, ctx)
            assert _same_outcome(got_shapes, want_shapes), (
                f"{case.op}: the shape rule reads attrs outside its key ({attrs} vs {base})")
    assert checked > 0


RANKED_CASES = [c for c in CASES
                if any(k in c.attrs for k in all_ops()[c.op].rank_attrs)]


@pytest.mark.parametrize("case", RANKED_CASES, ids=lambda c: c.id)
def test_rank_attributes_renamed_one_to_one_change_nothing(case):
    """The fold moves a unit onto its representative by renaming the rank ids in
    `OpSpec.rank_attrs` (a group, a source, a destination), comparing the rest
    (tvsmt/fold/table.py). That is sound only if a rule reads the ranks' positions and
    number, never their values: every one-to-one renaming, order-keeping or not, gives the
    same values and shape constraints."""
    spec = all_ops()[case.op]
    renamings = (lambda r: r + 8, lambda r: 100 - r, lambda r: (r * 7 + 3) % 101)

    def renamed(attrs, f):
        out = dict(attrs)
        for k in spec.rank_attrs:
            v = attrs.get(k)
            if isinstance(v, int):
                out[k] = f(v)
            elif isinstance(v, list):
                out[k] = [f(r) for r in v]
        return out

    outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    want = ("ok", outs)
    want_shapes = _shape_outcome(spec, False, case.inputs, outs, case.attrs, case.ctx)
    for f in renamings:
        attrs = renamed(case.attrs, f)
        assert attrs != case.attrs
        got = _outcome(spec.forward, NB, case.inputs, attrs, case.ctx)
        assert _same_outcome(got, want), f"{case.op}: ranks renamed to {attrs}"
        assert _same_outcome(
            _shape_outcome(spec, False, case.inputs, outs, attrs, case.ctx), want_shapes)


@pytest.mark.parametrize("case", BW_CASES, ids=lambda c: c.id)
def test_n_outputs_splits_backward_inputs_into_gradients_and_mirrors(case):
    """The derived backward shape rule (`registry.derived_bw_shape`) splits a backward
    node's inputs into the gradients of the forward outputs and the mirrored forward inputs
    by `OpSpec.n_outputs(attrs, number of backward inputs)`: it must be the number of
    outputs the forward gives."""
    spec = all_ops()[case.op]
    outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
    bw_ins = backward_inputs(case, random_grads(outs))
    assert spec.n_outputs(bw_attrs(case), len(bw_ins)) == len(outs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rules_leave_their_input_arrays_as_they_were(case):
    """A tensor's array is shared by every node that reads it, and the interpreter's node memo
    keeps the input arrays of each result it serves again: a rule that wrote into an input
    would change what later readers see. Forward and backward, numeric and symbolic: every
    input holds the same values (the very same terms) after the rule as before."""
    be, spec = SymbolicBackend(), all_ops()[case.op]
    env = {be.neg_inf(): -math.inf}
    runs = [(spec.forward, NB, case.inputs, case.attrs, case.ctx),
            (spec.forward, be, symbolize(case.inputs, "x", env), case.attrs, case.ctx)]
    if spec.backward is not None:
        outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
        bw_ins = backward_inputs(case, random_grads(outs))
        runs += [(spec.backward, NB, bw_ins, bw_attrs(case), case.bw_ctx),
                 (spec.backward, be, symbolize(bw_ins, "b", env), bw_attrs(case), case.bw_ctx)]
    for rule, backend, ins, attrs, ctx in runs:
        assert_inputs_kept(rule, backend, ins, attrs, ctx, case.id)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_symbolic_rules_give_the_very_same_terms_on_the_same_inputs(case):
    """The interpreter's node memo serves a node's result to every node with the same
    operator, semantic attributes, shapes and input terms (tvsmt/encoding/interpreter.py):
    sound only if a rule is a function of those, with no fresh symbol per call. Run twice on
    the same input terms in one backend, every rule gives the very same output terms."""
    be, spec = SymbolicBackend(), all_ops()[case.op]
    ins = symbolize(case.inputs, "x", {})
    runs = [(spec.forward, ins, case.attrs, case.ctx)]
    if spec.backward is not None:
        outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
        runs.append((spec.backward, symbolize(backward_inputs(case, random_grads(outs)), "b", {}),
                     bw_attrs(case), case.bw_ctx))
    for rule, arrays, attrs, ctx in runs:
        assert_same_terms(rule, be, arrays, attrs, ctx, case.id)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rules_apply_only_the_uninterpreted_functions_they_declare(case):
    """`OpSpec.abstracts` names the real functions an operator's rules leave uninterpreted
    (the registry's contract, README's ops row): run symbolically, forward and backward,
    its terms apply no other."""
    be, spec = SymbolicBackend(), all_ops()[case.op]
    runs = [(spec.forward, symbolize(case.inputs, "x", {}), case.attrs, case.ctx)]
    if spec.backward is not None:
        outs = spec.forward(NB, case.inputs, case.attrs, case.ctx)
        runs.append((spec.backward, symbolize(backward_inputs(case, random_grads(outs)), "b", {}),
                     bw_attrs(case), case.bw_ctx))
    for rule, arrays, attrs, ctx in runs:
        assert_declared_abstractions(rule, be, arrays, attrs, ctx, spec.abstracts, case.id)
