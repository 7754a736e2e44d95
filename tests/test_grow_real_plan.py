"""scripts/grow_real_plan.py: a real nnScaler plan's data parallelism grown, the stand-in for
real plans larger than those in ../shared/plans (issue 12's 512-rank plan). Growing must give
the source back when the world stays the same, a grown plan must verify as its source does
(folded, every new replica checked), and a bug in a grown replica must still be caught."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest
from conftest import ROOT, fixture_pair

from tvsmt.frontends.mutations import apply
from tvsmt.plan import plan_from_dict
from tvsmt.verify import Options, verify_plans

SOURCE = "llama3-ly2-dp2pp2tp2mb2"  # 8 ranks: dp2 pp2 tp2, 2 micro-batches


def _script():
    spec = importlib.util.spec_from_file_location("grow_real_plan",
                                                  ROOT / "scripts" / "grow_real_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(name: str) -> tuple[dict, dict]:
    out = []
    for path in fixture_pair(name):
        with gzip.open(path) as f:
            out.append(json.load(f))
    return tuple(out)


@pytest.fixture(scope="module")
def source():
    return _read(SOURCE)


def _grown(source, dp: int) -> tuple[dict, dict]:
    grow = _script()
    single, parallel = source
    lay = grow.Layout(parallel["world"], dp)
    return grow.grow_single(single, parallel, lay), grow.grow_parallel(parallel, lay)


def test_growing_to_the_same_world_gives_the_source_back(source):
    single, parallel = _grown(source, 2)
    assert single == source[0]
    assert {k: v for k, v in parallel.items() if k != "name"} == \
        {k: v for k, v in source[1].items() if k != "name"}
    assert list(parallel["tensors"]) == list(source[1]["tensors"])


def test_a_grown_plan_verifies_as_its_source_with_every_replica_checked(source):
    single, parallel = _grown(source, 6)
    assert parallel["world"]["dp"] == 6 and parallel["world"]["ranks"] == 24
    assert len(parallel["nodes"]) == 3 * len(source[1]["nodes"])
    batch = source[0]["tensors"]["t621v1@r0m0"]["shape"][0]
    assert single["tensors"]["t621v1@r0m0"]["shape"][0] == 3 * batch
    report = verify_plans(plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel"),
                          Options(jobs=1))
    assert report.verdict == "equivalent"
    assert report.fold is not None and report.fold["replicas"] == 6, report.fold_note


def test_a_bug_in_a_grown_replica_is_caught(source):
    single, parallel = _grown(source, 6)
    per = parallel["world"]["pp"] * parallel["world"]["tp"]
    where = next(n["id"] for n in reversed(parallel["nodes"])
                 if n["op"] == "linear" and n["pass"] == "bw" and n["rank"] // per == 5)
    broken, _ = apply(parallel, "grad-scale-wrong", where=where)
    report = verify_plans(plan_from_dict(single, "single"), plan_from_dict(broken, "broken"),
                          Options(jobs=1))
    assert report.verdict == "violation"
    node = next(n for n in parallel["nodes"] if n["id"] == where)
    unit = f"replica 5 micro-batch {node['mb']}"
    assert report.fold is not None and unit in report.fold["exceptions"], report.fold_note


def test_a_plan_whose_nodes_read_across_replicas_is_not_grown(source):
    parallel = source[1]
    nodes = [dict(n) for n in parallel["nodes"]]
    per = parallel["world"]["pp"] * parallel["world"]["tp"]
    i = next(i for i, n in enumerate(nodes) if n["op"] == "linear" and n["rank"] < per)
    other = next(t for t in parallel["tensors"] if f"@r{per}m" in t)
    nodes[i] = dict(nodes[i], inputs=[other] + nodes[i]["inputs"][1:])
    grow = _script()
    with pytest.raises(SystemExit, match="reads across replicas"):
        grow.grow_parallel(dict(parallel, nodes=nodes), grow.Layout(parallel["world"], 4))


@pytest.mark.slow
def test_the_512_rank_real_plan_of_the_issue_grown_from_its_128_rank_sibling_folds():
    """Issue 12's 512-rank plan (Llama3 dp16 pp4 tp8 mb8, 345k parallel nodes) grown from
    `llama3-ly2-dp4pp4tp8mb8`: every one of its 128 units is checked, 4 kept, and it is
    equivalent, as its source is."""
    single, parallel = _grown(_read("llama3-ly2-dp4pp4tp8mb8"), 16)
    assert len(parallel["nodes"]) == 345_088 and parallel["world"]["ranks"] == 512
    report = verify_plans(plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel"),
                          Options(jobs=1))
    assert report.verdict == "equivalent"
    fold = report.fold
    assert fold is not None and (fold["replicas"], fold["micro_batches"]) == (16, 8)
    assert fold["kept_units"] == 4 and not fold["exceptions"]
