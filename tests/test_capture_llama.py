"""The Llama block capture (examples/llama_block.py: RMSNorm, rotary, causal attention, SiLU
MLP, tp2 x dp2, 2 micro-batches of gradient accumulation): equivalent as written, each
planted bug a violation whose first failure shows the user's line, micro-batches and the
dp x tp world read from the code, and the shortcuts that make it fast each still catching
what they must."""

from __future__ import annotations

import os

import pytest

from tvsmt.capture import capture, check_pair
from tvsmt.capture.build import world_layout
from tvsmt.capture.lineages import covers
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama_block.py")
OPTS = Options(jobs=1, timeout=20)


def _line_of(text: str) -> int:
    with open(LLAMA, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(text)


@pytest.fixture(scope="module")
def llama_pair():
    os.environ.pop("TVSMT_BUG", None)
    return capture(LLAMA)


def test_llama_block_is_equivalent_in_one_round(llama_pair):
    report = check_pair(llama_pair, OPTS)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert report.hypotheses["rounds"] == 1 and report.hypotheses["dropped"] == 0
    assert report.hypotheses["kept"] > 100
    assert llama_pair.witnessed == {}


def test_world_and_micro_batches_come_from_the_code(llama_pair):
    world = llama_pair.parallel["world"]
    assert (world["dp"], world["tp"], world["pp"], world["mb"]) == (2, 2, 1, 2)
    line = _line_of("loss.backward()")
    backward = [n for n in llama_pair.parallel["nodes"]
                if (n.get("source") or "").endswith(f"llama_block.py:{line}")]
    assert {n["mb"] for n in backward} == {0, 1}
    sync = [n for n in llama_pair.parallel["nodes"] if n["op"] == "all_reduce_avg"]
    assert sync and {n["mb"] for n in sync} == {-1}  # gradient sync: no micro-batch


def test_every_hypothesis_covers_its_single_tensor_with_one_scale(llama_pair):
    shapes = {t: tuple(v["shape"]) for t, v in llama_pair.single["tensors"].items()}
    hyps = [lin for lin in llama_pair.parallel["lineages"] if lin.get("hypothesis")]
    assert hyps
    for lin in hyps:
        assert covers(shapes[lin["single"]], [tuple(map(tuple, p["slice"]))
                                              for p in lin["parts"]]), lin["single"]
        assert len({tuple(p.get("scale") or ()) for p in lin["parts"]}) == 1, lin["single"]


@pytest.mark.parametrize("bug,marker", [
    ("wrong-group", "dist.all_reduce(p.grad, op=op, group=group)"),
    ("sum-not-average", "dist.all_reduce(p.grad, op=op, group=group)"),
    ("per-microbatch", "return (out * out).mean()"),
])
def test_llama_bugs_are_violations_at_the_users_line(monkeypatch, bug, marker):
    monkeypatch.setenv("TVSMT_BUG", bug)
    pair = capture(LLAMA)
    report = check_pair(pair, OPTS)
    assert report.verdict == "violation"
    first = report.failures[0]
    assert first.kind == "counterexample" and "concrete run" in first.message
    line = _line_of(marker)
    sources = [n.get("source") or "" for n in first.parallel_nodes]
    assert any(s.endswith(f"llama_block.py:{line}") for s in sources), sources


def test_a_witnessed_claim_that_the_solver_proves_is_never_a_pass(llama_pair):
    """The concrete run's witness only keeps a failing claim's stage small; if it ever
    disagreed with a proof, the run is inconclusive, not equivalent."""
    import copy

    pair = copy.copy(llama_pair)
    pair.witnessed = {"grad.o.weight": "on the concrete run (planted by the test) it differs"}
    report = check_pair(pair, OPTS)
    assert report.verdict == "inconclusive"
    assert any("contradicts the real programs" in f.message for f in report.failures)


def test_world_layout_needs_exactly_one_fit():
    mesh, how = world_layout(4, [(0, 1), (2, 3), (0, 2), (1, 3)])
    assert (mesh.dp, mesh.tp) == (2, 2) and "from the groups" in how
    # one group over the whole world fits dp=1 x tp=2 and dp=2 x tp=1: nothing assumed
    mesh, how = world_layout(2, [(0, 1)])
    assert (mesh.dp, mesh.tp) == (1, 2) and "none is assumed" in how
    mesh, how = world_layout(4, [(0, 3)])  # fits no mesh
    assert (mesh.dp, mesh.tp) == (1, 4) and "none is assumed" in how
