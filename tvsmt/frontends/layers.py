"""Building blocks shared by the model descriptions (llama.py, mlp.py).

Each function emits the forward operators of one layer through a `Tracer`; the backward pass is
derived from the tape. Shapes passed to the tracer are *local* (per tp rank, per micro-batch);
keys are the single-plan tensor ids.
"""

from __future__ import annotations

from tvsmt.frontends.spmd import Tracer, Val

COL, ROW, REP = "col", "row", "rep"


def linear(tr: Tracer, key: str, x: Val, weight: str, out_features: int, mode: str) -> Val:
    """y = x @ w.T without bias, Megatron style:

    col: column-parallel, w split by rows (output features), y split along its last axis;
    row: row-parallel, x split along its last axis, w split by columns, y a tp partial sum
         (the caller all-reduces it);
    rep: replicated on every tp rank.
    """
    tp = tr.tp
    in_full = x.shape[-1] * (tp if mode == ROW else 1)
    if mode == COL:
        w = tr.param(weight, (out_features, in_full), split=0)
        out_local, split = out_features // tp, -1
    elif mode == ROW:
        w = tr.param(weight, (out_features, in_full), split=1)
        out_local, split = out_features, None
    elif mode == REP:
        w = tr.param(weight, (out_features, in_full))
        out_local, split = out_features, None
    else:
        raise ValueError(f"unknown linear mode {mode!r}")
    return tr.op("linear", [x, w], key, x.shape[:-1] + (out_local,), {"bias": None},
                 split=split, partial=mode == ROW)


def rmsnorm(tr: Tracer, name: str, x: Val, eps: float) -> Val:
    """Llama RMSNorm as traced by PyTorch: float, pow 2, mean over the last axis (keepdim),
    + eps, rsqrt, mul, to, mul by the (replicated) weight."""
    nd = len(x.shape)
    reduced = x.shape[:-1] + (1,)
    xf = tr.op("float", [x], f"{name}.x_float", x.shape)
    for_sq, for_mul = tr.multiref(xf, 2)
    sq = tr.op("pow", [for_sq], f"{name}.sq", x.shape, {"consts": [2]})
    ms = tr.op("mean", [sq], f"{name}.mean_sq", reduced, {"dim": [nd - 1], "keepdim": True})
    ms_eps = tr.op("add", [ms], f"{name}.mean_sq_eps", reduced, {"alpha": 1, "consts": [eps]})
    rstd = tr.op("rsqrt", [ms_eps], f"{name}.rstd", reduced)
    y = tr.op("mul", [for_mul, rstd], f"{name}.normed", x.shape)
    y = tr.op("to", [y], f"{name}.normed_to", x.shape, {"dtype_or_device": "torch.float32"})
    w = tr.param(f"{name}.weight", (x.shape[-1],))
    return tr.op("mul", [y, w], f"{name}.out", x.shape)


def transpose(tr: Tracer, key: str, x: Val, d0: int, d1: int) -> Val:
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    s = x.layout.split
    s = d1 if s == d0 else d0 if s == d1 else s
    return tr.op("transpose", [x], key, tuple(shape), {"dim0": d0, "dim1": d1}, split=s)


def view(tr: Tracer, key: str, x: Val, shape: tuple[int, ...], size: list[int],
         split: int | None) -> Val:
    return tr.op("view", [x], key, shape, {"size": size}, split=split)


def sum_loss(tr: Tracer, x: Val) -> Val:
    """The loss: the sum of all elements (shape [1]). Each (replica, micro-batch) computes the
    sum over its rows; the single loss is the sum of these partial losses."""
    return tr.op("sum", [x], "loss", (1,), batch=False, reduce="dm", role="loss")
