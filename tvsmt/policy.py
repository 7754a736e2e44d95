"""The verdict policy, in one place: solver answers -> stage verdicts -> the plan's verdict.

A stage is proven only when a solver answers `unsat` (or both sides are literally the same
term, in which case there is no obligation) AND random concrete points of the stage, evaluated
with the real functions, do not contradict the proof. Everything else is a failure:

| what happened                                              | failure kind      | verdict      |
| ---------------------------------------------------------- | ----------------- | ------------ |
| `sat` with a model that survives the real functions        | counterexample    | violation    |
| no usable answer, but a concrete point shows a difference  | counterexample    | violation    |
| a claim the graph cannot support (found before solving)    | structural        | violation    |
| `unsat`, yet a concrete point shows a difference           | solver-failure    | inconclusive |
| timeout, `unknown`, error, disagreement, abstract-only sat | inconclusive      | inconclusive |
| parallel results no lineage claims, with `--strict`        | unclaimed         | inconclusive |
| nothing claimed at all                                     | error             | inconclusive |

A violation needs evidence of a difference; an inconclusive stage never counts as a pass.

An obligation whose random concrete points already show a difference (before solving) gets at
most `REFUTED_BUDGET_S` seconds of solver time: only `unsat` could change its outcome (to a
solver failure), a `sat` or no answer leaves it a violation. Nonlinear `sat` queries are where
solvers time out, so a bug would otherwise cost the whole timeout per obligation. It is asked
first with its inputs and uninterpreted functions fixed at the refuting point made exact
(`obligations.pinned_obligation`), a ground query: a `sat` there is a `sat` of the obligation
(a model of the one is a model of the other); any other answer there says nothing, and the
obligation is then asked whole.
"""

from __future__ import annotations

from dataclasses import replace

from tvsmt.encoding.concrete import evaluate_at_random
from tvsmt.encoding.obligations import EVALUATION_POINTS, StageOutcome, encode_one
from tvsmt.errors import PlanError
from tvsmt.ops import SymbolicBackend
from tvsmt.plan import Plan
from tvsmt.report.counterexample import (
    confirm,
    counterexample,
    first_mismatch_part,
    uses_abstraction,
)
from tvsmt.report.failures import stage_failure
from tvsmt.report.report import EQUIVALENT, INCONCLUSIVE, VIOLATION, Failure, Report, load_report
from tvsmt.solving.types import SAT, TIMEOUT, UNKNOWN, UNSAT, SolverResult
from tvsmt.timing import Timer

VIOLATION_KINDS = ("counterexample", "structural")
INCONCLUSIVE_KINDS = ("inconclusive", "error", "solver-failure", "unclaimed")
# Solver seconds for an obligation already refuted at concrete points: far above the slowest
# proof of the real plans' obligations (z3, about 0.1 s), so that an `unsat` (a solver or
# encoding failure) is still seen.
REFUTED_BUDGET_S = 3.0
# Solver seconds for a stage that proves a hypothesis (an inferred cut of a capture) once the
# concrete run and the solver agree on a bug: no hypothesis can change that verdict (a
# violation), they only decide how the report's stages are cut (capture/driver.py).
SETTLED_HYPOTHESIS_BUDGET_S = 3.0


def both_must_prove(res: SolverResult) -> SolverResult:
    """Cross-checking: a pass needs `unsat` from every solver; a `sat` with a model stands on
    its own (its counterexample is checked against the plan), with the other answers named;
    `sat` against `unsat` is a disagreement (inconclusive)."""
    if res.status == UNSAT and any(d.status != UNSAT for d in res.details):
        others = ", ".join(f"{d.solver} says {d.status}" for d in res.details)
        return replace(res, status=UNKNOWN, message=f"not proven by every solver: {others}")
    return res


def refuted_at_concrete_points(outcomes: list[StageOutcome]) -> set[str]:
    """The digests of the obligations whose random concrete points show a difference."""
    return {o.obligation.digest for o in outcomes if o.obligation is not None
            and o.evaluation is not None and o.evaluation.counterexample is not None}


def refuted_budget(timeout: float | None) -> float:
    """The solver timeout of an obligation refuted at concrete points (`timeout`: the run's,
    None or 0 = none)."""
    return REFUTED_BUDGET_S if not timeout or timeout <= 0 else min(timeout, REFUTED_BUDGET_S)


def settled_hypothesis_budget(timeout: float | None) -> float:
    """The solver timeout of a hypothesis's stage once a confirmed bug decides the verdict
    (`timeout`: the run's, None or 0 = none)."""
    if not timeout or timeout <= 0:
        return SETTLED_HYPOTHESIS_BUDGET_S
    return min(timeout, SETTLED_HYPOTHESIS_BUDGET_S)


def _timed_out_within(res: SolverResult, why: str) -> SolverResult:
    """A timeout's answer saying why its budget was short; any other answer as it is."""
    if res.status != TIMEOUT:
        return res
    return replace(res, message=f"{res.message}, {why}" if res.message else why)


def within_settled_budget(res: SolverResult) -> SolverResult:
    """A settled hypothesis's answer, a timeout saying why the budget was short."""
    return _timed_out_within(res, "the budget of a hypothesis once a confirmed bug decides "
                                  "the verdict")


def within_refuted_budget(res: SolverResult) -> SolverResult:
    """A refuted obligation's answer, a timeout saying why the budget was short."""
    return _timed_out_within(res, "the budget of an obligation that concrete points already "
                                  "refute")


def sat_at_refuting_point(res: SolverResult) -> SolverResult:
    """A refuted obligation's `sat`, answered with its inputs fixed at the concrete point that
    refutes it (`obligations.pinned_obligation`): a model there is a model of the obligation."""
    why = "with the inputs fixed at the concrete point that refutes it"
    return replace(res, message=f"{res.message}; {why}" if res.message else why)


