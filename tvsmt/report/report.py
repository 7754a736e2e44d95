"""The report of one verification run, as plain dataclasses that serialize to JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tvsmt.errors import PlanError

EQUIVALENT, VIOLATION, INCONCLUSIVE, ERROR = "equivalent", "violation", "inconclusive", "error"
# The documented exit codes (also in `tvsmt --help`): 0 equivalent, 1 violation, 2 input
# error (raised before a report exists), 3 inconclusive, 4 internal error.
EXIT_EQUIVALENT, EXIT_VIOLATION, EXIT_INPUT_ERROR, EXIT_INCONCLUSIVE, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_CODES = {EQUIVALENT: EXIT_EQUIVALENT, VIOLATION: EXIT_VIOLATION,
              INCONCLUSIVE: EXIT_INCONCLUSIVE, ERROR: EXIT_INCONCLUSIVE}


@dataclass
class Failure:
    """Why one stage (or the plan as a whole) is not proven."""

    kind: str  # "counterexample" | "structural" | "inconclusive" | "error"
    message: str
    stage: str | None = None
    lineage: int | None = None
    tensor: str | None = None  # the single-plan tensor whose lineage is not established
    slice: list[list[int]] | None = None  # original slice of the failing lineage part
    parallel_tensors: list[str] = field(default_factory=list)
    # [{"id", "op", "rank", "source"?}]: "source" is the producer's file:line (capture)
    single_nodes: list[dict[str, Any]] = field(default_factory=list)
    parallel_nodes: list[dict[str, Any]] = field(default_factory=list)
    node: str | None = None  # a specific node at fault, where known
    counterexample: dict[str, Any] | None = None  # {"inputs": {...}, "mismatches": [...]}
    solver: dict[str, Any] | None = None  # solver answers (name, status, time, message)
    # graph inputs an underivable claim depends on that no lineage relates (structural)
    free_tensors: list[str] = field(default_factory=list)
    # the producer's code lines ("file:line") to show first: for a captured gradient claim,
    # where the program uses the parameter (its backward nodes all say `loss.backward()`)
    code: list[str] = field(default_factory=list)


@dataclass
class Report:
    verdict: str
    single: str
    parallel: str
    stages_total: int = 0
    stages_proven: int = 0
    stages_violated: int = 0
    stages_inconclusive: int = 0
    assumptions: int = 0
    stage_templates: int = 0  # distinct stage structures actually encoded
    obligations_total: int = 0
    obligations_unique: int = 0
    proven_without_solver: int = 0
    cache_hits: int = 0  # obligations answered wholly by verdicts reused from the corpus
    cache: dict[str, int] = field(default_factory=dict)  # solver -> verdicts reused
    # recorded verdicts not reused, by reason ("changed outside tvsmt", "other profile", ...)
    cache_refused: dict[str, int] = field(default_factory=dict)
    solver: str = "z3"
    solver_seconds: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    failures: list[Failure] = field(default_factory=list)
    # replica folding (tvsmt/fold): what was verified, or why the plan was not folded
    fold: dict[str, Any] | None = None
    fold_note: str | None = None
    # parallel results (written, never read) that no lineage claims: nothing about them is
    # proven; with --strict they make the run fail
    unclaimed: int = 0
    unclaimed_tensors: list[str] = field(default_factory=list)
    # belt and braces: obligations also evaluated at random concrete points
    evaluated: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # one record per stage: [id, lineage, single tensor, status, obligation digest or "",
    # solver seconds]; status is proven / violated / inconclusive (see policy.py)
    stages: list[list] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = "tvsmt.report"
        d["version"] = 1
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def save(self, path: str) -> None:
        from tvsmt.atomic import atomic_write

        try:
            atomic_write(path, self.to_json().encode("utf-8"))
        except OSError as e:
            raise PlanError(f"cannot write the report: {e.strerror}", file=path) from None


def load_report(path: str) -> Report:
    """Read a JSON report written by `Report.save`; a report that is not one (hand-edited,
    damaged) is an input error naming what is wrong in it. Whether what it records can be
    the verdict it states is the verdict policy's question (`policy.load_trusted_report`,
    what `tvsmt report` reads)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        why = e.strerror if isinstance(e, OSError) and e.strerror else \
            "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise PlanError(f"cannot read report: {why}", file=path) from None
    if not isinstance(data, dict) or data.get("format") != "tvsmt.report":
        raise PlanError("not a tvsmt report", file=path)
    fields = {k: v for k, v in data.items() if k in Report.__dataclass_fields__}
    problem = _malformed(fields, Report, "report")
    if problem is None and fields.get("verdict") not in EXIT_CODES:
        problem = f"unknown verdict {fields.get('verdict')!r}"
    failures = fields.get("failures", [])
    for i, f in enumerate(failures if problem is None else []):
        problem = (f"failure #{i} is not an object" if not isinstance(f, dict) else
                   _malformed(f, Failure, f"failure #{i}"))
        if problem:
            break
        for side in ("single_nodes", "parallel_nodes"):
            if not all(isinstance(n, dict) and isinstance(n.get("id"), str)
                       and isinstance(n.get("op"), str) for n in f.get(side, [])):
                problem = f"failure #{i}: {side} entries need string 'id' and 'op'"
    if problem is None and fields.get("fold") is not None:
        missing = [k for k in _FOLD_KEYS if k not in fields["fold"]]
        if missing or not isinstance(fields["fold"].get("exceptions"), list):
            problem = f"'fold' lacks {', '.join(missing) or 'an exceptions list'}"
    if problem:
        raise PlanError(f"malformed report: {problem}", file=path)
    fields["failures"] = [Failure(**{k: v for k, v in f.items()
                                     if k in Failure.__dataclass_fields__}) for f in failures]
    return Report(**fields)


_FOLD_KEYS = ("replicas", "micro_batches", "kept_replicas", "kept_units", "batch_factor",
              "exceptions")


def _malformed(values: dict, cls, what: str) -> str | None:
    """The first field of `values` whose JSON type does not fit `cls`'s annotation, or a
    missing required field; None when all fit (unknown keys are ignored)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return f"{what} lacks '{f.name}'"
            continue
        if not _fits(values[f.name], hints[f.name]):
            return f"{what}: '{f.name}' is not {_describe(hints[f.name])}"
    return None


def _fits(value, hint) -> bool:
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        # lists of Failure are checked one by one by load_report, with their index
        return isinstance(value, list) and (not args or args[0] is Failure or
                                            all(_fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and all(_fits(v, args[1]) for v in value.values())
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint) -> str:
    import typing

    origin = typing.get_origin(hint)
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object"}
    if origin in (list, dict):
        return names[origin]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return _describe(args[0]) + " or null"
    return names.get(hint, getattr(hint, "__name__", str(hint)))
