"""Verifying plans from files and other sources: the entry points of tvsmt/pipeline.py's
phases, and the routes a plan takes to them.

* `verify_pair`: two plan files. A large plan document is read and folded in a forked
  process (tvsmt/fold_child.py), a JSON Lines file in one pass into columns
  (`verify_stream_file`), anything else here; a plan with inferred lineages goes through
  the capture's hypotheses (tvsmt/capture/driver.py).
* `verify_source`: a unit source too large to hold (e.g. the streamed generator).
* `verify_plans` (pipeline.py): two plans in memory. `export_obligations`: the same phases,
  nothing solved.
"""

from __future__ import annotations

from tvsmt.encoding.obligations import PARALLEL_TEMPLATES, StageOutcome  # noqa: F401
from tvsmt.fold_child import fold_in_child, verify_folded_in_child
from tvsmt.heap import collector_paused, leave_to_exit, plans_frozen
from tvsmt.options import Options, check_solver_choice, solver_names  # noqa: F401
from tvsmt.pipeline import (  # noqa: F401 - the phases, re-exported for callers and tests
    PlanPair,
    Prepared,
    Run,
    _through_fold,
    export_unfolded,
    prepare,
    solve_and_judge,
    verify_plans,
    verify_unfolded,
)
from tvsmt.plan import Plan, load_plan
from tvsmt.plan.reader import check_pair
from tvsmt.report.report import INCONCLUSIVE, Failure, Report
from tvsmt.solving.dispatch import (  # noqa: F401 - re-exported for callers and tests
    SMALL_RUN,
    _both_must_prove,
    solve_obligations,
    store_in_corpus,
)
from tvsmt.timing import Timer


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

    return _through_fold(lambda extra: fold_source(source, extra, jobs=opts.jobs or 1),
                         cannot, opts, timer, verify_unfolded)


def verify_pair(single_path: str, parallel_path: str, opts: Options | None = None,
                jobs: int | None = None, **kw) -> Report:
    """Load two plan files and verify them (InputError on malformed input)."""
    opts = opts or Options(jobs=jobs, **kw)
    timer = Timer()
    if opts.progress:
        opts.progress("loading plans", 0, None)
    if opts.fold and is_stream_file(parallel_path):
        report = verify_stream_file(single_path, parallel_path, opts, timer)
        if report is not None:
            return report
    if opts.fold and fold_in_child(parallel_path):
        report = verify_folded_in_child(single_path, parallel_path, opts, timer)
        if report is not None:
            return report
    with timer.phase("load"):
        pair = PlanPair.load(single_path, parallel_path)
    leave_to_exit(pair)  # a command frees nothing at its end (heap.py)
    with plans_frozen():
        return _verify_loaded(pair, opts, timer)


def _verify_loaded(pair: PlanPair, opts: Options, timer: Timer) -> Report:
    if any(lin.hypothesis for lin in pair.parallel.lineages):
        # inferred lineages only cut stages: one whose stage fails is dropped and the
        # neighbouring stages merge (tvsmt/capture/driver.py), never a violation by itself
        from tvsmt.capture.driver import verify_with_hypotheses  # imports torch: only here

        report, hyp = verify_with_hypotheses(pair.single, pair.parallel, opts)
        report.notes.append(f"hypotheses: {hyp['proposed']} proposed, {hyp['dropped']} "
                            f"dropped, {hyp['rounds']} rounds")
        report.timings["load"] = round(timer.timings.get("load", 0.0), 4)
        return report
    return verify_plans(pair.single, pair.parallel, opts, timer)


def is_stream_file(path: str) -> bool:
    """A JSON Lines plan (by name or first bytes; docs/format.md)."""
    from tvsmt.plan.reader import STREAM_START, STREAM_SUFFIXES, open_binary

    if str(path).endswith(STREAM_SUFFIXES):
        return True
    try:
        with open_binary(str(path)) as f:
            head = f.peek(64)[:64] if hasattr(f, "peek") else f.read(64)
    except Exception:  # the ordinary path words the error
        return False
    return head.lstrip().startswith(STREAM_START)


def verify_stream_file(single_path: str, parallel_path: str, opts: Options,
                       timer: Timer) -> Report | None:
    """A JSON Lines parallel plan read in one pass into integer columns (tvsmt/plan/scan.py:
    no record object is kept but those the fold keeps) and folded over them
    (tvsmt/fold/columns.py). None when the one pass does not take the file (an unusual but
    valid file) or the fold refuses it: the caller then reads it whole. A malformed file
    raises the one-line InputError of the record-by-record checks."""
    from tvsmt.fold import FoldRefused, fold_source
    from tvsmt.fold.columns import ColumnPlan
    from tvsmt.plan.scan import NotScanned, scan_plan
    from tvsmt.plan.stream import check_stream

    with timer.phase("load"):
        single = load_plan(single_path)
        try:
            scanned = scan_plan(parallel_path)
        except NotScanned:
            check_stream(parallel_path)  # words what is wrong, if anything is
            return None
    if any(lin.hypothesis for lin in scanned.lineages):
        return None  # inferred lineages are verified from the whole plan (capture/driver.py)
    header = scanned.header_plan()
    with timer.phase("load"):
        check_pair(single, header)  # every part's slice, also those of units folded away
    try:
        with timer.phase("fold"), collector_paused():
            held = [ColumnPlan(single, header, scanned.columns)]
    except FoldRefused:
        return None
    del scanned, header
    note: list[str] = []

    def fold(extra: int):
        folded = fold_source(held[0], extra)
        if not folded.info.exceptions:  # no second fold: the columns are freed before the
            held.clear()  # encoding's workers are forked
        return folded

    def whole() -> Report:
        with timer.phase("load"):
            pair = PlanPair.load(single_path, parallel_path)
        report = verify_plans(pair.single, pair.parallel, opts, timer)
        note.append(report.fold_note or "")
        return report

    report = _through_fold(fold, whole, opts, timer, verify_unfolded)
    if note:
        report.fold_note = (f"{report.fold_note}; read whole: {note[0]}" if note[0]
                            else f"{report.fold_note}; verified from the whole file")
    return report


def export_obligations(single: Plan, parallel: Plan, corpus_dir: str,
                       opts: Options | None = None) -> Report:
    """`tvsmt export`: the same phases as verify (folding included), obligations written to
    `corpus_dir`, nothing solved."""
    from dataclasses import replace

    opts = replace(opts or Options(), corpus=corpus_dir)
    return verify_plans(single, parallel, opts, Timer(), run=export_unfolded)
