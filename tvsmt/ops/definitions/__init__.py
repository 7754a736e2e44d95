"""Operator entries, one module per family. Importing this package registers them all."""

from tvsmt.ops.definitions import comm, elementwise, layout, linalg, llama, moe, reductions  # noqa: F401
