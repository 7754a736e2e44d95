"""Phase 4: shape reduction of each stage."""

from tvsmt.shapes.reduce import ReducedShapes, reduce_stage, reduced_slice

__all__ = ["ReducedShapes", "reduce_stage", "reduced_slice"]
