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

A signature is a tuple, compared exactly (hash, then equality) as a dictionary key: no digest
stands between two stages and the claim that they are the same computation.
"""

from __future__ import annotations

from collections.abc import Iterator

from tvsmt.ops import attrs_key
from tvsmt.ops import get as get_op
from tvsmt.plan.model import Plan
from tvsmt.stages.cutter import Stage

Signature = tuple


def stage_signatures(stages: list[Stage], single: Plan, parallel: Plan
                     ) -> Iterator[Signature]:
    """Every stage's signature, one at a time (a caller keeps only the distinct ones: a
    405B plan has 18k stages and a hundred templates); each lineage's parts are put in form
    once for all stages."""
    forms = _LineageForms(parallel)
    return (_signature(st, single, parallel, forms) for st in stages)


def stage_signature(stage: Stage, single: Plan, parallel: Plan) -> Signature:
    return _signature(stage, single, parallel, _LineageForms(parallel))


class _LineageForms:
    """Each lineage's parts with its parallel tensors numbered 0.. in first-use order (its
    form, a tuple of ints compared exactly), those tensors in that order and their shapes.
    A stage where all of a lineage's tensors are new to it numbers them base.. in that same
    order, so (base, form) says exactly what the tensor-by-tensor numbering would."""

    def __init__(self, parallel: Plan):
        self.lineages, self.tensors = parallel.lineages, parallel.tensors
        self.of: dict[int, tuple[tuple, tuple, tuple]] = {}

    def __call__(self, j: int) -> tuple[tuple, tuple, tuple]:
        hit = self.of.get(j)
        if hit is None:
            order: dict[str, int] = {}
            form = tuple((p.slice, tuple([order.setdefault(t, len(order)) for t in p.sum_of]),
                          _ratio(p.scale)) for p in self.lineages[j].parts)
            hit = self.of[j] = (form, tuple(order),
                                tuple([self.tensors[t].shape for t in order]))
        return hit


def _ratio(scale) -> tuple[int, int]:
    """A part's scale as two ints: hashed in C, unlike a Fraction."""
    return (scale.numerator, scale.denominator)


def _signature(stage: Stage, single: Plan, parallel: Plan, forms: _LineageForms) -> Signature:
    local = ({}, {})  # single, parallel: tensor id -> local number (one count for both)
    shapes: list = []
    tables = (single.tensors, parallel.tensors)

    def tid(side: int, t: str | None):
        if t is None:
            return None
        seen = local[side]
        k = seen.get(t)
        if k is None:
            k = seen[t] = len(local[0]) + len(local[1])
            shapes.append(tables[side][t].shape)
        return k

    parts: list = []
    p_seen = local[1]
    for role, j in [("target", stage.target)] + [("input", j) for j in stage.inputs]:
        single_k = tid(0, parallel.lineages[j].single)
        form, tensors, form_shapes = forms(j)
        if p_seen.keys().isdisjoint(tensors):  # all new: numbered base.. in form order
            base = len(local[0]) + len(p_seen)
            p_seen.update(zip(tensors, range(base, base + len(tensors))))
            shapes.extend(form_shapes)
            parts.append((role, single_k, "form", base, form))
        else:  # some tensor seen before in this stage: each part tensor by its number
            parts.append((role, single_k, "parts", tuple(
                (p.slice, tuple([tid(1, t) for t in p.sum_of]), _ratio(p.scale))
                for p in parallel.lineages[j].parts)))
    for side, plan, idxs in ((0, single, stage.single_nodes),
                             (1, parallel, stage.parallel_nodes)):
        nodes = plan.nodes
        for i in idxs:
            n = nodes[i]
            reads = get_op(n.op).semantic_attrs
            parts.append((side, n.op, n.pass_,
                          attrs_key(n.attrs if reads is None else reads(n.attrs)),
                          tuple([tid(side, t) for t in n.inputs]),
                          tuple([tid(side, t) for t in n.outputs])))
    parts.append(("frontier", tuple([tid(0, t) for t in stage.single_frontier]),
                  tuple([tid(1, t) for t in stage.parallel_frontier])))
    parts.append(("shapes", tuple(shapes)))
    return tuple(parts)
