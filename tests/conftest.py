"""Shared test helpers: where the third-party fixture plans live. Outside CI a missing fixture
folder skips with the reason; in CI (CI=true) it fails, because those plans carry the only
real-bug tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_PLANS = Path(os.environ.get("TVSMT_SHARED_PLANS", ROOT.parent / "shared" / "plans"))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/handmade.py and friends


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing_fixtures(what: str) -> None:
    """Skip (outside CI) or fail (in CI) because fixture plans are absent."""
    reason = (f"fixture plans not found at {what} (the third-party nnScaler plans are "
              "kept beside the checkout in ../shared/plans, never in the project)")
    if in_ci():
        pytest.fail(reason + "; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason)


def fixture_pair(name: str) -> tuple[str, str]:
    """(single, parallel) paths of a fixture pair; skip with the reason, or fail in CI."""
    folder = SHARED_PLANS / name
    single, parallel = folder / "single.json.gz", folder / "parallel.json.gz"
    if not (single.exists() and parallel.exists()):
        missing_fixtures(str(folder))
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


@pytest.fixture(autouse=True)
def _run_in_a_temporary_folder(tmp_path, monkeypatch):
    """Every test runs in its own folder, so a `tvsmt verify` without --corpus writes its
    default smt_corpus/ there, never into the checkout, and no later run reuses its verdicts."""
    monkeypatch.chdir(tmp_path)
