"""Mixture-of-experts operators: the router `gate_fw` and the grouped expert GEMM
`nnscaler_moe_gmm` (slots and attributes as in `../shared/plans/OPS.md`).

Routing is the one value-dependent choice in a MoE layer. The selection (top-k after group
limiting) is an uninterpreted function of the WHOLE score row (`Backend.topk_route`,
`uf_topk<E>` in `backend.UNINTERPRETED`, real function `backend.route_topk`); everything
around it is exact:

* the selected weights are the scores at the selected indices, `w_j = sum_e [idx_j == e] s_e`
  (an exact indicator per expert, `ite` on an equality, so also right for an index that is
  out of range or repeated: it selects nothing, or twice);
* the sigmoid normalisation `w / sum(w)` and `route_scale` are exact (division by a tensor is
  `w * uf_recip(sum(w))`);
* the backward is the exact VJP with the indices held constant (they are piecewise constant);
* the expert GEMM sums `[idx == e] * w * F_e(h)` over its local experts exactly.

Why this is sound: a proof holds for every interpretation of `uf_topk<E>`, hence for the real
top-k. Two selections are equal in every interpretation only when their arguments are equal,
i.e. when both plans select from equal score rows, in the same expert order, with equal
k / n_groups / topk_groups. A plan that selects from a shard of the row, or from different
logits, gets a different term and is not proven. A counterexample through the function is
re-checked with `route_topk` before it is reported (the verifier's usual rule for UFs).

Shape reduction may reduce the expert axis E like a vocabulary (embedding): experts are
positions that indices select by exact indicators, each expert computes the same function of
its own weights. A reduction by s keeps every expert-range boundary (`local_expert_start`, the
lineage slices of the expert weights) and every router group boundary an integer position,
and rescales the ranges to the reduced axis (start * E' / E); a range that s does not divide
keeps E unreduced. The router's selection is uninterpreted either way, so a proof at E' holds
for every selection function over E' experts, i.e. for every way the tokens are routed among
the reduced ranges, which are the original ranges scaled. k is never reduced (and E' >= k).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tvsmt.ops.backend import TOPK_UFS, exact
from tvsmt.ops.definitions._common import add_all, nontrivial, require
from tvsmt.ops.registry import AttrError, OpSpec, register

# ----------------------------------------------------------------------------- router


def _gate_attrs(attrs: dict, n_experts: int, orig_experts: int | None = None
                ) -> tuple[str, int, int, int, object]:
    """Router attributes; `n_experts` is the (possibly reduced) row length, `orig_experts`
    the plan's."""
    if attrs.get("bias") is not None:
        raise AttrError("gate_fw: a router bias is not supported (attrs.bias must be null)")
    func = attrs.get("score_func", "softmax")
    if func not in ("sigmoid", "softmax"):
        raise AttrError(f"gate_fw: unknown score_func {func!r}")
    k = int(attrs["topk"])
    n_groups = int(attrs.get("n_groups") or 1)
    topk_groups = int(attrs.get("topk_groups") or 1)
    declared = attrs.get("n_routed_experts")
    rows = n_experts if orig_experts is None else orig_experts
    if declared is not None and int(declared) != rows:
        raise AttrError(f"gate_fw: router weight has {rows} rows, attrs say "
                         f"n_routed_experts = {declared}")
    if n_groups > 1 and n_experts % n_groups:
        raise AttrError(f"gate_fw: {n_experts} experts do not form {n_groups} groups")
    if not 0 < k <= n_experts:
        raise AttrError(f"gate_fw: topk = {k} with {n_experts} experts")
    return func, k, n_groups, topk_groups, attrs.get("route_scale", 1.0)


def _scores(be, x, wg, func):
    """Router scores s (T, E): sigmoid or softmax (over all E) of x @ Wg^T."""
    logits = x @ wg.T
    if func == "sigmoid":
        return be.sigmoid(logits)
    e = be.exp(logits)
    return be.div(e, np.sum(e, axis=-1, keepdims=True))


def _pick(be, idx, values, first=0):
    """values[..., idx - first] for each index (..., k), from values (..., n): the exact sum
    of `[idx == first + e] ? values[..., e] : 0` (nothing for an index out of range)."""
    zero = be.zeros(idx.shape)
    out = zero
    for e in range(values.shape[-1]):
        out = out + be.select_eq(idx, first + e, values[..., e:e + 1], zero)
    return out


