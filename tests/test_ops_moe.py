"""The MoE operators (`gate_fw`, `nnscaler_moe_gmm`) against PyTorch references written here
from the plans' attributes (OPS.md): forward against an autograd-free reference, backward
against torch autograd on an out-of-place reference (indices constant), then the symbolic
semantics evaluated with the real functions; and the soundness of the routing model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import z3
from op_contracts import assert_declared_abstractions, assert_inputs_kept, assert_same_terms
from pysmt.shortcuts import Not, Solver, Symbol
from pysmt.typing import REAL

from tvsmt.encoding.evaluate import FloatEvaluator
from tvsmt.ops import NodeCtx, NumericBackend, SymbolicBackend, all_ops
from tvsmt.ops.backend import UNINTERPRETED, route_topk
from tvsmt.ops.registry import ShapeConstraints, TShape, shape_rule

TESTED_OPS = {"gate_fw", "nnscaler_moe_gmm", "moe_aux_loss", "moe_dispatch",
              "moe_combine"}  # read by test_ops_torch's coverage test

NB = NumericBackend()
RNG = np.random.default_rng(77)
CTX = NodeCtx()


def rand(*shape):
    return RNG.uniform(-2.0, 2.0, size=shape)


def t(x, grad=False):
    return torch.from_numpy(np.array(x, dtype=np.float64)).requires_grad_(grad)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b), rtol=1e-6,
                               atol=1e-9)


# ----------------------------------------------------------------------------- references


def gate_ref(x, wg, attrs):
    """DeepSeek-V3 Gate.forward, out of place, from the attributes (no bias)."""
    logits = x @ wg.T
    s = torch.sigmoid(logits) if attrs["score_func"] == "sigmoid" else logits.softmax(-1)
    sel = s
    g, tg = attrs["n_groups"], attrs["topk_groups"]
    if g > 1:
        blocks = sel.view(x.shape[0], g, -1)
        best = blocks.amax(-1).topk(tg, -1).indices
        drop = torch.ones(x.shape[0], g, dtype=torch.bool).scatter(1, best, False)
        sel = blocks.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
    idx = torch.topk(sel, attrs["topk"], -1).indices
    w = s.gather(1, idx)
    if attrs["score_func"] == "sigmoid":
        w = w / w.sum(-1, keepdim=True)
    return w * attrs["route_scale"], idx


def gmm_ref(h, idx, w, w11, w33, w22, start):
    """Grouped GEMM as the source computes it: tokens gathered per local expert, expert MLP,
    scaled by their weight and scattered back (index_add)."""
    y = torch.zeros_like(h)
    for e in range(w11.shape[0]):
        tok, slot = (idx == start + e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        v = h[tok]
        out = (F.silu(v @ w11[e].T) * (v @ w33[e].T)) @ w22[e].T
        y = y.index_add(0, tok, out * w[tok, slot, None])
    return y


GATE_ATTRS = [
    # group limiting changes the selection (k > topk_groups blocks' best experts)
    dict(score_func="sigmoid", bias=None, n_groups=4, topk_groups=2, topk=3, route_scale=2.5,
         n_routed_experts=16, consts=[]),
    dict(score_func="sigmoid", bias=None, n_groups=1, topk_groups=1, topk=2, route_scale=1.0,
         n_routed_experts=8, consts=[]),
    dict(score_func="softmax", bias=None, n_groups=2, topk_groups=1, topk=2, route_scale=1.5,
         n_routed_experts=8, consts=[]),
]


def gate_inputs(attrs, tokens=24, hidden=5):
    return [rand(tokens, hidden), rand(attrs["n_routed_experts"], hidden)]


@pytest.mark.parametrize("attrs", GATE_ATTRS, ids=lambda a: f"{a['score_func']}-g{a['n_groups']}")
def test_gate_forward_matches_torch(attrs):
    x, wg = gate_inputs(attrs)
    w, idx = all_ops()["gate_fw"].forward(NB, [x, wg], attrs, CTX)
    rw, ridx = gate_ref(t(x), t(wg), attrs)
    close(idx, ridx.numpy())
    close(w, rw.numpy())


def test_group_limiting_changes_some_selections():
    """The first case really exercises group limiting (else it would test nothing)."""
    attrs = GATE_ATTRS[0]
    x, wg = gate_inputs(attrs, tokens=64)
    s = 1 / (1 + np.exp(-(x @ wg.T)))
    plain = np.argsort(-s, axis=-1)[:, :attrs["topk"]]
    limited = route_topk(s, attrs["topk"], attrs["n_groups"], attrs["topk_groups"])
    assert (plain != limited).any(axis=-1).sum() > 0


@pytest.mark.parametrize("attrs", GATE_ATTRS, ids=lambda a: f"{a['score_func']}-g{a['n_groups']}")
def test_gate_backward_matches_autograd(attrs):
    x, wg = gate_inputs(attrs)
    xt, wt = t(x, True), t(wg, True)
    w, _ = gate_ref(xt, wt, attrs)
    g = rand(*w.shape)
    ex, ew = torch.autograd.grad(w, [xt, wt], grad_outputs=[t(g)])
    gx, gw = all_ops()["gate_fw"].backward(NB, [g, None, x, wg], attrs, CTX)
    close(gx, ex.numpy())
    close(gw, ew.numpy())


def gmm_inputs(n_experts=8, start=2, end=6, tokens=10, hidden=4, inner=3, k=3):
    idx = np.stack([RNG.permutation(n_experts)[:k] for _ in range(tokens)]).astype(np.float64)
    el = end - start
    return [rand(tokens, hidden), idx, rand(tokens, k), rand(el, inner, hidden),
            rand(el, inner, hidden), rand(el, hidden, inner)], dict(
        n_routed_experts=n_experts, local_expert_start=start, local_expert_end=end, consts=[])


def test_gmm_forward_matches_torch():
    ins, attrs = gmm_inputs()
    (y,) = all_ops()["nnscaler_moe_gmm"].forward(NB, ins, attrs, CTX)
    h, idx, w, a, b, c = ins
    close(y, gmm_ref(t(h), torch.from_numpy(idx.astype(np.int64)), t(w), t(a), t(b), t(c),
                     2).numpy())


def test_gmm_backward_matches_autograd():
    ins, attrs = gmm_inputs()
    h, idx, w, a, b, c = ins
    ts = [t(h, True), torch.from_numpy(idx.astype(np.int64)), t(w, True), t(a, True),
          t(b, True), t(c, True)]
    y = gmm_ref(*ts, 2)
    g = rand(*y.shape)
    wrt = [ts[0]] + ts[2:]
    expected = torch.autograd.grad(y, wrt, grad_outputs=[t(g)])
    got = all_ops()["nnscaler_moe_gmm"].backward(NB, [g] + ins, attrs, CTX)
    assert got[1] is None
    for mine, ref in zip([got[0]] + got[2:], expected):
        close(mine, ref.numpy())
    assert np.abs(got[2]).max() > 0  # the router's gradient is really computed


def test_expert_ranges_partition_the_unsharded_gemm():
    """Summing the nodes of a partition of [0, E) gives the single node, fw and bw."""
    ins, attrs = gmm_inputs(start=0, end=8)
    spec = all_ops()["nnscaler_moe_gmm"]
    g = rand(*ins[0].shape)
    (full,) = spec.forward(NB, ins, attrs, CTX)
    full_bw = spec.backward(NB, [g] + ins, attrs, CTX)
    parts, parts_bw = [], []
    for lo, hi in ((0, 3), (3, 8)):
        sub = ins[:3] + [x[lo:hi] for x in ins[3:]]
        a = dict(attrs, local_expert_start=lo, local_expert_end=hi)
        parts.append(spec.forward(NB, sub, a, CTX)[0])
        parts_bw.append(spec.backward(NB, [g] + sub, a, CTX))
    close(parts[0] + parts[1], full)
    close(parts_bw[0][0] + parts_bw[1][0], full_bw[0])
    close(parts_bw[0][2] + parts_bw[1][2], full_bw[2])
    close(np.concatenate([parts_bw[0][3], parts_bw[1][3]]), full_bw[3])


def test_gmm_indicators_are_exact_for_repeated_and_foreign_indices():
    ins, attrs = gmm_inputs(start=2, end=6, k=3)
    ins[1][0] = [3, 3, 7]  # expert 3 twice, expert 7 not local
    (y,) = all_ops()["nnscaler_moe_gmm"].forward(NB, ins, attrs, CTX)
    h, idx, w, a, b, c = ins
    close(y, gmm_ref(t(h), torch.from_numpy(idx.astype(np.int64)), t(w), t(a), t(b), t(c),
                     2).numpy())


def aux_ref(w, idx, n_experts, alpha):
    """Sequence-wise balance loss from the attributes: f from the routing counts, P from the
    router weights routed to each expert."""
    b, s, k = idx.shape
    hot = F.one_hot(idx, n_experts).to(w.dtype)  # (B, S, k, E)
    f = hot.sum((1, 2)) * n_experts / (k * s)
    p = (hot * w[..., None]).sum((1, 2)) / s
    return (alpha * (f * p).sum()).reshape(1)


def aux_inputs(n_experts=8):
    idx = np.stack([RNG.permutation(n_experts)[:3] for _ in range(6)]).reshape(2, 3, 3)
    return [rand(2, 3, 3), idx.astype(np.float64)], {"n_routed_experts": n_experts,
                                                     "alpha": 0.01}


def test_aux_loss_matches_torch_forward_and_autograd():
    (w, idx), attrs = aux_inputs()
    spec = all_ops()["moe_aux_loss"]
    it = torch.from_numpy(idx.astype(np.int64))
    (loss,) = spec.forward(NB, [w, idx], attrs, CTX)
    close(loss, aux_ref(t(w), it, 8, 0.01).detach().numpy())
    wt = t(w, True)
    g = rand(1)
    (expected,) = torch.autograd.grad(aux_ref(wt, it, 8, 0.01), [wt], grad_outputs=[t(g)])
    gw, gi = spec.backward(NB, [g, w, idx], attrs, CTX)
    assert gi is None
    close(gw, expected.numpy())


def test_aux_loss_sums_over_sequences():
    """Splitting the batch by sequences (dp, micro-batches) sums the loss exactly."""
    (w, idx), attrs = aux_inputs()
    spec = all_ops()["moe_aux_loss"]
    (whole,) = spec.forward(NB, [w, idx], attrs, CTX)
    parts = [spec.forward(NB, [w[i:i + 1], idx[i:i + 1]], attrs, CTX)[0] for i in range(2)]
    close(parts[0] + parts[1], whole)


# ----------------------------------------------------------------------------- symbolic


def symbols(arrays, prefix, env):
    out = []
    for k, a in enumerate(arrays):
        if a is None:
            out.append(None)
            continue
        s = np.empty(a.shape, dtype=object)
        for i in np.ndindex(a.shape):
            s[i] = Symbol(f"{prefix}{k}_" + "_".join(map(str, i)), REAL)
            env[s[i].symbol_name()] = float(a[i])
        out.append(s)
    return out


def evaluated(sym, env):
    ev = FloatEvaluator(env)
    return np.array([ev.walk(x) for x in sym.reshape(-1)]).reshape(sym.shape)


@pytest.mark.parametrize("attrs", GATE_ATTRS, ids=lambda a: f"{a['score_func']}-g{a['n_groups']}")
def test_gate_symbolic_with_real_functions_matches_numeric(attrs):
    """The symbolic router, its selection UF read as route_topk, computes the numeric one."""
    be, spec, env = SymbolicBackend(), all_ops()["gate_fw"], {}
    x, wg = gate_inputs(attrs, tokens=3, hidden=2)
    num = spec.forward(NB, [x, wg], attrs, CTX)
    sym = spec.forward(be, symbols([x, wg], "x", env), attrs, CTX)
    for s, n in zip(sym, num):
        close(evaluated(s, env), n)
    g = rand(3, attrs["topk"])
    num_bw = spec.backward(NB, [g, None, x, wg], attrs, CTX)
    sym_bw = spec.backward(be, symbols([g, None, x, wg], "b", env), attrs, CTX)
    for s, n in zip(sym_bw, num_bw):
        close(evaluated(s, env), n)


def test_aux_symbolic_matches_numeric():
    be, spec, env = SymbolicBackend(), all_ops()["moe_aux_loss"], {}
    ins, attrs = aux_inputs()
    (num,) = spec.forward(NB, ins, attrs, CTX)
    (sym,) = spec.forward(be, symbols(ins, "x", env), attrs, CTX)
    close(evaluated(sym, env), num)
    g = rand(1)
    num_bw = spec.backward(NB, [g] + ins, attrs, CTX)
    sym_bw = spec.backward(be, symbols([g] + ins, "b", env), attrs, CTX)
    close(evaluated(sym_bw[0], env), num_bw[0])


def test_gmm_symbolic_matches_numeric():
    be, spec, env = SymbolicBackend(), all_ops()["nnscaler_moe_gmm"], {}
    ins, attrs = gmm_inputs(tokens=2, hidden=2, inner=2)
    (num,) = spec.forward(NB, ins, attrs, CTX)
    (sym,) = spec.forward(be, symbols(ins, "x", env), attrs, CTX)
    close(evaluated(sym, env), num)
    g = rand(*num.shape)
    num_bw = spec.backward(NB, [g] + ins, attrs, CTX)
    sym_bw = spec.backward(be, symbols([g] + ins, "b", env), attrs, CTX)
    for s, n in zip(sym_bw, num_bw):
        if n is None:
            assert s is None
        else:
            close(evaluated(s, env), n)


def _selection(be, row):
    return be.topk_route(np.array([row], dtype=object), 2, 2, 1)[0]


def _provable(claim) -> bool:
    with Solver(name="z3") as s:
        s.add_assertion(Not(claim))
        return not s.solve()


def test_selection_is_congruent_on_equal_whole_rows():
    be = SymbolicBackend()
    row = [Symbol(f"r{i}", REAL) for i in range(4)]
    a, b = _selection(be, row), _selection(be, list(row))
    assert all(x is y for x, y in zip(a, b))  # the same term: proven without a solver


def test_selection_from_a_shard_or_a_reordered_row_is_not_proven():
    """Selecting from half of the experts, or from the experts in another order, is not the
    selection of the whole row: no proof (the solver finds an interpretation that differs)."""
    be = SymbolicBackend()
    row = [Symbol(f"q{i}", REAL) for i in range(4)]
    whole = _selection(be, row)
    swapped = _selection(be, row[2:] + row[:2])
    assert not _provable(whole[0].Equals(swapped[0]))
    shard = be.topk_route(np.array([row[:2]], dtype=object), 1, 1, 1)[0]
    assert not _provable(whole[0].Equals(shard[0]))


def test_selection_function_has_its_real_counterpart():
    be = SymbolicBackend()
    row = [Symbol(f"p{i}", REAL) for i in range(8)]
    idx = be.topk_route(np.array([row], dtype=object), 3, 4, 2)[0]
    env = {f"p{i}": v for i, v in enumerate(RNG.uniform(size=8))}
    got = [FloatEvaluator(env).walk(x) for x in idx]
    want = route_topk(np.array([[env[f"p{i}"] for i in range(8)]]), 3, 4, 2)[0]
    assert got == list(map(float, want))
    assert idx[0].function_name().symbol_name() in UNINTERPRETED


# ----------------------------------------------------------------------------- shapes, refusals


def _shapes(arrays, prefix):
    return [None if a is None else
            TShape([z3.Int(f"{prefix}{k}_{i}") for i in range(a.ndim)], tuple(a.shape))
            for k, a in enumerate(arrays)]


def _accepts(rule, ins, outs, attrs, fix=None) -> bool:
    """Whether the rule holds with the dims at the arrays' shapes, or with one dim (slot,
    axis) halved (`fix`), every other dim free."""
    c = ShapeConstraints()
    tin, tout = _shapes(ins, "i"), _shapes(outs, "o")
    rule(c, tin, tout, attrs)
    solver = z3.Solver()
    solver.add(*c.constraints)
    if fix is None:
        for ts, a in zip(tin + tout, list(ins) + list(outs)):
            if ts is not None:
                solver.add(*[d == n for d, n in zip(ts.dims, a.shape)])
    else:
        slot, axis = fix
        solver.add(tin[slot].dims[axis] == ins[slot].shape[axis] // 2)
    return solver.check() == z3.sat


@pytest.mark.parametrize("op", ["gate_fw", "moe_aux_loss", "nnscaler_moe_gmm"])
def test_shape_rules_keep_k_and_let_experts_shrink_on_their_boundaries(op):
    """The rules accept the real shapes (fw and bw) and never let k shrink, while the tokens
    and the expert axis (E, El) may, keeping the router groups' and the local range's first
    expert whole positions (boundaries handed to the shape reducer)."""
    spec = all_ops()[op]
    boundaries = []
    if op == "gate_fw":
        attrs = GATE_ATTRS[0]
        ins = gate_inputs(attrs)
        fixed, free = [], [(0, 0), (1, 0)]  # x rows (T); Wg rows (E)
        boundaries = [(1, 0, attrs["n_routed_experts"] // attrs["n_groups"])]
    elif op == "moe_aux_loss":
        ins, attrs = aux_inputs()
        ins = [ins[0][:, :2], ins[1][:, :2]]  # an even sequence length, to halve
        fixed, free = [(0, 2), (1, 2)], [(0, 1)]  # k; the sequence length
    else:
        ins, attrs = gmm_inputs()
        fixed, free = [(1, 1), (2, 1)], [(0, 0), (3, 0), (4, 0), (5, 0)]
        boundaries = [(3, 0, attrs["local_expert_start"])]
    outs = spec.forward(NB, ins, attrs, CTX)
    fw = shape_rule(spec, False)
    assert _accepts(fw, ins, outs, attrs)
    for slot_axis in fixed:
        assert not _accepts(fw, ins, outs, attrs, slot_axis), slot_axis
    for slot_axis in free:
        assert _accepts(fw, ins, outs, attrs, slot_axis), slot_axis
    c = ShapeConstraints()
    tin = _shapes(ins, "i")
    fw(c, tin, _shapes(outs, "o"), attrs)
    kept = {(str(b.dim), b.at) for b in c.boundaries}
    for slot, axis, at in boundaries:
        assert (str(tin[slot].dims[axis]), at) in kept, (kept, slot, axis, at)
    bw_ins = ([rand(*outs[0].shape), None] + ins) if op == "gate_fw" else ([outs[0]] + ins)
    bw_outs = spec.backward(NB, bw_ins, attrs, CTX)
    assert _accepts(shape_rule(spec, True), bw_ins, bw_outs, attrs)


def test_unsupported_router_attributes_are_refused():
    spec = all_ops()["gate_fw"]
    attrs = GATE_ATTRS[1]
    x, wg = gate_inputs(attrs)
    with pytest.raises(ValueError, match="bias"):
        spec.forward(NB, [x, wg], dict(attrs, bias=[0.1] * 8), CTX)
    with pytest.raises(ValueError, match="n_routed_experts"):
        spec.forward(NB, [x, wg], dict(attrs, n_routed_experts=16), CTX)
    with pytest.raises(ValueError, match="score_func"):
        spec.forward(NB, [x, wg], dict(attrs, score_func="relu"), CTX)
    ins, gattrs = gmm_inputs()
    with pytest.raises(ValueError, match="experts"):
        all_ops()["nnscaler_moe_gmm"].forward(NB, ins, dict(gattrs, local_expert_end=7), CTX)


def test_real_functions_tolerate_nan_free_rows():
    assert math.isfinite(UNINTERPRETED["uf_topk4"](0, 2, 1, 1, 0.1, 0.9, 0.3, 0.5))


# ----------------------------------------------------------------------------- expert parallelism


def all_to_all_ref(xs):
    """torch.distributed.all_to_all_single on equal splits, emulated: member q receives
    chunk q of every member's tensor, in member order."""
    n = len(xs)
    return [torch.cat([x.chunk(n, 0)[q] for x in xs], 0) for q in range(n)]


