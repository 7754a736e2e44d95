"""DeepSpeed as shipped (deepspeed 0.19.8, a test dependency) in the capture, and what it
needs of the tracer:

* the model's own parameter objects are the traced tensors during the step
  (`trace.parameters_kept`): DeepSpeed holds them in its partitions and registered its
  gradient reduction as hooks on them (ZeRO-2), so swapping other tensors onto the module
  left its hooks unfired and its lists pointing at untraced tensors; plain PyTorch code that
  keeps parameters in a list or reduces gradients in a post-accumulate-grad hook needs the
  same (tested without DeepSpeed below);
* under ZeRO-1 and ZeRO-2 every `p.grad` is None after `engine.backward`: the claims are the
  pieces of the gradient partition each rank keeps (`zero.gradient_pieces`), as rectangular
  blocks of the single gradient (`zero.flat_blocks`); a partition piece that is wrong is a
  violation, and every element must still be held by some rank;
* DeepSpeed's default contiguous gradient buckets are read through views of a buffer that
  other views wrote (`trace._Converter.rederive_part`; in small in
  tests/test_capture_inplace.py)."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
from capture_helpers import TWO_LAYER_SCRIPT, line_of, proven_tensors, sources

from tvsmt.capture import check
from tvsmt.capture.zero import flat_blocks
from tvsmt.errors import InputError
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO = os.path.join(ROOT, "examples", "deepspeed_zero.py")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("TVSMT_BUG", "DS_STAGE", "DS_NONCONTIGUOUS", "DS_STEP", "DS_BF16", "DS_SINGLE"):
        monkeypatch.delenv(name, raising=False)


def _deepspeed():
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install .[test])")


@pytest.mark.parametrize("stage, contiguous", [("0", True), ("1", True), ("2", True),
                                               ("2", False), ("3", True)])
def test_deepspeed_data_parallelism_is_equivalent_at_every_zero_stage(monkeypatch, stage,
                                                                      contiguous):
    """DeepSpeed's defaults (contiguous gradient buckets: a `torch.empty` filled through
    narrow views and read through others) and its other reduction path."""
    _deepspeed()
    monkeypatch.setenv("DS_STAGE", stage)
    if not contiguous:
        monkeypatch.setenv("DS_NONCONTIGUOUS", "1")
    report = check(ZERO, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]


def test_deepspeed_bf16_gradients_are_equivalent_and_its_step_is_refused_by_name(monkeypatch):
    """`"bf16": {"enabled": true}`: the engine casts the module to bfloat16 when it is built;
    each rank's parameter is matched as the single one's cast (tests/test_capture_casts.py).
    Its step (BF16_Optimizer) branches on the gradients' values: refused in one line."""
    _deepspeed()
    from tvsmt.capture import capture

    monkeypatch.setenv("DS_BF16", "1")
    report = check(ZERO, Options(jobs=1, timeout=5))  # ZeRO-2
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    hows = {i["how"] for i in report.inputs if i["tensor"].startswith("param.")}
    assert hows and all(h.endswith("held as bfloat16") for h in hows), hows
    monkeypatch.setenv("DS_STAGE", "0")
    monkeypatch.setenv("DS_STEP", "1")
    with pytest.raises(InputError, match=r"engine.step\(\) with bf16 enabled is not captured"):
        capture(ZERO)


@pytest.mark.parametrize("stage, bug", [("2", "loss-scaled-twice"), ("2", "sum-not-average"),
                                        ("2", "no-reduce"), ("1", "no-reduce"),
                                        ("3", "sum-not-average"), ("3", "no-reduce")])
