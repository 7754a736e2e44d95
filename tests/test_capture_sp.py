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
from capture_helpers import line_of as _line_of, sources as _sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SP = os.path.join(EXAMPLES, "sequence_parallel.py")
PROVE = Options(jobs=1, timeout=10)
# a planted bug is found by evaluating both plans at random points; the solver's timeout
# only bounds each of the driver's rounds
REFUTE = Options(jobs=1, timeout=1)


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
    report = _violation_at(SP, "no-norm-grad-allreduce", "h = self.norm(x)", monkeypatch,
                           tensor="grad.norm.weight")
    # the summary's first code line of the gradient failure is where the norm is used (its
    # backward nodes only carry the line of loss.backward())
    from io import StringIO

    from rich.console import Console

    from tvsmt.report.render import render

    out = StringIO()
    render(report, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    grad = text[text.index("grad.norm."):]
    first_code = grad[grad.index("  code "):].splitlines()[0]
    assert first_code.endswith(f"sequence_parallel.py:{_line_of(SP, 'h = self.norm(x)')}: "
                               "h = self.norm(x)"), first_code


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


# ----------------------------------------------------------------------------- collective forms

FORMS_SCRIPT = '''
import os
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

WORLD_SIZE = 2
FORM = os.environ["TVSMT_FORM"]
AVG = dist.ReduceOp.AVG


def build_single():
    return torch.nn.Linear(4, 4, bias=False), torch.randn(4, 4)


def build_rank(rank):
    full, x = build_single()
    return full, x[2 * rank:2 * rank + 2]          # data parallel: two rows per rank


def average(g):
    """The mean of both ranks' gradients, written with the collective form under test."""
    n = dist.get_world_size()
    if FORM == "async_avg":
        dist.all_reduce(g, op=AVG, async_op=True).wait()
        return g
    if FORM == "gather_tensor":
        out = torch.empty(n * 4, 4)
        dist.all_gather_into_tensor(out, g)
        return (out[:4] + out[4:]) / n
    if FORM == "gather_list":
        outs = [torch.empty_like(g) for _ in range(n)]
        dist.all_gather(outs, g)
        return (outs[0] + outs[1]) / n
    if FORM == "scatter_tensor":
        part = torch.empty(2, 4)
        dist.reduce_scatter_tensor(part, g)
        out = torch.empty(4, 4)
        dist.all_gather_into_tensor(out, part)
        return out / n
    if FORM == "scatter_list":
        part = torch.empty(2, 4)
        dist.reduce_scatter(part, list(g.chunk(n)), op=AVG)
        outs = [torch.empty_like(part) for _ in range(n)]
        dist.all_gather(outs, part)
        return torch.cat(outs)
    if FORM == "all_to_all_single":
        mixed = torch.empty_like(g)
        dist.all_to_all_single(mixed, g)
        out = torch.empty(4, 4)
        dist.all_gather_into_tensor(out, mixed[:2] + mixed[2:])
        return out / n
    if FORM == "all_to_all_list":
        outs = [torch.empty(2, 4) for _ in range(n)]
        dist.all_to_all(outs, [c.contiguous() for c in g.chunk(n)])
        out = torch.empty(4, 4)
        dist.all_gather_into_tensor(out, outs[0] + outs[1])
        return out / n
    if FORM == "broadcast":
        dist.all_reduce(g)
        dist.broadcast(g, src=1)
        return g / n
    if FORM == "functional":
        w = dist.group.WORLD
        mean = fc.all_gather_tensor(fc.reduce_scatter_tensor(g, "avg", 0, w), 0, w)
        mixed = fc.all_to_all_single(mean, None, None, w)   # [mean_r; mean_r] on rank r
        again = fc.all_gather_tensor(mixed[:2], 0, w)
        return fc.broadcast(fc.all_reduce(again, "sum", w) / n, 1, w)
    if FORM == "wrong":                            # rank 0's gradient only: a bug
        out = torch.empty(n * 4, 4)
        dist.all_gather_into_tensor(out, g)
        return out[:4] * 1.0
    raise ValueError(FORM)


def train_step(model, x):
    loss = (model(x) ** 2).mean()
    loss.backward()
    if dist.get_world_size() > 1:
        model.weight.grad = average(model.weight.grad)
    return None
'''

FORMS = {"async_avg": "all_reduce_avg", "gather_tensor": "all_gather",
         "gather_list": "broadcast", "scatter_tensor": "reduce_scatter",
         "scatter_list": "reduce_scatter_avg", "all_to_all_single": "all_to_all",
         "all_to_all_list": "all_to_all", "broadcast": "broadcast",
         "functional": "reduce_scatter_avg"}


@pytest.fixture(scope="module")
def forms_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("forms") / "forms.py"
    path.write_text(FORMS_SCRIPT)
    return str(path)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_collective_form_is_converted_and_proven(forms_script, monkeypatch, form):
    monkeypatch.setenv("TVSMT_FORM", form)
    pair = capture(forms_script)
    assert FORMS[form] in _ops(pair), _ops(pair)
    report = check_pair(pair, PROVE)
    assert report.verdict == "equivalent", [f.message for f in report.failures]


def test_collective_forms_can_fail(forms_script, monkeypatch):
    monkeypatch.setenv("TVSMT_FORM", "wrong")
    assert check(forms_script, REFUTE).verdict == "violation"


def test_subgroup_collectives_resolve_group_ranks(tmp_path):
    """c10d takes the root of a broadcast as a rank of its group: the plan names the global
    rank (group [2, 3], src 3 is the group's rank 1)."""
    path = _script(tmp_path, """
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc
        WORLD_SIZE = 4
        def build_single():
            return torch.nn.Linear(4, 4, bias=False), torch.randn(4, 4)
        def build_rank(rank):
            full, x = build_single()
            return full, x[rank:rank + 1]
        def train_step(model, x):
            loss = (model(x) ** 2).sum()
            loss.backward()
            if dist.get_world_size() == 1:
                return None
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            r = dist.get_rank()
            mine, other = pairs[r // 2], across[r % 2]
            g = model.weight.grad
            dist.all_reduce(g, group=mine)
            dist.broadcast(g, src=2 * (r // 2) + 1, group=mine)
            g = fc.broadcast(fc.all_reduce(g, "sum", other), 1, other)
            model.weight.grad = g
            return None
        """)
    pair = capture(path)
    roots = sorted({(tuple(n["attrs"]["ranks"]), n["attrs"]["src"]) for n in pair.parallel["nodes"]
                    if n["op"] == "broadcast"})
    assert roots == [((0, 1), 1), ((0, 2), 2), ((1, 3), 3), ((2, 3), 3)]
    assert check_pair(pair, PROVE).verdict == "equivalent"


@pytest.mark.parametrize("call,message", [
    ("dist.all_reduce(g, op=dist.ReduceOp.MIN)", "reduction MIN is not supported"),
    ("dist.reduce_scatter_tensor(torch.empty(2, 4), g, op=dist.ReduceOp.MAX)",
     "reduce_scatter with reduction max is not supported"),
    ("dist.all_to_all_single(torch.empty(4, 4), g, [1, 3], [1, 3])",
     r"split sizes \[1, 3\] are not 2 equal pieces"),
])
def test_unsupported_collective_forms_name_the_line(tmp_path, call, message):
    path = _script(tmp_path, f"""
        import torch
        import torch.distributed as dist
        WORLD_SIZE = 2
        def build_single():
            return torch.nn.Linear(4, 4, bias=False), torch.randn(2, 4)
        def build_rank(rank):
            return build_single()
        def train_step(model, x):
            loss = model(x).sum()
            loss.backward()
            g = model.weight.grad
            if dist.get_world_size() > 1:
                {call}
            return loss
        """)
    line = _line_of(path, call)
    with pytest.raises(InputError, match=rf"rank 0 at .*train.py:{line}: .*{message}"):
        capture(path)
