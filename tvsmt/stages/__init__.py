"""Phase 3: cutting both graphs into small independent stages along the lineages."""

from tvsmt.stages.cutter import Stage, cut_stages

__all__ = ["Stage", "cut_stages"]
