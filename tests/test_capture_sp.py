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


# ----------------------------------------------------------------------------- pipeline

PP = os.path.join(EXAMPLES, "pipeline_mlp.py")


def test_pipeline_is_equivalent_with_sends_paired_into_moves(monkeypatch):
    _clean(monkeypatch)
    pair = capture(PP)
    moves = [n for n in pair.parallel["nodes"] if n["op"] == "move"]
    # two micro-batches: two activations 0 -> 1, two gradients 1 -> 0
    assert sorted((n["attrs"]["src"], n["attrs"]["dst"], n["rank"]) for n in moves) == [
        (0, 1, 1), (0, 1, 1), (1, 0, 0), (1, 0, 0)]
    assert all(len(n["inputs"]) == 1 and n["inputs"][0].startswith(f"r{n['attrs']['src']}:")
               for n in moves)
    assert "send" not in _ops(pair)
    report = check_pair(pair, PROVE)
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    claims = {lin["single"]: {p["sum_of"][0].split(":")[0] for p in lin["parts"]}
              for lin in pair.parallel["lineages"] if lin["single"].startswith("grad.")}
    assert claims["grad.fc1.weight"] == {"r0"} and claims["grad.fc2.weight"] == {"r1"}


@pytest.mark.parametrize("bug,marker", [("grad-order", "h.backward(g)"),
                                        ("no-grad-send", "g = torch.zeros_like(h)")])
def test_pipeline_bugs_are_violations_at_the_users_line(monkeypatch, bug, marker):
    _violation_at(PP, bug, marker, monkeypatch, tensor="grad.fc1.weight")


def _script(tmp_path, body: str, name="train.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


P2P_SCRIPT = """
    import torch
    import torch.distributed as dist
    WORLD_SIZE = 2
    class Half(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            setattr(self, name, torch.nn.Linear(4, 4, bias=False))
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
    def build_single():
        return Both(), torch.randn(2, 4)
    def build_rank(rank):
        full, x = build_single()
        m = Half("a" if rank == 0 else "b")
        m.load_state_dict({k: v for k, v in full.state_dict().items()
                           if k.startswith("a" if rank == 0 else "b")})
        return m, x
    def single_step(model, x):
        loss = model.b(model.a(x)).sum()
        loss.backward()
        return loss
    def train_step(model, x):
        if dist.get_rank() == 0:
            h = model.a(x)
            dist.send(h.detach(), dst=1)
            SEND_AGAIN
            g = torch.empty(RECV_SHAPE)
            dist.recv(g, src=1)
            h.backward(g.reshape(2, 4))
            return None
        h = torch.empty(2, 4)
        dist.recv(h, src=0)
        h.requires_grad_(True)
        loss = model.b(h).sum()
        loss.backward()
        dist.send(h.grad, dst=0)
        return loss
"""


def test_point_to_point_script_is_equivalent(tmp_path):
    path = _script(tmp_path, P2P_SCRIPT.replace("SEND_AGAIN", "pass")
                   .replace("RECV_SHAPE", "2, 4"))
    assert check(path, PROVE).verdict == "equivalent"


def test_unpaired_send_names_rank_and_line(tmp_path):
    path = _script(tmp_path, P2P_SCRIPT.replace("SEND_AGAIN", "dist.send(h.detach(), dst=1)")
                   .replace("RECV_SHAPE", "2, 4"))
    line = _line_of(path, "dist.send(h.detach(), dst=1)") + 1
    with pytest.raises(InputError, match=rf"rank 0 at .*train.py:{line}: send #1 sends to "
                                         r"rank 1 .* no partner"):
        capture(path)


def test_send_and_recv_of_other_shapes_are_refused(tmp_path):
    path = _script(tmp_path, P2P_SCRIPT.replace("SEND_AGAIN", "pass")
                   .replace("RECV_SHAPE", "4, 2"))
    line = _line_of(path, "dist.recv(g, src=1)")
    with pytest.raises(InputError, match=rf"rank 0 at .*train.py:{line}: receives a \[4, 2\] "
                                         r"tensor but the paired send of rank 1"):
        capture(path)


def test_a_parameter_no_rank_holds_is_refused(tmp_path):
    """A rank may lack a parameter (a pipeline stage), but some rank must hold it all."""
    path = _script(tmp_path, """
        import torch
        WORLD_SIZE = 2
        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4, bias=False)
                self.b = torch.nn.Linear(4, 4, bias=False)
        class One(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4, bias=False)
        def build_single():
            return Two(), torch.randn(2, 4)
        def build_rank(rank):
            full, x = build_single()
            m = One()
            m.a.load_state_dict(full.a.state_dict())
            return m, x
        def single_step(model, x):
            loss = model.b(model.a(x)).sum()
            loss.backward()
            return loss
        def train_step(model, x):
            loss = model.a(x).sum()
            loss.backward()
            return loss
        """)
    with pytest.raises(InputError, match="no rank holds parameter b.weight"):
        capture(path)