def _spread(be, idx, vals, n, first=0):
    """out[..., e] = sum_j [idx[..., j] == first + e] ? vals[..., j] : 0 (a scatter-add of
    vals (..., k) into n expert slots), exact."""
    zero = be.zeros(idx.shape)
    return np.stack([np.sum(be.select_eq(idx, first + e, vals, zero), axis=-1)
                     for e in range(n)], -1)


def _orig_rows(ctx, slot: int) -> int | None:
    orig = ctx.orig_in[slot] if len(ctx.orig_in) > slot else None
    return None if orig is None else int(orig[0])


def _route(be, x, wg, attrs, orig_experts=None):
    func, k, n_groups, topk_groups, scale = _gate_attrs(attrs, wg.shape[0], orig_experts)
    s = _scores(be, x, wg, func)
    idx = be.topk_route(s, k, n_groups, topk_groups)
    return func, scale, s, idx, _pick(be, idx, s)  # v (T, k): s at the selected experts


def gate_fw(be, ins, attrs, ctx):
    func, scale, s, idx, v = _route(be, ins[0], ins[1], attrs, _orig_rows(ctx, 1))
    w = v
    if func == "sigmoid":
        w = be.div(v, np.sum(v, axis=-1, keepdims=True))
    return [be.scale(w, scale), idx]


def gate_bw(be, ins, attrs, ctx):
    g, x, wg = ins[0], ins[2], ins[3]
    func, scale, s, idx, v = _route(be, x, wg, attrs, _orig_rows(ctx, 3))
    g = be.scale(g, scale)
    if func == "sigmoid":
        total = np.sum(v, axis=-1, keepdims=True)
        dv = be.div(g - be.div(np.sum(g * v, axis=-1, keepdims=True), total), total)
    else:
        dv = g
    ds = _spread(be, idx, dv, wg.shape[0])  # scatter_add of dv into the E slots
    if func == "sigmoid":
        dz = ds * s * (be.scale(s, -1) + be.const(1))
    else:
        dz = s * (ds - np.sum(ds * s, axis=-1, keepdims=True))
    return [dz @ wg, dz.T @ x]


