"""The phases of one verification, composed and timed: plan -> graph -> stages -> shapes ->
encoding -> solving -> report, through replica folding where the plan allows it.

    PlanPair --fold--> PlanPair --prepare--> Prepared (stages, obligations) --solve--> Report

Each phase is a package of its own; this module only composes them. How a pair gets here
(read from files, folded in a forked process, streamed, captured from PyTorch) is the
callers' business: tvsmt/verify.py, tvsmt/fold_child.py, tvsmt/capture/driver.py. What a
verdict means is decided in one place, tvsmt/policy.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tvsmt.encoding.obligations import StageOutcome, build_obligations
from tvsmt.graph import Graph
from tvsmt.heap import collector_paused, plans_frozen
from tvsmt.lineage import check_output_coverage, check_plan_shapes, unclaimed_sinks
from tvsmt.options import Options, solver_names
from tvsmt.plan import Plan, load_plan
from tvsmt.plan.reader import check_pair
from tvsmt.policy import decide, judge_stage, stage_status
from tvsmt.report.report import EQUIVALENT, Failure, Report
from tvsmt.solving.dispatch import solve_obligations, store_in_corpus
from tvsmt.solving.types import Obligation
from tvsmt.stages import cut_stages
from tvsmt.timing import Timer


@dataclass(frozen=True)
class PlanPair:
    """The two plans of one verification (Alive2's Transform{src, tgt}): the single-device
    plan, the ground truth, and the parallel plan with its lineages."""

    single: Plan
    parallel: Plan

    @classmethod
    def load(cls, single_path: str, parallel_path: str, lazy: bool = False) -> "PlanPair":
        """Read and cross-check two plan files (InputError on malformed input); `lazy`: a
        large parallel plan's nodes may be built on demand (for the fold only, which reads
        its columns: tvsmt.plan.reader.decode_document)."""
        pair = cls(load_plan(single_path), load_plan(parallel_path, lazy))
        check_pair(pair.single, pair.parallel)
        return pair


class Prepared(NamedTuple):
    """Everything before solving."""

    report: Report
    failures: list[Failure]
    outcomes: list[StageOutcome]
    unique: dict[str, Obligation]  # digest -> obligation (identical scripts solved once)


def prepare(single: Plan, parallel: Plan, opts: Options, timer: Timer) -> Prepared:
    """Checks, stages, templates, obligations (deduplicated), concrete evaluations."""
    report = Report(EQUIVALENT, single.path, parallel.path,
                    solver="+".join(solver_names(opts)))
    failures: list[Failure] = []
    if opts.progress:
        opts.progress("cutting stages", 0, None)
    # the collector paused: cutting allocates millions of acyclic records, and collecting
    # them as they grew was a third of this phase on the folded 405B plan (scripts/bench.py's
    # stages column, back to back: 7.2 against 4.5 s)
    with timer.phase("stages"), collector_paused():
        sgraph, pgraph = Graph(single), Graph(parallel)
        for plan in (single, parallel):
            for v in check_plan_shapes(plan):
                failures.append(Failure("structural", str(v), node=v.node, tensor=v.tensor))
        for v in check_output_coverage(single, parallel):
            failures.append(Failure("structural", str(v), tensor=v.tensor, lineage=v.lineage))
        cut = cut_stages(single, parallel, sgraph, pgraph)
        for v in cut.violations:
            failures.append(Failure("structural", str(v), tensor=v.tensor, lineage=v.lineage))
        sinks = unclaimed_sinks(parallel, pgraph)
    report.unclaimed = len(sinks)
    report.unclaimed_tensors = sinks[:50]
    if sinks and opts.strict:
        failures.append(Failure(
            "unclaimed", f"{len(sinks)} parallel results are claimed by no lineage, so nothing "
            f"about them is proven (--strict): {', '.join(sinks[:5])}"
            + (" ..." if len(sinks) > 5 else ""), tensor=sinks[0]))
    report.assumptions = len(cut.assumptions)
    report.stages_total = len(cut.stages)
    built = build_obligations(single, parallel, cut.stages, timer, opts.progress,
                              jobs=opts.jobs)
    report.stage_templates = built.templates
    report.notes += built.notes + ([built.serial_reason] if built.serial_reason else [])
    report.obligations_total = sum(1 for o in built.outcomes if o.obligation is not None)
    report.obligations_unique = len(built.unique)
    report.proven_without_solver = sum(1 for o in built.outcomes if o.failure is None
                                       and o.obligation is None)
    evaluated = {o.obligation.digest: o.evaluation for o in built.outcomes
                 if o.obligation is not None and o.evaluation is not None}
    report.evaluated = {"obligations": len(evaluated),
                        "points": sum(e.points for e in evaluated.values()),
                        "not_evaluated": sum(1 for e in evaluated.values() if e.points == 0)}
    return Prepared(report, failures, built.outcomes, built.unique)


def verify_unfolded(single: Plan, parallel: Plan, opts: Options, timer: Timer) -> Report:
    """Verify the pair as it is (no folding): prepare, solve, judge every stage."""
    return solve_and_judge(prepare(single, parallel, opts, timer), single, parallel, opts,
                           timer)


def solve_and_judge(prepared: Prepared, single: Plan, parallel: Plan, opts: Options,
                    timer: Timer) -> Report:
    """Solve a prepared pair's obligations and judge every stage."""
    report, failures, outcomes, unique = prepared
    with timer.phase("solving"):
        results = solve_obligations(unique, outcomes, parallel, opts, report)
    with timer.phase("report"):
        seconds: dict[str, float] = {}
        for r in results.values():
            for raw in (r.details or [r]):
                seconds[raw.solver] = round(seconds.get(raw.solver, 0.0) + raw.seconds, 4)
        report.solver_seconds = seconds
        for out in outcomes:
            failure, seconds = out.failure, 0.0
            if failure is None and out.obligation is not None:
                out.result = results[out.obligation.digest]
                seconds = out.result.seconds
                failure = judge_stage(out, out.result, single, parallel)
            if failure is None:
                report.stages_proven += 1
            else:
                failures.append(failure)
            report.stages.append([out.stage.id, out.stage.target,
                                  parallel.lineages[out.stage.target].single,
                                  stage_status(failure),
                                  out.obligation.digest if out.obligation else "",
                                  round(seconds, 4)])
        decide(report, failures)
    report.timings = timer.rounded()
    return report


