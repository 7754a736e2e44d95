"""The verification pipeline: plan -> graph -> stages -> shapes -> encoding -> solving -> report.

Each phase is a package of its own; this module only composes them (and times them):

    PlanPair --fold--> PlanPair --prepare--> Prepared (stages, obligations) --solve--> Report

`verify`, `export` and `replay` (and the frontends' `check`) go through the same phases,
folding included. What a verdict means is decided in one place, tvsmt/policy.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from tvsmt.encoding.obligations import (PARALLEL_TEMPLATES, StageOutcome,  # noqa: F401
                                        build_obligations, encode_one)
from tvsmt.graph import Graph
from tvsmt.heap import collector_paused, leave_to_exit, plans_frozen
from tvsmt.lineage import check_output_coverage, check_plan_shapes, unclaimed_sinks
from tvsmt.plan import Plan, load_plan
from tvsmt.plan.reader import check_pair
from tvsmt.policy import decide, judge_stage, stage_status
from tvsmt.report.report import EQUIVALENT, INCONCLUSIVE, Failure, Report
from tvsmt.solving.dispatch import (  # noqa: F401 - re-exported for callers and tests
    SMALL_RUN,
    _both_must_prove,
    _solver_names,
    check_solver_choice,
    solve_obligations,
    store_in_corpus,
)
from tvsmt.solving.types import DEFAULT_BACKEND, Obligation
from tvsmt.stages import Stage, cut_stages
from tvsmt.timing import Timer  # noqa: F401  (re-exported: scripts and tests time phases)


@dataclass
class Options:
    jobs: int | None = None
    solver: str = "z3"
    timeout: float = 60.0
    # True: z3 and cvc5; or the profiles (names or paths) that must all prove each stage
    crosscheck: bool | str | tuple[str, ...] = False
    corpus: str | None = None
    fresh: bool = False
    backend: str = DEFAULT_BACKEND
    scheduler: str | None = None
    fold: bool = True  # replica folding (tvsmt/fold) when the plan has > 2 replicas or mbs
    strict: bool = False  # parallel results that no lineage claims make the run fail
    progress: Callable[[str, int, int | None], None] | None = None  # (phase, done, total)

    def __post_init__(self):
        check_solver_choice(self.solver, self.crosscheck)


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
                    solver="+".join(_solver_names(opts)))
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
    decide(report, failures)
    if report.verdict == EQUIVALENT:
        report.verdict = INCONCLUSIVE  # nothing was solved
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
        report = _verify_folded_in_child(single_path, parallel_path, opts, timer)
        if report is not None:
            return report
    with timer.phase("load"):
        pair = PlanPair.load(single_path, parallel_path)
    leave_to_exit(pair)  # a command frees nothing at its end (heap.py)
    with plans_frozen():
        return _verify_loaded(pair, opts, timer)


# A plan document at least this large (decompressed) is loaded and folded in a forked
# process, and only the folded pair comes back (`_FoldAnswer`). This process then never holds
# the whole plan: the 128-rank MoE plan's 3.4M objects are not freed one by one at the end
# (0.4 s, most of it page faults on memory the encoding workers' fork had made
# copy-on-write), and those workers fork from a small process. $TVSMT_FOLD_IN_CHILD: "always"
# or "never" (tests, benchmarks).
FOLD_IN_CHILD_MIN_BYTES = 8 << 20
FOLD_IN_CHILD_ENV = "TVSMT_FOLD_IN_CHILD"


def fold_in_child(parallel_path: str) -> bool:
    """Load and fold this parallel plan in a forked process? (Its size, decompressed, and
    whether it has anything to fold.)"""
    import os

    forced = os.environ.get(FOLD_IN_CHILD_ENV, "").strip().lower()
    if not hasattr(os, "fork") or forced == "never":
        return False
    if forced == "always":
        return True
    from tvsmt.fold.units import WorldUnits
    from tvsmt.plan.reader import text_size, world_hint

    size = text_size(str(parallel_path))
    if size is None or size < FOLD_IN_CHILD_MIN_BYTES:
        return False
    # a plan with nothing to fold would be read twice (by the child, then here): its world,
    # when the start of the file tells it, decides
    world = world_hint(str(parallel_path))
    return world is None or not WorldUnits.of(world).nothing_to_fold()


class _FoldAnswer:
    """The forked process's answer: its folds and its phases' times, as MessagePack decoded
    by msgspec into the typed records themselves (exact: tests/test_fold_in_child.py
    compares them with a fold in this process). A fold is its folded pair, as MessagePack
    bytes of their own (`encode_pair`: what `_load_and_fold`'s pair note sends ahead, so
    that the two compare as bytes), and its `FoldInfo`; or the refusal's words. Nothing but
    a folded pair's records can come out of it; anything else is refused (DecodeError,
    ValidationError) and the pair is then loaded here. Lineage scales travel as text."""

    @staticmethod
    def _encode_scale(obj):
        if isinstance(obj, Fraction):
            return str(obj)
        raise NotImplementedError(f"{type(obj).__name__} in a folded pair")

    @staticmethod
    def _decode_scale(kind: type, obj):
        if kind is Fraction and isinstance(obj, str):
            return Fraction(obj)
        raise NotImplementedError(kind)

    @classmethod
    def encode_pair(cls, folded) -> bytes:
        import msgspec

        return msgspec.msgpack.encode((folded.single, folded.parallel),
                                      enc_hook=cls._encode_scale)

    @classmethod
    def decode_pair(cls, data: bytes) -> tuple[Plan, Plan]:
        import msgspec

        return msgspec.msgpack.decode(data, type=tuple[Plan, Plan], dec_hook=cls._decode_scale)

    @classmethod
    def encode(cls, folds: list, phases: dict[str, float]) -> bytes:
        import msgspec

        sent = [f if isinstance(f, str) else (cls.encode_pair(f), f.info) for f in folds]
        return msgspec.msgpack.encode((sent, phases), enc_hook=cls._encode_scale)

    @classmethod
    def decode_raw(cls, data: bytes) -> tuple[list, dict[str, float]]:
        """(per fold: (its pair's bytes, its FoldInfo) or the refusal's words, phases)."""
        import msgspec

        from tvsmt.fold.folder import FoldInfo

        return msgspec.msgpack.decode(
            data, type=tuple[list[tuple[bytes, FoldInfo] | str], dict[str, float]])

    @classmethod
    def decode(cls, data: bytes) -> tuple[list, dict[str, float]]:
        """(per fold: a `Folded` or the refusal's words, phases)."""
        from tvsmt.fold import Folded

        folds, phases = cls.decode_raw(data)
        return [f if isinstance(f, str) else Folded(*cls.decode_pair(f[0]), f[1])
                for f in folds], phases


# The forked process's notes (ForkedCall's): the pair is read and the fold begins; the
# folded pair the first fold will give if the units not yet checked are copies
# (fold_source's `ahead`), after this tag.
LOADED_NOTE, AHEAD_NOTE = b"loaded", b"ahead:"


def _load_and_fold(single_path: str, parallel_path: str, note=None) -> bytes:
    """In the forked process: load the pair and fold it (a second time when the first fold
    has exceptions, as `_through_fold` may ask): `_FoldAnswer`. An input error, inferred
    lineages, anything unusual: no answer (the parent then does it all itself, and words the
    error). With `note` (ForkedCall's notes): LOADED_NOTE once the pair is read, then
    AHEAD_NOTE and the first fold's pair as soon as its kept units are checked."""
    from tvsmt.fold import FoldRefused, fold_plans

    timer = Timer()
    with timer.phase("load"):
        pair = PlanPair.load(single_path, parallel_path, lazy=True)  # only the fold reads it
    leave_to_exit(pair)  # freed with the process, after the answer (tvsmt/forked.py)
    if note is not None:
        note(LOADED_NOTE)
    if any(lin.hypothesis for lin in pair.parallel.lineages):
        return b""  # inferred lineages are verified from the whole plan (_verify_loaded)
    folds: list = []
    for extra in (0, 1):
        try:
            with timer.phase("fold"):
                folded = fold_plans(pair.single, pair.parallel, extra, ahead=(
                    None if note is None or extra else
                    lambda guess: note(AHEAD_NOTE + _FoldAnswer.encode_pair(guess))))
        except FoldRefused as e:
            folds.append(str(e))
            break
        folds.append(folded)
        if not folded.info.exceptions:
            break
    return _FoldAnswer.encode(folds, timer.timings)


def prepare_phases_after_load(opts: Options) -> None:
    """Import and probe, ahead of time, what the phases after loading will need: pysmt and
    the solver bindings it probes, the solver profiles, their binaries and versions, the
    worker pool. Called while another process folds the plan, on the core the fold leaves
    idle; without it, the same 0.1-0.2 s are spent after the fold. Changes nothing the
    phases compute, and fails silently: a phase that needs what failed here raises its own
    error later."""
    with contextlib.suppress(Exception):  # a hint only: the phases raise their own errors
        import multiprocessing.pool  # noqa: F401 (fork_map's pool)

        from tvsmt.ops import SymbolicBackend
        from tvsmt.solving import corpus, runner  # noqa: F401 (solve_obligations imports them)
        from tvsmt.solving.profiles import get_profile, require_binary, solver_version

        SymbolicBackend.fresh()  # the first one imports pysmt and probes its solvers
        for name in _solver_names(opts):
            profile = get_profile(name)
            require_binary(profile)
            solver_version(profile)  # cached for this process


def _verify_folded_in_child(single_path: str, parallel_path: str, opts: Options,
                            timer: Timer) -> Report | None:
    """`verify_pair` with the load and the fold in a forked process (`fold_in_child`); None
    when the child gives no answer (the caller then loads the pair here)."""
    import time

    import msgspec

    # tvsmt.fold imported before the fork: the child inherits it (0.1-0.25 s each otherwise)
    from tvsmt.fold import Folded, FoldRefused
    from tvsmt.forked import ForkedCall

    t0 = time.perf_counter()
    call = ForkedCall(lambda note: _load_and_fold(single_path, parallel_path, note), notes=True)
    ahead = None
    try:
        note = call.next_note()
        if note == LOADED_NOTE:
            # the fold runs on one core: the other one sets up what comes after it
            prepare_phases_after_load(opts)
            note = call.next_note()
        if note is not None and note.startswith(AHEAD_NOTE):
            ahead = _Ahead.prepare(note[len(AHEAD_NOTE):], opts)
        data = call.answer()
    except BaseException:  # Ctrl-C while waiting: the child ends now, not with this process
        call.stop()
        raise
    if not data:
        return None
    try:
        with collector_paused():
            folds, phases = _FoldAnswer.decode_raw(data)
    except (msgspec.DecodeError, msgspec.ValidationError):  # e.g. cut short
        return None
    for name, seconds in phases.items():
        timer.add(name, seconds)
    # forking, sending the folds and reading them back count as loading
    timer.add("load", max(0.0, time.perf_counter() - t0 - sum(phases.values())
                          - (ahead.seconds if ahead is not None else 0.0)))
    if ahead is not None and not (folds and ahead.is_pair_of(folds[0])):
        ahead = None  # the guess was not the first fold's pair: not used
    decoded: dict[int, Folded] = {}

    def fold(extra: int) -> Folded:
        got = folds[extra]
        if isinstance(got, str):
            raise FoldRefused(got)
        if extra not in decoded:
            if extra == 0 and ahead is not None:  # its pair is the guess, already here
                decoded[0] = Folded(ahead.single, ahead.parallel, got[1])
            else:
                with collector_paused():
                    decoded[extra] = Folded(*_FoldAnswer.decode_pair(got[0]), got[1])
        return decoded[extra]

    def run(single: Plan, parallel: Plan, opts: Options, timer: Timer) -> Report:
        if ahead is not None and parallel is ahead.parallel:
            return ahead.finish(opts, timer)
        return verify_unfolded(single, parallel, opts, timer)

    def whole() -> Report:  # the fold refused: the pair is read here after all
        with timer.phase("load"):
            pair = PlanPair.load(single_path, parallel_path)
        leave_to_exit(pair)
        return verify_unfolded(pair.single, pair.parallel, opts, timer)

    with plans_frozen():
        return _through_fold(fold, whole, opts, timer, run)


class _Ahead:
    """The first fold's pair as the forked process guessed it before checking every unit
    (AHEAD_NOTE), prepared (stages cut, obligations encoded) while that process checks the
    rest. Used only when the pair of the first fold it answers is the same bytes: then it
    is the same pair, and preparing it again would compute the same obligations. Else it is
    dropped (a unit not a copy, a refusal: the answer's folds are verified as they come)."""

    def __init__(self, blob: bytes, single: Plan, parallel: Plan, prepared: Prepared,
                 timer: Timer, seconds: float):
        self.blob, self.single, self.parallel = blob, single, parallel
        self.prepared, self.timer, self.seconds = prepared, timer, seconds

    @classmethod
    def prepare(cls, blob: bytes, opts: Options) -> "_Ahead | None":
        import time

        import msgspec

        t0 = time.perf_counter()
        try:
            with collector_paused():
                single, parallel = _FoldAnswer.decode_pair(blob)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        timer = Timer()
        try:
            with plans_frozen():
                prepared = prepare(single, parallel, opts, timer)
        except Exception:  # noqa: BLE001 - a guess only: the answered pair meets it again
            return None
        return cls(blob, single, parallel, prepared, timer, time.perf_counter() - t0)

    def is_pair_of(self, fold) -> bool:
        """Is this the pair of the answer's fold (bytes and FoldInfo, or a refusal)?"""
        return not isinstance(fold, str) and fold[0] == self.blob

    def finish(self, opts: Options, timer: Timer) -> Report:
        for name, seconds in self.timer.timings.items():
            timer.add(name, seconds)
        return solve_and_judge(self.prepared, self.single, self.parallel, opts, timer)


def _verify_loaded(pair: PlanPair, opts: Options, timer: Timer) -> Report:
    if any(lin.hypothesis for lin in pair.parallel.lineages):
        # inferred lineages only cut stages: one whose stage fails is dropped and the
        # neighbouring stages merge (tvsmt/capture/driver.py), never a violation by itself
        from tvsmt.capture.driver import verify_with_hypotheses

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
