"""Structural claims checked before any solver call.

* Every single-plan output must have a lineage whose parts are whole tensors (no pending
  partial sum) and whose slices cover every element (execplan v1, "Lineage").
* Every node's declared shapes must satisfy its operator's shape rule at the original sizes.
Both failures are violations of a well-formed plan, not input errors.
"""

from __future__ import annotations

import itertools

from tvsmt.errors import PlanError, StructuralViolation
from tvsmt.ops import ShapeConstraints, ShapeRuleError, TShape
from tvsmt.ops import get as get_op
from tvsmt.ops.registry import shape_rule
from tvsmt.plan.model import Lineage, Plan


def covers(lin: Lineage, full: tuple[int, ...]) -> bool:
    """Do the lineage's slices cover every element of a tensor of shape `full`?"""
    if not full:
        return bool(lin.parts)
    cuts = [sorted({0, n} | {b for p in lin.parts for b in p.slice[d]})
            for d, n in enumerate(full)]
    cells = [list(zip(c[:-1], c[1:])) for c in cuts]
    boxes = [p.slice for p in lin.parts]
    for cell in itertools.product(*cells):
        if not any(all(s <= lo and hi <= e for (lo, hi), (s, e) in zip(cell, box))
                   for box in boxes):
            return False
    return True


def check_output_coverage(single: Plan, parallel: Plan) -> list[StructuralViolation]:
    by_single: dict[str, list[Lineage]] = {}
    for lin in parallel.lineages:
        by_single.setdefault(lin.single, []).append(lin)
    out = []
    for t in single.outputs:
        lins = by_single.get(t, [])
        complete = [lin for lin in lins if all(len(p.sum_of) == 1 for p in lin.parts)]
        if not complete:
            out.append(StructuralViolation(
                f"output {t} is only held as a partial sum (no lineage of whole tensors)",
                tensor=t, lineage=lins[-1].index if lins else None))
        elif not any(covers(lin, single.shape(t)) for lin in complete):
            out.append(StructuralViolation(
                f"output {t} is not fully held: some elements are in no lineage part",
                tensor=t, lineage=complete[-1].index))
    return out


def check_plan_shapes(plan: Plan) -> list[StructuralViolation]:
    """Each node's operator shape rule, evaluated on the declared (original) shapes."""
    out = []
    for node in plan.nodes:
        spec = get_op(node.op)
        ins = [TShape(list(plan.shape(t)), plan.shape(t)) if t else None for t in node.inputs]
        outs = [TShape(list(plan.shape(t)), plan.shape(t)) if t else None for t in node.outputs]
        c = ShapeConstraints()
        try:
            shape_rule(spec, node.is_backward)(c, ins, outs, node.attrs)
            bad = [x for x in c.constraints if x is False]
        except ShapeRuleError as e:
            bad = [e]
        except (IndexError, KeyError, TypeError, ValueError, ArithmeticError) as e:
            # not a shape contradiction: the rule cannot read this node's attributes
            what = f"missing attribute {e}" if isinstance(e, KeyError) else str(e)
            raise PlanError(f"operator {node.op} cannot be applied with attrs "
                            f"{node.attrs}: {what}", file=plan.path, node=node.id) from None
        if bad:
            out.append(StructuralViolation(
                f"{plan.path}: node {node.id} ({node.op}): declared shapes violate the "
                f"operator's shape rule ({bad[0]})", node=node.id))
    return out
