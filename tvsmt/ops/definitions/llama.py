"""Transformer (Llama) operators: embedding, create_mask, apply_mask, apply_rotary_emb,
softmax, silu."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tvsmt.ops.definitions._common import (broadcast_rule, identity_shape, nontrivial,
                                           norm_axes, require, same_shape, sum_axes, unary,
                                           unbroadcast)
from tvsmt.ops.registry import AttrError, OpSpec, register

# ----------------------------------------------------------------------------- embedding


def vocab_offset(attrs, ctx, w: np.ndarray, w_slot: int) -> int:
    """Token id of the weight's first row.

    `attrs.start`/`stop` (Megatron VocabParallelEmbedding) say that the weight holds rows
    [start, stop) of the full vocabulary; ids outside the range give 0. Under shape reduction
    the range is rescaled by (reduced rows) / (original rows), the original rows coming from
    `ctx.orig_in[w_slot]`. Absent: the weight starts at 0.
    """
    if attrs.get("padding_idx") is not None:
        raise AttrError("embedding: padding_idx is not supported (its row gets no gradient "
                         "in torch, which has no meaning under shape reduction)")
    start, stop = attrs.get("start"), attrs.get("stop")
    if start is None or stop is None:
        return 0
    orig = ctx.orig_in[w_slot] if len(ctx.orig_in) > w_slot else None
    if orig is None and start == 0:  # no original shapes given: an unscaled range from 0
        return 0
    rows = orig[0] if orig is not None else w.shape[0]
    if stop - start != rows:
        raise AttrError(f"embedding: vocabulary range [{start}, {stop}) does not match the "
                         f"weight's {rows} rows")
    offset = Fraction(start * w.shape[0], rows)
    if offset.denominator != 1:
        raise AttrError(f"embedding: vocabulary offset {start} is not a multiple of the "
                         f"reduction {rows} -> {w.shape[0]}")
    return int(offset)


def embedding_fw(be, ins, attrs, ctx):
    ids, w = ins[0], ins[1]
    offset, sel = vocab_offset(attrs, ctx, w, 1), ids[..., None]
    out = be.zeros(ids.shape + (w.shape[1],))
    for r in range(w.shape[0]):
        out = be.select_eq(sel, offset + r, w[r], out)
    return [out]


def embedding_bw(be, ins, attrs, ctx):
    g, ids, w = ins[0], ins[1], ins[2]
    offset, sel, zero = vocab_offset(attrs, ctx, w, 2), ids[..., None], be.zeros(g.shape)
    positions = tuple(range(ids.ndim))
    rows = [np.sum(be.select_eq(sel, offset + r, g, zero), axis=positions)
            for r in range(w.shape[0])]
    return [None, np.stack(rows)]


def embedding_shape(c, ins, outs, attrs):
    ids, w, y = ins[0], ins[1], outs[0]
    require(len(w) == 2, "embedding: the weight must be 2-D")
    require(tuple(y.orig) == tuple(ids.orig) + (w.orig[1],),
            f"embedding: ids {list(ids.orig)} and weight {list(w.orig)} do not give "
            f"{list(y.orig)}")
    start, stop = attrs.get("start"), attrs.get("stop")
    if start is not None and stop is not None:
        require(stop - start == w.orig[0], f"embedding: range [{start}, {stop}) does not "
                                           f"match the weight's {w.orig[0]} rows")
        c.keep_boundary(w[0], start)  # the shard's first row must stay a whole row
    for a, b in zip(y.dims[:-1], ids.dims):
        c.eq(a, b)
    c.eq(y[-1], w[1])


def _embedding_reads(attrs) -> dict:
    """Only the vocabulary range and padding index matter; the batch bookkeeping the
    generator adds (dp, mb, batch_index, num_batches) does not."""
    return {k: attrs.get(k) for k in ("padding_idx", "start", "stop")}


register(OpSpec("embedding", embedding_fw, embedding_shape, embedding_bw,
                semantic_attrs=_embedding_reads,
                doc="out[p] = W[ids[p] - start] for start <= ids[p] < stop, else 0 (real token "
                    "values via select_eq; start/stop = vocabulary range of the shard, absent "
                    "= [0, rows)); bw [g, ids, W] -> [null, g_W], g_W[r] = sum_p [ids[p] == "
                    "start + r] g[p]; batch_index/num_batches ignored"))


# ----------------------------------------------------------------------------- masks


def create_mask_fw(be, ins, attrs, ctx):
    shape = ctx.out_shapes[0] if ctx.out_shapes and ctx.out_shapes[0] is not None else None
    if shape is None:
        s = ins[0].shape[1]
        shape = (1, 1, s, s)
    s = shape[-1]
    mask = be.zeros((s, s))
    mask[np.triu_indices(s, 1)] = be.neg_inf()
    return [mask.reshape(shape)]


def create_mask_shape(c, ins, outs, attrs):
    tokens, y = ins[0], outs[0]
    s = tokens.orig[1]
    require(tuple(y.orig) == (1, 1, s, s), f"create_mask: tokens {list(tokens.orig)} give "
                                            f"[1, 1, {s}, {s}], not {list(y.orig)}")
    c.eq(y[0], 1)
    c.eq(y[1], 1)
    c.eq(y[2], tokens[1])
    c.eq(y[3], tokens[1])


register(OpSpec("create_mask", create_mask_fw, create_mask_shape,
                doc="[tokens, h] -> [mask (1, 1, S, S)], S = tokens.shape[1]: -inf strictly "
                    "above the diagonal, 0 elsewhere; no backward",
                no_backward="a constant of the token shape: nothing to differentiate",
                shape_only=True))


def apply_mask_fw(be, ins, attrs, ctx):
    return [ins[0] + ins[1]]


def apply_mask_bw(be, ins, attrs, ctx):
    return [unbroadcast(ins[0], ins[1].shape), None]


register(OpSpec("apply_mask", apply_mask_fw,
                lambda c, ins, outs, attrs: broadcast_rule(c, ins[:2], outs[0]), apply_mask_bw,
                doc="x + mask (broadcast); bw [g, x, mask] -> [g, null]"))


# ----------------------------------------------------------------------------- rotary


def _angles(be, f: np.ndarray, ndim: int):
    """cos and sin of the angles f[position, pair], aligned with (B, S, ..., pairs)."""
    shape = (1, f.shape[0]) + (1,) * (ndim - 3) + (f.shape[1],)
    return be.cos(f).reshape(shape), be.sin(f).reshape(shape)


def _rotate(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Rotate the pairs (x[..., 0::2], x[..., 1::2]) by the angle with cosine c, sine s."""
    a, b = x[..., 0::2], x[..., 1::2]
    return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