def _a2a(xs):
    spec = all_ops()["all_to_all"]
    ranks = list(range(len(xs)))
    return [spec.forward(NB, list(xs), {"dim": 0, "split_dim": 0, "ranks": ranks, "idx": q},
                         CTX)[0] for q in ranks]


def test_all_to_all_matches_torch_and_is_its_own_inverse():
    xs = [rand(6, 3) for _ in range(3)]
    got = _a2a(xs)
    for mine, ref in zip(got, all_to_all_ref([t(x) for x in xs])):
        close(mine, ref.numpy())
    for back, x in zip(_a2a(got), xs):  # hence the backward of an all_to_all is one
        close(back, x)


def ep_layer(ins, tp, ep, n_experts):
    """The generator's expert-parallel layer on one tp group, with the registry's ops:
    dispatch, all_to_all, local experts, all_to_all, combine, summed over the tp ranks.
    Returns (y, backward(g) -> [g_h, g_w, g_W11, g_W33, g_W22] of the full tensors)."""
    h, idx, w, w11, w33, w22 = ins
    ops = all_ops()
    el = n_experts // ep
    tokens = h.shape[0]
    dis = [{"piece": r, "pieces": tp, "ep": ep} for r in range(tp)]
    gmm = [dict(n_routed_experts=n_experts, local_expert_start=(r % ep) * el,
                local_expert_end=(r % ep + 1) * el, consts=[]) for r in range(tp)]
    local = [(w11[(r % ep) * el:(r % ep + 1) * el], w33[(r % ep) * el:(r % ep + 1) * el],
              w22[(r % ep) * el:(r % ep + 1) * el]) for r in range(tp)]

    def a2a(parts):  # inside each group of ep consecutive ranks
        out = []
        for g0 in range(0, tp, ep):
            out += _a2a(parts[g0:g0 + ep])
        return out

    sent = [ops["moe_dispatch"].forward(NB, [h, idx, w], dis[r], CTX) for r in range(tp)]
    recv = [a2a([s[i] for s in sent]) for i in range(3)]
    yq = [ops["nnscaler_moe_gmm"].forward(NB, [recv[0][r], recv[1][r], recv[2][r], *local[r]],
                                          gmm[r], CTX)[0] for r in range(tp)]
    ys = a2a(yq)
    y = sum(ops["moe_combine"].forward(NB, [ys[r]], dis[r], CTX)[0] for r in range(tp))

    def backward(g):
        g_ys = [ops["moe_combine"].backward(NB, [g, ys[r]], dis[r], CTX)[0] for r in range(tp)]
        g_yq = a2a(g_ys)
        bw = [ops["nnscaler_moe_gmm"].backward(
            NB, [g_yq[r], recv[0][r], recv[1][r], recv[2][r], *local[r]], gmm[r], CTX)
            for r in range(tp)]
        g_x, g_w = a2a([b[0] for b in bw]), a2a([b[2] for b in bw])
        dbw = [ops["moe_dispatch"].backward(NB, [g_x[r], None, g_w[r], h, idx, w], dis[r],
                                            CTX) for r in range(tp)]
        assert all(d[1] is None for d in dbw)
        experts = []
        for slot in (3, 4, 5):  # the expert-data-parallel sum: ranks at the same position
            experts.append(np.concatenate([sum(bw[r][slot] for r in range(tp) if r % ep == q)
                                           for q in range(ep)]))
        return [sum(d[0] for d in dbw), sum(d[2] for d in dbw)] + experts

    assert y.shape == (tokens, h.shape[1])
    return y, backward


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2), (4, 1), (4, 4)])
def test_expert_parallel_layer_matches_torch_forward_and_backward(tp, ep):
    ins, _ = gmm_inputs(start=0, end=8, tokens=8)
    h, idx, w, a, b, c = ins
    y, backward = ep_layer(ins, tp, ep, 8)
    ts = [t(h, True), torch.from_numpy(idx.astype(np.int64)), t(w, True), t(a, True),
          t(b, True), t(c, True)]
    ref = gmm_ref(*ts, 0)
    close(y, ref.detach().numpy())
    g = rand(*y.shape)
    expected = torch.autograd.grad(ref, [ts[0]] + ts[2:], grad_outputs=[t(g)])
    for mine, exp in zip(backward(g), expected):
        close(mine, exp.numpy())