def _solver_info(res: SolverResult) -> dict:
    return {"name": res.solver, "version": res.version, "status": res.status,
            "seconds": round(res.seconds, 4), "message": res.message}


def _own_encoding(out: StageOutcome, single: Plan, parallel: Plan) -> None:
    """A template's copy carries only the template's obligation: encode it again to name
    its own tensors (only done for stages that are not proven)."""
    if out.printed is None:
        redo = encode_one(out.stage, single, parallel, SymbolicBackend.fresh(), Timer())
        out.formula, out.printed = redo.formula, redo.printed
        if redo.formula is not None and redo.formula.comparisons:
            out.evaluation = evaluate_at_random(redo.formula, EVALUATION_POINTS)


def judge_stage(out: StageOutcome, res: SolverResult, single: Plan,
                parallel: Plan) -> Failure | None:
    """None when the stage is proven; else the failure saying why not."""
    solver = _solver_info(res)
    lin = parallel.lineages[out.stage.target]
    if res.status == UNSAT:
        ev = out.evaluation
        if ev is None or ev.counterexample is None:
            return None
        _own_encoding(out, single, parallel)
        own = out.evaluation.counterexample if out.evaluation is not None else None
        cex = own or ev.counterexample  # a copy's own points may miss what its template's hit
        return stage_failure(
            "solver-failure", f"SOLVER OR ENCODING FAILURE on {lin.label}: {res.solver} "
            "answered unsat, but both plans evaluated at concrete "
            "inputs with the real functions give different values; the proof is not "
            "trusted", out.stage, single, parallel, part=first_mismatch_part(cex),
            counterexample=cex, solver=solver)
    _own_encoding(out, single, parallel)
    found = f"the parallel plan does not compute {lin.label}"
    why = f"solver answered {res.status}" + (f": {res.message}" if res.message else "")
    cex = None
    if res.status == SAT and out.printed is not None:
        cex = counterexample(out.printed, out.formula, res.values)
        if not uses_abstraction(out.printed) or confirm(out.printed, out.formula,
                                                        res.values, cex):
            return stage_failure("counterexample", found + ": counterexample found", out.stage,
                                 single, parallel, part=first_mismatch_part(cex),
                                 counterexample=cex, solver=solver)
        why = ("the solver's counterexample relies on the uninterpreted abstraction of "
               "exp/rsqrt/... and is not reproduced with the real functions")
    screened = out.evaluation.counterexample if out.evaluation is not None else None
    if screened is not None:
        return stage_failure("counterexample", found + " (counterexample found by evaluating "
                             f"both plans; {why})", out.stage, single, parallel,
                             part=first_mismatch_part(screened), counterexample=screened,
                             solver=solver)
    return stage_failure("inconclusive", f"{lin.label}: {why}",
                         out.stage, single, parallel, part=first_mismatch_part(cex or {}),
                         counterexample=cex, solver=solver)


def stage_status(failure: Failure | None) -> str:
    if failure is None:
        return "proven"
    return "violated" if failure.kind in VIOLATION_KINDS else "inconclusive"


def decide(report: Report, failures: list[Failure], solved: bool = True) -> None:
    """The plan's verdict and the stage counts from every failure found. Equivalent only
    when every stage was judged proven; `solved=False` (`tvsmt export`: obligations written,
    none solved) is never equivalent."""
    if report.stages_total == 0 and not failures:
        failures.append(Failure("error", "nothing was claimed: the parallel plan has no "
                                "lineage to prove, so nothing is verified"))
    unjudged = report.stages_total - report.stages_proven
    if solved and not failures and unjudged:
        # every stage is proven or has a failure; one with neither was lost on the way
        failures.append(Failure("error", f"internal error: {unjudged} of "
                                f"{report.stages_total} stages were never judged, so the "
                                "plan is not proven"))
    report.failures = failures
    report.stages_violated = len({f.stage for f in failures if f.stage and f.kind in
                                  VIOLATION_KINDS})
    report.stages_inconclusive = len({f.stage for f in failures if f.stage and f.kind in
                                      INCONCLUSIVE_KINDS})
    if any(f.kind in VIOLATION_KINDS for f in failures):
        report.verdict = VIOLATION
    elif failures or not solved:
        report.verdict = INCONCLUSIVE
    else:
        report.verdict = EQUIVALENT


def contradicted_pass(report: Report) -> str | None:
    """Why a report that says `equivalent` cannot be one, by what it records itself (a
    failure, a stage not proven, no stage at all); None when it can. `tvsmt report` refuses
    such a report (hand-edited, or put together from two runs): re-rendering a report never
    turns what it records into a pass. A report that says less than its contents (an
    `inconclusive` with no failure, as `tvsmt export` writes) is never a pass, so it stands."""
    if report.verdict != EQUIVALENT:
        return None
    if report.failures:
        return f"it says equivalent but lists {len(report.failures)} failure(s)"
    if report.stages_total < 1:
        return "it says equivalent but proves no stage"
    if (report.stages_proven != report.stages_total or report.stages_violated
            or report.stages_inconclusive):
        return (f"it says equivalent but proves {report.stages_proven} of "
                f"{report.stages_total} stages")
    return None


def load_trusted_report(path: str) -> Report:
    """A saved report (`report.load_report`) whose verdict what it records can support: one
    that says `equivalent` against its own contents (`contradicted_pass`) is an input error,
    never re-rendered as a pass."""
    report = load_report(path)
    problem = contradicted_pass(report)
    if problem:
        raise PlanError(f"inconsistent report: {problem}", file=path)
    return report
