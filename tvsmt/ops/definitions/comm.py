"""Communication and gradient-finalization operators (pass: null, forward semantics only).

A collective node on one rank lists the inputs of all group members (execplan v1 / OPS.md),
in the order the plan gives them, and writes that rank's output. `attrs.ranks` is the group,
`attrs.dim` the tensor axis, `attrs.idx` the piece a splitting op keeps.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from tvsmt.ops.definitions._common import (add_all, identity_shape, present, relate, require,
                                           same_shape)
from tvsmt.ops.registry import AttrError, OpSpec, register


def _axis(attrs, key: str, ndim: int, default: str | None = None) -> int:
    d = attrs.get(key)
    if d is None and default is not None:
        d = attrs.get(default)
    if d is None:
        raise AttrError(f"missing attrs.{key}")
    if not isinstance(d, int) or not -ndim <= d < ndim:
        raise AttrError(f"attrs.{key}={d!r} is not an axis of a {ndim}-d tensor")
    return d % ndim


def _parts(attrs, n_in: int) -> int:
    """Number of pieces a split makes: the group size (default: the number of inputs)."""
    ranks = attrs.get("ranks") or ()
    if not isinstance(ranks, list):
        raise AttrError(f"attrs.ranks={ranks!r} is not a list of ranks")
    return len(ranks) or n_in


def _piece(x: np.ndarray, n: int, idx: int, axis: int) -> np.ndarray:
    if type(idx) is not int or not 0 <= idx < n:
        raise AttrError(f"attrs.idx={idx!r} is not a piece index of {n} pieces")
    if x.shape[axis] % n:
        raise AttrError(f"cannot split axis {axis} of size {x.shape[axis]} into {n} pieces")
    size = x.shape[axis] // n
    return np.take(x, range(idx * size, (idx + 1) * size), axis=axis)


# ----------------------------------------------------------------------------- semantics


def sum_fw(be, ins, attrs, ctx):
    return [add_all(present(ins))]


def copy_fw(be, ins, attrs, ctx):
    return [ins[0]]


def all_gather_fw(be, ins, attrs, ctx):
    xs = present(ins)
    return [np.concatenate(xs, axis=_axis(attrs, "dim", xs[0].ndim))]


def chunk_fw(be, ins, attrs, ctx):
    x = ins[0]
    return [_piece(x, _parts(attrs, 1), attrs["idx"], _axis(attrs, "dim", x.ndim))]


def reduce_scatter_fw(be, ins, attrs, ctx):
    xs = present(ins)
    total = add_all(xs)
    return [_piece(total, _parts(attrs, len(xs)), attrs["idx"], _axis(attrs, "dim", total.ndim))]


def all_to_all_fw(be, ins, attrs, ctx):
    xs = present(ins)
    ndim = xs[0].ndim
    split, dim = _axis(attrs, "split_dim", ndim, default="dim"), _axis(attrs, "dim", ndim)
    n = _parts(attrs, len(xs))
    return [np.concatenate([_piece(x, n, attrs["idx"], split) for x in xs], axis=dim)]


def broadcast_fw(be, ins, attrs, ctx):
    xs = present(ins)
    if len(xs) == 1:
        x = xs[0]
    else:
        x = ins[list(attrs["ranks"]).index(attrs["src"])]
    return [x] * max(1, len(ctx.out_shapes))


# ----------------------------------------------------------------------------- shape rules


def _group_shape(c, ins):
    xs = present(ins)
    require(len(xs) > 0, "collective without inputs")
    for t in xs[1:]:
        same_shape(c, xs[0], t)
    return xs


def all_gather_shape(c, ins, outs, attrs):
    xs = _group_shape(c, ins)
    relate(c, xs[0], outs[0], {_axis(attrs, "dim", len(xs[0])): (len(xs), 1)})


def chunk_shape(c, ins, outs, attrs):
    x = ins[0]
    relate(c, x, outs[0], {_axis(attrs, "dim", len(x)): (1, _parts(attrs, 1))})


def reduce_scatter_shape(c, ins, outs, attrs):
    xs = _group_shape(c, ins)
    relate(c, xs[0], outs[0], {_axis(attrs, "dim", len(xs[0])): (1, _parts(attrs, len(xs)))})


def all_to_all_shape(c, ins, outs, attrs):
    xs = _group_shape(c, ins)
    ndim = len(xs[0])
    split, dim = _axis(attrs, "split_dim", ndim, default="dim"), _axis(attrs, "dim", ndim)
    n = _parts(attrs, len(xs))
    if split == dim:
        factors = {dim: (len(xs), n)}
    else:
        factors = {split: (1, n), dim: (len(xs), 1)}
    relate(c, xs[0], outs[0], factors)


def _comm(name: str, forward, shape, doc: str, reads=None, *,
          rank_attrs: tuple[str, ...] = ("ranks",), unit_sum: bool = False) -> OpSpec:
    return register(OpSpec(name, forward, shape, communication=True, doc=doc,
                           semantic_attrs=reads, rank_attrs=rank_attrs, unit_sum=unit_sum,
                           no_backward="communication: its backward is written in the plan as "
                                       "other communication nodes"))


def _reads_nothing(attrs) -> dict:
    """Sum/copy semantics: the group's rank ids, src/dst, shape and dtype change nothing."""
    return {}