def test_deepspeed_zero_bugs_are_violations_in_the_partitions(monkeypatch, stage, bug):
    _deepspeed()
    monkeypatch.setenv("DS_STAGE", stage)
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(ZERO, Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert wrong and all(t.startswith("grad.module.") or t == "loss" for t in wrong), wrong
    if bug == "loss-scaled-twice":  # the report shows the line that scales the loss
        line = line_of(ZERO, "loss = loss / dist.get_world_size()")
        assert any(s.endswith(f"deepspeed_zero.py:{line}") for s in sources(report)), \
            sources(report)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_single_model_under_deepspeed_too_claims_its_whole_partitions(monkeypatch, stage):
    """The single device's model built with deepspeed.initialize as well (a world of one
    rank): its one partition of each gradient is the whole gradient, so every gradient is
    still claimed (they were all left unclaimed, and DeepSpeed's reduction skipped passed)."""
    _deepspeed()
    monkeypatch.setenv("DS_STAGE", stage)
    monkeypatch.setenv("DS_SINGLE", "engine")
    report = check(ZERO, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    grads = {f"grad.module.fc{i}.{w}" for i in (1, 2, 3) for w in ("weight", "bias")}
    assert grads <= proven_tensors(report), sorted(proven_tensors(report))
    monkeypatch.setenv("TVSMT_BUG", "no-reduce")
    report = check(ZERO, Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert wrong and wrong <= grads, wrong


def test_a_single_model_under_zero_3_is_refused_in_one_line(monkeypatch):
    """ZeRO-3 on the single device: its engine's state would break the ranks' traces that
    follow with a message about a tensor of it; refused at the single model instead."""
    _deepspeed()
    monkeypatch.setenv("DS_STAGE", "3")
    monkeypatch.setenv("DS_SINGLE", "engine")
    with pytest.raises(InputError, match="single: DeepSpeed ZeRO-3 is not supported on the "
                                         "single device"):
        check(ZERO, Options(jobs=1, timeout=5))


def test_zero_claims_each_rank_s_partition_only(monkeypatch):
    """ZeRO-2 over two ranks: rank 0 holds the first half of the flattened gradients, rank 1
    the rest; fc2.weight (16 x 16) is split inside a row, so its claims are blocks of whole
    rows and of part of a row, on both ranks."""
    _deepspeed()
    from tvsmt.capture import capture

    pair = capture(ZERO)
    parts = [p for lin in pair.parallel["lineages"] if lin["single"] == "grad.module.fc2.weight"
             for p in lin["parts"]]
    by_rank: dict[str, list] = {}
    for p in parts:
        by_rank.setdefault(p["sum_of"][0].split(":")[0], []).append(
            tuple(map(tuple, p["slice"])))
    assert sorted(by_rank) == ["r0", "r1"], parts
    # every element once, the row split between the ranks held in part by each
    held = np.zeros((16, 16), int)
    for blocks in by_rank.values():
        for (r0, r1), (c0, c1) in blocks:
            held[r0:r1, c0:c1] += 1
    assert (held == 1).all(), held
    split = [b for blocks in by_rank.values() for b in blocks if b[0][1] - b[0][0] == 1]
    assert len(split) == 2 and {b[0] for b in split} == {split[0][0]}, by_rank


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 3), (6, 2, 2, 3)])
def test_flat_blocks_are_the_range_in_row_major_order(shape):
    n = int(np.prod(shape))
    idx = np.arange(n).reshape(shape)
    for start in range(n + 1):
        for end in range(start, n + 1):
            got = []
            for block, at in flat_blocks(shape, start, end):
                sub = idx[tuple(slice(a, b) for a, b in block)].reshape(-1)
                assert sub[0] == at and (np.diff(sub) == 1).all(), (shape, start, end, block)
                got += sub.tolist()
            assert got == list(range(start, end)), (shape, start, end)
            assert len(flat_blocks(shape, start, end)) <= 2 * len(shape) + 1


HOOKED = TWO_LAYER_SCRIPT + """

def build_rank(rank):
    model, x = build_single()
    # plain PyTorch data parallelism: each gradient averaged as soon as it is accumulated,
    # by hooks registered when the model is built, and a list of the parameters kept
    model.held = list(model.parameters())
    for p in model.held:
        if not (BUG == "fc2-unhooked" and p is model.fc2.weight):
            p.register_post_accumulate_grad_hook(
                lambda p: dist.all_reduce(p.grad, op=dist.ReduceOp.AVG))
    return model, x[rank * 2:(rank + 1) * 2]


def single_step(model, x):
    loss = model(x)
    loss.backward()
    return loss


def train_step(model, x):
    loss = model(x)
    loss.backward()
    for p in model.held:  # the kept list holds the very parameters the step traced
        assert p.grad is not None
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss
"""


