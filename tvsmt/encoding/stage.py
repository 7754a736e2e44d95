"""Symbolic execution of one stage into a pysmt formula.

Input lineages are encoded by substitution where possible (a replica or shard of a single
tensor *is* that slice; a single element known only as a partial sum *is* that sum), and as
equality constraints where an element is defined twice (replicas, several lineages). Substitution
of a variable by its defining term is equisatisfiable, so this loses nothing; it lets the solver
prove most stages by normalization alone.

The obligation is: constraints AND (some element of the target lineage differs). `unsat` proves
the stage. Elements whose two sides are the very same term (pysmt hash-conses terms) are
equal by construction and are left out of the disjunction.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from tvsmt.encoding.interpreter import Interpreter
from tvsmt.ops import SymbolicBackend
from tvsmt.plan.model import Plan
from tvsmt.shapes import ReducedShapes, reduced_slice
from tvsmt.stages import Stage


@dataclass
class Comparison:
    """One element of the target lineage: single value vs scaled sum of parallel values."""

    part: int
    index: tuple[int, ...]  # index inside the part (reduced)
    single_index: tuple[int, ...]  # index inside the single tensor (reduced)
    lhs: object  # pysmt term, single side
    rhs: object  # pysmt term, parallel side


@dataclass
class StageFormula:
    stage: Stage
    constraints: list  # pysmt Bool terms (assumed)
    comparisons: list[Comparison]  # non-trivial element comparisons (goal: one differs)
    trivially_equal: int = 0  # elements proven by term identity
    target_shape: tuple[int, ...] = ()  # reduced shape of the target's single tensor
    inputs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # symbol -> (tensor, index)


def _slice_view(arr: np.ndarray, slc) -> np.ndarray:
    # Ellipsis keeps a 0-d tensor (a scalar loss) an array view instead of its element
    return arr[tuple(slice(s, e) for s, e in slc) + (Ellipsis,)]


def _undefined(arr: np.ndarray) -> list[tuple[int, ...]]:
    """The indices of the elements not yet defined, in C order (`itertools.product`'s)."""
    free = [x is None for x in arr.flat]
    if not any(free):
        return []
    return list(itertools.compress(itertools.product(*map(range, arr.shape)), free))


def encode_stage(stage: Stage, single: Plan, parallel: Plan, shapes: ReducedShapes,
                 be: SymbolicBackend) -> StageFormula:
    mgr = be.mgr
    real = be.real
    inputs: dict[str, tuple[str, tuple[int, ...]]] = {}

    def symbol(side: str, tensor: str, idx: tuple[int, ...]):
        name = f"{side}|{tensor}|{','.join(map(str, idx))}"
        inputs[name] = (f"{side}:{tensor}", idx)
        return mgr.Symbol(name, real)

    # Element definitions of the stage's entry tensors; None = not yet defined.
    sval: dict[str, np.ndarray] = {}
    pval: dict[str, np.ndarray] = {}

    def slot(table, tensor, shape):
        if tensor not in table:
            table[tensor] = np.full(shape, None, dtype=object)
            if table is pval:
                untouched.add(tensor)
        return table[tensor]

    untouched: set[str] = set()  # parallel entry tensors no element of which is defined yet

    constraints = []
    for j in stage.inputs:
        lin = parallel.lineages[j]
        full = single.shape(lin.single)
        sred = shapes.single[lin.single]
        sarr = slot(sval, lin.single, sred)
        for part in lin.parts:
            rslc = reduced_slice(part.slice, full, sred)
            starts = [s for s, _ in rslc]
            view = _slice_view(sarr, rslc)
            parrs = [slot(pval, t, shapes.parallel[t]) for t in part.sum_of]
            copy = len(parrs) == 1 and part.scale == 1
            if copy and part.sum_of[0] in untouched and parrs[0].shape == view.shape:
                # a replica or shard not defined yet (the common case) *is* its slice, given
                # symbols where the single side has no definition yet: one array copy
                for idx in _undefined(view):
                    view[idx] = symbol("s", lin.single,
                                       tuple(i + s for i, s in zip(idx, starts)))
                parrs[0][...] = view
                untouched.discard(part.sum_of[0])
                continue
            untouched.difference_update(part.sum_of)
            for idx in itertools.product(*(range(n) for n in view.shape)):
                if copy and parrs[0][idx] is None:
                    if view[idx] is None:
                        view[idx] = symbol("s", lin.single,
                                           tuple(i + s for i, s in zip(idx, starts)))
                    parrs[0][idx] = view[idx]
                    continue
                terms = []
                for t, arr in zip(part.sum_of, parrs):
                    if arr[idx] is None:
                        arr[idx] = symbol("p", t, idx)
                    terms.append(arr[idx])
                rhs = terms[0] if len(terms) == 1 else mgr.Plus(terms)
                if part.scale != 1:
                    rhs = mgr.Times(mgr.Real(Fraction(part.scale)), rhs)
                if view[idx] is None:
                    view[idx] = rhs
                elif view[idx] is not rhs:
                    constraints.append(mgr.Equals(view[idx], rhs))

    def complete(table, side, tensor, shape):
        arr = slot(table, tensor, shape)
        for idx in _undefined(arr):
            arr[idx] = symbol(side, tensor, idx)
        return arr

    senv = {t: complete(sval, "s", t, shapes.single[t]) for t in
            list(sval) + [t for t in stage.single_frontier if t not in sval]}
    penv = {t: complete(pval, "p", t, shapes.parallel[t]) for t in
            list(pval) + [t for t in stage.parallel_frontier if t not in pval]}
    Interpreter(single, be, shapes.single).run(stage.single_nodes, senv)
    Interpreter(parallel, be, shapes.parallel).run(stage.parallel_nodes, penv)

    target = parallel.lineages[stage.target]
    full = single.shape(target.single)
    sred = shapes.single[target.single]
    sarr = senv[target.single]
    comparisons: list[Comparison] = []
    trivial = 0
    for j, part in enumerate(target.parts):
        rslc = reduced_slice(part.slice, full, sred)
        starts = [s for s, _ in rslc]
        view = _slice_view(sarr, rslc)
        parrs = [penv[t] for t in part.sum_of]
        if len(parrs) == 1 and part.scale == 1 and parrs[0].shape == view.shape and all(
                map(operator.is_, view.flat, parrs[0].flat)):
            trivial += view.size  # a replica or shard whose every term is the single side's
            continue
        for idx in itertools.product(*(range(n) for n in view.shape)):
            terms = [a[idx] for a in parrs]
            rhs = terms[0] if len(terms) == 1 else mgr.Plus(terms)
            if part.scale != 1:
                rhs = mgr.Times(mgr.Real(Fraction(part.scale)), rhs)
            lhs = view[idx]
            if lhs is rhs:
                trivial += 1
                continue
            sidx = tuple(i + s for i, s in zip(idx, starts))
            comparisons.append(Comparison(j, idx, sidx, lhs, rhs))
    return StageFormula(stage, constraints, comparisons, trivially_equal=trivial, inputs=inputs,
                        target_shape=tuple(sred))