def _reads_pieces(attrs) -> dict:
    """Gather/split semantics read the axes, the piece index and the NUMBER of ranks only."""
    return {"dim": attrs.get("dim"), "split_dim": attrs.get("split_dim"),
            "idx": attrs.get("idx"), "pieces": len(attrs.get("ranks") or ())}


def _reads_gather(attrs) -> dict:
    """A gather concatenates its inputs in order: it reads the axis (and, kept to be strict,
    the number of ranks), never a piece index. nnScaler's export writes `idx` on the
    all-gather half of some fused adapters on replicas >= 1 only, which must not make those
    replicas look different from replica 0 (folding, stage templates)."""
    return {"dim": attrs.get("dim"), "pieces": len(attrs.get("ranks") or ())}


_comm("all_reduce", sum_fw, identity_shape, "sum of the group's inputs", _reads_nothing,
      unit_sum=True)
_comm("reducer", sum_fw, identity_shape,
      "data-parallel gradient sum of one weight: sum of the inputs (no averaging)",
      _reads_nothing, unit_sum=True)
_comm("grad_accum", sum_fw, identity_shape, "micro-batch gradient accumulation: sum of inputs",
      _reads_nothing, rank_attrs=(), unit_sum=True)
_comm("move", copy_fw, identity_shape, "point-to-point copy: [x] -> [x]", _reads_nothing,
      rank_attrs=("src", "dst"))
_comm("broadcast", broadcast_fw, identity_shape,
      "[x] -> [x] (one copy per output slot); with several inputs, the one at the position of "
      "attrs.src in attrs.ranks", rank_attrs=("ranks", "src"))
_comm("all_gather", all_gather_fw, all_gather_shape,
      "concatenate the inputs along attrs.dim in input order", _reads_gather)
_comm("chunk", chunk_fw, chunk_shape,
      "[x] -> [piece attrs.idx of len(attrs.ranks) equal pieces along attrs.dim]",
      _reads_pieces)
_comm("reduce_scatter", reduce_scatter_fw, reduce_scatter_shape,
      "sum of the group's inputs, then piece attrs.idx of len(attrs.ranks) along attrs.dim",
      _reads_pieces)
_comm("all_to_all", all_to_all_fw, all_to_all_shape,
      "inputs = the group's tensors in group order; this rank's output concatenates, along "
      "attrs.dim, piece attrs.idx (of len(attrs.ranks), default the number of inputs) of every "
      "input split along attrs.split_dim (default attrs.dim)", _reads_pieces)


# ----------------------------------------------------------------------------- averages
# torch.distributed's ReduceOp.AVG (DDP/FSDP gradient averaging), as the PyTorch capture
# writes it: the exact mean of the group's inputs (1/n is an exact rational).


def avg_fw(be, ins, attrs, ctx):
    xs = present(ins)
    return [be.scale(add_all(xs), Fraction(1, len(xs)))]


def reduce_scatter_avg_fw(be, ins, attrs, ctx):
    xs = present(ins)
    total = be.scale(add_all(xs), Fraction(1, len(xs)))
    return [_piece(total, _parts(attrs, len(xs)), attrs["idx"], _axis(attrs, "dim", total.ndim))]


def _reads_count(attrs) -> dict:
    """A mean reads the NUMBER of ranks (its 1/n), not their ids."""
    return {"pieces": len(attrs.get("ranks") or ())}


_comm("all_reduce_avg", avg_fw, identity_shape,
      "mean of the group's inputs: (1/n) * sum (ReduceOp.AVG)", _reads_count)
_comm("reduce_scatter_avg", reduce_scatter_avg_fw, reduce_scatter_shape,
      "mean of the group's inputs, then piece attrs.idx of len(attrs.ranks) along attrs.dim",
      _reads_pieces)


# ----------------------------------------------------------------------------- max
# torch.distributed's ReduceOp.MAX (the row max of Megatron's vocab-parallel cross entropy).


def max_fw(be, ins, attrs, ctx):
    """Elementwise max of the group's inputs, exactly: a chain of ite(a >= b, a, b)."""
    xs = present(ins)
    out = xs[0]
    for x in xs[1:]:
        out = be.maximum(out, x)
    return [out]


_comm("all_reduce_max", max_fw, identity_shape,
      "elementwise max of the group's inputs (ReduceOp.MAX), exact on the real values "
      "(ite(a >= b, a, b) chained in group order; max is associative and commutative, so "
      "the max over a sharded dim followed by this op equals the max over the whole dim). "
      "c10d gives it no autograd rule: code that differentiates through it (Megatron's "
      "cross entropy) detaches the max or writes the backward itself, and the trace then "
      "contains that backward as ATen ops", _reads_nothing)
