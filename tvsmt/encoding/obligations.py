"""From stages to obligations: shape reduction, symbolic execution, printing, evaluation.

One stage becomes a `StageOutcome`: its formula and canonical SMT-LIB obligation, or the
structural failure found on the way, plus what random concrete points said about it
(`concrete.Evaluation`, the belt and braces next to the solver's answer, see policy.py).

Stages with the same structural signature (stages/signature.py) are encoded once, as a
*template*; with many templates and several cores the templates are encoded in forked worker
processes that inherit the loaded plans. Where `fork` is not available the run is serial, and
the outcome says so (`ObligationSet.serial_reason`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from tvsmt.encoding.concrete import Evaluation, evaluate_at_random, exact_refutation
from tvsmt.encoding.smtlib import Printed, pin_symbols, print_obligation
from tvsmt.encoding.stage import StageFormula, encode_stage
from tvsmt.errors import StructuralViolation
from tvsmt.forked import can_fork_workers, cpu_workers, fork_map
from tvsmt.ops import SymbolicBackend
from tvsmt.plan import Plan
from tvsmt.report.failures import stage_failure, underivable
from tvsmt.report.report import Failure
from tvsmt.shapes import reduce_stage
from tvsmt.shapes.reduce import ReducedShapeTooLarge
from tvsmt.solving.types import Obligation, SolverResult
from tvsmt.stages import Stage
from tvsmt.stages.signature import stage_signatures
from tvsmt.timing import Timer

# Stage templates worth encoding in worker processes (below this, starting workers costs
# more than it saves).
PARALLEL_TEMPLATES = 48
EVALUATION_POINTS = 2  # random concrete points per template (belt and braces)


@dataclass
class StageOutcome:
    stage: Stage
    formula: StageFormula | None = None
    printed: Printed | None = None
    failure: Failure | None = None
    obligation: Obligation | None = None
    evaluation: Evaluation | None = None  # random concrete points, real functions
    result: SolverResult | None = None
    template: "StageOutcome | None" = None  # the stage whose encoding this one reuses
    pinned: Obligation | None = None  # refuted at a concrete point: `pinned_obligation`


@dataclass
class ObligationSet:
    outcomes: list[StageOutcome]
    unique: dict[str, Obligation]  # digest -> obligation, identical scripts solved once
    templates: int
    serial_reason: str = ""  # why templates were not encoded in parallel, if they were not
    notes: list[str] = field(default_factory=list)


def encode_one(stage: Stage, single: Plan, parallel: Plan, be: SymbolicBackend,
               timer: Timer) -> StageOutcome:
    """Shape reduction, symbolic execution, printing and concrete evaluation of one stage."""
    out = StageOutcome(stage)
    if stage.free_single or stage.free_parallel:
        out.failure = underivable(stage, single, parallel)
        return out
    try:
        with be.active():
            with timer.phase("shapes"):
                shapes = reduce_stage(stage, single, parallel)
            with timer.phase("encoding"):
                out.formula = encode_stage(stage, single, parallel, shapes, be)
                if out.formula.comparisons:
                    pairs = [(c.lhs, c.rhs) for c in out.formula.comparisons]
                    out.printed = p = print_obligation(out.formula.constraints, pairs)
                    query = tuple(p.symbols) + tuple(dict.fromkeys(n for pair in p.pairs
                                                                   for n in pair))
                    out.obligation = Obligation(p.digest, p.text, query,
                                                {"stage": stage.id, "lineage": stage.target})
            if out.formula.comparisons:
                with timer.phase("evaluation"):
                    out.evaluation = evaluate_at_random(out.formula, EVALUATION_POINTS)
                    out.pinned = pinned_obligation(out)
    except StructuralViolation as e:
        out.failure = stage_failure("structural", str(e), stage, single, parallel,
                                    node=e.node, tensor=e.tensor)
    except ReducedShapeTooLarge as e:  # cannot be encoded: inconclusive, never a pass
        out.failure = stage_failure("inconclusive", str(e), stage, single, parallel)
    return out


def pinned_obligation(out: StageOutcome) -> Obligation | None:
    """The stage's obligation with its inputs and uninterpreted functions fixed at the
    concrete point where the two plans were evaluated different (`exact_refutation`; None if
    there is none): a ground query, where the whole one, nonlinear, makes solvers run out of
    time. A model of it is a model of the obligation, with the same query symbols."""
    ev, ob = out.evaluation, out.obligation
    if ev is None or ev.point is None or ob is None or out.printed is None:
        return None
    exact = exact_refutation(out.formula, ev.point)
    if exact is None:
        return None
    text = pin_symbols(ob.smt2, out.printed, *exact)
    return Obligation(hashlib.sha256(text.encode()).hexdigest(), text, ob.query, ob.meta)


def _encode_chunk(single: Plan, parallel: Plan, stages: list[Stage], indices: list[int]):
    """Worker side: encode some template stages; results travel back as plain data."""
    be, timer, out = SymbolicBackend.fresh(), Timer(), []
    for i in indices:
        o = encode_one(stages[i], single, parallel, be, timer)
        out.append((i, o.obligation, o.failure, o.evaluation, o.pinned))
    return out, timer.timings


def _chunks(stages: list[Stage], reps: list[int], n: int) -> list[list[int]]:
    """Split the templates into at most `n` chunks of similar size, keeping stages that run
    a common node (the stages of a multi-output node's outputs, an expert layer's stages
    through the same all-to-all) in the same chunk: a worker's node memo (interpreter.py)
    then runs those nodes once instead of once per worker."""
    parent = list(range(len(reps)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    owner: dict[tuple[str, int], int] = {}
    for k, i in enumerate(reps):
        st = stages[i]
        for node in [("s", x) for x in st.single_nodes] + [("p", x) for x in st.parallel_nodes]:
            j = owner.setdefault(node, k)
            if j != k:
                parent[find(k)] = find(j)
    groups: dict[int, list[int]] = {}
    cost: dict[int, int] = {}
    for k, i in enumerate(reps):
        r = find(k)
        groups.setdefault(r, []).append(i)
        cost[r] = cost.get(r, 0) + 1 + len(stages[i].parallel_nodes)
    chunks: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for r in sorted(groups, key=lambda r: -cost[r]):
        k = load.index(min(load))
        chunks[k].extend(groups[r])
        load[k] += cost[r]
    return [sorted(c) for c in chunks if c]


def _encode_parallel(single: Plan, parallel: Plan, stages: list[Stage], reps: list[int],
                     jobs: int, timer: Timer) -> dict[int, StageOutcome]:
    """Encode the template stages in forked worker processes (tvsmt.forked.fork_map): the
    workers inherit the loaded plans instead of receiving them pickled."""
    chunks = _chunks(stages, reps, jobs * 4)
    with timer.phase("encoding (wall)"):
        results = fork_map(lambda c: _encode_chunk(single, parallel, stages, c), chunks, jobs)
    done: dict[int, StageOutcome] = {}
    for items, timings in results:
        for phase, secs in timings.items():  # time spent in each phase, over all workers
            timer.add(phase, secs)
        for i, obligation, failure, evaluation, pinned in items:
            done[i] = StageOutcome(stages[i], obligation=obligation, failure=failure,
                                   evaluation=evaluation, pinned=pinned)
    return done


def build_obligations(single: Plan, parallel: Plan, stages: list[Stage], timer: Timer,
                      progress=None, jobs: int | None = 1) -> ObligationSet:
    """Encode every stage, once per stage *template*: stages with the same structural
    signature share the representative's obligation (and its evaluation). With several
    templates and jobs > 1, the templates are encoded in parallel worker processes."""
    with timer.phase("templates"):
        first: dict = {}  # signature -> its first stage (each tuple hashed once, here)
        rep_of = [first.setdefault(sig, i)
                  for i, sig in enumerate(stage_signatures(stages, single, parallel))]
        del first  # the signatures are big tuples: none stays for the collector to scan
    reps = sorted(set(rep_of))
    jobs = cpu_workers(jobs)
    # made before the workers are forked: the first backend imports pysmt and the solver
    # bindings it probes (0.14 s), which the workers then inherit instead of each importing
    # them again (scripts/phase_costs.py's encoding and solving rows)
    be = SymbolicBackend.fresh()
    done: dict[int, StageOutcome] = {}
    serial_reason = ""
    if jobs > 1 and len(reps) >= PARALLEL_TEMPLATES:
        if can_fork_workers():
            done = _encode_parallel(single, parallel, stages, reps, jobs, timer)
        else:
            serial_reason = "this platform cannot fork: templates encoded serially"
    outcomes = []
    for k, (stage, i) in enumerate(zip(stages, rep_of)):
        if i == k and k not in done:
            done[k] = encode_one(stage, single, parallel, be, timer)
        rep = done[i]
        if k == i:
            outcomes.append(rep)
        elif rep.failure is None:
            outcomes.append(StageOutcome(stage, obligation=rep.obligation,
                                         evaluation=rep.evaluation, template=rep,
                                         pinned=rep.pinned))
        else:  # a failing template: each copy gets its own encoding and its own names
            outcomes.append(encode_one(stage, single, parallel, be, timer))
        if progress and (k % 64 == 0 or k == len(stages) - 1):
            progress("encoding stages", k + 1, len(stages))
    unique: dict[str, Obligation] = {}
    for out in outcomes:
        if out.obligation is not None:
            unique.setdefault(out.obligation.digest, out.obligation)
    templates = len({id(o.template or o) for o in outcomes})
    return ObligationSet(outcomes, unique, templates, serial_reason)
