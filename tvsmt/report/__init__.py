"""Phase 7: the equivalence report (JSON for programs, rich text for people)."""

from tvsmt.report.report import EXIT_CODES, Failure, Report, load_report

__all__ = ["Report", "Failure", "EXIT_CODES", "load_report"]