def test_hooks_registered_on_parameters_when_built_run_in_the_traced_step(tmp_path,
                                                                          monkeypatch):
    path = tmp_path / "hooked.py"
    path.write_text(textwrap.dedent(HOOKED))
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    monkeypatch.setenv("TVSMT_BUG", "fc2-unhooked")
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert {f.tensor for f in report.failures if f.kind == "counterexample"} == {
        "grad.fc2.weight"}
    assert report.hypotheses["rounds"] <= 2, report.hypotheses


def test_a_solver_timeout_discredits_no_hypothesis_once_a_bug_is_witnessed(tmp_path):
    """Which hypotheses a round's failures drop (`driver.hypotheses_to_drop`): a wrong claim
    (counterexample) drops the hypotheses its stage assumed, a claim that timed out drops
    none (a merged stage is only larger); a hypothesis that timed out is dropped, unless a
    witnessed bug already makes the run a violation. Before, the timeouts of stages merged
    after the witnessed bug of `fc2-unhooked` dropped hypotheses round after round (five
    rounds, 36 s of this suite; two now)."""
    from tvsmt.capture import capture_pair
    from tvsmt.capture.driver import hypotheses_to_drop
    from tvsmt.report.report import Failure, Report
    from tvsmt.stages import cut_stages

    path = tmp_path / "hooked.py"
    path.write_text(textwrap.dedent(HOOKED))
    single, parallel = capture_pair(str(path)).plans()
    lins = parallel.lineages
    stages = {st.target: st for st in cut_stages(single, parallel).stages}
    claim = next(i for i, st in stages.items() if not lins[i].hypothesis
                 and any(lins[j].hypothesis for j in st.inputs))
    assumed = {j for j in stages[claim].inputs if lins[j].hypothesis}
    hyp = next(iter(assumed))

    def dropped(*failures, witnessed=None):
        report = Report("violation", "s", "p")
        report.failures = [Failure(kind, kind, lineage=i) for kind, i in failures]
        return hypotheses_to_drop(single, parallel, report, witnessed)

    assert dropped(("counterexample", claim)) >= assumed
    assert dropped(("inconclusive", claim)) == set()
    assert dropped(("inconclusive", hyp)) == {hyp}
    # a hypothesis that no wrong claim's stage assumed, timed out beside a wrong claim
    other = next(j for j in range(len(lins)) if lins[j].hypothesis and j not in assumed)
    assert other in dropped(("inconclusive", other), ("counterexample", claim))
    witnessed = {lins[claim].single: "a random input"}
    assert dropped(("inconclusive", other), ("counterexample", claim), witnessed=witnessed) \
        == dropped(("counterexample", claim), witnessed=witnessed)


def test_deepspeed_s_engine_step_under_zero_partitions_is_refused_in_one_line():
    """DeepSpeed's optimizer step over ZeRO partitions is not captured (stage 0's is, below;
    tests/test_capture_optimizer.py has torch's): a step it took is refused by name, never
    verified as if it had not run."""
    from tvsmt.capture import zero

    class Engine:  # what gradient_pieces reads of an engine that stepped
        __module__ = "deepspeed.runtime.engine"
        global_steps = 1
        stage = 1

        def zero_optimization_stage(self):
            return self.stage

    with pytest.raises(InputError, match=r"engine.step\(\) under ZeRO stage 1 is not captured"):
        zero.gradient_pieces(Engine(), {}, "train.py")
    Engine.stage = 0  # no partitions: every p.grad and parameter is whole, read as such
    assert zero.gradient_pieces(Engine(), {}, "train.py") is None


