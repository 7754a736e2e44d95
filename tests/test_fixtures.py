"""Required verdicts on the real nnScaler plans (issue 2, item 6)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import fixture_pair

from tvsmt.cli import main
from tvsmt.verify import Options, verify_pair


@pytest.mark.parametrize("name", ["mlp-ly2-dp2pp2tp2mb2", "llama3-ly2-dp2pp2tp2mb2"])
def test_fixture_pairs_are_equivalent(name):
    single, parallel = fixture_pair(name)
    report = verify_pair(single, parallel, Options(jobs=2))
    assert report.verdict == "equivalent", report.failures[:3]
    assert report.failures == []
    assert report.stages_total > 0
    assert report.stages_proven == report.stages_total
    # The final weight gradients are all established (nothing skipped).
    assert report.assumptions > 0


def test_br0_is_a_violation_naming_the_underivable_tensor(tmp_path):
    single, parallel = fixture_pair("br0-llama3-ly1-dp2pp2tp2mb2")
    out = tmp_path / "br0.json"
    result = CliRunner().invoke(main, ["verify", single, parallel, "--report", str(out)])
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "violation"
    failures = data["failures"]
    assert failures, "a violation must say where"
    structural = [f for f in failures if f["kind"] == "structural"]
    assert structural
    f = structural[0]
    # The bug: the multiref backward's second gradient never arrives, so the claimed lineage
    # of t355 (the multiref's output gradient) cannot be derived from the graph.
    assert f["tensor"] == "t355v1@r0m0"
    assert f["stage"] == f"L{f['lineage']}"
    assert "cannot be derived" in f["message"]
    assert f["parallel_tensors"]


def test_cli_verify_equivalent_exit_code_and_report(tmp_path):
    single, parallel = fixture_pair("mlp-ly2-dp2pp2tp2mb2")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["verify", single, parallel, "--report", str(out),
                                       "--jobs", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "equivalent"
    for key in ("stages_total", "obligations_total", "obligations_unique", "timings",
                "failures"):
        assert key in data
    assert set(data["timings"]) >= {"load", "stages", "shapes", "encoding", "solving"}
    again = CliRunner().invoke(main, ["report", str(out)])
    assert again.exit_code == 0 and "equivalent" in again.output
