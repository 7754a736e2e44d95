"""The verification pipeline: plan -> graph -> stages -> shapes -> encoding -> solving -> report.

Each phase is a package of its own; this module only composes them, times them, and turns
every outcome into the report. Soundness rule: a stage counts as proven only on `unsat` from
a solver (or when both sides are literally the same term); anything else is a failure or
inconclusive, never a pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from tvsmt.encoding.smtlib import Printed, print_obligation
from tvsmt.encoding.stage import StageFormula, encode_stage
from tvsmt.errors import StructuralViolation
from tvsmt.graph import Graph
from tvsmt.lineage import check_output_coverage, check_plan_shapes
from tvsmt.ops import SymbolicBackend
from tvsmt.plan import Plan, load_plan
from tvsmt.plan.reader import check_pair
from tvsmt.report.counterexample import (
    confirm,
    counterexample,
    first_mismatch_part,
    screen,
    uses_abstraction,
)
from tvsmt.report.report import EQUIVALENT, INCONCLUSIVE, VIOLATION, Failure, Report
from tvsmt.shapes import reduce_stage
from tvsmt.solving.dispatch import (  # noqa: F401 - re-exported for callers and tests
    SMALL_RUN,
    _both_must_prove,
    _solver_names,
    check_solver_choice,
    solve_obligations,
    store_in_corpus,
)
from tvsmt.solving.types import SAT, UNSAT, Obligation, SolverResult
from tvsmt.stages import Stage, cut_stages
from tvsmt.stages.signature import stage_signature


@dataclass
class Options:
    jobs: int | None = None
    solver: str = "z3"
    timeout: float = 60.0
    # True: z3 and cvc5; or the profiles (names or paths) that must all prove each stage
    crosscheck: bool | str | tuple[str, ...] = False
    corpus: str | None = None
    fresh: bool = False
    backend: str = "loky"
    scheduler: str | None = None
    fold: bool = True  # replica folding (tvsmt/fold) when the plan has > 2 replicas or mbs
    progress: Callable[[str, int, int | None], None] | None = None  # (phase, done, total)

    def __post_init__(self):
        check_solver_choice(self.solver, self.crosscheck)


@dataclass
class StageOutcome:
    stage: Stage
    formula: StageFormula | None = None
    printed: Printed | None = None
    failure: Failure | None = None
    obligation: Obligation | None = None
    result: SolverResult | None = None
    template: "StageOutcome | None" = None  # the stage whose encoding this one reuses


class Timer:
    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0


def _nodes(plan: Plan, idxs) -> list[dict]:
    """Report entries of plan nodes: id, op, rank, and the producer's source line if known."""
    out = []
    for i in idxs:
        n = plan.nodes[i]
        entry = {"id": n.id, "op": n.op, "rank": n.rank}
        if n.source:
            entry["source"] = n.source
        out.append(entry)
    return out


def _cone(plan: Plan, node_idxs, tensors) -> list[int]:
    """The stage nodes that the given tensors depend on (to point at the failing part)."""
    need, out = set(tensors), []
    for i in reversed(node_idxs):
        n = plan.nodes[i]
        if any(t in need for t in n.outputs if t is not None):
            out.append(i)
            need.update(t for t in n.inputs if t is not None)
    return out[::-1]


def _stage_failure(kind: str, message: str, stage: Stage | None, single: Plan, parallel: Plan,
                   part: int | None = None, node: str | None = None, tensor: str | None = None,
                   **extra) -> Failure:
    if stage is None:
        return Failure(kind, message, node=node, tensor=tensor, **extra)
    lin = parallel.lineages[stage.target]
    parts = lin.parts if part is None else [lin.parts[part]]
    return Failure(
        kind, message, stage=stage.id, lineage=stage.target, tensor=tensor or lin.single,
        slice=[list(r) for r in parts[0].slice] if part is not None else None,
        parallel_tensors=sorted({t for p in parts for t in p.sum_of}),
        single_nodes=_nodes(single, stage.single_nodes),
        parallel_nodes=_nodes(parallel, _cone(parallel, stage.parallel_nodes,
                                              [t for p in parts for t in p.sum_of])),
        node=node, **extra)


def _underivable(stage: Stage, single: Plan, parallel: Plan) -> Failure:
    """A claim whose computation reaches graph inputs that no input lineage relates."""
    lin = parallel.lineages[stage.target]
    why = []
    if stage.free_single:
        why.append("the single plan computes it from " + ", ".join(stage.free_single[:4])
                   + (" ..." if len(stage.free_single) > 4 else ""))
    if stage.free_parallel:
        why.append("the parallel plan computes it from " + ", ".join(stage.free_parallel[:4])
                   + (" ..." if len(stage.free_parallel) > 4 else ""))
    msg = (f"claimed lineage #{lin.index} of {lin.single} cannot be derived from the graph: "
           + "; ".join(why) + ", which no earlier lineage relates to the other plan")
    return _stage_failure("structural", msg, stage, single, parallel)


