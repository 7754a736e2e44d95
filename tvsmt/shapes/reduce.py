"""Shape reduction: the smallest shapes at which a stage is still a faithful test.

The operators are SIMD-like: an output element depends on its inputs through the same
expression at every position, so an equivalence proven at small sizes carries over to the
original sizes as long as the small instance keeps every *distinction* the stage relies on
(TrainVerify, SOSP'25, sec. 4). The rule, per stage:

* every dimension of original size n becomes n / s for a divisor s, with `min(2, n) <= n / s`. Keeping >= 2 everywhere keeps every reduction and contraction non-trivial (a partial
  sum differs from a full one) and every broadcast meaningful (size-1 dims stay 1, the others
  never become 1);
* every partition is kept exactly: a single tensor of size n along a dimension is divided by
  a divisor s of every slice boundary b_i in the stage's lineages, so every boundary maps to
  the integer b_i / s and each part keeps its relative position and size; each parallel part
  gets the matching size;
* every operator's shape rule holds between its reduced tensors (the registry entry says how:
  equal dims, gather/chunk factors, view groupings as products);
* among all solutions the largest reduction is taken (see dims.py: in "divisor space" the
  rules become union-find classes plus a few product relations, solved in microseconds).

Shapes that contradict a rule are a structural violation. A stage whose reduced shapes are
still too large to execute symbolically (a dimension that is prime, or whose divisors the
partitions forbid, near 2**54) is `ReducedShapeTooLarge`: inconclusive, never a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from math import prod

from tvsmt.errors import StructuralViolation, TvsmtError
from tvsmt.ops import ShapeConstraints, ShapeRuleError, TShape
from tvsmt.ops import get as get_op
from tvsmt.ops.registry import shape_rule
from tvsmt.plan.model import Plan
from tvsmt.shapes.dims import Dim, DivisorSolver
from tvsmt.stages import Stage

Shape = tuple[int, ...]

# Reduced tensors of real plans hold at most a few hundred elements (256 over the nnScaler
# fixtures that tvsmt supports, measured by scripts/measure_reduced.py); a symbolic tensor of a
# million terms cannot be encoded in useful time or memory.
MAX_REDUCED_ELEMENTS = 2**20


class ReducedShapeTooLarge(TvsmtError):
    """A stage that shape reduction cannot make small enough to encode (inconclusive)."""

    def __init__(self, message: str, *, tensor: str):
        self.tensor = tensor
        super().__init__(message)


@dataclass
class ReducedShapes:
    single: dict[str, Shape]
    parallel: dict[str, Shape]


def reduced_slice(slc, full: Shape, reduced: Shape) -> tuple[tuple[int, int], ...]:
    return tuple((s * r // n, e * r // n) if n else (0, 0)
                 for (s, e), n, r in zip(slc, full, reduced, strict=True))


def stage_tensors(stage: Stage, single: Plan, parallel: Plan) -> tuple[list[str], list[str]]:
    """Every single and parallel tensor a stage touches, in a deterministic order."""
    s: dict[str, None] = dict.fromkeys(stage.single_frontier)
    for i in stage.single_nodes:
        n = single.nodes[i]
        s.update(dict.fromkeys(t for t in n.inputs + n.outputs if t is not None))
    p: dict[str, None] = dict.fromkeys(stage.parallel_frontier)
    for i in stage.parallel_nodes:
        n = parallel.nodes[i]
        p.update(dict.fromkeys(t for t in n.inputs + n.outputs if t is not None))
    for j in stage.inputs + (stage.target,):
        lin = parallel.lineages[j]
        s[lin.single] = None
        p.update(dict.fromkeys(lin.parallel_tensors()))
    return list(s), list(p)


def dim_shape(solver: DivisorSolver, tensor: str, shape: Shape) -> TShape:
    """A tensor's dimensions as solver variables (sizes 0 and 1 stay constants)."""
    return TShape([n if n <= 1 else solver.new(n, (tensor, i))
                   for i, n in enumerate(shape)], shape)


def apply_shape_rule(c: ShapeConstraints, node, shapes: dict[str, TShape]) -> None:
    """Add a node's shape-rule constraints (ShapeRuleError when its shapes break it)."""
    ins = [shapes[t] if t is not None else None for t in node.inputs]
    outs = [shapes[t] if t is not None else None for t in node.outputs]
    shape_rule(get_op(node.op), node.is_backward)(c, ins, outs, node.attrs)


def reduce_stage(stage: Stage, single: Plan, parallel: Plan) -> ReducedShapes:
    solver = DivisorSolver()

    def fresh(tensor: str, shape: Shape) -> TShape:
        return dim_shape(solver, tensor, shape)

    stensors, ptensors = stage_tensors(stage, single, parallel)
    sshape = {t: fresh(t, single.shape(t)) for t in stensors}
    pshape = {t: fresh(t, parallel.shape(t)) for t in ptensors}
    c = ShapeConstraints()
    for j in stage.inputs + (stage.target,):
        lin = parallel.lineages[j]
        full = single.shape(lin.single)
        sdims = sshape[lin.single].dims
        for part in lin.parts:
            for i, ((s, e), n) in enumerate(zip(part.slice, full, strict=True)):
                if n <= 1:
                    continue
                # every slice boundary stays an integer position after reduction ...
                solver.keep_divisible(sdims[i], s)
                solver.keep_divisible(sdims[i], e)
                # ... and the part is (e - s) / n of the dimension: `p * n == d * (e - s)`,
                # which in divisor space (dims.py) is "same divisor" whatever the ratio
                for t in part.sum_of:
                    pdim = pshape[t].dims[i]
                    if type(pdim) is Dim:
                        solver.same(pdim, sdims[i])
                    else:
                        c.eq(pdim, sdims[i])

    for side, plan, idxs, shapes in (("single", single, stage.single_nodes, sshape),
                                     ("parallel", parallel, stage.parallel_nodes, pshape)):
        for i in idxs:
            node = plan.nodes[i]
            try:
                apply_shape_rule(c, node, shapes)
            except ShapeRuleError as e:
                raise StructuralViolation(f"{side} node {node.id} ({node.op}): {e}",
                                          node=node.id, lineage=stage.target) from None
    for boundary in c.boundaries:
        solver.keep_divisible(boundary.dim, boundary.at)
    try:
        for con in c.constraints:
            solver.add(con)
    except (TypeError, ValueError) as e:
        raise StructuralViolation(f"stage {stage.id}: contradictory shape constraints ({e})",
                                  tensor=parallel.lineages[stage.target].single,
                                  lineage=stage.target) from None
    sizes = solver.solve()

    def value(ts: TShape) -> Shape:
        return tuple(d if isinstance(d, int) else sizes[d.id] for d in ts.dims)

    reduced = ReducedShapes({t: value(v) for t, v in sshape.items()},
                            {t: value(v) for t, v in pshape.items()})
    for side, shapes in (("single", reduced.single), ("parallel", reduced.parallel)):
        for t, shape in shapes.items():
            if prod(shape) > MAX_REDUCED_ELEMENTS:
                raise ReducedShapeTooLarge(
                    f"{side} tensor {t} still has shape {list(shape)} after "
                    f"shape reduction (more than {MAX_REDUCED_ELEMENTS} elements, too large to "
                    "encode): its sizes have no divisor that keeps every partition", tensor=t)
    return reduced
