"""Capture of sequence parallelism, vocabulary-parallel embedding and cross entropy, and
pipeline send/recv (examples/sequence_parallel.py, vocab_parallel.py, pipeline_mlp.py): each
example is equivalent as written, each planted bug is a violation that names the user's
line; plus one small capture test per collective form the converter takes."""

from __future__ import annotations

import os
import textwrap

import pytest

from tvsmt.capture import capture, check
from tvsmt.capture.driver import check_pair
from tvsmt.errors import InputError
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SP = os.path.join(EXAMPLES, "sequence_parallel.py")
PROVE = Options(jobs=1, timeout=5)
# a planted bug is found by evaluating both plans at random points; the solver's timeout
# only bounds each of the driver's rounds
REFUTE = Options(jobs=1, timeout=1)


def _line_of(path: str, text: str) -> int:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(text)


def _sources(report) -> set[str]:
    return {n.get("source") for f in report.failures for n in f.parallel_nodes + f.single_nodes
            if n.get("source")}


def _clean(monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)


def _ops(pair, kind="parallel") -> list[str]:
    return [n["op"] for n in pair.__dict__[kind]["nodes"]]


def _violation_at(path: str, bug: str, marker: str, monkeypatch, tensor: str | None = None):
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(path, REFUTE)
    assert report.verdict == "violation", [f.message for f in report.failures]
    line = _line_of(path, marker)
    name = os.path.basename(path)
    assert any(s.endswith(f"{name}:{line}") for s in _sources(report)), _sources(report)
    if tensor is not None:
        assert any(f.tensor == tensor for f in report.failures), [f.tensor for f in
                                                                   report.failures]
    return report


# ----------------------------------------------------------------------------- sequence parallel


def test_sequence_parallel_is_equivalent(monkeypatch):
    _clean(monkeypatch)
    pair = capture(SP)
    ops = _ops(pair)
    # forward all-gather + reduce-scatter, backward the other way round, on both ranks
    assert ops.count("all_gather") == 4 and ops.count("reduce_scatter") == 4
    assert all(n["attrs"]["ranks"] == [0, 1] for n in pair.parallel["nodes"]
               if n["op"] in ("all_gather", "reduce_scatter"))
    report = check_pair(pair, PROVE)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    x = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    assert x[("batch", 1)] == [[2, 4], [0, 2], [0, 4]]  # the second half of the sequence


def test_sequence_parallel_missing_norm_grad_allreduce_is_a_violation(monkeypatch):
    _violation_at(SP, "no-norm-grad-allreduce", "h = self.norm(x)", monkeypatch,
                  tensor="grad.norm.weight")


# ----------------------------------------------------------------------------- vocab parallel

VP = os.path.join(EXAMPLES, "vocab_parallel.py")


def test_vocab_parallel_is_equivalent(monkeypatch):
    _clean(monkeypatch)
    pair = capture(VP)
    nodes = pair.parallel["nodes"]
    maxes = [n for n in nodes if n["op"] == "all_reduce_max"]
    assert len(maxes) == 2 and all(len(n["inputs"]) == 2 for n in maxes)
    # token ids and masks keep their dtype in the references (index/index_put read it)
    refs = [a for n in nodes if n["op"] == "aten.index_put.default"
            for a in n["attrs"]["args"][1]]
    assert {r.get("dtype") for r in refs} >= {"torch.bool", "torch.int64"}
    # the lifted 0-d constants of `x[mask] = 0` are `full` nodes
    assert any(n["op"] == "aten.full.default" for n in nodes)
    report = check_pair(pair, PROVE)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    ids = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    assert ids[("batch.0", 1)] == [[0, 4]]  # token ids replicated
    assert ids[("param.embed.weight", 1)] == [[4, 8], [0, 4]]  # the second vocabulary range


def test_vocab_parallel_local_max_is_a_violation(monkeypatch):
    _violation_at(VP, "local-max", "logits_max = torch.max(logits, dim=-1)[0]", monkeypatch,
                  tensor="loss")
