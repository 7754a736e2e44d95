"""Phase 2: indexes over a plan's dataflow (who writes and who reads each tensor)."""

from tvsmt.graph.graph import Graph

__all__ = ["Graph"]
