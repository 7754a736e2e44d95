"""Structural claims checked before any solver call.

* Every single-plan output must have a lineage whose parts are whole tensors (no pending
  partial sum) and whose slices cover every element (execplan v1, "Lineage").
* Every node's declared shapes must satisfy its operator's shape rule at the original sizes.
Both failures are violations of a well-formed plan, not input errors.
"""

from __future__ import annotations

import itertools

from tvsmt.errors import PlanError, StructuralViolation
from tvsmt.graph import Graph
from tvsmt.encoding.interpreter import _brief, internal_error
from tvsmt.ops import AttrError, ShapeConstraints, ShapeRuleError, TShape, attrs_key
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
        if not any(all(s <= lo and hi <= e for (lo, hi), (s, e) in zip(cell, box, strict=True))
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
        for lin in lins:
            scaled = [j for j, p in enumerate(lin.parts) if p.scale != 1]
            if scaled:
                # What the optimizer reads must BE the result: a lineage that needs a factor
                # on a final tensor says the rank holds a wrong value (scales are for
                # intermediate lineages, e.g. a gradient before its averaging).
                p = lin.parts[scaled[0]]
                out.append(StructuralViolation(
                    f"output {t} is held scaled: lineage #{lin.index} part {scaled[0]} says "
                    f"{t} = {p.scale} * {', '.join(p.sum_of[:3])}, so that rank holds "
                    f"{1 / p.scale} times the result", tensor=t, lineage=lin.index))
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


def unclaimed_sinks(parallel: Plan, graph: Graph | None = None) -> list[str]:
    """Parallel tensors that some node writes, no node reads and no lineage names: results
    (a final gradient on some rank, a loss) that nothing relates to the single plan, so
    nothing about them is proven. Listed in the report; `--strict` makes them a failure.
    `graph`: the plan's dataflow graph when the caller has it (its producer and consumer
    indexes are what this needs), in the order the nodes write."""
    graph = graph or Graph(parallel)
    named = {t for lin in parallel.lineages for p in lin.parts for t in p.sum_of}
    consumers = graph.consumers
    return [t for t in graph.producer if t not in consumers and t not in named]


def check_plan_shapes(plan: Plan) -> list[StructuralViolation]:
    """Each node's operator shape rule, evaluated on the declared (original) shapes.

    A rule is a function of the operator, the pass, the shapes and the attributes only, so
    nodes equal in all four share one evaluation (a folded 32-layer plan: 119k nodes, a few
    thousand distinct ones); attributes are compared by `attrs_key`, exactly."""
    out = []
    tensors = plan.tensors
    seen: dict[tuple, str | None] = {}  # (op, pass, shapes, attrs key) -> first violation
    for node in plan.nodes:
        in_shapes = tuple([tensors[t].shape if t else None for t in node.inputs])
        out_shapes = tuple([tensors[t].shape if t else None for t in node.outputs])
        key = (node.op, node.pass_, in_shapes, out_shapes, attrs_key(node.attrs))
        if key in seen:
            if seen[key] is not None:
                out.append(_shape_violation(plan, node, seen[key]))
            continue
        seen[key] = problem = _shape_problem(plan, node, in_shapes, out_shapes)
        if problem is not None:
            out.append(_shape_violation(plan, node, problem))
    return out


def _shape_violation(plan: Plan, node, problem: str) -> StructuralViolation:
    return StructuralViolation(
        f"{plan.path}: node {node.id} ({node.op}): declared shapes violate the "
        f"operator's shape rule ({problem})", node=node.id)


def _shape_problem(plan: Plan, node, in_shapes: tuple, out_shapes: tuple) -> str | None:
    """The first constraint the node's shape rule finds violated, or None (PlanError when
    the rule cannot be applied to the node at all)."""
    spec = get_op(node.op)
    ins = [TShape(list(s), s) if s is not None else None for s in in_shapes]
    outs = [TShape(list(s), s) if s is not None else None for s in out_shapes]
    c = ShapeConstraints()
    try:
        shape_rule(spec, node.is_backward)(c, ins, outs, node.attrs)
        bad = [x for x in c.constraints if x is False]
    except ShapeRuleError as e:
        bad = [e]
    except AttrError as e:
        raise PlanError(f"operator {node.op} cannot be applied with attrs "
                        f"{_brief(node.attrs)}: {e}", file=plan.path, node=node.id) from None
    except KeyError as e:
        if not (e.args and isinstance(e.args[0], str) and e.args[0] not in node.attrs):
            raise internal_error(node, e) from e
        raise PlanError(f"operator {node.op} needs attribute {e.args[0]!r}",
                        file=plan.path, node=node.id) from None
    except (IndexError, TypeError):
        # the rule reached for an input/output slot the node does not have (or null)
        raise PlanError(f"operator {node.op} does not take these inputs/outputs "
                        f"({len(node.inputs)} inputs, {len(node.outputs)} outputs, null "
                        "slots included)", file=plan.path, node=node.id) from None
    except Exception as e:  # a bug in the entry's shape rule
        raise internal_error(node, e) from e
    return str(bad[0]) if bad else None
