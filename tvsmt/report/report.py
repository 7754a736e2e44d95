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
        import os
        import tempfile

        folder = os.path.dirname(os.path.abspath(path))
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".report-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except OSError as e:
            raise PlanError(f"cannot write the report: {e.strerror}", file=path) from None


def load_report(path: str) -> Report:
    """Read a JSON report written by `Report.save` (for `tvsmt report`)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise PlanError(f"cannot read report: {e}", file=path) from None
    if not isinstance(data, dict) or data.get("format") != "tvsmt.report":
        raise PlanError("not a tvsmt report", file=path)
    fields = {k: v for k, v in data.items() if k in Report.__dataclass_fields__}
    try:
        fields["failures"] = [Failure(**f) for f in data.get("failures", [])]
        return Report(**fields)
    except TypeError as e:
        raise PlanError(f"malformed report: {e}", file=path) from None
