"""The ATen entries against PyTorch itself.

Small programs (a Llama block, GPT pieces, vocabulary-parallel embedding and cross entropy,
and direct calls of the remaining overloads) are traced with make_fx into joint forward and
backward graphs and run on random float64 values. Every ATen node becomes a plan node by the
capture convention (tvsmt/ops/definitions/aten_call.py), and its registry entry must give
what torch computed for that node: forward entries and the backward ATen ops alike (a
`*_backward` node is checked against torch's own backward op). The tests are parametrized
over the registry, so a new entry that no program exercises fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import z3
from torch.fx.experimental.proxy_tensor import make_fx

from tvsmt.encoding.evaluate import FloatEvaluator
from tvsmt.ops import NodeCtx, NumericBackend, ShapeConstraints, SymbolicBackend, TShape, all_ops
from tvsmt.ops.definitions.aten_call import bind

NB = NumericBackend()
F64 = torch.float64

# ----------------------------------------------------------------------------- capture


@dataclass
class Sample:
    """One traced ATen node as the capture writes it, with torch's values."""

    op: str
    inputs: list  # numpy float64 arrays (bools 0/1, ints as floats)
    attrs: dict
    outputs: list  # numpy arrays or None (non-tensor outputs)
    program: str

    @property
    def ctx(self) -> NodeCtx:
        shapes = tuple(None if o is None else o.shape for o in self.outputs)
        return NodeCtx(shapes, tuple(x.shape for x in self.inputs), shapes)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t._is_zerotensor():
        t = torch.zeros(t.shape, dtype=t.dtype)
    return t.to(F64).numpy().copy() if t.dtype != torch.bool else \
        t.detach().numpy().astype(np.float64)


def convert(node: torch.fx.Node, env: dict, program: str) -> Sample:
    """The capture convention: tensors become {"tensor": k} (with "dtype" when not floating),
    dtypes/devices strings, infinities strings."""
    inputs: list = []

    def ref(a):
        if isinstance(a, torch.fx.Node):
            v = env[a]
            if isinstance(v, torch.Tensor):
                r = {"tensor": len(inputs)}
                if not v.is_floating_point():
                    r["dtype"] = str(v.dtype)
                inputs.append(_to_numpy(v))
                return r
            return v
        if isinstance(a, (list, tuple)):
            return [ref(b) for b in a]
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(a)
        if isinstance(a, float) and math.isinf(a):
            return str(a)
        return a

    args = [ref(a) for a in node.args]
    kwargs = {k: ref(v) for k, v in node.kwargs.items()}
    value = env[node]
    outs = value if isinstance(value, (list, tuple)) else [value]
    outputs = [_to_numpy(o) if isinstance(o, torch.Tensor) else None for o in outs]
    return Sample(str(node.target), inputs, {"args": args, "kwargs": kwargs}, outputs, program)


def run_traced(fn, inputs, program: str, functional: str | None = "mutations") -> list[Sample]:
    gm = make_fx(fn)(*inputs)  # joint graph (autograd inlined), in-place ops left
    plain = [x.detach() for x in inputs]
    if functional:  # second pass: functional SSA, as the capture does
        gm = make_fx(torch.func.functionalize(gm, remove=functional))(*plain)
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    interp.run(*plain)
    return [convert(n, interp.env, program) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("aten.")
            and not _on_meta(interp.env[n])]


def _on_meta(value) -> bool:
    """Dead type-promotion checks that torch runs on the meta device (no values)."""
    vs = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and v.is_meta for v in vs)


def rnd(*shape, grad=True):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def grads(loss, params):
    return torch.autograd.grad(loss, params)


# ----------------------------------------------------------------------------- programs