def encode_one(stage: Stage, single: Plan, parallel: Plan, be: SymbolicBackend,
               timer: Timer) -> StageOutcome:
    """Shape reduction, symbolic execution and printing of one stage."""
    out = StageOutcome(stage)
    if stage.free_single or stage.free_parallel:
        out.failure = _underivable(stage, single, parallel)
        return out
    try:
        with timer.phase("shapes"):
            shapes = reduce_stage(stage, single, parallel)
        with timer.phase("encoding"):
            out.formula = encode_stage(stage, single, parallel, shapes, be)
            if out.formula.comparisons:
                pairs = [(c.lhs, c.rhs) for c in out.formula.comparisons]
                out.printed = p = print_obligation(out.formula.constraints, pairs)
                query = tuple(p.symbols) + tuple(n for pair in p.pairs for n in pair)
                out.obligation = Obligation(p.digest, p.text, query,
                                            {"stage": stage.id, "lineage": stage.target})
    except StructuralViolation as e:
        out.failure = _stage_failure("structural", str(e), stage, single, parallel,
                                     node=e.node, tensor=e.tensor)
    return out


# Stage templates worth encoding in worker processes (below this, starting workers costs
# more than it saves).
PARALLEL_TEMPLATES = 48
_WORK: tuple | None = None  # (single, parallel, stages), inherited by forked workers


def _encode_chunk(indices: list[int]):
    """Worker side: encode some template stages; results travel back as plain data."""
    single, parallel, stages = _WORK
    be, timer, out = SymbolicBackend(), Timer(), []
    for i in indices:
        o = encode_one(stages[i], single, parallel, be, timer)
        out.append((i, o.obligation, o.failure))
    return out, timer.timings


def _encode_parallel(single: Plan, parallel: Plan, stages: list[Stage], reps: list[int],
                     jobs: int, timer: Timer) -> dict[int, StageOutcome]:
    """Encode the template stages in forked worker processes (joblib, multiprocessing):
    the workers inherit the loaded plans instead of receiving them pickled."""
    import joblib

    global _WORK
    _WORK = (single, parallel, stages)
    chunks = [reps[k::jobs * 4] for k in range(jobs * 4) if reps[k::jobs * 4]]
    try:
        with timer.phase("encoding (wall)"):
            results = joblib.Parallel(n_jobs=jobs, backend="multiprocessing")(
                joblib.delayed(_encode_chunk)(c) for c in chunks)
    finally:
        _WORK = None
    done: dict[int, StageOutcome] = {}
    for items, timings in results:
        for phase, secs in timings.items():  # time spent in each phase, over all workers
            timer.timings[phase] = timer.timings.get(phase, 0.0) + secs
        for i, obligation, failure in items:
            done[i] = StageOutcome(stages[i], obligation=obligation, failure=failure)
    return done


def build_obligations(single: Plan, parallel: Plan, stages: list[Stage], timer: Timer,
                      progress=None, jobs: int | None = 1) -> list[StageOutcome]:
    """Encode every stage, once per stage *template*: stages with the same structural
    signature (see stages/signature.py) share the representative's obligation. With several
    templates and jobs > 1, the templates are encoded in parallel worker processes."""
    import multiprocessing
    import os

    with timer.phase("templates"):
        sigs = [stage_signature(st, single, parallel) for st in stages]
    first: dict[str, int] = {}
    for i, sig in enumerate(sigs):
        first.setdefault(sig, i)
    reps = sorted(first.values())
    jobs = (os.cpu_count() or 1) if jobs is None else jobs
    done: dict[int, StageOutcome] = {}
    if (jobs > 1 and len(reps) >= PARALLEL_TEMPLATES
            and "fork" in multiprocessing.get_all_start_methods()):
        done = _encode_parallel(single, parallel, stages, reps, jobs, timer)
    be = SymbolicBackend()
    outcomes = []
    for k, (stage, sig) in enumerate(zip(stages, sigs)):
        i = first[sig]
        if i == k and k not in done:
            done[k] = encode_one(stage, single, parallel, be, timer)
        rep = done[i]
        if k == i:
            outcomes.append(rep)
        elif rep.failure is None:
            outcomes.append(StageOutcome(stage, obligation=rep.obligation, template=rep))
        else:  # a failing template: each copy gets its own encoding and its own names
            outcomes.append(encode_one(stage, single, parallel, be, timer))
        if progress and (k % 64 == 0 or k == len(stages) - 1):
            progress("encoding stages", k + 1, len(stages))
    return outcomes