def rotary_fw(be, ins, attrs, ctx):
    xq, xk, f = ins[0], ins[1], ins[2]
    c, s = _angles(be, f, xq.ndim)
    return [_rotate(xq, c, s), _rotate(xk, c, s)]


def rotary_bw(be, ins, attrs, ctx):
    gq, gk, f = ins[0], ins[1], ins[4]
    c, s = _angles(be, f, ins[2].ndim)
    neg_s = be.scale(s, -1)  # the transpose of a rotation is the rotation by -theta
    return [None if g is None else _rotate(g, c, neg_s) for g in (gq, gk)] + [None]


def rotary_shape(c, ins, outs, attrs):
    xq, xk, f = ins[0], ins[1], ins[2]
    require(len(f) == 2, "apply_rotary_emb: the angles must be (S, head_dim / 2)")
    for x, y in zip((xq, xk), outs[:2]):
        require(len(x) >= 3, "apply_rotary_emb: inputs must be (B, S, ..., head_dim)")
        require(x.orig[1] == f.orig[0] and x.orig[-1] == 2 * f.orig[1],
                f"apply_rotary_emb: {list(x.orig)} does not match angles {list(f.orig)}")
        c.eq(x[1], f[0])
        c.eq(x[-1], 2 * f[1])
        if y is not None:
            same_shape(c, x, y)


register(OpSpec("apply_rotary_emb", rotary_fw, rotary_shape, rotary_bw,
                n_outputs=lambda attrs, n_in: 2,
                doc="[xq, xk, f] -> [xq', xk']: the last dim holds pairs (a, b) = (x[..., 0::2], "
                    "x[..., 1::2]) rotated by the angle f[position (dim 1), pair]: (a cos - b "
                    "sin, a sin + b cos); bw [g_xq', g_xk', xq, xk, f] -> [g_xq, g_xk, null]",
                abstracts=("uf_cos", "uf_sin")))


# ----------------------------------------------------------------------------- softmax, silu


def _softmax(be, x, axes):
    e = be.exp(x)
    return be.div(e, sum_axes(e, axes, True))


def softmax_fw(be, ins, attrs, ctx):
    x = ins[0]
    return [_softmax(be, x, norm_axes(attrs["dim"], x.ndim))]


def softmax_bw(be, ins, attrs, ctx):
    g, x = ins[0], ins[1]
    axes = norm_axes(attrs["dim"], x.ndim)
    s = _softmax(be, x, axes)
    return [s * (g - sum_axes(g * s, axes, True))]


def softmax_shape(c, ins, outs, attrs):
    identity_shape(c, ins, outs, attrs)
    nontrivial(c, ins[0], norm_axes(attrs["dim"], len(ins[0])))


register(OpSpec("softmax", softmax_fw, softmax_shape, softmax_bw,
                doc="exp(x) / sum(exp(x), dim) (no max subtraction, division by be.div); bw "
                    "[g, x] -> [s * (g - sum(g * s, dim))], s recomputed from x",
                abstracts=("uf_exp", "uf_recip"), reads_mirrors=True))


def _silu_grad(be, x, attrs):
    sig = be.sigmoid(x)
    one = be.const(1)
    return sig * (x * (be.scale(sig, -1) + one) + one)


unary("silu", lambda be, x, a: x * be.sigmoid(x), _silu_grad,
      doc="x * sigmoid(x); bw [g, x] -> [g * sig(x) * (1 + x * (1 - sig(x)))]",
      abstracts=("uf_sigmoid",))