def llama_block(x, wq, wk, wv, wo, wg, wu, wd, nw):
    """RMSNorm, rotary (slice/cat/neg), causal mask (full/triu), softmax attention, SiLU MLP."""
    b, s, d = x.shape
    h = 2
    hd = d // h
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    q = (y @ wq.t()).view(b, s, h, hd).transpose(1, 2)
    k = (y @ wk.t()).view(b, s, h, hd).transpose(1, 2)
    v = (y @ wv.t()).view(b, s, h, hd).transpose(1, 2)
    pos = torch.arange(s, dtype=F64)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=F64) / hd))
    ang = torch.outer(pos, inv)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()

    def rot(t):
        return torch.cat((-t[..., hd // 2:], t[..., :hd // 2]), -1)

    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    mask = torch.full((s, s), float("-inf"), dtype=F64).triu(1)
    att = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
    o = (att @ v).transpose(1, 2).reshape(b, s, d) @ wo.t()
    x = x + o
    m = F.silu(x @ wg.t()) * (x @ wu.t())
    out = x + m @ wd.t()
    loss = out.pow(2).mean()
    return (loss,) + grads(loss, [x, wq, wk, wv, wo, wg, wu, wd, nw])


def gpt_pieces(x, w1, b1, w2, b2, lw, lb, bb):
    """LayerNorm, addmm/baddbmm, both GELUs, tanh, sigmoid, stack/select/unbind, split/chunk."""
    z = F.layer_norm(x, (x.shape[-1],), lw, lb)
    u = F.linear(z.reshape(-1, z.shape[-1]), w1, b1)
    g = F.gelu(u) + F.gelu(u, approximate="tanh") + torch.tanh(u) * torch.sigmoid(u)
    r = F.relu(g) + g.abs() * 0.1 + torch.clamp(g, min=-0.5, max=0.7)
    v = F.linear(r, w2, b2).view(x.shape)
    st = torch.stack([v, v * 2], dim=1)
    v = st.select(1, 0) + st.select(1, 1) * 0.5 + sum(st.unbind(1))
    p1, p2 = v.split(2, dim=-1)[:2]
    c1, c2 = v.chunk(2, dim=1)
    att = torch.baddbmm(bb, v, v.transpose(1, 2), beta=0.5, alpha=0.25)
    lse = torch.log(torch.exp(att).sum(-1)) + torch.sqrt(att * att + 1.0).sum(-1)
    loss = (lse.sum() + (p1 * p2).sum() + (c1 - c2).pow(3).sum()
            + torch.amax(v, dim=-1).sum() + torch.max(v, dim=1).values.sum())
    return (loss,) + grads(loss, [x, w1, b1, w2, b2, lw, lb, bb])


V, V0, V1 = 12, 4, 8  # the vocabulary, and the shard [V0, V1) this rank holds


def vocab_parallel(tok, tgt, w, head):
    """Megatron-style vocabulary-parallel embedding and cross entropy on one rank."""
    outside = (tok < V0) | (tok >= V1)
    ids = tok.clone() - V0
    ids[outside] = 0
    e = F.embedding(ids, w)
    e[outside, :] = 0.0
    logits = e @ head.t()
    lmax = torch.max(logits, dim=-1)[0]
    logits = logits - lmax.unsqueeze(-1).detach()
    tout = (tgt < V0) | (tgt >= V1)
    mt = tgt.clone() - V0
    mt[tout] = 0
    flat = logits.view(-1, logits.shape[-1])
    rows = torch.arange(0, flat.shape[0])
    picked = flat[rows, mt.view(-1)].clone().view_as(tgt)
    picked[tout] = 0.0
    loss = (torch.log(logits.exp().sum(-1)) - picked).mean()
    return (loss,) + grads(loss, [w, head])


def cross_entropy(logits, tgt, cw, tok, emb):
    """torch's cross entropy (log_softmax + nll) in its three reductions, with class weights
    and ignore_index, and an embedding with a padding index."""
    e = F.embedding(tok, emb, padding_idx=1)
    lg = logits + e.sum(-1, keepdim=True)
    loss = (F.cross_entropy(lg, tgt) + F.cross_entropy(lg, tgt, weight=cw, reduction="sum")
            + F.cross_entropy(lg, tgt, ignore_index=2, reduction="none").sum()
            + F.nll_loss(F.log_softmax(lg[0], -1), tgt[0]))
    return (loss,) + grads(loss, [logits, emb])


def masks_and_logic(x, y):
    """Comparisons (Scalar and Tensor), logical and bitwise ops, where, masked_fill."""
    m = (x > 0) & (y <= 0.5) | (x.eq(y) ^ x.ne(0.25))
    l = torch.logical_and(x >= -1, y < 1) | torch.logical_or(x.lt(y), x.gt(y))
    n = torch.logical_not(l) | ~m
    out = torch.where(m, x, y) + x.masked_fill(n, -1.0) + torch.where(l, x, 0.0)
    out = out + torch.where(x.ge(y), 1.0, y) + x.masked_fill(y.le(0), float("-inf")).exp()
    out = out + torch.maximum(x, y) + torch.minimum(x, y) + x.sign() + x.sgn()
    out = out + m.float() * l.to(torch.int64) + torch.logical_xor(x > 0, y > 0).double()
    loss = out.sum() + torch.amin(out, dim=0).sum()
    return (loss,) + grads(loss, [x, y])


def creation_and_views(x, tok):
    """Factories, arange in three forms, casts, views, squeeze/unsqueeze/permute/expand."""
    b, s, d = x.shape
    c = torch.zeros(b, s, d, dtype=F64) + torch.ones(d, dtype=F64) + torch.ones_like(x)
    c = c + torch.full_like(x, 0.5) + torch.zeros_like(x) + x.new_zeros((s, d)) + x.new_ones(d)
    c = c + x.new_full((d,), 2.0) + torch.scalar_tensor(3.0, dtype=F64)
    a = torch.arange(d, dtype=F64) + torch.arange(1, d + 1, dtype=F64) \
        + torch.arange(0, 2 * d, 2, dtype=F64)
    t = (x * a).permute(2, 0, 1).unsqueeze(0).squeeze(0).squeeze().reshape(d, b * s)
    e = x[:, :1, :].expand(b, s, d) + x.sum(1, keepdim=True).expand(-1, s, -1)
    tri = torch.tril(x[0], diagonal=-1) + torch.triu(x[0], diagonal=2)
    cast = tok.to(torch.bool).to(F64) + (tok > 2).long().to(F64)
    loss = (t.t() @ t).sum() + (e * c).sum() + tri.sum() + (cast * x[..., 0]).sum()
    return (loss,) + grads(loss, [x])


def matmul_pieces(a, b, c, bias):
    out = torch.addmm(bias, a, b) + torch.mm(a, b) + torch.bmm(c, b.expand(2, 4, 5)).sum(0)
    out = out / (out * out + 1.0) + out.reciprocal() * 0.01 + 2.0 ** out + (out * out + 1).pow(0.5)
    out = out + torch.rsub(out, 1.0) + out.pow(-1) + (out * out + 1).pow(-0.5) + (out * out + 1) ** 1.5
    loss = out.sum()
    return (loss,) + grads(loss, [a, b, c, bias])


def gather_and_scatter(x, idx, base, vals, rows):
    g = torch.gather(x, 1, idx)
    p = base.index_put((rows,), vals, accumulate=True) + base.index_put((rows,), vals)
    i2 = base[rows[:2]]
    loss = g.sum() + p.sum() + i2.sum()
    return (loss,)


def _direct(fn, *inputs, functional="mutations"):
    return fn, inputs, functional


def direct_calls():
    """Overloads the programs above do not produce (functionalized views, rare forms)."""
    aten = torch.ops.aten
    x, x1 = torch.randn(2, 3, 4, dtype=F64), torch.randn(2, 1, 4, dtype=F64)
    m = torch.randn(3, 4, dtype=F64)
    return {
        "view_copy": _direct(lambda x, x1: (aten.view_copy.default(x, [6, 4]),
                                        aten._reshape_alias.default(x, [4, 6], [6, 1]),
                                        aten.t_copy.default(m), aten.transpose_copy.int(x, 0, 2),
                                        aten.permute_copy.default(x, [1, 0, 2]),
                                        aten.unsqueeze_copy.default(x, 1),
                                        aten.squeeze_copy.dim(x1, 1),
                                        aten.squeeze_copy.dims(x1, [1]),
                                        aten.squeeze_copy.default(x1),
                                        aten.squeeze.dims(x1, [1]),
                                        aten.expand_copy.default(x1, [2, 3, 4]),
                                        aten.slice_copy.Tensor(x, 2, 1, 3),
                                        aten.select_copy.int(x, 1, -1),
                                        aten.split_copy.Tensor(x, 2, 2),
                                        aten.alias_copy.default(x), aten.alias.default(x),
                                        aten.detach_copy.default(x),
                                       
                                        aten.clamp.Tensor(x, x1, None),
                                        aten.pow.Tensor_Tensor(x.abs() + 0.5, x1),
                                        aten.div.Tensor_mode(x, x1.abs() + 1, rounding_mode=None),
                                        aten.rsub.Tensor(x, x1),
                                        aten.max.dim(x, 0, True), aten.max.default(x),
                                        aten.add.Scalar(x, 2.5), aten.sub.Scalar(x, 1.5),
                                        aten.eq.Scalar(x > 0, 1), aten.le.Tensor(x, x1),
                                        aten.ne.Tensor(x, x1),
                                        aten.split_with_sizes.default(x, [1, 3], 2),
                                        aten.as_strided_copy.default(x, [4, 6], [6, 1], 0),
                                        aten.masked_fill.Tensor(x, x1 > 0, torch.tensor(
                                            4.0, dtype=F64)),
                                        aten.copy.default(x, x1),
                                        aten.cat.default([x, x1], 1),
                                        aten.bitwise_not.default(x > 0),
                                        aten.scatter.value(x, 2, torch.tensor(
                                            [[[1], [0], [3]], [[2], [2], [0]]]), 5.0),
                                        aten.as_strided.default(x, [6, 4], [4, 1], 0),
                                        aten.index.Tensor(x, [None, torch.tensor([2, 0])]),
                                        aten.index.Tensor(x, [torch.tensor([1, 0]), None,
                                                              torch.tensor([3, 3])]),
                                        aten.index_put.default(
                                            x, [None, torch.tensor([0, 2])],
                                            torch.ones(2, 2, 4, dtype=F64) * 7, False),
                                        aten.index_put.default(
                                            x, [x[..., 0] > 0], torch.tensor(
                                                2.0, dtype=F64), True)),
                             x, x1),
    }


def _programs():
    tok, tgt = torch.randint(0, V, (2, 3)), torch.randint(0, V, (2, 3))
    tgt[0, 0], tgt[1, 2] = V0, V1 - 1  # both ends of the shard
    d = 8
    ce_tgt = torch.tensor([0, 2, 4, 2, 1])
    return {
        "llama": (llama_block, [rnd(2, 4, d)] + [rnd(d, d) for _ in range(4)]
                  + [rnd(16, d), rnd(16, d), rnd(d, 16), rnd(d)], "mutations"),
        "gpt": (gpt_pieces, [rnd(2, 4, 6), rnd(10, 6), rnd(10), rnd(6, 10), rnd(6), rnd(6),
                             rnd(6), rnd(2, 4, 4)], "mutations"),
        "vocab": (vocab_parallel, [tok, tgt, rnd(V1 - V0, 6), rnd(5, 6)], "mutations"),
        "ce": (cross_entropy, [rnd(5, 5), ce_tgt, rnd(5, grad=False).abs() + 0.5,
                               torch.tensor([0, 1, 3, 1, 2]), rnd(4, 3)], "mutations"),
        "masks": (masks_and_logic, [rnd(3, 4), rnd(3, 4)], "mutations"),
        "creation": (creation_and_views, [rnd(2, 3, 4), torch.tensor([[0, 1, 3], [4, 0, 2]])],
                     "mutations"),
        "matmul": (matmul_pieces, [rnd(3, 4), rnd(4, 5), rnd(2, 3, 4), rnd(5)], "mutations"),
        "gather": (gather_and_scatter, [rnd(3, 4), torch.tensor([[0, 3], [1, 1], [2, 0]]),
                                        rnd(4, 2), rnd(3, 2), torch.tensor([1, 3, 1])],
                   "mutations"),
        **{k: (fn, list(ins), fu) for k, (fn, ins, fu) in direct_calls().items()},
        "views_removed": (llama_block, [rnd(2, 4, d)] + [rnd(d, d) for _ in range(4)]
                          + [rnd(16, d), rnd(16, d), rnd(d, 16), rnd(d)],
                          "mutations_and_views"),
    }


@lru_cache(maxsize=1)
def samples() -> dict[str, list[Sample]]:
    torch.manual_seed(0)
    by_op: dict[str, list[Sample]] = {}
    for name, (fn, inputs, functional) in _programs().items():
        for s in run_traced(fn, inputs, name, functional):
            by_op.setdefault(s.op, []).append(s)
    return by_op


ATEN_OPS = sorted(k for k in all_ops() if k.startswith("aten."))
MAX_SAMPLES = 6  # per op and test (the first ones of each program)


def cases(op: str) -> list[Sample]:
    got = samples().get(op, [])
    seen: dict[str, int] = {}
    out = []
    for s in got:
        if seen.get(s.program, 0) < 2:
            out.append(s)
            seen[s.program] = seen.get(s.program, 0) + 1
    return out[:MAX_SAMPLES]


def assert_close(got, want, what=""):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=1e-6, atol=1e-9, equal_nan=True), \
        f"{what}: max error {np.nanmax(np.abs(got - want))}"


# ----------------------------------------------------------------------------- tests


def test_every_traced_aten_op_has_an_entry():
    """What the programs produce is covered (an op the capture meets must not be unknown)."""
    missing = sorted(set(samples()) - set(all_ops()))
    assert not missing, f"traced ATen ops without a registry entry: {missing}"


@pytest.mark.parametrize("op", ATEN_OPS)
def test_entry_is_exercised_by_a_traced_program(op):
    assert cases(op), f"{op}: no traced program produces it (add one to _programs)"


# torch's values are uninitialised memory: only the shape can be compared.
UNDEFINED_VALUES = {"aten.new_empty_strided.default"}


@pytest.mark.parametrize("op", ATEN_OPS)
def test_forward_matches_torch(op):
    spec = all_ops()[op]
    for s in cases(op):
        outs = spec.forward(NB, s.inputs, s.attrs, s.ctx)
        assert len(outs) == len(s.outputs), f"{op} ({s.program}): output count"
        for k, (got, want) in enumerate(zip(outs, s.outputs)):
            if op in UNDEFINED_VALUES:
                assert np.shape(got) == want.shape
            elif want is not None and got is not None:
                assert_close(got, want, f"{op} ({s.program}) output {k}")
            elif want is not None:
                raise AssertionError(f"{op} ({s.program}): output {k} missing")


def _tshapes(arrays, prefix):
    return [None if a is None else TShape([z3.Int(f"{prefix}{k}_{i}") for i in range(a.ndim)],
                                          tuple(a.shape)) for k, a in enumerate(arrays)]


@pytest.mark.parametrize("op", ATEN_OPS)
def test_shape_rule_accepts_traced_shapes(op):
    spec = all_ops()[op]
    for s in cases(op):
        ins, outs = _tshapes(s.inputs, "i"), _tshapes(s.outputs, "o")
        c = ShapeConstraints()
        spec.shape(c, ins, outs, s.attrs)
        solver = z3.Solver()
        solver.add(*c.constraints)
        for t, a in zip(ins + outs, s.inputs + s.outputs):
            if t is not None:
                solver.add(*[d == n for d, n in zip(t.dims, a.shape)])
        assert solver.check() == z3.sat, f"{op} ({s.program}): rule rejects the traced shapes"


@pytest.mark.parametrize("op", ATEN_OPS)
def test_symbolic_terms_evaluate_to_the_numeric_values(op):
    """Under SymbolicBackend (every input a fresh real symbol, token ids included) each entry
    builds terms that, evaluated with the real functions, give the numeric result."""
    spec = all_ops()[op]
    s = cases(op)[0]
    be = SymbolicBackend()
    env, ins = {}, []
    for k, a in enumerate(s.inputs):
        syms = np.empty(a.shape, dtype=object)
        for idx in np.ndindex(a.shape):
            name = f"in{k}_{'_'.join(map(str, idx))}"
            syms[idx] = be.mgr.Symbol(name, be.real)
            env[name] = float(a[idx])
        ins.append(syms)
    outs = spec.forward(be, ins, s.attrs, s.ctx)
    want = spec.forward(NB, s.inputs, s.attrs, s.ctx)
    ev = FloatEvaluator(env)
    for got, w in zip(outs, want):
        if got is None or w is None:
            continue
        got = np.asarray(got, dtype=object)
        assert got.shape == np.shape(w)
        vals = np.array([ev.walk(t) if hasattr(t, "node_type") else float(t)
                         for t in got.ravel()], dtype=np.float64).reshape(got.shape)
        assert_close(vals, np.asarray(w, dtype=np.float64), f"{op} symbolic")


def test_bind_puts_inputs_back_in_call_order():
    a, b = np.zeros(2), np.ones(3)
    args, kwargs = bind({"args": [{"tensor": 1}, [{"tensor": 0}, None], 3],
                         "kwargs": {"alpha": 2, "device": "cpu"}}, [a, b])
    assert args[0] is b and args[1][0] is a and args[1][1] is None and args[2] == 3
    assert kwargs == {"alpha": 2}
    with pytest.raises(ValueError):
        bind({"args": [{"tensor": 2}]}, [a, b])


def test_unknown_kwarg_is_refused_not_ignored():
    with pytest.raises(TypeError):
        all_ops()["aten.mm.default"].forward(NB, [np.eye(2), np.eye(2)],
                                             {"args": [{"tensor": 0}, {"tensor": 1}],
                                              "kwargs": {"out_dtype": "torch.float16"}},
                                             NodeCtx())