def export_unfolded(single: Plan, parallel: Plan, opts: Options, timer: Timer) -> Report:
    """Write every stage's obligation to the corpus without solving (`tvsmt export`)."""
    from tvsmt.solving.corpus import Corpus

    report, failures, outcomes, unique = prepare(single, parallel, opts, timer)
    corpus = Corpus(opts.corpus)
    with timer.phase("export"):
        store_in_corpus(corpus, unique, outcomes, parallel)
        corpus.save()
    failures += [o.failure for o in outcomes if o.failure is not None]
    decide(report, failures, solved=False)
    report.timings = timer.rounded()
    return report


Run = Callable[[Plan, Plan, Options, Timer], Report]


def verify_plans(single: Plan, parallel: Plan, opts: Options | None = None,
                 timer: Timer | None = None, run: Run = verify_unfolded) -> Report:
    """Verify a pair; with `opts.fold`, through replica folding where the plan allows it."""
    from tvsmt.fold import fold_plans

    opts = opts or Options()
    timer = timer or Timer()
    with plans_frozen():
        if not opts.fold:
            return run(single, parallel, opts, timer)
        return _through_fold(lambda extra: fold_plans(single, parallel, extra),
                             lambda: run(single, parallel, opts, timer), opts, timer, run)


def _through_fold(fold, unfolded, opts: Options, timer: Timer, run: Run) -> Report:
    """Run on `fold(0)`; when it has exceptions, on `fold(1)` too (see tvsmt/fold/folder.py);
    when folding is refused, `unfolded()`, with the reason in the report."""
    from tvsmt.fold import FoldRefused

    try:
        with timer.phase("fold"):
            folded = fold(0)
    except FoldRefused as e:
        report = unfolded()
        report.fold_note = str(e)
        return report
    report = run(folded.single, folded.parallel, opts, timer)
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
        again = run(second.single, second.parallel, opts, timer)
        again.fold = second.info.to_json()
        if again.verdict != EQUIVALENT:
            report = again
        else:
            report.fold["second_fold"] = again.fold
        report.timings = timer.rounded()
    return report
