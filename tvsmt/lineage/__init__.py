"""Lineage-level checks that need no solver: output coverage, declared shapes."""

from tvsmt.lineage.checks import check_output_coverage, check_plan_shapes, covers, unclaimed_sinks

__all__ = ["check_output_coverage", "check_plan_shapes", "covers", "unclaimed_sinks"]
