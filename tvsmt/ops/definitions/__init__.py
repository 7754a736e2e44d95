"""Operator entries, one module per family. Importing this package registers them all."""

from tvsmt.ops.definitions import comm, linalg  # noqa: F401
