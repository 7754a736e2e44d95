"""Optimizer steps and gradient clipping in the capture: a train_step that ends with
`optimizer.step()` is verified on the parameters it leaves (`updated.<name>` claims) as well
as on the loss and the (clipped) gradients; torch's optimizers (SGD, SGD with momentum,
Adam, AdamW) and clipping by the global norm (torch.nn.utils.clip_grad_norm_, or Megatron's
way over the tensor-parallel group) are captured as torch runs them (their composite ATen
ops as torch's own decompositions, its profiler marks skipped), and each planted bug is a
violation at the user's line."""

from __future__ import annotations

import os
import re

import pytest
import torch
from capture_helpers import (DATA_PARALLEL_AVERAGES, TWO_LAYER_SCRIPT, line_of, proven_tensors,
                            sources, write_script)

from tvsmt.capture import capture_pair, check
from tvsmt.capture.execute import run
from tvsmt.capture.script import load_script
from tvsmt.capture.trace import build, trace_program
from tvsmt.errors import InputError, StructuralViolation
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "optimizer_step.py")

DATA_PARALLEL = TWO_LAYER_SCRIPT + """
OPTIMIZER = os.environ.get("OPTIMIZER", "sgd")
FOREACH = True if os.environ.get("FOREACH") else None  # torch's default: loops on CPU
AUTOCAST = bool(os.environ.get("AUTOCAST"))  # the forward in bfloat16


def build_rank(rank):
    model, x = build_single()
    return model, x[rank * 2:(rank + 1) * 2]


def _optimizer(model):
    lr = 0.2 if BUG == "lr-on-rank-1" and dist.get_rank() == 1 else 0.1
    if OPTIMIZER == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, foreach=FOREACH)
    if OPTIMIZER == "momentum":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=FOREACH)
    return torch.optim.SGD(model.parameters(), lr=lr, foreach=FOREACH)


def train_step(model, x):
    optimizer = _optimizer(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
        loss = model(x)
    loss.backward()
    average_gradients(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=FOREACH)
    if not (BUG == "no-step-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1):
        optimizer.step()
    if dist.is_initialized():  # the ranks' gradients are gone (as DeepSpeed's engine
        optimizer.zero_grad()  # leaves them), the single's kept: the parameters are claimed
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("TVSMT_BUG", "OPTIMIZER", "FOREACH", "AUTOCAST", "WARM"):
        monkeypatch.delenv(name, raising=False)


def _script(tmp_path) -> str:
    return write_script(tmp_path, DATA_PARALLEL)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_example_s_whole_step_is_equivalent(monkeypatch, optimizer):
    monkeypatch.setenv("OPTIMIZER", optimizer)
    report = check(EXAMPLE, Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    proven = proven_tensors(report)
    for name in ("proj.weight", "fc1.weight", "fc2.weight"):
        assert f"updated.{name}" in proven and f"grad.{name}" in proven, sorted(proven)


@pytest.mark.parametrize("bug, line, wrong", [
    ("local-norm", "p.grad.mul_(coef)", "grad."),
    ("clip-before-reduce", "p.grad.mul_(coef)", "grad."),
    ("lr-on-one-rank", "    optimizer.step()", "updated."),
])
def test_the_example_s_bugs_are_violations_at_their_lines(monkeypatch, bug, line, wrong):
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(EXAMPLE, Options(jobs=1, timeout=30))
    assert report.verdict == "violation", [f.message for f in report.failures]
    tensors = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert any(t.startswith(wrong) for t in tensors), tensors
    at = f"optimizer_step.py:{line_of(EXAMPLE, line)}"
    assert any(s.endswith(at) for s in sources(report)), sources(report)


@pytest.mark.parametrize("optimizer, foreach", [("sgd", ""), ("momentum", ""), ("adamw", ""),
                                                ("sgd", "1"), ("adamw", "1")])
def test_torch_s_clipping_and_optimizers_with_gradients_zeroed(tmp_path, monkeypatch,
                                                              optimizer, foreach):
    """clip_grad_norm_ and an optimizer, then zero_grad on the ranks: the updated parameters
    are the claims, and each is proven; also with foreach=True (torch's foreach kernels,
    traced as their per-tensor loops: `tvsmt.capture.foreach`)."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("FOREACH", foreach)
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    proven = proven_tensors(report)
    assert {f"updated.{n}" for n in ("fc1.weight", "fc1.bias", "fc2.weight",
                                     "fc2.bias")} <= proven, sorted(proven)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_wrong_learning_rate_in_a_foreach_step_is_a_violation(tmp_path, monkeypatch,
                                                               optimizer):
    """The per-tensor loops keep what each rank's foreach kernel does: rank 1 stepping at
    twice the learning rate is a violation of the updated parameters."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("FOREACH", "1")
    monkeypatch.setenv("TVSMT_BUG", "lr-on-rank-1")
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert any(f.tensor.startswith("updated.") for f in report.failures), \
        [f.tensor for f in report.failures]


@pytest.mark.parametrize("bug", ["", "lr-on-rank-1"])
def test_a_bfloat16_forward_is_checked_over_the_reals(tmp_path, monkeypatch, bug):
    """bf16 autocast on both sides: the proof is over the reals, and the concrete run that
    checks it runs in float64 (`capture/execute.py`), so bf16's rounding (1e-5 to 1e-2
    apart between the single and the ranks' runs) is no contradiction: equivalent, where it
    was inconclusive. A wrong learning rate on rank 1 is still a violation."""
    monkeypatch.setenv("AUTOCAST", "1")
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    if not bug:
        assert report.verdict == "equivalent", [f.message for f in report.failures]
        assert {f"updated.{n}" for n in ("fc1.weight", "fc2.weight")} <= proven_tensors(report)
    else:
        assert report.verdict == "violation", [f.message for f in report.failures]
        assert any(f.tensor.startswith("updated.") for f in report.failures)


# The optimizer built with the model, once, as training code builds it (held by a module
# that wraps the model), stepped in train_step; WARM steps it once when it is built, so the
# traced step reads its state (momentum buffers; Adam's moments and step counter).
BUILT_OPTIMIZER = TWO_LAYER_SCRIPT + """
WARM = bool(os.environ.get("WARM"))
OPTIMIZER = os.environ.get("OPTIMIZER", "sgd")
OFFSET = torch.ones(2)  # a tensor of the script's own, made at import


