"""The CI subset of scripts/mutate.py: every fast soundness mutation of tvsmt's own code must
be killed by the tests named for it (run the whole list with `python scripts/mutate.py`).

Without mutate.py's baseline (its run of every named test on the unmutated copy, 40% of the
subset's time): this suite runs each of those tests unmutated itself, and fails if one fails,
so a mutation is never counted killed by a test that fails anyway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_fast_mutation_is_killed():
    env = dict(os.environ)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--fast",
                           "--no-baseline"],
                          capture_output=True, text=True, env=env, timeout=900)
    table = proc.stdout
    assert proc.returncode == 0, table + proc.stderr[-3000:]
    rows = [line.split()[:2] for line in table.splitlines()[1:] if line.strip()
            and not line[0].isdigit()]
    assert rows and all(status in ("killed", "equivalent") for _, status in rows), table
    assert not any(status == "stale" for _, status in rows)
