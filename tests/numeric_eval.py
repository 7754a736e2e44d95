"""A small numeric evaluator of execplan pairs, for tests that need no solver.

`check_pair_numeric(single, parallel)` draws random concrete values for the single plan's graph
inputs, derives the parallel plan's graph inputs from them through their lineages, runs both
plans with the operator registry's numeric semantics and checks every lineage part
(`scale * sum(sum_of) == single[slice]`). It returns the list of mismatching parts.

A parallel graph input gets its value only from a lineage whose single tensor is itself a
graph input of the single plan (an assumption); a parallel tensor that no node writes and that
only computed lineages mention is an error (`UndefinedTensor`), never an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvsmt.encoding.interpreter import Interpreter
from tvsmt.ops import NumericBackend
from tvsmt.plan import Plan, plan_from_dict


class UndefinedTensor(Exception):
    pass


@dataclass
class Mismatch:
    lineage: int
    single: str
    part: int
    sum_of: tuple[str, ...]
    max_err: float

    def __str__(self):
        return (f"lineage #{self.lineage} of {self.single} part {self.part} "
                f"({', '.join(self.sum_of)}): max error {self.max_err:.3g}")


def _as_plan(p) -> Plan:
    return p if isinstance(p, Plan) else plan_from_dict(p, f"<{p.get('kind', 'plan')}>")


def graph_inputs(plan: Plan) -> list[str]:
    written = {t for n in plan.nodes for t in n.outputs if t is not None}
    read = []
    seen = set()
    for n in plan.nodes:
        for t in n.inputs:
            if t is not None and t not in written and t not in seen:
                seen.add(t)
                read.append(t)
    return read


def _token_inputs(plan: Plan) -> dict[str, int]:
    """Graph inputs read as embedding ids -> vocabulary size."""
    out = {}
    for n in plan.nodes:
        if n.op == "embedding" and n.pass_ == "fw":
            out[n.inputs[0]] = plan.shape(n.inputs[1])[0]
    return out


def random_inputs(plan: Plan, rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens = _token_inputs(plan)
    vals = {}
    for t in graph_inputs(plan):
        shape = plan.shape(t)
        if t in tokens:
            vals[t] = rng.integers(0, tokens[t], size=shape).astype(np.float64)
        elif plan.tensors[t].role == "param":
            vals[t] = rng.normal(0.0, 0.5, size=shape)
        else:
            vals[t] = rng.normal(0.0, 1.0, size=shape)
    return vals


def run(plan: Plan, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every node of the plan on numbers, with tvsmt's own interpreter."""
    interpreter = Interpreter(plan, NumericBackend())
    vals = dict(inputs)
    for n in plan.nodes:
        missing = [t for t in n.inputs if t is not None and t not in vals]
        if missing:
            raise UndefinedTensor(f"node {n.id} reads {missing[0]}, which has no value")
        interpreter.run_node(n, vals)
    return vals


def _sl(slice_):
    return tuple(slice(s, e) for s, e in slice_)


def parallel_inputs(single: Plan, parallel: Plan, svals: dict[str, np.ndarray]
                    ) -> dict[str, np.ndarray]:
    s_inputs = set(graph_inputs(single))
    needed = graph_inputs(parallel)
    vals: dict[str, np.ndarray] = {}
    for lin in parallel.lineages:
        if lin.single not in s_inputs:
            continue
        for part in lin.parts:
            if len(part.sum_of) != 1:
                continue
            (t,) = part.sum_of
            v = svals[lin.single][_sl(part.slice)] / float(part.scale)
            if t in vals and not np.allclose(vals[t], v):
                raise AssertionError(f"input lineages give {t} two different values")
            vals[t] = v
    for t in needed:
        if t not in vals:
            raise UndefinedTensor(f"parallel graph input {t} has no input lineage")
    return vals


def check_pair_numeric(single, parallel, seed: int = 0, rtol: float = 1e-6,
                       atol: float = 1e-6) -> list[Mismatch]:
    single, parallel = _as_plan(single), _as_plan(parallel)
    rng = np.random.default_rng(seed)
    svals = run(single, random_inputs(single, rng))
    pvals = run(parallel, parallel_inputs(single, parallel, svals))
    bad = []
    for lin in parallel.lineages:
        ref_full = svals[lin.single]
        for j, part in enumerate(lin.parts):
            missing = [t for t in part.sum_of if t not in pvals]
            if missing:
                raise UndefinedTensor(f"lineage #{lin.index} names {missing[0]}, which has "
                                      "no value")
            got = sum(pvals[t] for t in part.sum_of) * float(part.scale)
            ref = ref_full[_sl(part.slice)]
            finite = np.isfinite(ref)
            scale = max([1.0] + ([float(np.max(np.abs(ref[finite])))] if finite.any() else []))
            with np.errstate(invalid="ignore"):
                diff = np.where(got == ref, 0.0, np.abs(got - ref))  # equal infinities: 0
            err = float(np.max(diff)) if ref.size else 0.0
            if not np.isfinite(err) or err > atol * scale + rtol * scale:
                bad.append(Mismatch(lin.index, lin.single, j, part.sum_of, err))
    return bad