def test_deepspeed_s_engine_step_under_zero_2_is_refused_at_its_line(monkeypatch):
    """ZeRO-2's step branches on the gradients' values (overflow check, clipping): the
    trace stops there, and the error says so at the user's `engine.step()`, not as torch's
    GuardOnDataDependentSymNode."""
    _deepspeed()
    from tvsmt.capture import capture

    monkeypatch.setenv("DS_STAGE", "2")
    monkeypatch.setenv("DS_STEP", "1")
    with pytest.raises(InputError) as info:
        capture(ZERO)
    message = str(info.value)
    assert "engine.step() under ZeRO stage 2 is not captured" in message, message
    assert f"deepspeed_zero.py:{line_of(ZERO, '        engine.step()')}" in message, message
    assert "GuardOnDataDependent" not in message and "\n" not in message, message


def test_deepspeed_engine_step_at_stage_0_clips_and_updates_as_the_single_step(monkeypatch):
    """`engine.step()`: DeepSpeed's clipping to a global norm (the norm averaged over the
    ranks, the coefficient `min(1, c)`) and SGD's update, against torch's `clip_grad_norm_`
    (`clamp(c, max=1)`) and the same update. The claims are the updated parameters."""
    _deepspeed()
    from tvsmt.capture import capture

    monkeypatch.setenv("DS_STAGE", "0")
    monkeypatch.setenv("DS_STEP", "1")
    claimed = {lin["single"] for lin in capture(ZERO).parallel["lineages"]}
    assert {f"updated.module.fc{i}.{w}" for i in (1, 2, 3) for w in ("weight", "bias")} \
        <= claimed, sorted(claimed)
    report = check(ZERO, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]


@pytest.mark.parametrize("bug, line", [
    ("no-clip", "        engine.step()"),
    ("clip-before-reduce", "torch.nn.utils.clip_grad_norm_(engine.module.parameters(), "
                           "MAX_NORM)")])
def test_deepspeed_step_bugs_are_violations_of_the_updated_parameters(monkeypatch, bug, line):
    _deepspeed()
    monkeypatch.setenv("DS_STAGE", "0")
    monkeypatch.setenv("DS_STEP", "1")
    monkeypatch.setenv("TVSMT_BUG", bug)
    # the concrete run witnesses every wrong update (by the step it took): no round drops
    # hypotheses one stage at a time (at most one merge of small stages, driver.py); the
    # solver's budget is short, a counterexample needs no proof
    report = check(ZERO, Options(jobs=1, timeout=0.25))
    assert report.hypotheses["rounds"] <= 2, report.hypotheses
    assert all("confirmed on the concrete run" in f.message for f in report.failures
               if f.kind == "counterexample"), [f.message for f in report.failures]
    assert report.verdict == "violation", [f.message for f in report.failures]
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert wrong and all(t.startswith("updated.module.") for t in wrong), wrong
    where = f"deepspeed_zero.py:{line_of(ZERO, line)}"
    assert any(s.endswith(where) for s in sources(report)), sources(report)


def test_zero_3_inputs_and_claims_are_each_rank_s_partition(monkeypatch):
    """ZeRO-3 over two ranks: every parameter lives on the ranks only as the flat partitions
    DeepSpeed keeps of it (`ds_tensor`), gathered before each module runs. Each rank's input
    is its partition, the block of the single parameter it holds (rows 0-7 and 8-15 of
    fc2.weight), and so is its claim, the piece of the reduced gradient it keeps."""
    _deepspeed()
    from tvsmt.capture import capture

    monkeypatch.setenv("DS_STAGE", "3")
    pair = capture(ZERO)

    def blocks(single):
        return {tuple(map(tuple, p["slice"])): p["sum_of"][0].split(":")[0]
                for lin in pair.parallel["lineages"] if lin["single"] == single
                for p in lin["parts"]}

    halves = {((0, 8), (0, 16)): "r0", ((8, 16), (0, 16)): "r1"}
    assert blocks("param.module.fc2.weight") == halves
    assert blocks("grad.module.fc2.weight") == halves
    assert blocks("grad.module.fc3.bias") == {((0, 4),): "r0", ((4, 8),): "r1"}