def gate_shape(c, ins, outs, attrs):
    x, wg = ins[0], ins[1]
    require(len(x) == 2 and len(wg) == 2, "gate_fw: x must be (T, H) and Wg (E, H)")
    require(x.orig[1] == wg.orig[1], f"gate_fw: x {list(x.orig)} does not match Wg "
                                     f"{list(wg.orig)}")
    k = int(attrs["topk"])
    c.eq(x[1], wg[1])
    nontrivial(c, x, [1])
    # E may be reduced (module doc): every router group keeps whole experts, E' >= k
    n_groups = int(attrs.get("n_groups") or 1)
    if n_groups > 1 and wg.orig[0] % n_groups == 0:
        c.keep_boundary(wg[0], wg.orig[0] // n_groups)
    if not isinstance(wg[0], int):
        c.add(wg[0] >= k)
    for y in outs[:2]:
        if y is None:
            continue
        require(tuple(y.orig) == (x.orig[0], k), f"gate_fw: output {list(y.orig)} is not "
                                                  f"[{x.orig[0]}, {k}]")
        c.eq(y[0], x[0])
        c.eq(y[1], k)


register(OpSpec(
    "gate_fw", gate_fw, gate_shape, gate_bw, n_outputs=lambda attrs, n_in: 2,
    abstracts=("uf_sigmoid", "uf_exp", "uf_recip") + TOPK_UFS, reads_mirrors=True,
    doc="MoE router, fw [x (T,H), Wg (E,H)] -> [weights (T,k), indices (T,k)]: s = "
        "sigmoid(x @ Wg^T) (or softmax over E); indices = uf_topk<E>(j, k, n_groups, "
        "topk_groups, s[t, :]) for slot j, an uninterpreted function of the WHOLE score row "
        "(real function: top-k after group limiting, backend.route_topk); weights_j = sum_e "
        "[idx_j == e] s_e exactly, sigmoid: / sum_j weights_j, then * route_scale. bw [g_w, "
        "null, x, Wg] -> [g_x, g_Wg], the exact VJP with the indices constant (recomputed by "
        "the same function of the same row). Sound: a proof holds for every selection "
        "function, so for the real one; two selections agree only through congruence, i.e. "
        "when both plans select from equal whole rows with equal k and groups. k is never "
        "reduced; E may be, keeping every group boundary (module doc)."))


# ----------------------------------------------------------------------------- grouped GEMM


def _expert_range(attrs, n_local: int, orig_local: int | None = None) -> int:
    """First local expert, on the (possibly reduced) expert axis: attrs are written for the
    plan's `orig_local` experts, the weights hold `n_local` (start rescaled by
    n_local / orig_local, like a vocabulary shard's first row)."""
    rows = n_local if orig_local is None else orig_local
    start, end = int(attrs.get("local_expert_start", 0)), attrs.get("local_expert_end")
    end = start + rows if end is None else int(end)
    if end - start != rows:
        raise AttrError(f"nnscaler_moe_gmm: experts [{start}, {end}) but the weights hold "
                         f"{rows}")
    total = attrs.get("n_routed_experts")
    if total is not None and not 0 <= start < end <= int(total):
        raise AttrError(f"nnscaler_moe_gmm: experts [{start}, {end}) outside [0, {total})")
    offset = Fraction(start * n_local, rows)
    if offset.denominator != 1:
        raise AttrError(f"nnscaler_moe_gmm: first expert {start} is not a multiple of the "
                         f"reduction {rows} -> {n_local}")
    return int(offset)


def _experts(be, h, w11, w33, w22):
    """Per local expert: (a1, a3, act, F) with F_e(h) = (silu(h W11_e^T) * h W33_e^T) W22_e^T."""
    out = []
    for e in range(w11.shape[0]):
        a1, a3 = h @ w11[e].T, h @ w33[e].T
        sig = be.sigmoid(a1)
        act = a1 * sig * a3
        out.append((a1, a3, sig, act, act @ w22[e].T))
    return out


def gmm_fw(be, ins, attrs, ctx):
    h, idx, w, w11, w33, w22 = ins[:6]
    start = _expert_range(attrs, w11.shape[0], _orig_rows(ctx, 3))
    c = _spread(be, idx, w, w11.shape[0], start)  # combine weight of each local expert
    y = be.zeros(h.shape)
    for e, (_, _, _, _, f) in enumerate(_experts(be, h, w11, w33, w22)):
        y = y + c[:, e:e + 1] * f
    return [y]


def gmm_bw(be, ins, attrs, ctx):
    g, h, idx, w, w11, w33, w22 = ins[:7]
    start = _expert_range(attrs, w11.shape[0], _orig_rows(ctx, 4))
    c = _spread(be, idx, w, w11.shape[0], start)
    one = be.const(1)
    g_h = be.zeros(h.shape)
    g_c, g11, g33, g22 = [], [], [], []
    for e, (a1, a3, sig, act, f) in enumerate(_experts(be, h, w11, w33, w22)):
        g_c.append(np.sum(g * f, axis=-1))
        g_f = c[:, e:e + 1] * g
        g22.append(g_f.T @ act)
        g_act = g_f @ w22[e]
        g_a3 = g_act * (a1 * sig)
        g_a1 = g_act * a3 * (sig * (a1 * (be.scale(sig, -1) + one) + one))
        g11.append(g_a1.T @ h)
        g33.append(g_a3.T @ h)
        g_h = g_h + g_a1 @ w11[e] + g_a3 @ w33[e]
    g_w = _pick(be, idx, np.stack(g_c, -1), start)
    return [g_h, None, g_w, np.stack(g11), np.stack(g33), np.stack(g22)]


def gmm_shape(c, ins, outs, attrs):
    h, idx, w, w11, w33, w22 = ins[:6]
    require(len(h) == 2 and len(idx) == 2 and len(w) == 2,
            "nnscaler_moe_gmm: h, indices and weights must be 2-D (T, H), (T, k), (T, k)")
    require(len(w11) == 3 and len(w33) == 3 and len(w22) == 3,
            "nnscaler_moe_gmm: expert weights must be 3-D")
    el, d, hid = w11.orig
    require(tuple(w33.orig) == (el, d, hid) and tuple(w22.orig) == (el, hid, d)
            and h.orig[1] == hid and idx.orig == w.orig and idx.orig[0] == h.orig[0],
            f"nnscaler_moe_gmm: shapes h {list(h.orig)}, indices {list(idx.orig)}, weights "
            f"{list(w.orig)}, W11 {list(w11.orig)}, W33 {list(w33.orig)}, W22 "
            f"{list(w22.orig)} do not fit")
    start, end = attrs.get("local_expert_start"), attrs.get("local_expert_end")
    if start is not None and end is not None:
        require(int(end) - int(start) == el, f"nnscaler_moe_gmm: experts [{start}, {end}) "
                                             f"but the weights hold {el}")
    # the local experts may be reduced (module doc): the first one stays a whole expert
    c.eq(w33[0], w11[0])
    c.eq(w22[0], w11[0])
    if start is not None:
        c.keep_boundary(w11[0], int(start))
    c.eq(idx[1], idx.orig[1])  # nor k
    c.eq(w[1], idx[1])
    c.eq(idx[0], h[0])
    c.eq(w[0], h[0])
    c.eq(w11[1], w33[1])
    c.eq(w11[1], w22[2])
    c.eq(w11[2], w33[2])
    c.eq(w11[2], w22[1])
    c.eq(h[1], w11[2])
    nontrivial(c, w11, [1, 2])
    y = outs[0] if outs else None
    if y is not None:
        require(tuple(y.orig) == tuple(h.orig), f"nnscaler_moe_gmm: output {list(y.orig)} is "
                                                f"not h's {list(h.orig)}")
        c.same(y, h)


register(OpSpec(
    "nnscaler_moe_gmm", gmm_fw, gmm_shape, gmm_bw,
    abstracts=("uf_sigmoid",), reads_mirrors=True,
    doc="routed experts, fw [h (T,H), indices (T,k), weights (T,k), W11, W33 (El,D,H), W22 "
        "(El,H,D)] -> [y (T,H)]: y[t] = sum_j sum_{e in [s, s+El)} [idx[t,j] == e] w[t,j] "
        "F_e(h[t]), F_e(v) = (silu(v W11[e-s]^T) * v W33[e-s]^T) W22[e-s]^T, s = "
        "local_expert_start (exact indicators: an index outside the range, or repeated, adds "
        "nothing, or twice); bw [g_y, h, idx, w, W11, W33, W22] -> [g_h, null, g_w, g_W11, "
        "g_W33, g_W22], the exact VJP, g_w[t,j] = sum_e [idx[t,j] == e] <g_y[t], F_e(h[t])>. "
        "k is never reduced; El may be, keeping s an integer position (rescaled by the "
        "reduction, module doc)."))


# ----------------------------------------------------------------------------- auxiliary loss


def _aux_f(be, idx, attrs):
    """f[b, e] = E / (k S) * (number of slots of sequence b routed to e), shape (B, E)."""
    n_experts = int(attrs["n_routed_experts"])
    _, s, k = idx.shape
    counts = np.sum(_spread(be, idx, be.full(idx.shape, 1), n_experts), axis=1)
    return be.scale(counts, Fraction(n_experts, k * s)), n_experts


def aux_fw(be, ins, attrs, ctx):
    w, idx = ins[0], ins[1]
    f, n_experts = _aux_f(be, idx, attrs)
    p = be.scale(np.sum(_spread(be, idx, w, n_experts), axis=1), Fraction(1, idx.shape[1]))
    return [be.scale(np.sum(f * p, keepdims=True).reshape(1), attrs.get("alpha", 1))]


def aux_bw(be, ins, attrs, ctx):
    g, idx = ins[0], ins[2]  # the loss is linear in the weights ins[1]
    f, _ = _aux_f(be, idx, attrs)
    scale = Fraction(exact(attrs.get("alpha", 1))) / idx.shape[1]
    per_slot = _pick(be, idx, f[:, None, :])  # f of the slot's expert, (B, S, k)
    return [be.scale(per_slot * g[0], scale), None]


def aux_shape(c, ins, outs, attrs):
    w, idx = ins[0], ins[1]
    require(len(w) == 3 and tuple(w.orig) == tuple(idx.orig),
            f"moe_aux_loss: weights {list(w.orig)} and indices {list(idx.orig)} must be the "
            "same (B, S, k)")
    c.same(w, idx)
    c.eq(w[2], w.orig[2])  # k is never reduced
    if outs and outs[0] is not None:
        require(tuple(outs[0].orig) == (1,), "moe_aux_loss: the loss has shape [1]")
        c.eq(outs[0][0], 1)


register(OpSpec(
    "moe_aux_loss", aux_fw, aux_shape, aux_bw, reads_mirrors=True,
    doc="sequence-wise auxiliary load-balancing loss (DeepSeek-V3 style, on the router's "
        "weights), fw [weights (B,S,k), indices (B,S,k)] -> [loss (1,)]: alpha * sum_b sum_e "
        "f[b,e] * P[b,e], f[b,e] = E/(k S) * #{(s,j): idx[b,s,j] == e} (a constant of the "
        "routing), P[b,e] = 1/S sum_{s,j} [idx[b,s,j] == e] w[b,s,j]; E = attrs.n_routed_"
        "experts, alpha = attrs.alpha; exact indicators. bw [g, weights, indices] -> [g * "
        "alpha / S * f[b, idx[b,s,j]], null]. Per sequence, so splitting the batch by "
        "sequences (dp, micro-batches) sums it exactly. k is never reduced."))


# ----------------------------------------------------------------------------- dispatch / combine
# Expert parallelism with all_to_all (the generator's plans): tp rank t owns rows piece t of
# the tokens (of `pieces` = tp pieces); `moe_dispatch` builds its send buffer, one row block
# per member of its expert-parallel group (attrs.ep ranks): its rows with their indices and
# router weights; an `all_to_all` (comm.py) brings every member's block q to member q, which
# runs its local experts (`nnscaler_moe_gmm`: the expert range selects, by index, the slots
# routed to them); a second all_to_all brings the outputs back and `moe_combine` adds the ep
# blocks up into this rank's rows of a (T, H) tensor, a tp partial sum. (Masking the weights
# of the other ranks' slots in the send buffer as well would change nothing, the expert
# range already selects; measured: nested indicators there turn 2 s proofs into z3 timeouts.)


def _rows(attrs, n_rows: int) -> tuple[int, int]:
    pieces, piece = attrs.get("pieces"), attrs.get("piece")
    if type(pieces) is not int or type(piece) is not int or not 0 <= piece < pieces:
        raise AttrError(f"moe dispatch/combine: attrs.piece={piece!r} is not a piece of "
                        f"attrs.pieces={pieces!r}")
    if n_rows % pieces:
        raise AttrError(f"moe dispatch/combine: {n_rows} rows do not form {pieces} pieces")
    size = n_rows // pieces
    return piece * size, (piece + 1) * size


def _copies(attrs) -> int:
    n = attrs.get("ep")
    if type(n) is not int or n < 1:
        raise AttrError(f"moe dispatch/combine: attrs.ep={n!r} is not an expert-parallel size")
    return n


def dispatch_fw(be, ins, attrs, ctx):
    x, idx, w = ins[:3]
    lo, hi = _rows(attrs, x.shape[0])
    n = _copies(attrs)
    return [np.concatenate([t[lo:hi]] * n) for t in (x, idx, w)]


def dispatch_bw(be, ins, attrs, ctx):
    g_x, g_w, x, w = ins[0], ins[2], ins[3], ins[5]  # the indices ins[4] get no gradient
    lo, hi = _rows(attrs, x.shape[0])
    size = hi - lo
    outs = []
    for g, like in ((g_x, x), (g_w, w)):
        out = be.zeros(like.shape)
        if g is not None:
            out[lo:hi] = add_all([g[q * size:(q + 1) * size] for q in range(_copies(attrs))])
        outs.append(out)
    return [outs[0], None, outs[1]]


def _rows_unreduced(c, t) -> None:
    c.eq(t[0], t.orig[0])  # the row pieces are positions: tokens are never reduced here


def dispatch_shape(c, ins, outs, attrs):
    x, idx, w = ins[:3]
    require(len(x) == 2 and len(idx) == 2 and tuple(idx.orig) == tuple(w.orig)
            and idx.orig[0] == x.orig[0], f"moe_dispatch: x {list(x.orig)}, indices "
            f"{list(idx.orig)}, weights {list(w.orig)} are not (T, H), (T, k), (T, k)")
    n = _copies(attrs)
    lo, hi = _rows(attrs, x.orig[0])
    for src, out in zip((x, idx, w), outs):
        _rows_unreduced(c, src)
        if out is not None:
            require(tuple(out.orig) == (n * (hi - lo), src.orig[1]),
                    f"moe_dispatch: output {list(out.orig)} is not [{n * (hi - lo)}, "
                    f"{src.orig[1]}]")
            _rows_unreduced(c, out)
            c.eq(out[1], src[1])
    c.eq(idx[1], idx.orig[1])  # k is never reduced
    c.eq(w[1], idx[1])


register(OpSpec(
    "moe_dispatch", dispatch_fw, dispatch_shape, dispatch_bw,
    n_outputs=lambda attrs, n_in: 3, reads_mirrors=True,
    doc="expert-parallel dispatch (send buffer of one rank), fw [x (T,H), indices (T,k), "
        "weights (T,k)] -> [x_send (n*Ts,H), idx_send (n*Ts,k), w_send (n*Ts,k)], Ts = "
        "T/attrs.pieces, rows r = [piece*Ts, (piece+1)*Ts), n = attrs.ep: each of the n "
        "blocks of x_send / idx_send / w_send is x[r] / idx[r] / w[r] (one per member of "
        "the expert-parallel group; its experts select their slots by index). bw [g_xs, null, "
        "g_ws, x, idx, w] -> [g_x, null, g_w]: g_x[r] = sum_q g_xs block q, g_w[r] = sum_q "
        "g_ws block q, other rows 0 (the exact VJP). Rows are never reduced."))


def combine_fw(be, ins, attrs, ctx):
    ys = ins[0]
    n = _copies(attrs)
    if ys.shape[0] % n:
        raise AttrError(f"moe_combine: {ys.shape[0]} rows do not form attrs.ep={n} blocks")
    size = ys.shape[0] // n
    lo, hi = _rows(attrs, size * int(attrs["pieces"]))
    out = be.zeros((size * int(attrs["pieces"]),) + ys.shape[1:])
    out[lo:hi] = add_all([ys[q * size:(q + 1) * size] for q in range(n)])
    return [out]


def combine_bw(be, ins, attrs, ctx):
    g = ins[0]  # linear in the expert outputs ins[1]
    n = int(attrs["ep"])
    lo, hi = _rows(attrs, g.shape[0])
    return [np.concatenate([g[lo:hi]] * n)]


def combine_shape(c, ins, outs, attrs):
    ys = ins[0]
    n, pieces = int(attrs["ep"]), int(attrs["pieces"])
    require(len(ys) == 2 and ys.orig[0] % n == 0, f"moe_combine: input {list(ys.orig)} is "
                                                  f"not (ep*Ts, H) with ep = {n}")
    _rows(attrs, ys.orig[0] // n * pieces)
    _rows_unreduced(c, ys)
    y = outs[0] if outs else None
    if y is not None:
        require(tuple(y.orig) == (ys.orig[0] // n * pieces, ys.orig[1]),
                f"moe_combine: output {list(y.orig)} is not [{ys.orig[0] // n * pieces}, "
                f"{ys.orig[1]}]")
        _rows_unreduced(c, y)
        c.eq(y[1], ys[1])


register(OpSpec(
    "moe_combine", combine_fw, combine_shape, combine_bw, reads_mirrors=True,
    doc="expert-parallel combine (receive side of one rank), fw [ys (ep*Ts, H)] -> [y (T, H)], "
        "T = Ts*attrs.pieces: y[r] = sum of the ep row blocks of ys, r = [piece*Ts, "
        "(piece+1)*Ts), other rows 0 (this rank's part of a tp partial sum). bw [g (T,H), ys] "
        "-> [g[r] repeated ep times]. Rows are never reduced."))
