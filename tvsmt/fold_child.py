"""Verifying a large plan document loaded and folded in a forked process (`fold_in_child`).

Only the folded pair comes back, as MessagePack (`_FoldAnswer`), so this process never holds
the whole plan. The child also sends two notes ahead of its answer: when the pair is read
(this process then sets up the phases after loading, `prepare_phases_after_load`), and the
folded pair it will answer if every unit not yet checked is a copy (`_Ahead`: this process
cuts its stages and encodes its obligations meanwhile, and uses them only if the answered pair
is the same bytes). A child that fails, refuses or dies leaves the work to this process
(tvsmt.verify). The phases themselves are tvsmt.pipeline's; this module is their plumbing
across the fork (tests/test_fold_in_child.py).
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

from tvsmt.heap import collector_paused, leave_to_exit, plans_frozen
from tvsmt.options import Options, solver_names
from tvsmt.pipeline import (
    PlanPair,
    Prepared,
    _through_fold,
    prepare,
    solve_and_judge,
    verify_unfolded,
)
from tvsmt.plan import Plan
from tvsmt.report.report import Report
from tvsmt.timing import Timer, mark

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
    def _scale_decoder():
        """The decoder's hook for scales: each distinct text parsed once (a folded pair
        holds thousands of parts and a few scales; `Fraction(text)` is a regular
        expression's match: 20 ms of the 128-rank MoE plan's guess, before its encoding)."""
        parsed: dict[str, Fraction] = {}

        def hook(kind: type, obj):
            if kind is Fraction and isinstance(obj, str):
                got = parsed.get(obj)
                if got is None:
                    got = parsed[obj] = Fraction(obj)
                return got
            raise NotImplementedError(kind)

        return hook

    @classmethod
    def encode_pair(cls, folded) -> bytes:
        import msgspec

        return msgspec.msgpack.encode((folded.single, folded.parallel),
                                      enc_hook=cls._encode_scale)

    @classmethod
    def decode_pair(cls, data: bytes) -> tuple[Plan, Plan]:
        import msgspec

        return msgspec.msgpack.decode(data, type=tuple[Plan, Plan],
                                      dec_hook=cls._scale_decoder())

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
        return b""  # inferred lineages are verified from the whole plan (verify._verify_loaded)

    def send_guess(guess) -> None:
        note(AHEAD_NOTE + _FoldAnswer.encode_pair(guess))
        mark("guess sent")

    folds: list = []
    for extra in (0, 1):
        try:
            with timer.phase("fold"):
                folded = fold_plans(pair.single, pair.parallel, extra,
                                    ahead=None if note is None or extra else send_guess)
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
        for name in solver_names(opts):
            profile = get_profile(name)
            require_binary(profile)
            solver_version(profile)  # cached for this process


def verify_folded_in_child(single_path: str, parallel_path: str, opts: Options,
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
    def prepare(cls, blob: bytes, opts: Options) -> _Ahead | None:
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
