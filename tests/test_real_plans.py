"""Every real nnScaler plan in ../shared/plans gets the verdict its README gives.

The table of ../shared/plans/README.md is the oracle: each row names a folder and its expected
verdict (`equivalent`, `violation`, or an input error), and each row becomes one test that
runs `tvsmt verify` on the pair, with a temporary corpus, and checks the exit code and the
report. A row added to the README is tested without touching this file; a folder without a
row, or a row without a folder, is a failure. Large plans are marked `slow` (they still run
in the default suite).
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from conftest import SHARED_PLANS, fixture_pair, missing_fixtures

from tvsmt.cli import main
from tvsmt.report.report import EXIT_CODES, EXIT_INPUT_ERROR

README = SHARED_PLANS / "README.md"
SLOW_NODES = 10_000  # parallel nodes above which a pair is marked slow
_ROW = re.compile(r"^\|\s*`(?P<folder>[^`]+)`\s*\|(?P<cells>.*)\|\s*$")


def _expected(cell: str) -> str:
    """The verdict a README cell states: its first back-quoted word, or an input error."""
    quoted = re.match(r"\s*`(\w+)`", cell)
    if quoted:
        return quoted.group(1)
    if "input error" in cell:
        return "input error"
    raise ValueError(f"README row with no verdict: {cell!r}")


def readme_rows() -> list[tuple[str, str, int]]:
    """(folder, expected verdict, parallel nodes) for every row of the README's table."""
    if not README.exists():
        return []
    rows = []
    header: list[str] | None = None
    for line in README.read_text().splitlines():
        if header is None and line.startswith("| folder"):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            continue
        m = _ROW.match(line)
        if header is None or not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        row = dict(zip(header, cells))
        nodes = int(row["parallel nodes"].replace(",", ""))
        rows.append((m.group("folder"), _expected(row["expected verdict"]), nodes))
    return rows


ROWS = readme_rows()


def _params():
    if not ROWS:  # no README: one test that skips, or fails in CI, with the reason
        return [pytest.param(None, None, id="no-fixtures")]

    def marks(folder, nodes):
        return [pytest.mark.fixtures] + ([pytest.mark.slow] if nodes > SLOW_NODES else [])

    return [pytest.param(folder, verdict, marks=marks(folder, nodes), id=folder)
            for folder, verdict, nodes in ROWS]


def test_the_readme_table_covers_every_fixture_folder():
    if not ROWS:
        missing_fixtures(str(README))
    folders = {p.name for p in SHARED_PLANS.iterdir() if p.is_dir()}
    listed = [folder for folder, _, _ in ROWS]
    assert len(listed) == len(set(listed)), "a folder listed twice"
    assert set(listed) == folders, (sorted(folders - set(listed)), sorted(set(listed) - folders))
    assert {v for _, v, _ in ROWS} <= {"equivalent", "violation", "input error"}


@pytest.mark.parametrize("folder,verdict", _params())
def test_real_plan_gets_the_readme_verdict(folder, verdict, tmp_path):
    if folder is None:
        missing_fixtures(str(README))
    single, parallel = fixture_pair(folder)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["verify", single, parallel, "--jobs", "1",
                                       "--corpus", str(tmp_path / "corpus"),
                                       "--report", str(out)])
    assert "Traceback" not in result.output, result.output
    if verdict == "input error":
        # nothing to verify is not a pass: one line naming the file, exit 2, no report
        assert result.exit_code == EXIT_INPUT_ERROR, result.output
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and folder in lines[0], result.output
        assert not out.exists()
        return
    assert result.exit_code == EXIT_CODES[verdict], result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == verdict
    assert data["cache_hits"] == 0  # a fresh corpus: nothing was taken from an earlier run
    if verdict == "equivalent":
        assert data["failures"] == []
        assert data["stages_total"] > 0 and data["stages_proven"] == data["stages_total"]
    else:  # a violation says where
        assert any(f["kind"] in ("counterexample", "structural") and f["tensor"]
                   for f in data["failures"]), data["failures"][:3]


@pytest.mark.parametrize("ci,expected", [("true", "1 failed"), ("", "1 skipped")])
def test_missing_fixture_plans_fail_in_ci_and_skip_elsewhere(tmp_path, ci, expected):
    """Without ../shared/plans the real-bug test cannot run: outside CI it says so and skips;
    in CI (CI=true) that is a failure, never a silent skip."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, CI=ci, TVSMT_SHARED_PLANS=str(tmp_path / "nowhere"))
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(ROOT / "tests" / "test_fixtures.py") + "::"
         "test_br0_is_a_violation_naming_the_underivable_tensor"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert expected in proc.stdout, proc.stdout[-2000:]
    assert "fixture plans not found" in proc.stdout