CUT = """
import os

import torch
import torch.distributed as dist

WORLD_SIZE = 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)
        # 5 x 6: each rank's 15 elements are two whole rows and half of row 2
        self.mix = torch.nn.Linear(6, 5, bias=bool(os.environ.get("CUT_BIAS")))
        self.out = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.out(self.mix(torch.nn.functional.silu(self.fc(x))))


class Single(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def build_single():
    return Single(Net()), torch.randn(8, 8)


def build_rank(rank):
    import deepspeed

    single, x = build_single()
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    optimizer = torch.optim.SGD(single.module.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=single.module, optimizer=optimizer, config=config)
    return engine, x[rank * 4:(rank + 1) * 4]


def single_step(model, x):
    loss = (model(x) ** 2).mean()
    loss.backward()
    return loss


def train_step(engine, x):
    loss = (engine(x) ** 2).mean()
    if os.environ.get("TVSMT_BUG") == "half-mix-grad":
        engine.module.mix.weight.register_hook(lambda g: g / 2)
    engine.backward(loss)
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported
"""


def test_zero_3_partitions_that_cut_a_row_are_several_blocks(tmp_path, monkeypatch):
    """mix.weight (5 x 6) over two ranks: each rank keeps 15 elements, two whole rows and
    half of row 2, so its partition is two inputs, one block each, and so are its claims;
    a bug in that gradient is a violation. A parameter DeepSpeed pads (a bias of 5
    elements) is refused by name: its reduce-scatter pads with uninitialised memory."""
    _deepspeed()
    from tvsmt.capture import capture

    path = tmp_path / "cut.py"
    path.write_text(textwrap.dedent(CUT))
    pair = capture(str(path))
    held = {(p["sum_of"][0].split(":")[0], tuple(map(tuple, p["slice"])))
            for lin in pair.parallel["lineages"] if lin["single"] == "param.module.mix.weight"
            for p in lin["parts"]}
    assert held == {("r0", ((0, 2), (0, 6))), ("r0", ((2, 3), (0, 3))),
                    ("r1", ((2, 3), (3, 6))), ("r1", ((3, 5), (0, 6)))}, held
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    monkeypatch.setenv("TVSMT_BUG", "half-mix-grad")
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert "grad.module.mix.weight" in {f.tensor for f in report.failures
                                        if f.kind == "counterexample"}
    monkeypatch.delenv("TVSMT_BUG")
    monkeypatch.setenv("CUT_BIAS", "1")
    with pytest.raises(InputError, match=r"ZeRO-3 pads the partitions of module.mix.bias "
                                         r"\(5 elements over 2 ranks\)"):
        check(str(path), Options(jobs=1, timeout=5))


def test_a_zero_3_block_whose_values_differ_from_the_single_block_is_refused():
    """The blocks stage3_partitions computes from DeepSpeed's ranges are taken only where the
    values confirm them on every draw (a wrong range would otherwise be an assumption)."""
    import torch

    from tvsmt.capture.lineages import input_lineage
    from tvsmt.capture.program import InputTensor

    draws = [torch.randn(4, 6), torch.randn(4, 6)]
    single = InputTensor("param.w", "param", "w", (4, 6), draws)
    for block, ok in ((((2, 4), (0, 6)), True), (((0, 2), (0, 6)), False)):
        mine = InputTensor("param.w@zero3.0", "param", "w", (2, 6),
                           [d[2:4] for d in draws], {"zero3": block}, single_id="param.w")
        if ok:
            assert input_lineage(single, 1, mine, {}, "t.py").slice == block
        else:
            with pytest.raises(InputError, match="ZeRO-3 partition is not the block"):
                input_lineage(single, 1, mine, {}, "t.py")


def test_a_zero_3_parameter_held_gathered_when_the_step_starts_is_refused():
    """Its full values would be used without the all-gather the trace sees."""
    import enum

    import torch

    from tvsmt.capture import zero

    class Status(enum.Enum):
        AVAILABLE = 1

    class Engine:
        __module__ = "deepspeed.runtime.engine"

        def zero_optimization_stage(self):
            return 3

    p = torch.nn.Parameter(torch.randn(4, 2))
    p.ds_tensor, p.ds_status = torch.randn(4), Status.AVAILABLE
    with pytest.raises(InputError, match="ZeRO-3 holds w gathered when train_step starts"):
        zero.stage3_partitions(Engine(), {"w": p}, "train.py")


