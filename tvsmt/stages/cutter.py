"""Lineage-guided stage cutting.

Lineages are processed in the plan's order. A lineage whose parallel tensors are all graph
inputs is an *assumption* (data, weights, seeds) and forms no stage; it is only accepted if its
single tensor is a graph input of the single plan too (otherwise the parallel plan would be
assuming an intermediate result it never computes: a violation).

Every other lineage k is a *claim* and forms one stage:
1. parallel side: slice the parallel graph backward from the tensors of lineage k, stopping at
   tensors named by an earlier lineage (already proven or assumed) and at graph inputs;
2. input lineages: every earlier lineage that names a reached frontier tensor. Assuming all of
   them is sound because each one is proven (or is an assumption on graph inputs);
3. single side: slice the single graph backward from lineage k's single tensor, stopping at the
   single tensors of the input lineages and at graph inputs.
The `aligned` hints of the format are not needed for this and are not trusted.
A frontier tensor that no input lineage constrains stays a free symbol: if the claim depends on
it, the solver finds a counterexample (the claim cannot be derived).

Widening. Stopping at the first known tensor can stop too early: a parallel copy (`identity`
of a `multiref` output, a chain of moves through a pipeline stage that only passes
activations on) may be named by the lineage of a *sibling* copy in the single plan, which the
single side cannot use (`t908 = multiref(t589)[1]` is not computed from `t904 =
multiref(t589)[0]`). When the single side of a stage reaches graph inputs that nothing
relates, the stage is widened: the parallel slice goes on through every known frontier tensor
none of whose lineages names an ancestor of the target in the single plan, until the
frontier only holds useful tensors (or nothing changes). Widening only makes a stage bigger
and its assumptions are still earlier lineages, so it cannot make a wrong claim pass; it is
tried only when the narrow stage is underivable, so proven plans pay nothing for it.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from tvsmt.errors import StructuralViolation
from tvsmt.graph import Graph
from tvsmt.plan.model import Plan


@dataclass(frozen=True)
class Stage:
    """One proof obligation's worth of both graphs (indices into the plans' node lists)."""

    target: int  # lineage index proven by this stage
    inputs: tuple[int, ...]  # lineage indices assumed
    single_nodes: tuple[int, ...]
    parallel_nodes: tuple[int, ...]
    single_frontier: tuple[str, ...]  # single tensors entering the stage
    parallel_frontier: tuple[str, ...]
    free_parallel: tuple[str, ...] = ()  # parallel graph inputs that no lineage constrains
    free_single: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"L{self.target}"


@dataclass
class CutResult:
    stages: list[Stage]
    assumptions: list[int]  # lineage indices taken as assumptions
    violations: list[StructuralViolation]


def cut_stages(single: Plan, parallel: Plan, sgraph: Graph | None = None,
               pgraph: Graph | None = None) -> CutResult:
    sgraph = sgraph or Graph(single)
    pgraph = pgraph or Graph(parallel)
    known: dict[str, list[int]] = {}  # parallel tensor -> earlier lineages naming it
    known_single: dict[str, list[int]] = {}
    stages: list[Stage] = []
    assumptions: list[int] = []
    violations: list[StructuralViolation] = []

    for lin in parallel.lineages:
        ptensors = lin.parallel_tensors()
        if all(pgraph.is_input(t) for t in ptensors):
            if sgraph.is_input(lin.single):
                assumptions.append(lin.index)
            else:
                violations.append(StructuralViolation(
                    f"lineage #{lin.index} relates parallel graph inputs to {lin.single}, which "
                    "the single plan computes: the parallel plan never derives it",
                    tensor=lin.single, lineage=lin.index))
        else:
            stages.append(_cut_one(lin.index, lin.single, ptensors, sgraph, pgraph, known,
                                   parallel))
        for t in ptensors:
            known.setdefault(t, []).append(lin.index)
        known_single.setdefault(lin.single, []).append(lin.index)
    return CutResult(stages, assumptions, violations)


def _cut_one(index: int, single_tensor: str, ptensors: list[str], sgraph: Graph, pgraph: Graph,
             known: dict[str, list[int]], parallel: Plan) -> Stage:
    stage = _cut_through(index, single_tensor, ptensors, sgraph, pgraph, known, parallel, set())
    if not stage.free_single:
        return stage
    # Widen (module docstring): slice through known tensors whose lineages cannot help.
    snodes, _ = sgraph.backward_slice([single_tensor], stop=lambda t: False)
    ancestors = {t for i in snodes for t in sgraph.nodes[i].inputs if t is not None}
    ancestors.add(single_tensor)
    through: set[str] = set()
    wide = stage
    while True:
        useless = {t for t in wide.parallel_frontier if t in known and t not in through
                   and not any(parallel.lineages[j].single in ancestors for j in known[t])}
        if not useless:
            break
        through |= useless
        wide = _cut_through(index, single_tensor, ptensors, sgraph, pgraph, known, parallel,
                            through)
        if not wide.free_single and not wide.free_parallel:
            return wide
    return stage  # still underivable: report the narrow stage, which names the first gap


def _cut_through(index: int, single_tensor: str, ptensors: list[str], sgraph: Graph,
                 pgraph: Graph, known: dict[str, list[int]], parallel: Plan,
                 through: set[str]) -> Stage:
    """The stage of one claim, stopping at known parallel tensors except those in `through`."""
    pnodes, pfrontier = pgraph.backward_slice(
        ptensors, stop=lambda t: t in known and t not in through)
    inputs = sorted({j for t in pfrontier for j in known.get(t, ())})
    single_stop = {parallel.lineages[j].single for j in inputs}
    snodes, sfrontier = sgraph.backward_slice([single_tensor], stop=lambda t: t in single_stop)
    # a tensor of no elements (FSDP2's last rank's share of a few rows) holds no values:
    # nothing depends on it, so no lineage needs to relate it
    free_p = tuple(t for t in pfrontier if t not in known and math.prod(parallel.shape(t)))
    free_s = tuple(t for t in sfrontier if t not in single_stop)
    return Stage(index, tuple(inputs), tuple(snodes), tuple(pnodes), tuple(sfrontier),
                 tuple(pfrontier), free_p, free_s)
