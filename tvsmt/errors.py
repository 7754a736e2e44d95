"""Error types shared by all phases.

`PlanError` is a user-input error (malformed file, unknown operator, inconsistent lineage):
the CLI prints its one-line message and exits with code 2, never a traceback.
`StructuralViolation` is a well-formed plan whose claims cannot hold (a lineage that cannot be
derived, an impossible shape): it is a *violation* (exit 1), reported like a counterexample.
"""

from __future__ import annotations


class TvsmtError(Exception):
    """Base class of every error tvsmt reports to the user."""


class PlanError(TvsmtError):
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
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.detail = message


class UnsupportedOperator(PlanError):
    """An operator name that the registry does not know."""


class StructuralViolation(TvsmtError):
    """The plan is well formed but one of its claims cannot hold, found without a solver."""

    def __init__(self, message: str, *, tensor: str | None = None, lineage: int | None = None,
                 node: str | None = None):
        self.tensor, self.lineage, self.node = tensor, lineage, node
        super().__init__(message)