def prepare(single: Plan, parallel: Plan, opts: Options, timer: Timer
            ) -> tuple[Report, list[Failure], list[StageOutcome], dict[str, Obligation]]:
    """Everything before solving: checks, stages, templates, obligations (deduplicated)."""
    report = Report(EQUIVALENT, single.path, parallel.path,
                    solver="+".join(_solver_names(opts)))
    failures: list[Failure] = []
    if opts.progress:
        opts.progress("cutting stages", 0, None)
    with timer.phase("stages"):
        sgraph, pgraph = Graph(single), Graph(parallel)
        for plan in (single, parallel):
            for v in check_plan_shapes(plan):
                failures.append(Failure("structural", str(v), node=v.node, tensor=v.tensor))
        for v in check_output_coverage(single, parallel):
            failures.append(Failure("structural", str(v), tensor=v.tensor, lineage=v.lineage))
        cut = cut_stages(single, parallel, sgraph, pgraph)
        for v in cut.violations:
            failures.append(Failure("structural", str(v), tensor=v.tensor, lineage=v.lineage))
    report.assumptions = len(cut.assumptions)
    report.stages_total = len(cut.stages)
    outcomes = build_obligations(single, parallel, cut.stages, timer, opts.progress,
                                 jobs=opts.jobs)
    report.stage_templates = len({id(o.template or o) for o in outcomes})
    # Identical obligations (same canonical text = same digest) are solved once.
    unique: dict[str, Obligation] = {}
    for out in outcomes:
        if out.obligation is not None:
            unique.setdefault(out.obligation.digest, out.obligation)
    report.obligations_total = sum(1 for o in outcomes if o.obligation is not None)
    report.obligations_unique = len(unique)
    report.proven_without_solver = sum(1 for o in outcomes if o.failure is None
                                       and o.obligation is None)
    return report, failures, outcomes, unique


def export_obligations(single: Plan, parallel: Plan, corpus_dir: str, opts: Options | None = None
                       ) -> Report:
    """Write every stage's obligation to a corpus without solving (`tvsmt export`)."""
    from tvsmt.solving.corpus import Corpus

    opts = opts or Options()
    timer = Timer()
    report, failures, outcomes, unique = prepare(single, parallel, opts, timer)
    corpus = Corpus(corpus_dir)
    with timer.phase("export"):
        store_in_corpus(corpus, unique, outcomes, parallel)
        corpus.save()
    report.failures = failures + [o.failure for o in outcomes if o.failure is not None]
    report.verdict = VIOLATION if report.failures else INCONCLUSIVE  # nothing was solved
    report.timings = {k: round(v, 4) for k, v in timer.timings.items()}
    return report


def _judge(out: StageOutcome, res: SolverResult, solver: dict, single: Plan,
           parallel: Plan) -> Failure:
    """The failure of a stage the solver did not prove: a counterexample (from the model,
    checked with the real functions where the encoding abstracts them, or else from random
    evaluation of both plans) or, without one, an inconclusive stage."""
    if out.printed is None:  # a template's copy: encode it to name its own tensors
        redo = encode_one(out.stage, single, parallel, SymbolicBackend(), Timer())
        out.formula, out.printed = redo.formula, redo.printed
    lin = parallel.lineages[out.stage.target]
    found = f"the parallel plan does not compute lineage #{lin.index} of {lin.single}"
    why = f"solver answered {res.status}" + (f": {res.message}" if res.message else "")
    cex = None
    if res.status == SAT:
        cex = counterexample(out.printed, out.formula, res.values)
        if not uses_abstraction(out.printed) or confirm(out.printed, out.formula,
                                                        res.values, cex):
            return _stage_failure("counterexample", found + ": counterexample found", out.stage,
                                  single, parallel, part=first_mismatch_part(cex),
                                  counterexample=cex, solver=solver)
        why = ("the solver's counterexample relies on the uninterpreted abstraction of "
               "exp/rsqrt/... and is not reproduced with the real functions")
    screened = screen(out.formula)
    if screened is not None:
        return _stage_failure("counterexample", found + " (counterexample found by evaluating "
                              f"both plans; {why})", out.stage, single, parallel,
                              part=first_mismatch_part(screened), counterexample=screened,
                              solver=solver)
    return _stage_failure("inconclusive", f"lineage #{lin.index} of {lin.single}: {why}",
                          out.stage, single, parallel, part=first_mismatch_part(cex or {}),
                          counterexample=cex, solver=solver)