def test_dispatch_to_the_wrong_member_changes_the_result():
    """A member receiving another member's tokens (with its own indices) computes something
    else: the all_to_all's order matters, so the bug zoo's wrong-rank dispatch is a bug."""
    ins, _ = gmm_inputs(start=0, end=8, tokens=8)
    ops = all_ops()
    h, idx, w = ins[:3]
    dis = [{"piece": r, "pieces": 2, "ep": 2} for r in range(2)]
    sent = [ops["moe_dispatch"].forward(NB, [h, idx, w], d, CTX) for d in dis]
    right = _a2a([s[0] for s in sent])
    wrong = _a2a([sent[1][0], sent[0][0]])
    assert not np.allclose(right[0], wrong[0])


@pytest.mark.parametrize("op", ["moe_dispatch", "moe_combine"])
def test_dispatch_and_combine_symbolic_match_numeric_and_keep_rows(op):
    be, spec, env = SymbolicBackend(), all_ops()[op], {}
    attrs = {"piece": 1, "pieces": 2, "ep": 2}
    if op == "moe_dispatch":
        ins = [rand(4, 3), np.array([[0., 1.], [2., 3.], [1., 0.], [3., 2.]]), rand(4, 2)]
        bw_extra = 3
    else:
        ins = [rand(4, 3)]
        bw_extra = 1
    num = spec.forward(NB, ins, attrs, CTX)
    sym = spec.forward(be, symbols(ins, "x", env), attrs, CTX)
    for a, b in zip(num, sym):
        close(evaluated(b, env), a)
    gs = [rand(*o.shape) for o in num]
    if op == "moe_dispatch":
        gs[1] = None
    num_bw = spec.backward(NB, gs + ins, attrs, CTX)
    sym_bw = spec.backward(be, symbols(gs + ins, "b", env), attrs, CTX)
    for a, b in zip(num_bw, sym_bw):
        if a is not None:
            close(evaluated(b, env), a)
    assert len(num_bw) == bw_extra
    fw = shape_rule(spec, False)
    assert _accepts(fw, ins, num, attrs)
    assert not _accepts(fw, ins, num, attrs, (0, 0))  # rows are positions: never reduced


