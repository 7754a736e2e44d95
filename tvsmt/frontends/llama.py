"""The Llama3 model description (forward only; the tracer derives the backward).

Tensor parallelism (Megatron-LM, no sequence parallelism):
* attention: q/k/v column-parallel (heads split over the tp ranks), output projection
  row-parallel, its partial sums all-reduced (AllReduceIdentity); an IdentityAllreduce at the
  start of the region all-reduces the input gradient in the backward pass;
* feed-forward (SwiGLU): gate/up column-parallel, down row-parallel, same adapters;
* norms: replicated and computed redundantly on every tp rank; since the gradients entering
  them are complete (after the backward all-reduce), their weight gradients are complete on
  every tp rank and only summed over data-parallel replicas;
* embedding: replicated (every tp rank looks up the full table);
* LM head: column-parallel (vocabulary split), logits all-gathered (AllGatherSplit: chunk of
  the gradient backward), so the loss is computed redundantly on every tp rank.
"""

from __future__ import annotations

import math

from tvsmt.frontends.layers import COL, ROW, linear, rmsnorm, sum_loss, transpose, view
from tvsmt.frontends.spmd import Tracer, Val


def attention(tr: Tracer, cfg, p: str, x: Val, mask: Val, b: int) -> Val:
    """Self-attention on the normalized input x (replicated); returns the tp partial sums of
    the output projection."""
    s, hd = cfg.seq, cfg.hidden // cfg.heads
    nh = cfg.heads // tr.tp
    hl = nh * hd
    xq, xk, xv = tr.multiref(x, 3)
    heads = (b, s, nh, hd)
    q = linear(tr, f"{p}.q", xq, f"{p}.wq", cfg.hidden, COL)
    k = linear(tr, f"{p}.k", xk, f"{p}.wk", cfg.hidden, COL)
    v = linear(tr, f"{p}.v", xv, f"{p}.wv", cfg.hidden, COL)
    q = view(tr, f"{p}.q_heads", q, heads, list(heads), split=2)
    k = view(tr, f"{p}.k_heads", k, heads, list(heads), split=2)
    v = view(tr, f"{p}.v_heads", v, heads, list(heads), split=2)
    freqs = tr.const(f"{p}.freqs", (s, hd // 2))
    q, k = tr.op("apply_rotary_emb", [q, k, freqs], [f"{p}.q_rot", f"{p}.k_rot"], [heads, heads])
    q = transpose(tr, f"{p}.q_t", q, 1, 2)
    k = transpose(tr, f"{p}.k_t", k, 1, 2)
    v = transpose(tr, f"{p}.v_t", v, 1, 2)
    k = transpose(tr, f"{p}.k_tt", k, 2, 3)
    scores_shape = (b, nh, s, s)
    sc = tr.op("matmul", [q, k], f"{p}.scores", scores_shape)
    sc = tr.op("div", [sc], f"{p}.scores_scaled", scores_shape,
               {"rounding_mode": None, "consts": [math.sqrt(hd)]})
    sc = tr.op("apply_mask", [sc, mask], f"{p}.scores_masked", scores_shape)
    sc = tr.op("float", [sc], f"{p}.scores_float", scores_shape)
    pr = tr.op("softmax", [sc], f"{p}.probs", scores_shape,
               {"dim": -1, "_stacklevel": 3, "dtype": None})
    pr = tr.op("to", [pr], f"{p}.probs_to", scores_shape, {"dtype_or_device": "torch.float32"})
    o = tr.op("matmul", [pr, v], f"{p}.ctx", (b, nh, s, hd))
    o = transpose(tr, f"{p}.ctx_t", o, 1, 2)
    o = tr.op("contiguous", [o], f"{p}.ctx_contiguous", heads)
    o = view(tr, f"{p}.ctx_flat", o, (b, s, hl), [b, s, -1], split=2)
    return linear(tr, f"{p}.out", o, f"{p}.wo", cfg.hidden, ROW)


def feed_forward(tr: Tracer, cfg, p: str, x: Val) -> Val:
    """SwiGLU on the normalized input x; returns the tp partial sums of the down projection."""
    xg, xu = tr.multiref(x, 2)
    g = linear(tr, f"{p}.gate", xg, f"{p}.w_gate", cfg.ffn, COL)
    g = tr.op("silu", [g], f"{p}.gate_silu", g.shape, {"inplace": False})
    u = linear(tr, f"{p}.up", xu, f"{p}.w_up", cfg.ffn, COL)
    m = tr.op("mul", [g, u], f"{p}.swiglu", g.shape)
    return linear(tr, f"{p}.down", m, f"{p}.w_down", cfg.hidden, ROW)


def block(tr: Tracer, cfg, layer: int, h: Val, mask: Val, b: int) -> Val:
    p = f"L{layer}"
    res, x = tr.multiref(h, 2)
    x = tr.tp_enter(rmsnorm(tr, f"{p}.attn_norm", x, cfg.eps))
    a = tr.all_reduce(attention(tr, cfg, f"{p}.attn", x, mask, b))
    h = tr.op("add", [res, a], f"{p}.attn_residual", h.shape, {"alpha": 1})
    res, x = tr.multiref(h, 2)
    x = tr.tp_enter(rmsnorm(tr, f"{p}.ffn_norm", x, cfg.eps))
    f = tr.all_reduce(feed_forward(tr, cfg, f"{p}.ffn", x))
    return tr.op("add", [res, f], f"{p}.ffn_residual", h.shape, {"alpha": 1})


def embed(tr: Tracer, cfg, b: int) -> tuple[Val, Val]:
    """The token embedding of one micro-batch of b sequences (its batch position in the
    attributes) and the causal mask: the start of every Llama-like model."""
    w = tr.w
    ids = tr.data("tokens", (b, cfg.seq))
    table = tr.param("embed.weight", (cfg.vocab, cfg.hidden))
    emb_attrs = {"padding_idx": None, "start": 0, "stop": cfg.vocab, "dp": tr.d, "mb": tr.m,
                 "num_dp": w.dp, "num_mb": w.mb, "batch_index": tr.d * w.mb + tr.m,
                 "num_batches": w.dp * w.mb}
    h = tr.op("embedding", [ids, table], "embed.out", (b, cfg.seq, cfg.hidden), emb_attrs)
    mask = tr.op("create_mask", [ids, h], "mask", (1, 1, cfg.seq, cfg.seq), batch=False,
                 differentiable=False)
    return h, mask


def forward(tr: Tracer, cfg, b: int, stage_of: list[int]) -> Val:
    """One micro-batch of b sequences: embedding, layers, final norm, LM head, sum loss."""
    w = tr.w
    h, mask = embed(tr, cfg, b)
    for layer in range(cfg.layers):
        h, mask = tr.goto(stage_of[layer], h, mask)
        h = block(tr, cfg, layer, h, mask, b)
    (h,) = tr.goto(w.pp - 1, h)
    x = rmsnorm(tr, "norm", h, cfg.eps)
    logits = linear(tr, "head.logits", tr.tp_enter(x), "head.weight", cfg.vocab, COL)
    logits = tr.all_gather(logits, 2)
    logits = tr.op("float", [logits], "head.logits_float", logits.shape)
    return sum_loss(tr, logits)
