"""Required verdicts on the real nnScaler plans (issue 2, item 6)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import fixture_pair

from tvsmt.cli import main
from tvsmt.graph import Graph
from tvsmt.plan import load_plan
from tvsmt.plan.reader import check_pair
from tvsmt.stages import cut_stages
from tvsmt.verify import Options, verify_plans


@pytest.mark.parametrize("name", ["mlp-ly2-dp2pp2tp2mb2", "llama3-ly2-dp2pp2tp2mb2"])
def test_fixture_pairs_are_equivalent(name, tmp_path):
    single_path, parallel_path = fixture_pair(name)
    single, parallel = load_plan(single_path), load_plan(parallel_path)
    check_pair(single, parallel)
    report = verify_plans(single, parallel, Options(jobs=2, corpus=str(tmp_path / "corpus")))
    assert report.verdict == "equivalent", report.failures[:3]
    assert report.failures == []
    assert report.cache_hits == 0  # a fresh corpus: every verdict comes from a solver now
    assert report.stages_total > 0
    assert report.stages_proven == report.stages_total
    # The final weight gradients are all established: every single-plan output is the
    # target of a claimed stage (not an assumption), and every stage was proven above.
    assert report.fold is None  # dp2 mb2: not folded, so the stages below are the ones proven
    cut = cut_stages(single, parallel, Graph(single), Graph(parallel))
    assert len(cut.stages) == report.stages_total
    established = {parallel.lineages[st.target].single for st in cut.stages}
    assert single.outputs and set(single.outputs) <= established, (
        sorted(set(single.outputs) - established))


def test_br0_is_a_violation_naming_the_underivable_tensor(tmp_path):
    single, parallel = fixture_pair("br0-llama3-ly1-dp2pp2tp2mb2")
    out = tmp_path / "br0.json"
    result = CliRunner().invoke(main, ["verify", single, parallel, "--report", str(out),
                                       "--corpus", str(tmp_path / "corpus")])
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
                                       "--jobs", "1", "--corpus", str(tmp_path / "corpus")])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "equivalent" and data["cache_hits"] == 0
    for key in ("stages_total", "obligations_total", "obligations_unique", "timings",
                "failures"):
        assert key in data
    assert set(data["timings"]) >= {"load", "stages", "shapes", "encoding", "solving"}
    again = CliRunner().invoke(main, ["report", str(out)])
    assert again.exit_code == 0 and "equivalent" in again.output
