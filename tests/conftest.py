"""Shared test helpers: where the third-party fixture plans live, and a skip when absent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_PLANS = Path(os.environ.get("TVSMT_SHARED_PLANS", ROOT.parent / "shared" / "plans"))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/handmade.py and friends


def fixture_pair(name: str) -> tuple[str, str]:
    """(single, parallel) paths of a fixture pair, or skip with the reason."""
    folder = SHARED_PLANS / name
    single, parallel = folder / "single.json.gz", folder / "parallel.json.gz"
    if not (single.exists() and parallel.exists()):
        pytest.skip(f"fixture plans not found at {folder} (the third-party nnScaler plans are "
                    "kept beside the checkout in ../shared/plans, never in the project)")
    return str(single), str(parallel)


def fake_solver_profile(folder: Path, name: str, answer: str) -> str:
    """A solver profile whose 'solver' is a script that always prints `answer`."""
    import json
    import textwrap

    script = folder / f"{name}_solver.py"
    script.write_text(f"print({answer!r})\n")
    prof = folder / f"{name}.toml"
    prof.write_text(textwrap.dedent(f"""\
        name = "{name}"
        [binary]
        search = ["{{python}}"]
        [run]
        file = ["{{bin}}", {json.dumps(str(script))}, "{{file}}"]
        """))
    return str(prof)
