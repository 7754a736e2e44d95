"""A revision of this repository checked out beside the working tree, for the benchmarks that
compare a base revision with today's code in one run (bench_read_history.py,
bench_phases_history.py)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checked_out(rev: str) -> Iterator[Path]:
    """A temporary git worktree of `rev`, removed afterwards whatever happens."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree),
                        rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False)