def _moe_runs():
    """(op, pass, inputs, attrs) of every MoE operator, forward and backward."""
    ops = all_ops()
    runs = []
    for attrs in GATE_ATTRS:
        x, wg = gate_inputs(attrs)
        w, _ = ops["gate_fw"].forward(NB, [x, wg], attrs, CTX)
        runs += [("gate_fw", "fw", [x, wg], attrs),
                 ("gate_fw", "bw", [rand(*w.shape), None, x, wg], attrs)]
    ins, attrs = gmm_inputs()
    (y,) = ops["nnscaler_moe_gmm"].forward(NB, ins, attrs, CTX)
    runs += [("nnscaler_moe_gmm", "fw", ins, attrs),
             ("nnscaler_moe_gmm", "bw", [rand(*y.shape)] + ins, attrs)]
    (w, idx), attrs = aux_inputs()
    runs += [("moe_aux_loss", "fw", [w, idx], attrs),
             ("moe_aux_loss", "bw", [rand(1), w, idx], attrs)]
    h, idx, w = ins[0], ins[1], ins[2]
    dis = {"piece": 1, "pieces": 2, "ep": 2}
    sent = ops["moe_dispatch"].forward(NB, [h, idx, w], dis, CTX)
    runs += [("moe_dispatch", "fw", [h, idx, w], dis),
             ("moe_dispatch", "bw", [rand(*sent[0].shape), None, rand(*sent[2].shape), h, idx,
                                     w], dis)]
    (out,) = ops["moe_combine"].forward(NB, [sent[0]], dis, CTX)
    runs += [("moe_combine", "fw", [sent[0]], dis),
             ("moe_combine", "bw", [rand(*out.shape), sent[0]], dis)]
    return runs


