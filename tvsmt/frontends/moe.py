"""A DeepSeek-V3-style mixture-of-experts model (forward only; the tracer derives the
backward).

Layers: the first `dense_layers` are Llama blocks; the others replace the feed-forward by a
MoE block: a router (`gate_fw`: sigmoid scores, group-limited top-k, normalised weights times
route_scale), routed experts (`nnscaler_moe_gmm`), shared experts (a SwiGLU) and a
sequence-wise auxiliary load-balancing loss (`moe_aux_loss`) added to the training loss.

Expert parallelism (ep, a divisor of tp; default ep = tp) is carved out of the
tensor-parallel group, as Megatron carves it out of dp x tp: the tp group splits into tp/ep
expert-parallel groups of ep consecutive ranks; rank t holds the routed experts of its
position q = t % ep, [q E/ep, (q+1) E/ep). The router runs replicated on every tp rank (it
reads whole score rows). Tokens: tp rank t owns rows piece t of the micro-batch's T tokens;
`moe_dispatch` copies them (with their indices and router weights) into one send block per
member of its expert-parallel group, an exact `all_to_all` inside the group sends block q to
member q, whose `nnscaler_moe_gmm` runs its local experts on the slots routed to them, a
second `all_to_all` brings the outputs back and `moe_combine` adds them into this rank's
rows: a tp partial sum (all_reduce forward; the gradients of the tokens and router weights
are partial sums, all_reduce backward, IdentityAllreduce). The shared experts are column/row
tensor-parallel like Llama's SwiGLU.
An expert weight's gradient on one rank covers its token group only: it is summed over
micro-batches and over the expert-data-parallel group (every replica's ranks at the same
position q: dp * tp/ep ranks) by one reducer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvsmt.frontends import llama
from tvsmt.frontends.layers import COL, ROW, linear, rmsnorm, view
from tvsmt.frontends.spmd import Tracer, Val


@dataclass(frozen=True)
class MoEShape:
    """The MoE hyper-parameters (DeepSeek-V3 names). A model config may carry any of them as
    attributes (e.g. a ModelConfig subclass); missing ones take these defaults."""

    experts: int = 8  # n_routed_experts
    topk: int = 2  # n_activated_experts
    n_groups: int = 4  # n_expert_groups
    topk_groups: int = 2  # n_limited_groups
    expert_ffn: int = 16  # moe_inter_dim
    shared_ffn: int = 16  # n_shared_experts * moe_inter_dim
    dense_layers: int = 1  # n_dense_layers
    route_scale: float = 2.5
    aux_alpha: float = 0.001  # weight of the sequence-wise balance loss


def moe_shape(cfg) -> MoEShape:
    base = MoEShape()
    return MoEShape(**{k: getattr(cfg, k, getattr(base, k)) for k in base.__dataclass_fields__})


def validate(cfg, tp: int, ep: int | None = None, rows: int | None = None) -> MoEShape:
    """The MoE shape of cfg, or ValueError naming what does not divide (ep None: ep = tp)."""
    ms = moe_shape(cfg)
    ep = tp if ep is None else ep
    if type(ep) is not int or ep < 1 or tp % ep:
        raise ValueError(f"expert-parallel size ep={ep} must divide tp={tp} (the experts are "
                         "split over a part of the tensor-parallel group)")
    if ms.experts % ep:
        raise ValueError(f"{ms.experts} routed experts are not divisible by ep = {ep}")
    if rows is not None and tp > 1 and rows % tp:
        raise ValueError(f"{rows} tokens per micro-batch are not divisible by tp={tp} (each tp "
                         "rank dispatches its own rows)")
    if ms.n_groups < 1 or ms.experts % ms.n_groups:
        raise ValueError(f"{ms.experts} experts do not form {ms.n_groups} groups")
    if not 0 < ms.topk <= ms.experts or not 0 < ms.topk_groups <= ms.n_groups:
        raise ValueError(f"topk {ms.topk} / topk_groups {ms.topk_groups} do not fit "
                         f"{ms.experts} experts in {ms.n_groups} groups")
    if ms.shared_ffn % tp:
        raise ValueError(f"shared experts' dim {ms.shared_ffn} is not divisible by tp = {tp}")
    return ms


def moe_ffn(tr: Tracer, cfg, p: str, x: Val, b: int) -> tuple[Val, Val]:
    """MoE feed-forward on the normalized input x (b, s, H), replicated over the tp group.
    Returns (output (b, s, H), replicated; auxiliary loss of this micro-batch)."""
    s, hid = cfg.seq, cfg.hidden
    t_rows = b * s
    ep = tr.w.ep_size
    ms = validate(cfg, tr.tp, ep, t_rows)
    e, k = ms.experts, ms.topk
    xt = view(tr, f"{p}.tokens", x, (t_rows, hid), [-1, hid], split=None)
    x_gate, x_exp = tr.multiref(xt, 2)
    wg = tr.param(f"{p}.gate.weight", (e, hid))
    gate_attrs = {"score_func": "sigmoid", "bias": None, "n_groups": ms.n_groups,
                  "topk_groups": ms.topk_groups, "topk": k, "route_scale": ms.route_scale,
                  "consts": [], "n_routed_experts": e}
    weights, idx = tr.op("gate_fw", [x_gate, wg], [f"{p}.gate.weights", f"{p}.gate.indices"],
                         [(t_rows, k), (t_rows, k)], gate_attrs)
    idx.grad = False  # indices get no gradient (null slots in the plan convention)
    w_aux, w_exp = tr.multiref(weights, 2)

    # sequence-wise balance loss, on every tp rank (the router is replicated)
    seqs = (b, s, k)
    w3 = view(tr, f"{p}.aux.weights", w_aux, seqs, [b, s, k], split=None)
    i3 = view(tr, f"{p}.aux.indices", idx, seqs, [b, s, k], split=None)
    aux = tr.op("moe_aux_loss", [w3, i3], f"{p}.aux.loss", (1,),
                {"n_routed_experts": e, "alpha": ms.aux_alpha}, batch=False, reduce="dm",
                role="loss")

    # routed experts: expert-parallel over groups of ep tp ranks
    h = tr.tp_enter(x_exp)
    h_route, h_s1, h_s3 = tr.multiref(h, 3)
    w_exp = tr.tp_enter(w_exp)
    y = routed_experts(tr, ms, p, h_route, idx, w_exp, t_rows, hid, ep)

    # shared experts: a SwiGLU, column- then row-parallel
    g = linear(tr, f"{p}.shared.gate", h_s1, f"{p}.shared.w1", ms.shared_ffn, COL)
    g = tr.op("silu", [g], f"{p}.shared.gate_silu", g.shape, {"inplace": False})
    u = linear(tr, f"{p}.shared.up", h_s3, f"{p}.shared.w3", ms.shared_ffn, COL)
    m = tr.op("mul", [g, u], f"{p}.shared.swiglu", g.shape)
    z = tr.all_reduce(linear(tr, f"{p}.shared.down", m, f"{p}.shared.w2", hid, ROW))

    out = tr.op("add", [y, z], f"{p}.out_tokens", (t_rows, hid), {"alpha": 1})
    return view(tr, f"{p}.out", out, (b, s, hid), [b, s, hid], split=None), aux


def routed_experts(tr: Tracer, ms: MoEShape, p: str, h: Val, idx: Val, w: Val, t_rows: int,
                   hid: int, ep: int) -> Val:
    """The routed experts' output (T, H), complete on every tp rank. tp = 1: one GEMM over
    every expert; otherwise dispatch, all_to_all, local experts, all_to_all, combine and the
    tp all_reduce (see the module docstring)."""
    e, k = ms.experts, ms.topk
    el = e // ep
    w11 = tr.param(f"{p}.experts.w1", (e, ms.expert_ffn, hid), split=0, pieces=ep)
    w33 = tr.param(f"{p}.experts.w3", (e, ms.expert_ffn, hid), split=0, pieces=ep)
    w22 = tr.param(f"{p}.experts.w2", (e, hid, ms.expert_ffn), split=0, pieces=ep)

    def expert_range(t: int) -> dict:
        q = t % ep
        return {"n_routed_experts": e, "local_expert_start": q * el,
                "local_expert_end": (q + 1) * el, "consts": []}

    if tr.tp == 1:
        return tr.op_per_rank("nnscaler_moe_gmm", [h, idx, w, w11, w33, w22], f"{p}.experts.out",
                              (t_rows, hid), expert_range, split=None)
    tp = tr.tp
    sent = ep * (t_rows // tp)

    def dispatch(t: int) -> dict:
        return {"piece": t, "pieces": tp, "ep": ep}

    xs, ids, ws = tr.op_per_rank(
        "moe_dispatch", [h, idx, w],
        [f"{p}.dispatch.tokens", f"{p}.dispatch.indices", f"{p}.dispatch.weights"],
        [(sent, hid), (sent, k), (sent, k)], dispatch, split=None, hidden=True,
        partial_grads=True)
    ids.grad = False
    xs, ids, ws = tr.all_to_all(xs, ep), tr.all_to_all(ids, ep), tr.all_to_all(ws, ep)
    yq = tr.op_per_rank("nnscaler_moe_gmm", [xs, ids, ws, w11, w33, w22],
                        f"{p}.experts.tokens_out", (sent, hid), expert_range, split=None,
                        hidden=True)
    ys = tr.all_to_all(yq, ep)
    y = tr.op_per_rank("moe_combine", [ys], f"{p}.experts.out", (t_rows, hid),
                       lambda t: {"piece": t, "pieces": tp, "ep": ep}, split=None, partial=True)
    return tr.all_reduce(y)


def moe_block(tr: Tracer, cfg, layer: int, h: Val, mask: Val, b: int) -> tuple[Val, Val]:
    p = f"L{layer}"
    res, x = tr.multiref(h, 2)
    x = tr.tp_enter(rmsnorm(tr, f"{p}.attn_norm", x, cfg.eps))
    a = tr.all_reduce(llama.attention(tr, cfg, f"{p}.attn", x, mask, b))
    h = tr.op("add", [res, a], f"{p}.attn_residual", h.shape, {"alpha": 1})
    res, x = tr.multiref(h, 2)
    x = rmsnorm(tr, f"{p}.ffn_norm", x, cfg.eps)  # the MoE block enters the tp region itself
    f, aux = moe_ffn(tr, cfg, f"{p}.moe", x, b)
    return tr.op("add", [res, f], f"{p}.ffn_residual", h.shape, {"alpha": 1}), aux


def forward(tr: Tracer, cfg, b: int, stage_of: list[int]) -> Val:
    """One micro-batch: embedding, dense and MoE layers, final norm, LM head; the loss is the
    sum of the logits plus every MoE layer's auxiliary loss."""
    w, ms = tr.w, moe_shape(cfg)
    h, mask = llama.embed(tr, cfg, b)
    auxes = []
    for layer in range(cfg.layers):
        h, mask = tr.goto(stage_of[layer], h, mask)
        if layer < ms.dense_layers:
            h = llama.block(tr, cfg, layer, h, mask, b)
        else:
            h, aux = moe_block(tr, cfg, layer, h, mask, b)
            auxes.append(aux)
    h, *auxes = tr.goto(w.pp - 1, h, *auxes)
    x = rmsnorm(tr, "norm", h, cfg.eps)
    logits = linear(tr, "head.logits", tr.tp_enter(x), "head.weight", cfg.vocab, COL)
    logits = tr.all_gather(logits, 2)
    logits = tr.op("float", [logits], "head.logits_float", logits.shape)
    loss = tr.op("sum", [logits], "loss.lm" if auxes else "loss", (1,), batch=False,
                 reduce="dm", role="loss")
    for i, aux in enumerate(auxes):
        key = "loss" if i == len(auxes) - 1 else f"loss.aux{i}"
        loss = tr.op("add", [loss, aux], key, (1,), {"alpha": 1}, batch=False, reduce="dm",
                     role="loss")
    return loss


# DeepSeek-V3's routing (671B: 256 routed experts, 8 active, 8 groups of which 4 may be used,
# 1 shared expert, the first 3 layers dense); the dims are the generator's (shape reduction
# makes the real ones cheap anyway).
DEEPSEEK_V3 = MoEShape(experts=256, topk=8, n_groups=8, topk_groups=4, expert_ffn=16,
                       shared_ffn=16, dense_layers=3, route_scale=2.5, aux_alpha=0.0001)


@dataclass(frozen=True)
class _WithShape:
    """A model config seen through a MoE shape (attributes of both)."""

    cfg: object
    shape: MoEShape

    def __getattr__(self, name):
        if name in MoEShape.__dataclass_fields__:
            return getattr(self.shape, name)
        return getattr(self.cfg, name)


def deepseek_v3_forward(tr: Tracer, cfg, b: int, stage_of: list[int]) -> Val:
    """`forward` with DeepSeek-V3's routing hyper-parameters (model name "deepseek-v3")."""
    return forward(tr, _WithShape(cfg, DEEPSEEK_V3), b, stage_of)
