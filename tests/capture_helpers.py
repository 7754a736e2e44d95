"""What the capture tests share: where a line of an example is, and which source lines a
report's failures name."""

from __future__ import annotations


def line_of(path: str, text: str) -> int:
    """The 1-based number of the first line of `path` containing `text`."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(f"{text!r} is not in {path}")


def sources(report) -> set[str]:
    """Every "file:line" that a report's failure nodes carry."""
    return {n.get("source") for f in report.failures for n in f.parallel_nodes + f.single_nodes
            if n.get("source")}
