"""Shrink the single plan's batch to the pieces a fold keeps.

The folded parallel plan keeps K of the P pieces of the batch. The single plan must then run
on a batch of K pieces: every dimension that the operators' shape rules tie to a batch
dimension (the same union-find classes and product relations as shape reduction, see
shapes/dims.py) is multiplied by K/P, and the kept pieces are packed in their original order.
A dimension the rules tie to a constant, or a slice on a shrunk dimension that is neither a
batch piece nor the whole dimension, makes the fold refuse.
"""

from __future__ import annotations

from fractions import Fraction

from tvsmt.fold.units import FoldRefused
from tvsmt.ops import ShapeConstraints, ShapeRuleError
from tvsmt.plan.model import (
    LineagePart,
    Plan,
    TensorInfo,
    replace,  # LineagePart is a msgspec Struct
)
from tvsmt.shapes.dims import Dim, DivisorSolver
from tvsmt.shapes.reduce import apply_shape_rule, dim_shape


class _Refused(Exception):
    pass


def _classes(single: Plan) -> tuple[DivisorSolver, dict[str, list], set[int]]:
    """The single plan's dimensions tied by the shape rules (shape reduction's classes)."""
    solver = DivisorSolver()
    shapes = {t: dim_shape(solver, t, info.shape) for t, info in single.tensors.items()}
    c = ShapeConstraints()
    for node in single.nodes:
        try:
            apply_shape_rule(c, node, shapes)
        except ShapeRuleError as e:
            raise _Refused(f"single node {node.id}: {e}") from None
    for con in c.constraints:
        solver.add(con)
    boundaries = {b.dim.id for b in c.boundaries if isinstance(b.dim, Dim)}
    return solver, {t: s.dims for t, s in shapes.items()}, boundaries


def rebatch_single(single: Plan, header: Plan, fold_dim: dict[int, int],
                   piece_len: dict[int, int], pieces: dict[int, int], total_pieces: int):
    """(rebatched single plan, function remapping a kept part's slice)."""
    factor = Fraction(len(pieces), total_pieces)
    try:
        solver, dims, boundaries = _classes(single)
    except _Refused as e:
        raise FoldRefused(str(e)) from None
    find = solver._find
    f: dict[int, Fraction] = {}
    for lin, k in fold_dim.items():
        s = header.lineages[lin].single
        n = single.tensors[s].shape[k]
        if n != total_pieces * piece_len[lin]:
            raise FoldRefused(f"{header.lineages[lin].label}: {n} rows along dim {k}, not "
                              f"{total_pieces} pieces of {piece_len[lin]}")
        d = dims[s][k]
        if isinstance(d, Dim):
            f[find(d.id)] = factor
    prods = [([find(x) for x in lhs], [find(x) for x in rhs]) for lhs, rhs in solver.products]
    changed = True
    while changed:  # propagate through view groupings (products of dims)
        changed = False
        for lhs, rhs in prods:
            unknown = [c for c in lhs + rhs if c not in f]
            if len(unknown) == 1 and (lhs + rhs).count(unknown[0]) == 1:
                c = unknown[0]
                pl = _product(lhs, f, c)
                pr = _product(rhs, f, c)
                f[c] = pr / pl if c in lhs else pl / pr
                changed = True
    for lhs, rhs in prods:
        if _product(lhs, f) != _product(rhs, f):
            raise FoldRefused("the single plan's view groupings do not allow a smaller batch")
    for dim_id, fixed in solver.fixed.items():
        if f.get(find(dim_id), 1) != 1:
            raise FoldRefused("a batch dimension of the single plan is tied to a constant")
    if any(f.get(find(b), 1) != 1 for b in boundaries):
        raise FoldRefused("an operator needs a boundary inside the batch")

    def new_dim(d) -> int:
        if not isinstance(d, Dim):
            return d
        size = d.n * f.get(find(d.id), 1)
        if size.denominator != 1 or size < 1:
            raise FoldRefused(f"dimension {d.label} of {d.n} cannot shrink by {factor}")
        return int(size)

    tensors = {t: TensorInfo(t, tuple(new_dim(d) for d in dims[t]), info.role)
               for t, info in single.tensors.items()}
    shrunk = {t: [isinstance(d, Dim) and f.get(find(d.id), 1) != 1 for d in dims[t]]
              for t in single.tensors}

    memo: dict = {}  # (lineage, slice) -> new slice: a weight's parts repeat per unit

    def new_slice(lin: int, p: LineagePart) -> LineagePart:
        key = (lin, p.slice)
        out = memo.get(key)
        if out is None:
            out = memo[key] = _new_slice(lin, p.slice)
        return replace(p, slice=out)

    def _new_slice(lin: int, slc: tuple) -> tuple:
        s = header.lineages[lin].single
        out = []
        for k, (a, b) in enumerate(slc):
            if not shrunk[s][k]:
                out.append((a, b))
            elif fold_dim.get(lin) == k:
                length = piece_len[lin]
                new = pieces.get(a // length) if (b - a) == length and a % length == 0 else None
                if new is None:
                    raise FoldRefused(f"{header.lineages[lin].label}: slice {a}:{b} is not a "
                                      "kept piece")
                out.append((new * length, (new + 1) * length))
            elif (a, b) == (0, single.tensors[s].shape[k]):
                out.append((0, tensors[s].shape[k]))
            else:
                raise FoldRefused(f"{header.lineages[lin].label}: slice {a}:{b} cuts a batch "
                                  "dimension that is not split by replica")
        return tuple(out)

    rebatched = Plan(single.path, single.name, single.kind, single.world, tensors,
                     list(single.nodes), list(single.outputs), list(single.lineages))
    return rebatched, new_slice


def _product(classes, f, skip=None) -> Fraction:
    out = Fraction(1)
    for c in classes:
        if c != skip:
            out *= f.get(c, 1)
    return out
