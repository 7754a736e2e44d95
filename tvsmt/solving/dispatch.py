"""From unique obligations to one verdict each: trusted corpus verdicts first, then the solver
profiles (one, or several cross-checking each other), and the new verdicts recorded.

Policy with several solvers (`--crosscheck A,B,...`): a pass needs `unsat` from every solver;
`sat` against `unsat` is a disagreement (inconclusive); a `sat` with a model stands on its own,
because the caller checks its counterexample on the plan (report/counterexample.py), with the
other answers named. A corpus verdict is reused only if tvsmt sealed it and it was recorded by
a solver of the same name, version and profile file (tvsmt/solving/corpus.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from tvsmt.options import Options, solver_names
from tvsmt.solving.types import SAT, TIMEOUT, Obligation, SolverResult

if TYPE_CHECKING:  # pragma: no cover - types only
    from tvsmt.encoding.obligations import StageOutcome
    from tvsmt.plan import Plan
    from tvsmt.report.report import Report

SMALL_RUN = 24  # obligations below which loky's solving stays in this process (one solver)

# The answers of one run of several verifications of the same pair (capture/driver.py's
# hypothesis rounds), by what was asked: (digest, solvers, timeout, asked with the refuted
# budget) -> the answer. A round re-encodes the stages its dropped hypotheses merge, and
# every other stage is the same script again: asked once. A timeout is remembered too (the
# corpus reuses decisive verdicts only): the same script under the same budget, asked again
# in the same run, costs its whole budget to answer timeout again; never a pass either way.
_ANSWERS: ContextVar[dict | None] = ContextVar("tvsmt_answers", default=None)


@contextmanager
def answers_remembered():
    """Within it, `solve_obligations` asks each script once (see `_ANSWERS`)."""
    token = _ANSWERS.set({})
    try:
        yield
    finally:
        _ANSWERS.reset(token)


def store_in_corpus(corpus, unique: dict[str, Obligation], outcomes: "list[StageOutcome]",
                    parallel: "Plan", pinned: dict[str, Obligation] | None = None) -> None:
    """Write each unique obligation with a header naming the stages and tensors it stands for
    (outside the hashed body) and map every stage to its digest, under the plan pair's key
    (this run's stage map replaces the pair's previous one). `pinned` (digest -> the script
    asked at its refuting point) are written too, their headers naming the obligation."""
    from tvsmt.solving.corpus import pair_key

    if not corpus.pair:
        corpus.pair = pair_key(parallel.path)
    corpus.pairs[corpus.pair] = {}
    by_digest: dict[str, list] = {}
    for o in outcomes:
        if o.obligation is not None:
            by_digest.setdefault(o.obligation.digest, []).append(o.stage)
    for dg, ob in unique.items():
        stages = by_digest[dg]
        header = {"plan": parallel.name, "stages": [st.id for st in stages[:50]],
                  "tensors": sorted({parallel.lineages[st.target].single
                                     for st in stages})[:50],
                  "stage_count": len(stages), "query": list(ob.query)}
        corpus.add(ob, [st.id for st in stages], header=header)
        if pinned and dg in pinned:
            corpus.add(pinned[dg], (), header={**header, "pinned_from": dg})


def _both_must_prove(res: SolverResult) -> SolverResult:
    """The cross-checking rule lives with the rest of the verdict policy (tvsmt/policy.py)."""
    from tvsmt.policy import both_must_prove

    return both_must_prove(res)


every_solver_must_prove = _both_must_prove


def _trusted_verdict(corpus, trust: list[tuple[str, str, str]], digest: str,
                     refused: list[str]) -> SolverResult | None:
    """The corpus verdict on `digest` that every solver of `trust` (name, version, profile)
    recorded and may reuse, reconciled; None if one may not, its reason appended to `refused`
    unless there was just nothing decisive to reuse."""
    from tvsmt.solving.runner import reconcile

    for name, version, profile in trust:
        why = corpus.refusal(digest, name, version=version, profile=profile)
        if why is not None:
            if why not in ("none recorded", "not decisive"):
                refused.append(why)
            return None
    cached = [corpus.lookup(digest, name, version=version, profile=profile)
              for name, version, profile in trust]
    return _both_must_prove(reconcile(cached)) if len(cached) > 1 else cached[0]


def solve_obligations(unique: dict[str, Obligation], outcomes: "list[StageOutcome]",
                      parallel: "Plan", opts: "Options", report: "Report"
                      ) -> dict[str, SolverResult]:
    """Solve each unique obligation once: trusted corpus verdicts first (unless --fresh), then
    the external solver(s) in parallel; new verdicts are recorded in the corpus.

    An obligation that concrete points already refute gets the policy's short budget, and is
    asked first with its inputs and uninterpreted functions fixed at the refuting point
    (`StageOutcome.pinned`): a `sat` there is a `sat` of the obligation; what that does not
    confirm is asked whole. The pinned script is an obligation of the corpus in its own right
    (its answers recorded under its own digest).

    The report counts the reused verdicts per solver (`cache`), the obligations answered
    wholly from the corpus (`cache_hits`), and the recorded verdicts refused, by reason
    (`cache_refused`: changed outside tvsmt, other version, other profile; one per
    obligation)."""
    from tvsmt.policy import refuted_at_concrete_points, sat_at_refuting_point
    from tvsmt.solving.corpus import Corpus
    from tvsmt.solving.profiles import get_profile, solver_version

    profiles = [get_profile(n) for n in solver_names(opts)]
    corpus = Corpus(opts.corpus, fresh=opts.fresh) if opts.corpus else None
    refuted = refuted_at_concrete_points(outcomes)
    pinned = {o.obligation.digest: o.pinned for o in outcomes
              if o.pinned is not None and o.obligation.digest in refuted}
    results: dict[str, SolverResult] = {}
    todo: list[Obligation] = []
    if corpus is not None:
        store_in_corpus(corpus, unique, outcomes, parallel, pinned)
    memo = _ANSWERS.get()
    names = tuple(p.name for p in profiles)
    settled = _hypotheses_only(outcomes, parallel) if opts.hypothesis_budget is not None \
        else set()

    def asked_as(dg: str) -> tuple:
        return (dg, names, opts.timeout, opts.fresh, dg in refuted,
                opts.hypothesis_budget if dg in settled else None)

    if memo:
        for dg in unique:
            if asked_as(dg) in memo:
                results[dg] = memo[asked_as(dg)]
        unique = {dg: ob for dg, ob in unique.items() if dg not in results}
    trust = []
    if corpus is not None and not opts.fresh and unique:
        trust = [(p.name, solver_version(p), p.digest) for p in profiles]
    for dg, ob in unique.items():
        if trust:
            refused: list[str] = []
            res = (_trusted_verdict(corpus, trust, pinned[dg].digest, refused)
                   if dg in pinned else None)
            res = (sat_at_refuting_point(res) if res is not None and res.status == SAT
                   else _trusted_verdict(corpus, trust, dg, refused))
            if res is not None:
                results[dg] = res
                report.cache_hits += 1
                for name, _, _ in trust:
                    report.cache[name] = report.cache.get(name, 0) + 1
                continue
            if refused:
                report.cache_refused[refused[0]] = report.cache_refused.get(refused[0], 0) + 1
        todo.append(ob)
    solved = _solve(todo, refuted, pinned, profiles, corpus, opts, len(results), len(unique),
                    settled)
    results.update(solved)
    if memo is not None:
        memo.update((asked_as(dg), res) for dg, res in solved.items())
    if corpus is not None:
        corpus.save()
    return results


def _hypotheses_only(outcomes: "list[StageOutcome]", parallel: "Plan") -> set[str]:
    """The digests of the obligations that only stages proving hypotheses stand for."""
    lins = parallel.lineages
    kinds: dict[str, bool] = {}
    for o in outcomes:
        if o.obligation is not None:
            dg = o.obligation.digest
            kinds[dg] = kinds.get(dg, True) and bool(lins[o.stage.target].hypothesis)
    return {dg for dg, only in kinds.items() if only}


def _solve(todo: list[Obligation], refuted: set[str], pinned: dict[str, Obligation],
           profiles: list, corpus, opts: "Options", done: int, total: int,
           settled: set[str] = frozenset()) -> dict[str, SolverResult]:
    """The solvers' answers to `todo`, recorded in `corpus` (if any): the refuted ones first
    (they are the ones likely to use their budget), their pinned scripts asked in the same run
    as the other obligations, then, whole, those whose pinned script gave no `sat`. The
    `settled` ones (hypotheses' stages once a confirmed bug decides the verdict) get
    `opts.hypothesis_budget` at most."""
    from tvsmt.policy import (refuted_budget, sat_at_refuting_point, within_refuted_budget,
                              within_settled_budget)
    from tvsmt.solving.runner import crosscheck, solve_all

    count = [done]

    def progress(_index, _result):
        count[0] += 1  # a refuted obligation may be asked twice: counted once at the most
        if opts.progress:
            opts.progress("solving", min(count[0], total), total)

    jobs = opts.jobs
    if opts.backend == "loky" and len(todo) * len(profiles) <= SMALL_RUN:
        jobs = 1  # starting worker processes (~0.5 s) costs more than solving in this one
    common = dict(jobs=jobs, backend=opts.backend, scheduler=opts.scheduler, progress=progress)

    def solve(group: list[Obligation], budgets: dict[str, float]) -> list[SolverResult]:
        if len(profiles) > 1:
            return [_both_must_prove(r) for r in crosscheck(group, solvers=profiles,
                                                            timeout_s=opts.timeout,
                                                            budgets=budgets, **common)]
        return solve_all(group, solver=profiles[0], timeout_s=opts.timeout, budgets=budgets,
                         **common)

    def record(asked: Obligation, res: SolverResult, cut_short: bool) -> None:
        if corpus is not None:
            for raw in (res.details or [res]):
                if not (cut_short and raw.status == TIMEOUT):
                    corpus.record(asked.digest, raw)  # a budget cut short is no verdict

    budget = refuted_budget(opts.timeout)

    def limit(ob: Obligation) -> float | None:
        """Its budget below the run's timeout, if any."""
        own = budget if ob.digest in refuted else None
        if ob.digest in settled:
            own = min(own or opts.hypothesis_budget, opts.hypothesis_budget)
        return own

    todo = sorted(todo, key=lambda ob: ob.digest not in refuted)
    asked = [pinned.get(ob.digest, ob) for ob in todo]
    answers = solve(asked, {a.digest: limit(ob) for ob, a in zip(todo, asked)
                            if limit(ob) is not None})
    results: dict[str, SolverResult] = {}
    again = []
    for ob, a, res in zip(todo, asked, answers, strict=True):
        record(a, res, limit(ob) is not None)
        if a is not ob and res.status != SAT:
            again.append(ob)
        else:
            results[ob.digest] = res if a is ob else sat_at_refuting_point(res)
    for ob, res in zip(again, solve(again, {ob.digest: limit(ob) for ob in again}) if again
                       else [], strict=True):
        record(ob, res, True)
        results[ob.digest] = res
    return {dg: within_refuted_budget(res) if dg in refuted else
            within_settled_budget(res) if dg in settled else res
            for dg, res in results.items()}