def _address_space_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


def test_a_zero_3_capture_leaves_no_reservation_that_stops_fork(monkeypatch):
    """Each ZeRO-3 engine reserves its reduce bucket at initialisation (2 GB of float32 by
    default) and DeepSpeed keeps engines reachable: a capture builds four, and a process
    that had run a few captures could not fork any more (ENOMEM: 52 tests of this suite
    failed after this file). The capture releases them when it is done with each engine."""
    _deepspeed()
    import os

    from tvsmt.capture import capture

    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads the address space from /proc (Linux)")
    monkeypatch.setenv("DS_STAGE", "3")
    capture(ZERO)  # imports and first initialisations
    before = _address_space_kb()
    capture(ZERO)
    grown = _address_space_kb() - before
    assert grown < 1_000_000, f"the address space grew by {grown // 1024} MB"


ACCUMULATING_STEP = '''def train_step(engine, x):
    from tvsmt.capture import microbatch

    total = 0
    for i, mb in enumerate(x.chunk(2)):
        with microbatch(i):
            loss = loss_of(engine(mb))
            if BUG == "first-backward-skipped" and i == 0:
                continue
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            total = total + loss.detach() / 2
    reported = total.clone()
    dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported
'''


def test_zero_3_gradient_accumulation_over_micro_batches(tmp_path, monkeypatch):
    """The example with `gradient_accumulation_steps: 2`, each rank's half of the batch in two
    micro-batches: ZeRO-3 adds the second reduce-scattered partition to the first in its
    gradient buffers (traced zeros at the start of the step); equivalent, and a micro-batch
    whose backward is skipped is a violation."""
    _deepspeed()
    with open(ZERO, encoding="utf-8") as f:
        source = f.read()
    batch = '"train_micro_batch_size_per_gpu": batch,'
    assert batch in source and "def train_step(engine, x):" in source
    source = source.replace(batch, '"train_micro_batch_size_per_gpu": batch // 2, '
                                   '"gradient_accumulation_steps": 2,')
    source = source[:source.index("def train_step(engine, x):")] + ACCUMULATING_STEP
    path = tmp_path / "accumulate.py"
    path.write_text(source)
    monkeypatch.setenv("DS_STAGE", "3")
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    monkeypatch.setenv("TVSMT_BUG", "first-backward-skipped")
    # the concrete run witnesses the bug: a short budget keeps z3's counterexamples cheap
    report = check(str(path), Options(jobs=1, timeout=1))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert any(f.kind == "counterexample" and f.tensor.startswith("grad.module.")
               for f in report.failures), [f.message for f in report.failures]


NO_SHARED_MEMORY_KERNEL = '''
import sys
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

def refuse(self, *a, **k):
    raise SystemExit("DeepSpeed was asked to build its shared-memory kernel")

ShareMemCommBuilder.load = refuse
from tvsmt.capture import capture

capture(sys.argv[1])
assert "deepspeed.comm.torch" in sys.modules  # the world really made DeepSpeed's backend
assert sys.modules["deepspeed.comm.torch"].build_shm_op.__name__ == "build_shm_op"
print("captured")
'''


def test_a_capture_never_builds_deepspeed_s_shared_memory_kernel(tmp_path):
    """DeepSpeed's backend compiles a C++ all-reduce for the ranks of one node the first time
    it is made on a CPU machine (30-50 s on a fresh machine; the first DeepSpeed test of this
    suite took 55 s in CI); every rank here is one process on the fake backend, which never
    runs it (`world.deepspeed_without_shared_memory`). A fresh interpreter, so that the
    example's own late `import deepspeed` makes the backend module within the world; the
    builder fails if asked, and the module's function is its own again afterwards."""
    _deepspeed()
    import subprocess
    import sys

    script = tmp_path / "no_shm.py"
    script.write_text(NO_SHARED_MEMORY_KERNEL)
    env = {**os.environ, "DS_STAGE": "0"}
    done = subprocess.run([sys.executable, str(script), ZERO], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("captured")