def verify_plans(single: Plan, parallel: Plan, opts: Options | None = None,
                 timer: Timer | None = None) -> Report:
    """Verify a pair; with `opts.fold`, through replica folding where the plan allows it."""
    from tvsmt.fold import fold_plans

    opts = opts or Options()
    timer = timer or Timer()
    if not opts.fold:
        return _verify_plans(single, parallel, opts, timer)
    return _verify_folded(lambda extra: fold_plans(single, parallel, extra),
                          lambda: _verify_plans(single, parallel, opts, timer), opts, timer)


def verify_source(source, opts: Options | None = None, timer: Timer | None = None) -> Report:
    """Verify a unit source (e.g. frontends.stream.StreamedPlan): a plan too large to hold
    in memory, which can only be verified folded."""
    from tvsmt.fold import fold_source

    opts = opts or Options()
    timer = timer or Timer()

    def cannot() -> Report:
        report = Report(INCONCLUSIVE, source.single.path, source.header.path)
        report.failures = [Failure("error", "a streamed plan that cannot be folded cannot be "
                                   "verified (it is never held in memory whole)")]
        return report

    return _verify_folded(lambda extra: fold_source(source, extra, jobs=opts.jobs or 1),
                          cannot, opts, timer)


def _verify_folded(fold, unfolded, opts: Options, timer: Timer) -> Report:
    """Verify `fold(0)`; when it has exceptions, `fold(1)` too (see tvsmt/fold/folder.py);
    when folding is refused, `unfolded()`, with the reason in the report."""
    from tvsmt.fold import FoldRefused

    try:
        with timer.phase("fold"):
            folded = fold(0)
    except FoldRefused as e:
        report = unfolded()
        report.fold_note = str(e)
        return report
    report = _verify_plans(folded.single, folded.parallel, opts, timer)
    report.fold = folded.info.to_json()
    if folded.info.exceptions and report.verdict == EQUIVALENT:
        # Units that are not copies: a second fold with one more uniform replica and
        # micro-batch rules out compensating constant offsets.
        try:
            with timer.phase("fold"):
                second = fold(1)
        except FoldRefused as e:
            report = unfolded()
            report.fold_note = f"second fold refused ({e})"
            return report
        again = _verify_plans(second.single, second.parallel, opts, timer)
        again.fold = second.info.to_json()
        if again.verdict != EQUIVALENT:
            report = again
        else:
            report.fold["second_fold"] = again.fold
        report.timings = {k: round(v, 4) for k, v in timer.timings.items()}
    return report


def _verify_plans(single: Plan, parallel: Plan, opts: Options, timer: Timer) -> Report:
    report, failures, outcomes, unique = prepare(single, parallel, opts, timer)
    with timer.phase("solving"):
        results = solve_obligations(unique, outcomes, parallel, opts, report)
    with timer.phase("report"):
        seconds: dict[str, float] = {}
        for r in results.values():
            for raw in (r.details or [r]):
                seconds[raw.solver] = round(seconds.get(raw.solver, 0.0) + raw.seconds, 4)
        report.solver_seconds = seconds
        for out in outcomes:
            if out.failure is not None:
                failures.append(out.failure)
                continue
            if out.obligation is None:
                report.stages_proven += 1
                continue
            out.result = results[out.obligation.digest]
            res = out.result
            solver = {"name": res.solver, "version": res.version, "status": res.status,
                      "seconds": round(res.seconds, 4), "message": res.message}
            if res.status == UNSAT:
                report.stages_proven += 1
            else:
                failures.append(_judge(out, res, solver, single, parallel))
        report.failures = failures
        report.stages_violated = len({f.stage for f in failures if f.stage and f.kind in
                                      ("counterexample", "structural")})
        report.stages_inconclusive = len({f.stage for f in failures if f.stage and f.kind in
                                          ("inconclusive", "error")})
        if any(f.kind in ("counterexample", "structural") for f in failures):
            report.verdict = VIOLATION
        elif failures:
            report.verdict = INCONCLUSIVE
    report.timings = {k: round(v, 4) for k, v in timer.timings.items()}
    return report


def verify_pair(single_path: str, parallel_path: str, opts: Options | None = None,
                jobs: int | None = None, **kw) -> Report:
    """Load two plan files and verify them (PlanError on malformed input)."""
    opts = opts or Options(jobs=jobs, **kw)
    timer = Timer()
    if opts.progress:
        opts.progress("loading plans", 0, None)
    with timer.phase("load"):
        single = load_plan(single_path)
        parallel = load_plan(parallel_path)
        check_pair(single, parallel)
    return verify_plans(single, parallel, opts, timer)
