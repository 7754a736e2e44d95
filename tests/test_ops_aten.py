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
from op_contracts import assert_declared_abstractions
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
    sq = out * out + 1
    out = out + torch.rsub(out, 1.0) + out.pow(-1) + sq.pow(-0.5) + sq ** 1.5
    loss = out.sum()
    return (loss,) + grads(loss, [a, b, c, bias])


def gather_and_scatter(x, idx, base, vals, rows):
    g = torch.gather(x, 1, idx)
    p = base.index_put((rows,), vals, accumulate=True) + base.index_put((rows,), vals)
    i2 = base[rows[:2]]
    loss = g.sum() + p.sum() + i2.sum()
    return (loss,)


def attention_pieces(q, k, v, bias):
    """torch's CPU attention kernel (causal, with a float mask, with a bool mask), erf,
    in-place fill/zero made functional."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o + F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    o = o + F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    loss = torch.erf(o).sum() + o.pow(2).sum()
    return (loss,) + grads(loss, [q, k, v])


def statistics(x):
    """logsumexp, var/std/var_mean with corrections, log1p, expm1."""
    v, m = torch.var_mean(x, dim=-1, correction=0, keepdim=True)
    loss = (torch.logsumexp(x, dim=-1).sum() + x.var(dim=0).sum() + x.std(dim=-1).sum()
            + (v * m).sum() + torch.log1p(x.abs()).sum() + torch.expm1(x).sum())
    return (loss,) + grads(loss, [x])


def fills(x):
    """In-place fill_/zero_, made functional."""
    filled = x.detach().clone().fill_(0.5) + x.detach().clone().zero_()
    loss = (x * filled).sum()
    return (loss,) + grads(loss, [x])


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
                                        # 0-d: a clipping coefficient
                                        aten.clamp.default(aten.sum.default(x), None, 0.3),
                                        aten.pow.Tensor_Tensor(x.abs() + 0.5, x1),
                                        aten.div.Tensor_mode(x, x1.abs() + 1, rounding_mode=None),
                                        aten.rsub.Tensor(x, x1),
                                        aten.max.dim(x, 0, True), aten.max.default(x),
                                        aten.amax.default(x), aten.sum.dim_IntList(x, []),
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
        "attention": (attention_pieces, [rnd(2, 2, 4, 4), rnd(2, 2, 4, 4), rnd(2, 2, 4, 3),
                                         rnd(4, 4, grad=False)], "mutations"),
        # without the functional pass: torch's CPU attention kernel stays one node
        # (float32: the kernel is not used for float64)
        "attention_kernel": (attention_pieces, [
            t.detach().float().requires_grad_(g) for t, g in (
                (rnd(2, 2, 4, 4), True), (rnd(2, 2, 4, 4), True), (rnd(2, 2, 4, 4), True),
                (rnd(4, 4), False))], None),
        "fills": (fills, [rnd(3, 4)], "mutations"),
        "statistics": (statistics, [rnd(3, 4)], "mutations"),
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


FLOAT32_PROGRAMS = {"attention_kernel"}


def assert_close(got, want, what="", rtol=1e-6):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=rtol, atol=1e-9 if rtol <= 1e-6 else 1e-5, equal_nan=True), \
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
                assert_close(got, want, f"{op} ({s.program}) output {k}",
                             1e-4 if s.program in FLOAT32_PROGRAMS else 1e-6)
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
        # as the plan checks run it: plain ints for the dims (tvsmt/lineage/checks.py)
        plain = ShapeConstraints()
        spec.shape(plain, [None if a is None else TShape(list(a.shape), a.shape)
                           for a in s.inputs],
                   [None if a is None else TShape(list(a.shape), a.shape) for a in s.outputs],
                   s.attrs)
        assert not [x for x in plain.constraints if x is False], f"{op} ({s.program})"


@pytest.mark.parametrize("op", ATEN_OPS)
def test_symbolic_terms_evaluate_to_the_numeric_values(op):
    """Under SymbolicBackend (every input a fresh real symbol, token ids included) each entry
    builds terms that, evaluated with the real functions, give the numeric result."""
    spec = all_ops()[op]
    assert cases(op), f"{op}: no traced case"
    for s in cases(op)[:3]:
        _check_symbolic(spec, s)


@pytest.mark.parametrize("op", ATEN_OPS)
def test_symbolic_terms_apply_only_the_uninterpreted_functions_declared(op):
    """`OpSpec.abstracts` names the real functions an entry leaves uninterpreted (the
    registry's contract): its symbolic terms apply no other."""
    spec = all_ops()[op]
    for s in cases(op)[:3]:
        be, ins, _ = _symbolic_inputs(s)
        assert_declared_abstractions(spec.forward, be, ins, s.attrs, s.ctx, spec.abstracts,
                                     f"{op} ({s.program})")


def _symbolic_inputs(s: Sample) -> tuple[SymbolicBackend, list, dict]:
    """A fresh backend, every input element a fresh real symbol, and their values."""
    be = SymbolicBackend()
    env, ins = {}, []
    for k, a in enumerate(s.inputs):
        syms = np.empty(a.shape, dtype=object)
        for idx in np.ndindex(a.shape):
            name = f"in{k}_{'_'.join(map(str, idx))}"
            syms[idx] = be.mgr.Symbol(name, be.real)
            env[name] = float(a[idx])
        ins.append(syms)
    return be, ins, env


def _check_symbolic(spec, s: Sample) -> None:
    op = spec.name
    be, ins, env = _symbolic_inputs(s)
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
        assert_close(vals, np.asarray(w, dtype=np.float64), f"{op} symbolic ({s.program})")


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


# ----------------------------------------------------------------------------- shape reduction


def rotary_mask_program(x, w):
    """Shape-polymorphic code whose only size-dependent constants are sizes and positions in
    op attributes (slice bounds, split sizes, view/expand/full sizes, arange ranges)."""
    b, s, d = x.shape
    half = d // 2
    y = x @ w
    rot = torch.cat((-y[..., half:], y[..., :half]), -1)
    pos = torch.arange(s, dtype=F64).view(1, s, 1) + torch.arange(0, s, dtype=F64).view(
        1, s, 1) + torch.arange(0, 2 * s, 2, dtype=F64).view(1, s, 1)
    heads = (y + rot * pos * 0.05).view(b, s, 2, half).transpose(1, 2)
    att = heads @ heads.transpose(-1, -2) + torch.full((s, s), float("-inf"), dtype=F64).triu(1)
    att = F.softmax(att, dim=-1) @ heads
    p, q = att.transpose(1, 2).reshape(b, s, d).split(half, dim=-1)
    z = p * q + y[:, :s // 2, half:].sum(1, keepdim=True).expand(b, s, half)
    z = z + x.new_zeros((s, half))
    st = torch.stack([z, z * 2]).select(0, 1)
    loss = st.pow(2).sum() + y[:, s // 2:, :].sum()  # (mean's backward divides by a constant)
    return (loss,) + grads(loss, [x, w])


def _traced_pair():
    torch.manual_seed(1)
    full = run_traced(rotary_mask_program, [rnd(2, 8, 8), rnd(8, 8)], "full")
    small = run_traced(rotary_mask_program, [rnd(2, 4, 4), rnd(4, 4)], "small")
    assert [s.op for s in full] == [s.op for s in small]
    return full, small


def test_entries_rescale_sizes_and_positions_under_shape_reduction():
    """Each node of the full-size trace, run at the sizes of the half-size trace (its attrs
    still naming full-size positions), gives what torch computes at half size."""
    full, small = _traced_pair()
    checked = set()
    for f, r in zip(full, small):
        spec = all_ops()[f.op]
        ctx = NodeCtx(tuple(None if o is None else o.shape for o in r.outputs),
                      tuple(x.shape for x in f.inputs),
                      tuple(None if o is None else o.shape for o in f.outputs))
        outs = spec.forward(NB, r.inputs, f.attrs, ctx)
        for got, want in zip(outs, r.outputs):
            if want is not None:
                assert_close(got, want, f"{f.op} at reduced size")
        checked.add(f.op)
    for op in ("aten.slice.Tensor", "aten.slice_backward.default", "aten.arange.default",
               "aten.arange.start", "aten.arange.start_step", "aten.full.default",
               "aten.view.default",
               "aten.expand.default", "aten.split.Tensor", "aten.cat.default",
               "aten.new_zeros.default", "aten._unsafe_view.default"):
        assert op in checked, op


def _halves_an_inner_axis(full_node, small_node) -> bool:
    """A view whose half-size instance shrinks an inner axis of a merged or split run (the
    program's `view(b, s, 2, half)`: the head size halved with the hidden size)."""
    from tvsmt.ops.definitions.layout import view_groups

    if "view" not in full_node.op:
        return False
    shapes = [(tuple(full_node.inputs[0].shape), tuple(small_node.inputs[0].shape)),
              (tuple(full_node.outputs[0].shape), tuple(small_node.outputs[0].shape))]
    groups = view_groups(shapes[0][0], shapes[1][0])
    return any(shapes[k][0][i] != shapes[k][1][i]
               for ga, gb in groups for k, group in ((0, ga), (1, gb)) for i in group[1:])


def test_shape_rules_admit_the_reduction_and_keep_its_boundaries():
    """The rules (with the full sizes as originals) accept the half sizes, and every position
    they ask to keep is a whole position at half size; except a view whose half sizes shrink
    an inner axis of a merged or split run, which the rule refuses (only a run's outermost
    axis is reduced: two views of one buffer then decode it alike)."""
    full, small = _traced_pair()
    refused = 0
    for f, r in zip(full, small):
        spec = all_ops()[f.op]
        ins = _tshapes(f.inputs, "i")
        outs = _tshapes(f.outputs, "o")
        c = ShapeConstraints()
        spec.shape(c, ins, outs, f.attrs)
        solver = z3.Solver()
        solver.add(*c.constraints)
        for t, a in zip(ins + outs, r.inputs + r.outputs):
            if t is not None:
                solver.add(*[d == n for d, n in zip(t.dims, a.shape)])
        if _halves_an_inner_axis(f, r):
            assert solver.check() == z3.unsat, f"{f.op}: an inner axis of a run reduced"
            refused += 1
            continue
        assert solver.check() == z3.sat, f"{f.op}: rule rejects the half sizes"
        m = solver.model()
        for kb in c.boundaries:
            t = next(t for t in ins + outs if t is not None and any(d is kb.dim for d in t.dims))
            i = next(i for i, d in enumerate(t.dims) if d is kb.dim)
            reduced = m.eval(kb.dim).as_long()
            assert (kb.at * reduced) % t.orig[i] == 0, f"{f.op}: boundary {kb.at} lost"
    assert refused, "the program's head split was expected among the views"


def _reduce_node(op, in_shapes, out_shapes, attrs):
    """Reduced sizes the divisor solver picks for one node (as shape reduction would)."""
    from tvsmt.shapes.dims import DivisorSolver
    from tvsmt.shapes.reduce import dim_shape

    solver = DivisorSolver()
    ins = [dim_shape(solver, f"i{k}", s) for k, s in enumerate(in_shapes)]
    outs = [dim_shape(solver, f"o{k}", s) for k, s in enumerate(out_shapes)]
    c = ShapeConstraints()
    all_ops()[op].shape(c, ins, outs, attrs)
    for kb in c.boundaries:
        solver.keep_divisible(kb.dim, kb.at)
    for con in c.constraints:
        solver.add(con)
    sizes = solver.solve()

    def value(t):
        return tuple(d if isinstance(d, int) else sizes[d.id] for d in t.dims)

    return [value(t) for t in ins], [value(t) for t in outs]


def _call(*args, **kwargs):
    return {"args": list(args), "kwargs": kwargs}


def test_slice_bounds_limit_the_reduction():
    x = {"tensor": 0}
    ins, outs = _reduce_node("aten.slice.Tensor", [(4, 12)], [(4, 4)], _call(x, 1, 4, 8))
    assert ins == [(2, 3)] and outs == [(2, 1)] or ins[0][1] in (3, 6, 12)
    ins, outs = _reduce_node("aten.slice.Tensor", [(4, 12)], [(4, 3)], _call(x, 1, 0, 3))
    assert ins[0][1] in (4, 12) and outs[0][1] * 12 == ins[0][1] * 3  # boundary 3 kept whole
    ins, outs = _reduce_node("aten.slice.Tensor", [(4, 12)], [(4, 6)], _call(x, 1, 0, 12, 2))
    assert ins[0][1] == 12 and outs[0][1] == 6  # strided: never reduced


def test_value_indexed_dims_are_never_reduced():
    """A vocabulary indexed by token values keeps its size: the constants the ids are compared
    with (vocabulary ranges) are only right at the original size."""
    w, i = {"tensor": 0}, {"tensor": 1, "dtype": "torch.int64"}
    ins, outs = _reduce_node("aten.embedding.default", [(16, 8), (4, 6)], [(4, 6, 8)],
                             _call(w, i))
    assert ins[0][0] == 16 and ins[0][1] < 8 and outs[0] == ins[1] + (ins[0][1],)
    ins, _ = _reduce_node("aten.nll_loss_forward.default", [(6, 16), (6,)], [(), ()],
                          _call({"tensor": 0}, {"tensor": 1}, None, 1, -100))
    assert ins[0][1] == 16 and ins[0][0] < 6
    ins, _ = _reduce_node("aten.index.Tensor", [(6, 16), (6,), (6,)], [(6,)],
                          _call({"tensor": 0}, [{"tensor": 1, "dtype": "torch.int64"},
                                                {"tensor": 2, "dtype": "torch.int64"}]))
    assert ins[0] == (6, 16)
    ins, _ = _reduce_node("aten.select.int", [(4, 6)], [(4,)], _call({"tensor": 0}, 1, 2))
    assert ins[0] == (2, 6)


def test_reductions_stay_real_sums():
    ins, _ = _reduce_node("aten.sum.dim_IntList", [(4, 8)], [(4,)],
                          _call({"tensor": 0}, [1]))
    assert ins[0][1] >= 2
    ins, _ = _reduce_node("aten.mm.default", [(4, 8), (8, 6)], [(4, 6)],
                          _call({"tensor": 0}, {"tensor": 1}))
    assert ins[0][1] == ins[1][0] >= 2


# ----------------------------------------------------------------------------- value models


def test_vocab_mask_is_exact_on_symbolic_token_ids():
    """lt/ge on a symbolic id against the shard bounds, then masked selection: for every id
    value the solver may pick, the terms equal torch (checked at ids inside, at and outside
    the bounds)."""
    be = SymbolicBackend()
    tok = np.array([be.mgr.Symbol("tok", be.real)], dtype=object)
    w = np.array([[be.mgr.Symbol(f"w{r}", be.real)] for r in range(V1 - V0)], dtype=object)
    ops = all_ops()
    lt = ops["aten.lt.Scalar"].forward(be, [tok], _call({"tensor": 0}, V0), NodeCtx())[0]
    ge = ops["aten.ge.Scalar"].forward(be, [tok], _call({"tensor": 0}, V1), NodeCtx())[0]
    out = ops["aten.bitwise_or.Tensor"].forward(
        be, [lt, ge], _call({"tensor": 0, "dtype": "torch.bool"},
                            {"tensor": 1, "dtype": "torch.bool"}), NodeCtx())[0]
    ids = ops["aten.sub.Tensor"].forward(be, [tok], _call({"tensor": 0}, V0), NodeCtx())[0]
    ids = ops["aten.index_put.default"].forward(
        be, [ids, out, be.zeros(())], _call({"tensor": 0}, [{"tensor": 1, "dtype": "torch.bool"}],
                                             {"tensor": 2}), NodeCtx())[0]
    emb = ops["aten.embedding.default"].forward(be, [w, ids], _call({"tensor": 0}, {"tensor": 1}),
                                                 NodeCtx())[0]
    masked = ops["aten.index_put.default"].forward(
        be, [emb, out, be.zeros(())], _call({"tensor": 0}, [{"tensor": 1, "dtype": "torch.bool"}],
                                             {"tensor": 2}), NodeCtx())[0]
    wv = {f"w{r}": float(10 + r) for r in range(V1 - V0)}
    for t in range(-1, V + 1):
        ev = FloatEvaluator({"tok": float(t), **wv})
        want = 10.0 + t - V0 if V0 <= t < V1 else 0.0
        assert ev.walk(masked[0, 0]) == want, t


def test_max_is_exact_so_a_global_max_of_shard_maxima_is_provable():
    """max over a sharded dim = max of the shards' maxima, proven by z3 for all reals."""
    from pysmt.shortcuts import Equals, Not, Solver

    be = SymbolicBackend()
    x = np.array([[be.mgr.Symbol(f"x{i}", be.real) for i in range(4)]], dtype=object)
    amax = all_ops()["aten.amax.default"]
    whole = amax.forward(be, [x], _call({"tensor": 0}, [-1]), NodeCtx())[0]
    parts = [amax.forward(be, [x[:, k:k + 2]], _call({"tensor": 0}, [-1]), NodeCtx())[0]
             for k in (0, 2)]
    combined = all_ops()["aten.maximum.default"].forward(be, parts, _call(
        {"tensor": 0}, {"tensor": 1}), NodeCtx())[0]
    with Solver(name="z3") as s:
        s.add_assertion(Not(Equals(whole[0], combined[0])))
        assert not s.solve()
        s.reset_assertions()
        local = parts[0][0]  # the bug: the local max taken for the global one
        s.add_assertion(Not(Equals(whole[0], local)))
        assert s.solve()


def _recip(be, t):
    return be.apply_uf("uf_recip", np.array([t], dtype=object))[0]


def test_max_of_two_terms_is_one_term_whichever_comes_first():
    """max is symmetric but its ite is not: torch's `clamp(c, max=1)` and DeepSpeed's
    `torch.min(ones, c)` (both clip a gradient norm) must give the same term, or the solver
    case-splits everything below it. The order may not follow creation order either (the
    node memo changes that): two environments that made the operands in opposite orders
    print the same max."""
    from pysmt.shortcuts import Equals, Not, Solver

    ops = all_ops()

    def operands(be, first_b):
        x, y = (be.mgr.Symbol(n, be.real) for n in ("x", "y"))
        make_a = lambda: be.mgr.Times(be.mgr.Real(2), x)  # noqa: E731
        make_b = lambda: be.mgr.Plus(y, _recip(be, x))  # noqa: E731
        b = make_b() if first_b else None
        a = make_a()
        return a, (b if first_b else make_b())

    be = SymbolicBackend.fresh()
    with be.active():
        c = np.array([be.mgr.Times(_recip(be, be.mgr.Symbol("n", be.real)),
                                   be.mgr.Real(0.0625))], dtype=object)
        ones = np.array([be.const(1.0)], dtype=object)
        clamped = ops["aten.clamp.default"].forward(be, [c], _call({"tensor": 0}, None, 1.0),
                                                    NodeCtx())[0]
        least = ops["aten.minimum.default"].forward(be, [ones, c], _call(
            {"tensor": 0}, {"tensor": 1}), NodeCtx())[0]
        assert clamped[0] is least[0], (clamped[0].serialize(), least[0].serialize())
        a, b = operands(be, first_b=False)
        assert be.maximum(np.array([a]), np.array([b]))[0] is \
            be.maximum(np.array([b]), np.array([a]))[0]
        with Solver(name="z3") as s:  # and it is still the max
            m = be.maximum(np.array([a]), np.array([b]))[0]
            s.add_assertion(Not(be.mgr.And(be.mgr.LE(a, m), be.mgr.LE(b, m),
                                           be.mgr.Or(Equals(m, a), Equals(m, b)))))
            assert not s.solve()
        printed = be.maximum(np.array([a]), np.array([b]))[0].serialize()
    other = SymbolicBackend.fresh()
    with other.active():
        a2, b2 = operands(other, first_b=True)
        assert other.maximum(np.array([a2]), np.array([b2]))[0].serialize() == printed


def test_the_square_of_the_root_of_a_sum_of_squares_is_the_sum_and_nothing_else():
    """Clipping's norm of norms: sqrt(n0 ** 2 + n1 ** 2) with n_r = sqrt(sum of rank r's
    squares) is proven equal to the root of all the squares (the square of `uf_sqrt(t)` is
    t where t is a sum of squares); the square of the root of anything that might be
    negative keeps the abstraction, so `sqrt(y) ** 2 = y` is not proven."""
    from pysmt.shortcuts import Equals, Not, Solver

    be = SymbolicBackend.fresh()
    with be.active():
        x = np.array([be.mgr.Symbol(f"x{i}", be.real) for i in range(4)], dtype=object)

        def norm(v):
            return be.sqrt(np.array([np.sum(be.ipow(v, 2))], dtype=object))[0]

        whole = norm(x)
        of_shards = norm(np.array([norm(x[:2]), norm(x[2:])], dtype=object))
        y = be.mgr.Symbol("y", be.real)
        not_squares = [y, be.mgr.Times(x[0], x[1]), be.mgr.Times(be.const(-1), x[0], x[0]),
                       be.mgr.Plus(be.mgr.Times(x[0], x[0]), y)]
        with Solver(name="z3") as s:
            s.add_assertion(Not(Equals(whole, of_shards)))
            assert not s.solve()
            for t in not_squares:
                square = be.ipow(be.sqrt(np.array([t], dtype=object)), 2)[0]
                assert "uf_sqrt" in square.serialize(), (t, square)
                s.reset_assertions()
                s.add_assertion(Not(Equals(square, t)))
                assert s.solve(), t


def test_refused_forms_raise_value_errors():
    ops = all_ops()
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="boolean mask"):
        ops["aten.index.Tensor"].forward(NB, [x, x > 0], _call(
            {"tensor": 0}, [{"tensor": 1, "dtype": "torch.bool"}]), NodeCtx())
    with pytest.raises(ValueError, match="not modelled"):
        ops["aten._to_copy.default"].forward(NB, [x], _call({"tensor": 0}, dtype="torch.int64"),
                                             NodeCtx())
    with pytest.raises(ValueError, match="bitwise"):
        ops["aten.bitwise_and.Tensor"].forward(NB, [x, x], _call(
            {"tensor": 0, "dtype": "torch.int64"}, {"tensor": 1, "dtype": "torch.int64"}),
            NodeCtx())
    with pytest.raises(ValueError, match="as_strided"):
        ops["aten.as_strided.default"].forward(NB, [np.ones(6)], _call(
            {"tensor": 0}, [2, 2], [2, 1], 1), NodeCtx())
    with pytest.raises(ValueError, match="truncates"):
        ops["aten.copy.default"].forward(NB, [x, x * 0.5], _call(
            {"tensor": 0, "dtype": "torch.int64"}, {"tensor": 1}), NodeCtx())
    with pytest.raises(ValueError, match="truncates"):
        ops["aten.fill.Scalar"].forward(NB, [x], _call(
            {"tensor": 0, "dtype": "torch.int64"}, 0.5), NodeCtx())
    with pytest.raises(ValueError, match="truncates"):
        ops["aten.full.default"].forward(NB, [], _call([2], 0.5, dtype="torch.int64"),
                                         NodeCtx(((2,),)))
    with pytest.raises(ValueError, match="lacks its dtype"):
        ops["aten.index_put.default"].forward(NB, [x, x > 0, np.zeros(())], _call(
            {"tensor": 0}, [{"tensor": 1}], {"tensor": 2}), NodeCtx())
    with pytest.raises(ValueError, match="rounding_mode"):
        ops["aten.div.Tensor_mode"].forward(NB, [x, x], _call(
            {"tensor": 0}, {"tensor": 1}, rounding_mode="floor"), NodeCtx())


def test_normalising_counts_stay_at_their_original_value_under_reduction():
    """mean (and layer norm, loss averaging) divide by the ORIGINAL count at reduced sizes,
    like the plain constants of a traced graph (mean's backward is div.Scalar(g, N))."""
    ops, x = all_ops(), RNG_SMALL.normal(size=(2, 4))
    ctx = NodeCtx(((2, 1),), ((4, 8),), ((4, 1),))
    (m,) = ops["aten.mean.dim"].forward(NB, [x], _call({"tensor": 0}, [-1], True), ctx)
    assert_close(m, x.sum(-1, keepdims=True) / 8)
    lp, t = RNG_SMALL.normal(size=(3, 5)), np.array([0.0, 4.0, 2.0])
    ctx = NodeCtx(((), ()), ((6, 5), (6,)), ((), ()))
    loss, total = ops["aten.nll_loss_forward.default"].forward(
        NB, [lp, t], _call({"tensor": 0}, {"tensor": 1}, None, 1, -100), ctx)
    assert float(total) == 6.0
    assert_close(loss, np.array(-(lp[0, 0] + lp[1, 4] + lp[2, 2]) / 6))


RNG_SMALL = np.random.default_rng(7)


def test_aten_terms_print_as_smtlib_that_z3_reads():
    """Comparisons, ite selections and exact max reach the SMT-LIB printer and parse."""
    from tvsmt.encoding.smtlib import print_obligation

    be = SymbolicBackend()
    x = np.array([be.mgr.Symbol(f"p{i}", be.real) for i in range(3)], dtype=object)
    ops = all_ops()
    m = ops["aten.amax.default"].forward(be, [x], _call({"tensor": 0}, [0]), NodeCtx())[0]
    lt = ops["aten.lt.Scalar"].forward(be, [x], _call({"tensor": 0}, 1), NodeCtx())[0]
    w = ops["aten.where.self"].forward(be, [lt, x, be.zeros((3,))], _call(
        {"tensor": 0}, {"tensor": 1}, {"tensor": 2}), NodeCtx())[0]
    e = ops["aten.embedding.default"].forward(be, [x.reshape(3, 1), x[:1]], _call(
        {"tensor": 0}, {"tensor": 1}), NodeCtx())[0]
    printed = print_obligation([], [(m[()], w[0]), (e[0, 0], w[1])])
    s = z3.Solver()
    s.from_string(printed.text.replace("(check-sat)", ""))
    assert s.check() == z3.sat  # the pairs can differ: a real, parseable obligation


# ----------------------------------------------------------------------------- through verify


def _ref(k, dtype=None):
    return {"tensor": k, **({"dtype": dtype} if dtype else {})}


def _vocab_plans(wrong_start_rank: int | None = None):
    """Single: embedding of token ids in a vocabulary of 8 rows. Parallel (2 ranks): the
    Megatron vocabulary-parallel embedding as the capture writes it in ATen ops (mask the ids
    outside [start, start + 4), look up, zero the masked rows, all-reduce)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from handmade import PlanDict

    b, s, d, vocab, shard = 2, 4, 4, 8, 4
    single = PlanDict("single", "vocab_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    single.t("tok", [b, s], "input"), single.t("W", [vocab, d], "param")
    single.t("e", [b, s, d])
    single.n("emb", "aten.embedding.default", ["W", "tok"], ["e"],
             args=[_ref(0), _ref(1, "torch.int64")], kwargs={})
    single.d["outputs"] = ["e"]

    par = PlanDict("parallel", "vocab_parallel", {"dp": 1, "tp": 2, "pp": 1, "mb": 1, "ranks": 2})
    for r in range(2):
        x = f"@{r}"
        start = r * shard + (1 if r == wrong_start_rank else 0)
        par.t("tok" + x, [b, s], "input"), par.t("W" + x, [shard, d], "param")
        for name, shape in (("lt", [b, s]), ("ge", [b, s]), ("out", [b, s]), ("sub", [b, s]),
                            ("ids", [b, s]), ("emb", [b, s, d]), ("zero", [1]),
                            ("masked", [b, s, d]), ("e", [b, s, d])):
            par.t(name + x, shape)
        i64, bl = "torch.int64", "torch.bool"
        par.n("lt" + x, "aten.lt.Scalar", ["tok" + x], ["lt" + x], rank=r,
              args=[_ref(0, i64), start], kwargs={})
        par.n("ge" + x, "aten.ge.Scalar", ["tok" + x], ["ge" + x], rank=r,
              args=[_ref(0, i64), start + shard], kwargs={})
        par.n("or" + x, "aten.bitwise_or.Tensor", ["lt" + x, "ge" + x], ["out" + x], rank=r,
              args=[_ref(0, bl), _ref(1, bl)], kwargs={})
        par.n("sub" + x, "aten.sub.Tensor", ["tok" + x], ["sub" + x], rank=r,
              args=[_ref(0, i64), start], kwargs={})
        par.n("fill" + x, "aten.masked_fill.Scalar", ["sub" + x, "out" + x], ["ids" + x],
              rank=r, args=[_ref(0, i64), _ref(1, bl), 0], kwargs={})
        par.n("emb" + x, "aten.embedding.default", ["W" + x, "ids" + x], ["emb" + x], rank=r,
              args=[_ref(0), _ref(1, i64)], kwargs={})
        par.n("zero" + x, "aten.zeros.default", [], ["zero" + x], rank=r, args=[[1]],
              kwargs={"dtype": "torch.float32"})
        par.n("put" + x, "aten.index_put.default", ["emb" + x, "out" + x, "zero" + x],
              ["masked" + x], rank=r, args=[_ref(0), [_ref(1, bl)], _ref(2)], kwargs={})
    for r in range(2):
        par.n(f"ar@{r}", "all_reduce", ["masked@0", "masked@1"], [f"e@{r}"], pass_=None,
              rank=r, ranks=[0, 1])
    whole = lambda shape: [(0, n) for n in shape]
    par.lineage("tok", [(whole([b, s]), [f"tok@{r}"]) for r in range(2)])
    par.lineage("W", [([(r * shard, (r + 1) * shard), (0, d)], [f"W@{r}"]) for r in range(2)])
    par.lineage("e", [(whole([b, s, d]), [f"e@{r}"]) for r in range(2)])
    return single.d, par.d


def _verify(single: dict, parallel: dict):
    from tvsmt.plan import plan_from_dict
    from tvsmt.plan.reader import check_pair
    from tvsmt.verify import Options, verify_plans

    s, p = plan_from_dict(single, "single.json"), plan_from_dict(parallel, "parallel.json")
    check_pair(s, p)
    return verify_plans(s, p, Options(jobs=1))


def test_vocab_parallel_embedding_in_aten_ops_is_proven_equivalent():
    report = _verify(*_vocab_plans())
    assert report.verdict == "equivalent", report.failures


def test_a_wrong_vocabulary_range_on_one_rank_is_a_violation():
    report = _verify(*_vocab_plans(wrong_start_rank=1))
    assert report.verdict == "violation", report.failures
    assert report.failures[0].tensor == "e"


def megatron_ce_backward(softmax, tgt, outside):
    """The backward of Megatron's vocab-parallel cross entropy: softmax minus the one-hot
    target where this rank holds it (every dim of the index_put indexed)."""
    g = softmax.clone()
    rows = torch.arange(0, g.shape[0])
    g[rows, tgt] -= 1.0 - outside.float()
    return (g * 2.0,)


def test_index_put_on_every_dim_with_value_indices_is_exact():
    """index_put where every dim is indexed, by a constant arange and by token ids: numeric
    equals torch, and the symbolic terms (ids as free reals) evaluate to it."""
    torch.manual_seed(3)
    sm = torch.rand(4, 5, dtype=F64)
    tgt = torch.tensor([0, 4, 2, 4])
    outside = torch.tensor([False, True, False, False])
    got = [s for s in run_traced(megatron_ce_backward, [sm, tgt, outside], "ce_bw")
           if s.op == "aten.index_put.default"]
    assert got
    spec = all_ops()["aten.index_put.default"]
    for s in got:
        assert_close(spec.forward(NB, s.inputs, s.attrs, s.ctx)[0], s.outputs[0], "index_put")
        _check_symbolic(spec, s)


def layer_norm_weight_only(x, w, b):
    y = F.layer_norm(x, (x.shape[-1],), w, b)
    loss = (y * y).sum()
    return (loss,) + grads(loss, [w, b])


def test_layer_norm_backward_without_input_gradient():
    """When the input needs no gradient (a batch), native_layer_norm_backward's first output
    is absent: the entry and its shape rule still take the node."""
    x = torch.randn(3, 4, dtype=F64)
    samples = [s for s in run_traced(layer_norm_weight_only, [x, rnd(4), rnd(4)], "ln")
               if s.op == "aten.native_layer_norm_backward.default"]
    assert samples and samples[0].outputs[0] is None
    spec = all_ops()[samples[0].op]
    for s in samples:
        got = spec.forward(NB, s.inputs, s.attrs, s.ctx)
        for g, w in zip(got[1:], s.outputs[1:]):
            assert_close(g, w, "layer norm weight/bias gradient")
        c = ShapeConstraints()
        spec.shape(c, _tshapes(s.inputs, "i"), [None] + _tshapes(s.outputs[1:], "o"), s.attrs)
        assert not [k for k in c.constraints if k is False]
