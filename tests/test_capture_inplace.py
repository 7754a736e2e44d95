"""What the capture makes of memory written in place (tvsmt/capture/trace.py), as Megatron-Core
writes it: an out= form (`torch.exp(x, out=x)`), a whole view written in place and its base
read afterwards (the attention scores masked through a view of the batched matmul's
result), uninitialised memory that `baddbmm(beta=0)` ignores, `.data` assigned (Megatron's
make_viewless_tensor), parts of a tensor written through contiguous views and read through
others (DeepSpeed's gradient bucket). Each captured program, run on the traced inputs, gives
the loss and gradients eager torch gives; a view that is not contiguous written in place, a
part never written read, and uninitialised memory that is read stay one-line input
errors."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tvsmt.capture import check
from tvsmt.capture.execute import run
from tvsmt.capture.script import load_script
from tvsmt.capture.trace import build, trace_program
from tvsmt.errors import InputError
from tvsmt.verify import Options

HEADER = """
import torch
WORLD_SIZE = 2


class ExpInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        torch.exp(y, out=y)  # Megatron's cross entropy writes its exponentials so
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Viewless(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # as Megatron-Core's make_viewless_tensor
        out = torch.empty((1,), dtype=x.dtype)
        out.data = x.data
        return out

    @staticmethod
    def backward(ctx, g):
        return g


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
{forward}


def build_single():
    return Model(), torch.randn(2, 4)


def build_rank(rank):
    return build_single()


def train_step(model, x):
    loss = model(x)
    loss.backward()
    return loss
"""

CASES = {
    "out-form": """
        h = self.lin(x)
        return ExpInPlace.apply(h).sum()
""",
    "whole-view-written": """
        b = self.lin(x) * 1.0
        v = b.view(2, 2, 2)
        v.masked_fill_(v > 0.5, -3.0)  # in place through a view of all of b
        return (b * b).sum()  # b read after its view was written
""",
    "data-assigned": """
        h = Viewless.apply(self.lin(x) * 1.0)  # torch.empty given its values by `.data =`
        return (h * h).sum()
""",
    "reused-buffer-ignored-by-baddbmm": """
        h = self.lin(x).view(1, 2, 4)
        buf = torch.empty(8)
        buf[0:8].copy_(h.reshape(-1))  # the buffer written through a view, then reused
        scores = torch.baddbmm(buf[0:4].view(1, 2, 2), h, h.transpose(1, 2), beta=0.0)
        return torch.softmax(scores, dim=-1).sum() + scores.sum()
""",
    "empty-transposed-ignored-by-baddbmm": """
        h = self.lin(x).view(1, 2, 4)
        buf = torch.empty(1, 2, 2).transpose(1, 2)  # any view of uninitialised memory
        scores = torch.baddbmm(buf, h, h.transpose(1, 2), beta=0.0)
        return torch.softmax(scores, dim=-1).sum() + scores.sum()
""",
    "partial-view-written": """
        b = self.lin(x) * 1.0
        b[0].mul_(2.0)  # a part of b written in place, through a contiguous view
        return (b * b).sum()  # b read afterwards: its other part as it was
""",
    "buffer-filled-through-views": """
        h = self.lin(x)
        buf = torch.empty(16)  # a gradient bucket, as DeepSpeed's contiguous gradients
        buf.narrow(0, 0, 8).copy_(h.reshape(-1))
        buf.narrow(0, 8, 4).copy_(h[0] * 2.0)
        buf.narrow(0, 0, 12).mul_(0.5)  # the filled part averaged in place
        return (buf.narrow(0, 0, 8).view(2, 4) * h).sum() + buf[8:12].sum()
""",
    "stale-views-of-a-buffer-written-again": """
        buf = torch.empty(8)  # as FSDP2's unsharded parameter: gathered, viewed and saved
        buf.copy_(self.lin(x).reshape(-1))  # for the backward, then gathered again into the
        w = buf.as_strided((2, 4), (4, 1), 0).detach().t()  # same memory, which the saved
        buf.copy_((self.lin(x) * 3.0).reshape(-1))  # views read
        return (w * w).sum() + (buf * w.t().reshape(-1)).sum()
""",
    "as-strided-ranges": """
        flat = self.lin(x).reshape(-1) * 1.0  # as FSDP2's views of each parameter's part
        a = flat.as_strided((2, 2), (2, 1), 2)  # of its reduce-scatter's flat output
        b = flat[1:7].as_strided((3,), (1,), 4)  # (offsets count from the storage's start)
        return (a * a).sum() + (b * flat[0:3]).sum()
""",
    "empty-ignored-by-baddbmm": """
        h = self.lin(x).view(1, 2, 4)
        buf = torch.empty(8)[0:4].view(1, 2, 2)  # uninitialised, as Megatron's buffer
        scores = torch.baddbmm(buf, h, h.transpose(1, 2), beta=0.0, alpha=0.5)
        return torch.softmax(scores, dim=-1).sum() + scores.sum()
""",
}


def _script(tmp_path, forward: str) -> str:
    body = HEADER.replace("{forward}", textwrap.indent(textwrap.dedent(forward), " " * 8))
    path = tmp_path / "train.py"
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_written_in_place_is_captured_as_torch_computes_it(tmp_path, case):
    sc = load_script(_script(tmp_path, CASES[case]))
    program = trace_program(sc, None)
    values = run([(0, n) for n in program.nodes], {i.id: i.draws[0] for i in program.inputs})
    model, x = build(sc, None, 0)  # draw 0 again: the inputs the trace recorded
    loss = sc.train_step(model, x)
    # the capture runs in float64, eager torch here in float32
    assert torch.allclose(values[program.loss], loss.detach().double(), rtol=1e-6), case
    for name, p in model.named_parameters():
        assert torch.allclose(values[program.grads[name]], p.grad.double(), rtol=1e-6,
                              atol=1e-7), (case, name)


@pytest.mark.parametrize("forward,refusal", [
    ("""
        b = self.lin(x) * 1.0
        b.t()[0].mul_(2.0)  # a view that is not contiguous written in place
        return (b * b).sum()
""", "through an alias"),
    ("""
        buf = torch.empty(2, 4)
        return (self.lin(x) + buf).sum()  # uninitialised memory read
""", r"train.py:\d+: aten.add.Tensor reads uninitialised memory \(torch.empty at "
     r"train.py:\d+\)"),
    ("""
        buf = torch.empty(8)[0:4].view(2, 2)  # read through views
        return (self.lin(x)[:, :2] * buf).sum()
""", "aten.mul.Tensor reads uninitialised memory"),
    ("""
        h = self.lin(x)
        buf = torch.empty(8)
        buf[0:4].copy_(h.reshape(-1)[:4])  # half written through a view ...
        return (buf[0:8].view(2, 4) * h).sum()  # ... and read whole: half uninitialised
""", "after an in-place operation changed it through an alias"),
    ("""
        buf = torch.empty(2, 4)
        torch.distributed.all_reduce(buf)  # a collective reading uninitialised memory
        return (self.lin(x) + buf).sum()
""", "all_reduce reads uninitialised memory"),
])
def test_what_the_capture_cannot_follow_is_refused_in_one_line(tmp_path, forward, refusal):
    with pytest.raises(InputError, match=refusal) as e:
        check(_script(tmp_path, forward), Options(jobs=1, timeout=3))
    assert "\n" not in str(e.value)


def test_a_captured_node_that_fails_to_run_is_named_with_its_line():
    from tvsmt.capture.program import CapNode, Ref
    from tvsmt.errors import InternalError

    mm = CapNode("mm_1", "aten.mm.default", ["a", "b"], ["c"], {}, source="train.py:12",
                 call=(torch.ops.aten.mm.default, (Ref(0), Ref(1)), {}))
    with pytest.raises(InternalError, match=r"rank 1, node mm_1 \(aten.mm.default\) at "
                                            r"train.py:12: RuntimeError: "):
        run([(1, mm)], {"a": torch.ones(2, 3), "b": torch.ones(2, 3)})


def test_as_strided_ranges_are_verified_as_slices(tmp_path):
    """`as_strided` picking a contiguous range of a contiguous tensor becomes a slice of the
    flattened tensor and a view (`_Converter.as_strided_range`), which the verifier models
    (it models as_strided only as a whole reshape): such a step is verified, and the same
    step with a range one element off on rank 1 is a violation."""
    body = HEADER.replace("{forward}", textwrap.indent(textwrap.dedent("""
        flat = self.lin(x).reshape(-1) * 1.0
        start = 3 if OFF and torch.distributed.get_rank() == 1 else 2
        return (flat.as_strided((2, 2), (2, 1), start) ** 2).sum()
"""), " " * 8))
    path = tmp_path / "train.py"
    path.write_text("OFF = False\n" + body)
    program = trace_program(load_script(str(path)), None)
    strided = [n.attrs["args"] for n in program.nodes if n.op == "aten.as_strided.default"]
    assert all(a[1:] == [[8], [1], 0] for a in strided), strided  # whole reshapes only
    assert check(str(path), Options(jobs=1, timeout=5)).verdict == "equivalent"
    path.write_text("OFF = True\n" + body)
    assert check(str(path), Options(jobs=1, timeout=5)).verdict == "violation"
