"""Structural signature of a stage: equal signatures mean equal obligations.

A signature lists, with tensors renamed to local numbers in first-use order, everything the
encoding of a stage reads: the target and input lineages (single tensor, slices, part tensors,
scales), every node (side, operator, pass, all attributes, input and output slots), the
frontier tensors and every tensor's original shape. Two stages with the same signature are
the same computation on differently named tensors, so shape reduction, symbolic execution and
printing would produce byte-identical scripts: the verifier computes them once (a template)
and reuses the result. Anything left out of the signature could merge different stages, so
when in doubt a field is included. The one normalization: an operator entry may declare
which attributes its rules read (`OpSpec.semantic_attrs`, e.g. a collective reads the size of
its group, not the rank ids); all others are keyed on every attribute.
"""

from __future__ import annotations

import hashlib
import json

from tvsmt.ops import get as get_op
from tvsmt.plan.model import Plan
from tvsmt.stages.cutter import Stage


def stage_signature(stage: Stage, single: Plan, parallel: Plan) -> str:
    local: dict[tuple[str, str], int] = {}
    shapes: list = []

    def tid(side: str, t: str | None):
        if t is None:
            return None
        key = (side, t)
        if key not in local:
            local[key] = len(local)
            plan = single if side == "s" else parallel
            shapes.append(plan.shape(t))
        return local[key]

    parts = []
    for role, j in [("target", stage.target)] + [("input", j) for j in stage.inputs]:
        lin = parallel.lineages[j]
        parts.append((role, tid("s", lin.single), tuple(
            (p.slice, tuple(tid("p", t) for t in p.sum_of), str(p.scale)) for p in lin.parts)))
    for side, plan, idxs in (("s", single, stage.single_nodes),
                             ("p", parallel, stage.parallel_nodes)):
        for i in idxs:
            n = plan.nodes[i]
            reads = get_op(n.op).semantic_attrs
            attrs = n.attrs if reads is None else reads(n.attrs)
            parts.append((side, n.op, n.pass_, json.dumps(attrs, sort_keys=True, default=str),
                          tuple(tid(side, t) for t in n.inputs),
                          tuple(tid(side, t) for t in n.outputs)))
    parts.append(("frontier", tuple(tid("s", t) for t in stage.single_frontier),
                  tuple(tid("p", t) for t in stage.parallel_frontier)))
    parts.append(("shapes", tuple(shapes)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()