def test_moe_rules_leave_their_input_arrays_as_they_were():
    """As test_ops_torch's test of every other operator: a rule that wrote into an input
    array would change what the tensor's other readers, and the node memo, see. Forward and
    backward, numeric and symbolic."""
    ops = all_ops()
    runs = _moe_runs()
    assert {op for op, *_ in runs} == TESTED_OPS
    be = SymbolicBackend()
    for op, pass_, ins, attrs in runs:
        spec = ops[op]
        rule = spec.forward if pass_ == "fw" else spec.backward
        for backend, arrays in ((NB, ins), (be, symbols(ins, "s", {}))):
            assert_inputs_kept(rule, backend, arrays, attrs, CTX, f"{op} {pass_}")


def test_moe_symbolic_rules_give_the_very_same_terms_on_the_same_inputs():
    """As test_ops_torch's test of every other operator (the node memo's premise): run twice
    on the same input terms in one backend, each MoE rule gives the very same terms."""
    ops, be = all_ops(), SymbolicBackend()
    for op, pass_, ins, attrs in _moe_runs():
        spec = ops[op]
        rule = spec.forward if pass_ == "fw" else spec.backward
        assert_same_terms(rule, be, symbols(ins, "s", {}), attrs, CTX, f"{op} {pass_}")


def test_moe_rules_apply_only_the_uninterpreted_functions_they_declare():
    """As test_ops_torch's test of every other operator: each MoE rule, forward and
    backward, applies only the uninterpreted functions of its `OpSpec.abstracts`."""
    ops, be = all_ops(), SymbolicBackend()
    for op, pass_, ins, attrs in _moe_runs():
        spec = ops[op]
        rule = spec.forward if pass_ == "fw" else spec.backward
        assert_declared_abstractions(rule, be, symbols(ins, "s", {}), attrs, CTX,
                                     spec.abstracts, f"{op} {pass_}")
