"""The operator registry (see registry.py) and the arithmetic backends (backend.py)."""

from tvsmt.ops.backend import Backend, NumericBackend, SymbolicBackend
from tvsmt.ops.registry import (AttrError, NodeCtx, OpSpec, ShapeConstraints, ShapeRuleError,
                                TShape, all_ops, attrs_key, get)

__all__ = ["AttrError", "Backend", "NumericBackend", "SymbolicBackend", "NodeCtx", "OpSpec", "ShapeConstraints",
           "ShapeRuleError", "TShape", "all_ops", "attrs_key", "get"]
