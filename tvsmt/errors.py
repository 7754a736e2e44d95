"""The one hierarchy of errors tvsmt reports (every phase raises one of these).

* `InputError` (alias `PlanError`): the user's input is malformed or unsupported (a plan
  file, an unknown operator, an inconsistent lineage, a bad option). The CLI prints its
  one-line message and exits with code 2, never a traceback.
* `StructuralViolation`: a well-formed plan whose claims cannot hold (a lineage that cannot
  be derived, an impossible shape): a *violation* (exit 1), reported like a counterexample.
* `SolverFailure`: a solver could not be run or answered nothing usable. Never a pass: the
  stages it concerns are inconclusive.
* `InternalError`: a bug in tvsmt itself (for example an exception inside an operator rule),
  named with the operator and node it happened at ("while executing <node>"). Exit code 4.
"""

from __future__ import annotations


class TvsmtError(Exception):
    """Base class of every error tvsmt reports to the user."""


def shown(text: str) -> str:
    """`text` with control characters escaped (a newline or an ANSI escape in a file name or
    id must not break the one-line message or drive the terminal)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class InputError(TvsmtError):
    """Malformed or unsupported input. The message names the file and the node/tensor."""

    def __init__(self, message: str, *, file: str | None = None, node: str | None = None,
                 tensor: str | None = None):
        self.file, self.node, self.tensor = file, node, tensor
        where = []
        if file:
            where.append(file)
        if node:
            where.append(f"node {node}")
        if tensor:
            where.append(f"tensor {tensor}")
        prefix = ": ".join(where)
        super().__init__(shown(f"{prefix}: {message}" if prefix else message))
        self.detail = shown(message)


PlanError = InputError  # the historical name, used throughout the readers


class UnsupportedOperator(InputError):
    """An operator name that the registry does not know."""


class StructuralViolation(TvsmtError):
    """The plan is well formed but one of its claims cannot hold, found without a solver."""

    def __init__(self, message: str, *, tensor: str | None = None, lineage: int | None = None,
                 node: str | None = None):
        self.tensor, self.lineage, self.node = tensor, lineage, node
        super().__init__(message)


class SolverFailure(TvsmtError):
    """A solver could not be started or gave no usable answer (never a pass)."""


class InternalError(TvsmtError):
    """A bug in tvsmt, not in the input: reported with where it happened, exit code 4."""

    def __init__(self, message: str, *, node: str | None = None, op: str | None = None):
        self.node, self.op = node, op
        super().__init__(message)
