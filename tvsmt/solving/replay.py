"""Re-solve a corpus and compare with the verdicts recorded in its manifest (`tvsmt replay`).

`replay` returns data (a `ReplayReport`) and prints nothing; files whose content no longer
matches their name are listed, not solved.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from tvsmt.solving.corpus import Corpus, FileProblem
from tvsmt.solving.profiles import get_profile, solver_version
from tvsmt.solving.runner import Progress, solve_all
from tvsmt.solving.types import DEFAULT_BACKEND, SAT, UNSAT, SolverResult


@dataclass
class ReplayDiff:
    """An obligation whose replayed status differs from a recorded one."""

    digest: str
    stage_ids: list[str]
    recorded: str          # recorded status
    recorded_by: str       # "solver version" that recorded it
    replayed: str          # status now
    message: str = ""      # the replayed result's message

    def __str__(self) -> str:
        stages = f" [{', '.join(self.stage_ids)}]" if self.stage_ids else ""
        why = f" ({self.message})" if self.message else ""
        return (f"{self.digest[:16]}...{stages}: recorded {self.recorded} by {self.recorded_by},"
                f" now {self.replayed}{why}")


@dataclass
class ReplayReport:
    corpus: str
    solver: str
    version: str
    total: int = 0                                   # obligations re-solved
    agree: int = 0                                   # ... whose status matches every record
    differences: list[ReplayDiff] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # digests with nothing to compare to
    unsealed: list[str] = field(default_factory=list)  # "digest solver": seal does not match
    file_problems: list[FileProblem] = field(default_factory=list)  # not re-solved
    results: dict[str, SolverResult] = field(default_factory=dict)  # digest -> new result
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Nothing differs, every file is intact and every recorded verdict is tvsmt's own
        (a verdict whose seal does not match was changed outside tvsmt: the corpus is
        damaged even when the status happens to agree)."""
        return not self.differences and not self.file_problems and not self.unsealed

    @property
    def hash_mismatches(self) -> list[FileProblem]:
        return [p for p in self.file_problems if p.problem == "hash mismatch"]


def replay(corpus_dir: str | os.PathLike, solver: str = "z3", jobs: int | None = None,
           timeout: float | None = 60, *, backend: str = DEFAULT_BACKEND, scheduler=None,
           progress: Progress | None = None) -> ReplayReport:
    """Re-solve every intact obligation of the corpus with `solver` and compare statuses.

    Each result is compared with the verdict recorded by the same solver name if it is one
    (sat or unsat), else with every recorded sat/unsat verdict of other solvers (a
    cross-check). A recorded timeout, unknown or error is no verdict to reproduce: it depended
    on the time the run gave (e.g. `--timeout`). Every compared verdict's seal is checked: one
    changed outside tvsmt is listed in `unsealed`.
    """
    t0 = time.monotonic()
    corpus = Corpus(corpus_dir, create=False)
    profile = get_profile(solver)
    report = ReplayReport(corpus=str(corpus.root), solver=profile.name,
                          version=solver_version(profile))
    report.file_problems = corpus.verify_files()
    broken = {p.expected for p in report.file_problems if p.expected}
    obligations = [corpus.read(dg) for dg in corpus.digests() if dg not in broken]
    results = solve_all(obligations, profile, jobs=jobs, timeout_s=timeout, backend=backend,
                        scheduler=scheduler, progress=progress)
    report.total = len(obligations)
    for ob, res in zip(obligations, results, strict=True):
        report.results[ob.digest] = res
        recorded = corpus.verdicts.get(ob.digest, {})
        decisive = {s: v for s, v in recorded.items() if v["status"] in (SAT, UNSAT)}
        compare = ({profile.name: decisive[profile.name]} if profile.name in decisive
                   else decisive)
        if not compare:
            report.unrecorded.append(ob.digest)
            continue
        same = True
        for name, entry in sorted(compare.items()):
            if corpus.refusal(ob.digest, name) == "changed outside tvsmt":
                report.unsealed.append(f"{ob.digest} {name}")
            if entry["status"] != res.status:
                same = False
                report.differences.append(ReplayDiff(
                    digest=ob.digest, stage_ids=corpus.stage_ids(ob.digest),
                    recorded=entry["status"],
                    recorded_by=f"{name} {entry.get('version', '')}".strip(),
                    replayed=res.status, message=res.message))
        report.agree += same
    report.seconds = time.monotonic() - t0
    return report