class Trainer(torch.nn.Module):
    def __init__(self, model, lr):
        super().__init__()
        self.model = model
        if OPTIMIZER == "adamw":
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        else:
            self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _built(rank):
    model, x = Model(), torch.randn(4, 4)
    trainer = Trainer(model, 0.1)
    if WARM:
        model(x).backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        if BUG == "state-on-rank-1" and rank == 1:
            state = trainer.optimizer.state[model.fc1.weight]
            state["exp_avg" if OPTIMIZER == "adamw" else "momentum_buffer"].mul_(2)
    return trainer, x


def build_single():
    return _built(None)


def build_rank(rank):
    trainer, x = _built(rank)
    return trainer, x[rank * 2:(rank + 1) * 2]


def train_step(trainer, x):
    loss = trainer.model(x)
    if BUG == "module-level-tensor":
        loss = loss + (trainer.model.fc2.bias * OFFSET).sum()
    loss.backward()
    average_gradients(trainer)
    if BUG == "lr-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
        for group in trainer.optimizer.param_groups:
            group["lr"] = 0.2
    trainer.optimizer.step()
    if BUG == "state-left-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
        state = trainer.optimizer.state[trainer.model.fc1.weight]
        state["exp_avg" if OPTIMIZER == "adamw" else "momentum_buffer"].mul_(0.5)
    if BUG == "state-dropped-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
        trainer.optimizer.state.clear()
    trainer.optimizer.zero_grad()
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES


@pytest.mark.parametrize("optimizer, warm", [("sgd", ""), ("sgd", "1"), ("adamw", "1")])
@pytest.mark.parametrize("bug, verdict", [("", "equivalent"), ("lr-on-rank-1", "violation")])
def test_an_optimizer_built_with_the_model_is_stepped_in_the_trace(tmp_path, monkeypatch,
                                                                    optimizer, warm, bug,
                                                                    verdict):
    """Also after a step taken when it was built: its state is an input of the step, matched
    by value like the parameters (the momentum buffers; Adam's moments, its step counter a
    constant of the trace)."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("WARM", warm)
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(write_script(tmp_path, BUILT_OPTIMIZER), Options(jobs=1, timeout=30))
    assert report.verdict == verdict, [f.message for f in report.failures]
    states = {i["tensor"] for i in report.inputs if i["tensor"].startswith("state.")}
    want = {"momentum_buffer"} if optimizer == "sgd" else {"exp_avg", "exp_avg_sq"}
    assert {s.rsplit(".", 1)[1] for s in states} == (want if warm else set()), states
    if not bug:
        assert {"updated.model.fc1.weight", "updated.model.fc2.weight"} <= \
            proven_tensors(report)


@pytest.mark.parametrize("optimizer, warm", [("sgd", ""), ("sgd", "1"), ("adamw", "")])
def test_the_state_an_optimizer_leaves_for_the_next_step_is_claimed(tmp_path, monkeypatch,
                                                                     optimizer, warm):
    """The momentum buffers and Adam's moments after the step, made by it or updated in
    place, are claims (`updated.state.<parameter>.<key>`), each proven; a rank that leaves
    another momentum buffer or first moment for the next step, its parameters right, is a
    violation of that state at the line that changed it."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("WARM", warm)
    path = write_script(tmp_path, BUILT_OPTIMIZER)
    report = check(path, Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    keys = ["momentum_buffer"] if optimizer == "sgd" else ["exp_avg", "exp_avg_sq"]
    want = {f"updated.state.model.{p}.{k}" for p in ("fc1.weight", "fc1.bias", "fc2.weight")
            for k in keys}
    assert want <= proven_tensors(report), sorted(proven_tensors(report))
    monkeypatch.setenv("TVSMT_BUG", "state-left-on-rank-1")
    # at the run's timeout of 60 s: once the solver confirms the witnessed bug, the stages
    # merged to show its computation time out at the settled hypotheses' budget (3 s), not
    # at 60 s each (AdamW: 2 min 7 s before, 12 s after)
    report = check(path, Options(jobs=1, timeout=60))
    assert report.verdict == "violation", [f.message for f in report.failures]
    timeouts = [f.message for f in report.failures if f.kind == "inconclusive"]
    assert all("once a confirmed bug decides the verdict" in m for m in timeouts), timeouts
    state = f"updated.state.model.fc1.weight.{keys[0]}"
    wrong = {f.tensor: f.message for f in report.failures if f.kind == "counterexample"}
    assert "confirmed on the concrete run" in wrong.get(state, ""), wrong
    assert "parameter's value" not in wrong[state], wrong  # a state, not a parameter
    if warm:  # its state there before the step: compared by the step it took
        assert "the step from the optimizer state's value before it" in wrong[state], wrong
    # the update of fc1.weight assumed the wrong state's claim (the single step reads the
    # very tensor it leaves): its stage fails with it, and the report says so
    assert set(wrong) <= {state, "updated.model.fc1.weight"}, wrong
    if "updated.model.fc1.weight" in wrong:
        assert "assumed lineage" in wrong["updated.model.fc1.weight"] and \
            f"({state}), found wrong: this may only follow from it" in \
            wrong["updated.model.fc1.weight"], wrong
    at = f"train.py:{line_of(path, '.mul_(0.5)')}"
    assert any(s.endswith(at) for s in sources(report)), sources(report)


def test_state_one_rank_drops_after_the_step_is_a_violation(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM", "1")
    monkeypatch.setenv("TVSMT_BUG", "state-dropped-on-rank-1")
    path = write_script(tmp_path, BUILT_OPTIMIZER)
    with pytest.raises(StructuralViolation, match="only the single step leaves optimizer "
                                                  "state 'momentum_buffer' of model.fc1"):
        capture_pair(path)
    assert check(path, Options(jobs=1, timeout=30)).verdict == "violation"


# The same, the optimizer a global of the script's, as many training scripts keep it: the
# latest build's (build_rank assigns it for the rank being traced).
GLOBAL_OPTIMIZER = TWO_LAYER_SCRIPT + """
WARM = bool(os.environ.get("WARM"))
OPTIMIZER = None


def _built(rank):
    global OPTIMIZER
    model, x = Model(), torch.randn(4, 4)
    OPTIMIZER = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if WARM:
        model(x).backward()
        OPTIMIZER.step()
        OPTIMIZER.zero_grad()
    return model, x


def build_single():
    return _built(None)


def build_rank(rank):
    model, x = _built(rank)
    return model, x[rank * 2:(rank + 1) * 2]


def train_step(model, x):
    loss = model(x)
    loss.backward()
    average_gradients(model)
    if BUG == "lr-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
        for group in OPTIMIZER.param_groups:
            group["lr"] = 0.2
    OPTIMIZER.step()
    if BUG == "state-left-on-rank-1" and dist.is_initialized() and dist.get_rank() == 1:
        OPTIMIZER.state[model.fc1.weight]["momentum_buffer"].mul_(0.5)
    OPTIMIZER.zero_grad()
    return averaged_loss(loss)
""" + DATA_PARALLEL_AVERAGES


@pytest.mark.parametrize("warm, bug, verdict", [("1", "", "equivalent"),
                                                ("1", "lr-on-rank-1", "violation"),
                                                ("", "state-left-on-rank-1", "violation")])
def test_an_optimizer_the_script_keeps_in_a_global_is_found(tmp_path, monkeypatch, warm, bug,
                                                            verdict):
    """Its state is an input of the step (stepped when built) and what the step leaves is
    claimed, as for an optimizer the model holds; a global optimizer of another build (its
    parameters not the traced model's) is not taken."""
    monkeypatch.setenv("WARM", warm)
    monkeypatch.setenv("TVSMT_BUG", bug)
    path = write_script(tmp_path, GLOBAL_OPTIMIZER)
    report = check(path, Options(jobs=1, timeout=5))
    assert report.verdict == verdict, [f.message for f in report.failures]
    states = {i["tensor"] for i in report.inputs if i["tensor"].startswith("state.")}
    assert bool(states) == bool(warm), states
    if verdict == "equivalent":
        assert "updated.state.fc1.weight.momentum_buffer" in proven_tensors(report)
    if bug == "state-left-on-rank-1":
        assert "updated.state.fc1.weight.momentum_buffer" in {
            f.tensor for f in report.failures if f.kind == "counterexample"}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_rank_whose_optimizer_state_differs_is_refused(tmp_path, monkeypatch, optimizer):
    from tvsmt.errors import InputError

    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("WARM", "1")
    monkeypatch.setenv("TVSMT_BUG", "state-on-rank-1")
    with pytest.raises(InputError, match=r"model.fc1.weight:(exp_avg|momentum_buffer): rank 1's "
                                         r"tensor equals no block"):
        check(write_script(tmp_path, BUILT_OPTIMIZER), Options(jobs=1, timeout=30))


def test_a_tensor_of_the_script_s_own_is_refused_in_one_line(tmp_path, monkeypatch):
    """A tensor made at import that the step computes with is none of its inputs: the trace
    cannot take it as a value of every input, and the capture says so at the user's line
    (it said FakeTensorMode's "Please convert all Tensors to FakeTensors first" before)."""
    from tvsmt.errors import InputError

    monkeypatch.setenv("TVSMT_BUG", "module-level-tensor")
    path = write_script(tmp_path, BUILT_OPTIMIZER)
    with pytest.raises(InputError) as info:
        check(path, Options(jobs=1, timeout=30))
    message = str(info.value)
    assert "a tensor made before it that is none of its inputs" in message, message
    assert f"train.py:{line_of(path, '* OFFSET).sum()')}" in message, message
    assert "FakeTensor" not in message and "\n" not in message, message


def test_a_step_on_one_side_only_is_a_violation(tmp_path, monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "no-step-on-rank-1")
    with pytest.raises(StructuralViolation, match="only the single step updates parameter"):
        capture_pair(_script(tmp_path))
    report = check(_script(tmp_path), Options(jobs=1, timeout=30))
    assert report.verdict == "violation"


@pytest.mark.parametrize("optimizer, foreach", [("sgd", ""), ("adamw", ""), ("adamw", "1")])
def test_the_captured_step_leaves_the_parameters_torch_leaves(tmp_path, monkeypatch,
                                                             optimizer, foreach):
    """The captured single program, run on the traced inputs, gives the parameters eager
    torch's step gives (the decomposed norm, clamp and optimizer arithmetic included; with
    foreach=True, eager torch runs its foreach kernels, the capture their loops)."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("FOREACH", foreach)
    sc = load_script(_script(tmp_path))
    program = trace_program(sc, None)
    assert set(program.updated) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    values = run([(0, n) for n in program.nodes], {i.id: i.draws[0] for i in program.inputs})
    model, x = build(sc, None, 0)  # draw 0 again: the inputs the trace recorded
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sc.train_step(model, x)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), name
        assert torch.allclose(values[program.updated[name]], p.detach().double(), rtol=1e-5,
                              atol=1e-7), name


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_captured_second_step_leaves_the_parameters_torch_leaves(tmp_path, monkeypatch,
                                                                   optimizer):
    """The state of a step taken when the optimizer was built is read as torch reads it:
    the momentum buffers, Adam's moments and its step counter (bias corrections of step 2,
    not of a first step); the captured program gives eager torch's parameters."""
    monkeypatch.setenv("OPTIMIZER", optimizer)
    monkeypatch.setenv("WARM", "1")
    sc = load_script(write_script(tmp_path, BUILT_OPTIMIZER))
    program = trace_program(sc, None)
    assert any(i.kind == "state" for i in program.inputs)
    values = run([(0, n) for n in program.nodes], {i.id: i.draws[0] for i in program.inputs})
    trainer, x = build(sc, None, 0)  # draw 0 again: the inputs the trace recorded
    sc.train_step(trainer, x)
    for name, p in trainer.named_parameters():
        assert torch.allclose(values[program.updated[name]], p.detach().double(), rtol=1e-5,
                              atol=1e-7), name


@pytest.mark.parametrize("lr", [1e-4, 3e-6])
def test_a_wrong_step_of_a_small_learning_rate_is_witnessed_by_the_step_it_took(lr):
    """The concrete run compares an updated parameter by the step it took from its value
    before (`build.concrete_mismatches`' `before`), at the step's own scale: half the step at
    a learning rate of 1e-4 hides within the parameters' own tolerance, and at 3e-6 within
    any tolerance of absolute 1e-5, not within the step's; float32's rounding of a right step
    is no witness."""
    from tvsmt.capture.build import concrete_mismatches
    from tvsmt.capture.lineages import CapLineage, Part

    torch.manual_seed(0)
    p = 1 + torch.rand(4, 6, dtype=torch.float64)  # parameters of about 1
    g = torch.randn(4, 6, dtype=torch.float64)
    claim = [CapLineage("updated.w", [Part(((0, 4), (0, 6)), ("r0:updated.w",))], False, 0,
                        "claim")]
    single = {"updated.w": p - lr * g, "param.w": p}
    before = {"updated.w": "param.w"}
    half = {"r0:updated.w": (p - lr * 0.5 * g).float()}
    assert concrete_mismatches(claim, single, half) == {}  # by the values alone: hidden
    witness = concrete_mismatches(claim, single, half, before)
    assert "the step from the parameter's value before it" in witness["updated.w"], witness
    right = {"r0:updated.w": p.float() - (lr * g).float()}  # float32 all the way
    assert concrete_mismatches(claim, single, right, before) == {}


# Tensor parallelism over two ranks (fc1's rows and fc2's columns split, fc2's bias whole)
# with an optimizer of the script's own whose state is factored: a weight's squared gradient
# summed over its rows and over its columns, kept as (R, 1) and (1, C) as Adafactor keeps
# them (torch's Adafactor itself is refused: its step size reads the parameter's norm with
# `.item()`), the sums over a split dimension added up over the group. STATE=preconditioner
# keeps a Shampoo-like (R, R) product instead, of which a rank's is no block;
# STATE=torch-adafactor steps with torch's own.
FACTORED = """
import os
import torch
import torch.distributed as dist

WORLD_SIZE = 2
BUG = os.environ.get("TVSMT_BUG", "")
STATE = os.environ.get("STATE", "factored")


class Factored(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st, sq = self.state[p], p.grad * p.grad
                if p.dim() == 1:
                    st["v"] = sq
                    p.sub_(group["lr"] * p.grad * (1 + sq))
                    continue
                if STATE == "preconditioner":
                    st["left"] = p.grad @ p.grad.T
                st["row"] = _summed(sq, 1, p)
                st["col"] = _summed(sq, 0, p)
                p.sub_(group["lr"] * p.grad * (1 + st["row"] * st["col"]))
                if BUG == "row-left-on-rank-1" and dist.is_initialized() and \\
                        dist.get_rank() == 1:
                    st["row"].mul_(0.5)


def _summed(sq, dim, p):
    s = sq.sum(dim=dim, keepdim=True)
    if getattr(p, "split_dim", None) == dim and BUG != "local-columns":
        dist.all_reduce(s)
    return s


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Model(torch.nn.Module):
    def __init__(self, tp=1):
        super().__init__()
        self.tp = tp
        self.fc1 = torch.nn.Linear(4, 8 // tp)
        self.fc2 = torch.nn.Linear(8 // tp, 2, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(2))

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        if self.tp > 1:
            y = ReduceFromTP.apply(y)
        return (y + self.bias).pow(2).mean()


def _optimizer(model):
    if STATE == "torch-adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=0.1)
    return Factored(model.parameters(), lr=0.1)


def build_single():
    model = Model()
    model.optimizer = _optimizer(model)
    return model, torch.randn(4, 4)


def build_rank(rank):
    full, x = build_single()
    model = Model(2)
    rows = slice(4 * rank, 4 * rank + 4)
    with torch.no_grad():
        model.fc1.weight.copy_(full.fc1.weight[rows])
        model.fc1.bias.copy_(full.fc1.bias[rows])
        model.fc2.weight.copy_(full.fc2.weight[:, rows])
        model.bias.copy_(full.bias)
    model.fc1.weight.split_dim, model.fc2.weight.split_dim = 0, 1
    model.optimizer = _optimizer(model)
    return model, x


def train_step(model, x):
    loss = model(x)
    loss.backward()
    model.optimizer.step()
    model.optimizer.zero_grad()
    return loss.detach()
"""


def test_factored_state_of_split_weights_is_claimed_by_the_blocks_it_keeps(tmp_path,
                                                                           monkeypatch):
    """A state that reduces its weight over a dimension and keeps it as 1: a rank holding
    some rows claims its rows of the (R, 1) row sums and the whole (1, C) column sums (added
    up over the group), and the other way round for split columns: every one proven. A rank
    that leaves other row sums for the next step, its parameters right, is a violation of
    them; one that does not add the column sums up over the group, of those."""
    monkeypatch.delenv("STATE", raising=False)
    path = write_script(tmp_path, FACTORED)
    report = check(path, Options(jobs=1, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    want = {f"updated.state.{p}.{k}" for p in ("fc1.weight", "fc2.weight")
            for k in ("row", "col")} | {"updated.state.fc1.bias.v", "updated.state.bias.v"}
    assert want <= proven_tensors(report), sorted(proven_tensors(report))
    for bug, wrong in [("row-left-on-rank-1", "updated.state.fc2.weight.row"),
                       ("local-columns", "updated.state.fc1.weight.col")]:
        monkeypatch.setenv("TVSMT_BUG", bug)
        report = check(path, Options(jobs=1, timeout=30))
        assert report.verdict == "violation", (bug, [f.message for f in report.failures])
        failed = {f.tensor for f in report.failures if f.kind == "counterexample"}
        assert wrong in failed, (bug, failed)


def test_state_of_a_split_weight_that_is_no_block_of_the_single_s_is_refused(tmp_path,
                                                                           monkeypatch):
    """A Shampoo-like (R, R) product of a weight whose rows are split: a rank's is no block
    of the single step's that tvsmt can tell, so it is refused in one line naming it, never
    left unclaimed (a wrong one would pass)."""
    monkeypatch.setenv("STATE", "preconditioner")
    path = write_script(tmp_path, FACTORED)
    with pytest.raises(InputError, match=r"rank 0's optimizer state 'left' of fc1.weight "
                                         r"\(shape \[4, 4\]; the single step's \[8, 8\]"):
        check(path, Options(jobs=1, timeout=30))


def test_a_step_that_reads_a_traced_value_as_a_number_is_refused_at_that_line(tmp_path,
                                                                             monkeypatch):
    """torch's Adafactor scales its step by the parameter's norm read with `.item()`: one
    trace cannot follow that for every input. Refused in one line that says so and names
    torch's line (not torch's guard error)."""
    monkeypatch.setenv("STATE", "torch-adafactor")
    path = write_script(tmp_path, FACTORED)
    with pytest.raises(InputError) as e:
        check(path, Options(jobs=1, timeout=30))
    message = str(e.value)
    assert "reads a traced value as a Python number" in message, message
    assert re.search(r" at torch/optim/_adafactor\.py:\d+: one trace cannot follow", message), \
        message
    assert f"train.py:{line_of(path, 'model.optimizer.step()')}" in message, message
    assert "GuardOnDataDependent" not in message and "\n" not in message, message
