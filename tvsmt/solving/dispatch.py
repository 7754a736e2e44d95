"""From unique obligations to one verdict each: trusted corpus verdicts first, then the solver
profiles (one, or several cross-checking each other), and the new verdicts recorded.

Policy with several solvers (`--crosscheck A,B,...`): a pass needs `unsat` from every solver;
`sat` against `unsat` is a disagreement (inconclusive); a `sat` with a model stands on its own,
because the caller checks its counterexample on the plan (report/counterexample.py), with the
other answers named. A corpus verdict is reused only if tvsmt sealed it and it was recorded by
a solver of the same name, version and profile file (tvsmt/solving/corpus.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tvsmt.options import Options, solver_names
from tvsmt.solving.types import TIMEOUT, Obligation, SolverResult

if TYPE_CHECKING:  # pragma: no cover - types only
    from tvsmt.encoding.obligations import StageOutcome
    from tvsmt.plan import Plan
    from tvsmt.report.report import Report

SMALL_RUN = 24  # obligations below which loky's solving stays in this process (one solver)


def store_in_corpus(corpus, unique: dict[str, Obligation], outcomes: "list[StageOutcome]",
                    parallel: "Plan") -> None:
    """Write each unique obligation with a header naming the stages and tensors it stands for
    (outside the hashed body) and map every stage to its digest, under the plan pair's key
    (this run's stage map replaces the pair's previous one)."""
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


def _both_must_prove(res: SolverResult) -> SolverResult:
    """The cross-checking rule lives with the rest of the verdict policy (tvsmt/policy.py)."""
    from tvsmt.policy import both_must_prove

    return both_must_prove(res)


every_solver_must_prove = _both_must_prove


def solve_obligations(unique: dict[str, Obligation], outcomes: "list[StageOutcome]",
                      parallel: "Plan", opts: "Options", report: "Report"
                      ) -> dict[str, SolverResult]:
    """Solve each unique obligation once: trusted corpus verdicts first (unless --fresh), then
    the external solver(s) in parallel; new verdicts are recorded in the corpus.

    The report counts the reused verdicts per solver (`cache`), the obligations answered
    wholly from the corpus (`cache_hits`), and the recorded verdicts refused, by reason
    (`cache_refused`: changed outside tvsmt, other version, other profile)."""
    from tvsmt.policy import refuted_at_concrete_points, refuted_budget, within_refuted_budget
    from tvsmt.solving.corpus import Corpus
    from tvsmt.solving.profiles import get_profile, solver_version
    from tvsmt.solving.runner import crosscheck, reconcile, solve_all

    names = solver_names(opts)
    profiles = [get_profile(n) for n in names]
    corpus = Corpus(opts.corpus, fresh=opts.fresh) if opts.corpus else None
    results: dict[str, SolverResult] = {}
    todo: list[Obligation] = []
    if corpus is not None:
        store_in_corpus(corpus, unique, outcomes, parallel)
    trust = []
    if corpus is not None and not opts.fresh and unique:
        trust = [(p.name, solver_version(p), p.digest) for p in profiles]
    for dg, ob in unique.items():
        if trust:
            why = None
            for name, version, digest in trust:
                why = corpus.refusal(dg, name, version=version, profile=digest)
                if why is not None:
                    break
            if why is None:
                cached = [corpus.lookup(dg, name, version=version, profile=digest)
                          for name, version, digest in trust]
                results[dg] = (_both_must_prove(reconcile(cached)) if len(cached) > 1
                               else cached[0])
                report.cache_hits += 1
                for name, _, _ in trust:
                    report.cache[name] = report.cache.get(name, 0) + 1
                continue
            if why not in ("none recorded", "not decisive"):
                report.cache_refused[why] = report.cache_refused.get(why, 0) + 1
        todo.append(ob)
    done = [len(results)]

    def progress(_index, _result):
        done[0] += 1
        if opts.progress:
            opts.progress("solving", done[0], len(unique))

    jobs = opts.jobs
    if opts.backend == "loky" and len(todo) * len(profiles) <= SMALL_RUN:
        jobs = 1  # starting worker processes (~0.5 s) costs more than solving in this one
    common = dict(jobs=jobs, backend=opts.backend, scheduler=opts.scheduler, progress=progress)
    # obligations that concrete points already refute get the policy's short budget, in the
    # same run as the others (first: they are the ones likely to use it up)
    refuted = refuted_at_concrete_points(outcomes)
    todo.sort(key=lambda ob: ob.digest not in refuted)
    budgets = {ob.digest: refuted_budget(opts.timeout) for ob in todo if ob.digest in refuted}
    if len(profiles) > 1:
        solved = [_both_must_prove(r) for r in crosscheck(todo, solvers=profiles,
                                                            timeout_s=opts.timeout,
                                                            budgets=budgets, **common)]
    else:
        solved = solve_all(todo, solver=profiles[0], timeout_s=opts.timeout, budgets=budgets,
                           **common)
    for ob, res in zip(todo, solved):
        if ob.digest in refuted:
            res = within_refuted_budget(res)
        results[ob.digest] = res
        if corpus is not None:
            for raw in (res.details or [res]):
                if not (ob.digest in refuted and raw.status == TIMEOUT):
                    corpus.record(ob.digest, raw)  # a budget cut short is no verdict
    if corpus is not None:
        corpus.save()
    return results
