"""Operator entries, one module per family. Importing this package registers them all."""

from tvsmt.ops.definitions import comm, elementwise, layout, linalg, llama, reductions  # noqa: F401
from tvsmt.ops.definitions import aten_layout, aten_math, aten_nn  # noqa: F401  (PyTorch capture)
