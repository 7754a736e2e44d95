"""PyTorch's FSDP2 (`fully_shard`, torch 2.13) in the capture (tvsmt/capture/fsdp.py), and
what it needs of the tracer:

* FSDP2's parameters stay on their modules, FSDP2's own shard storage becomes the traced
  local tensors, so its all-gathers read graph inputs; the claims are the sharded
  parameters' `.grad` rows, by their DTensor placements;
* the forward saves views of the unsharded parameter (`t(as_strided(buffer))`) that the
  backward reads after the buffer was all-gathered again
  (`trace._Converter.rederive_through_views`; in small in tests/test_capture_inplace.py);
* each parameter's gradient is an `as_strided` range of the reduce-scatter's flat output
  (`trace._Converter.as_strided_range`; in small there too).
"""

from __future__ import annotations

import os

import pytest
from capture_helpers import line_of, proven_tensors, sources

from tvsmt.capture import check
from tvsmt.errors import InputError
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP2 = os.path.join(ROOT, "examples", "fsdp2_mlp.py")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("TVSMT_BUG", "FSDP_RESHARD", "FSDP_SHAPE", "FSDP_OPTIMIZER", "FSDP_CLIP",
                 "FSDP_MP", "FSDP_HELD"):
        monkeypatch.delenv(name, raising=False)


PARAMS = [f"fc{i}.{w}" for i in (1, 2, 3) for w in ("weight", "bias")]


@pytest.mark.parametrize("reshard, shape, optimizer", [("1", "even", ""), ("0", "even", ""),
                                                       ("1", "uneven", "adamw"),
                                                       ("1", "hsdp", "")])
def test_fsdp2_data_parallelism_is_equivalent(monkeypatch, reshard, shape, optimizer):
    """With the parameters gathered again before the backward (reshard_after_forward, the
    default: the saved views read the buffer gathered again) and kept from the forward; and
    on four ranks whose rows do not divide evenly (padded shards, a rank holding no row),
    with AdamW's step on the sharded parameters (each rank's updated rows claimed); and
    hybrid sharding (HSDP: rows sharded within each of two replicas, placements
    [Replicate(), Shard(0)], gradients also all-reduced across the replicas)."""
    monkeypatch.setenv("FSDP_RESHARD", reshard)
    monkeypatch.setenv("FSDP_SHAPE", shape)
    monkeypatch.setenv("FSDP_OPTIMIZER", optimizer)
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    proven = proven_tensors(report)
    assert {f"grad.{n}" for n in PARAMS} <= proven, sorted(proven)
    assert ({f"updated.{n}" for n in PARAMS} <= proven) == bool(optimizer), sorted(proven)


@pytest.mark.parametrize("shape, optimizer, held", [("even", "sgd", "1"),
                                                    ("uneven", "adamw", "1"),
                                                    ("even", "sgd", "resumed"),
                                                    ("uneven", "adamw", "resumed")])
def test_fsdp2_an_optimizer_held_by_the_model_leaves_state_that_is_claimed(monkeypatch, shape,
                                                                          optimizer, held):
    """An optimizer built once with the model and held by it (FSDP_HELD): the state its step
    makes (DTensors sharded like the parameters: SGD's momentum buffers, AdamW's moments)
    is claimed, each rank's rows, and proven, on uneven rows too (a rank holding none of
    fc3's claims none of its state). Resumed (its state there before the step, DTensors):
    each state tensor is an input whose lineage is its placement."""
    monkeypatch.setenv("FSDP_SHAPE", shape)
    monkeypatch.setenv("FSDP_OPTIMIZER", optimizer)
    monkeypatch.setenv("FSDP_HELD", held)
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    keys = ["momentum_buffer"] if optimizer == "sgd" else ["exp_avg", "exp_avg_sq"]
    want = {f"updated.state.{n}.{k}" for n in PARAMS for k in keys}
    assert want | {f"updated.{n}" for n in PARAMS} <= proven_tensors(report), \
        sorted(proven_tensors(report))
    states = [(i["tensor"], i["how"]) for i in report.inputs
              if i["tensor"].startswith("state.")]
    assert {t for t, _ in states} == ({f"state.{n}.{k}" for n in PARAMS for k in keys}
                                      if held == "resumed" else set()), states
    assert all("DTensor placement" in how for _, how in states), states


def test_fsdp2_a_rank_resumed_with_other_optimizer_state_is_refused_naming_it(monkeypatch):
    from tvsmt.errors import InputError

    monkeypatch.setenv("FSDP_OPTIMIZER", "sgd")
    monkeypatch.setenv("FSDP_HELD", "resumed")
    monkeypatch.setenv("TVSMT_BUG", "resumed-state-on-one-rank")
    with pytest.raises(InputError, match=r"rank 1's local tensor is not the block") as info:
        check(FSDP2, Options(jobs=1, timeout=5))
    assert info.value.tensor.endswith(":momentum_buffer"), info.value.tensor


def test_fsdp2_clipping_by_the_global_norm_is_proven_and_a_local_norm_is_a_violation(
        monkeypatch):
    """torchtitan's step: `clip_grad_norm_` over FSDP2's DTensor gradients (each rank's
    squares summed, all-reduced, the root taken: traced as torch's per-tensor loop, not its
    foreach kernels over the local tensors, `foreach.as_loops`), then SGD. The norm of
    the per-parameter norms is proven equal to the single one because the square of a root
    of a sum of squares is that sum (`SymbolicBackend.ipow`) and squares are never cut by a
    hypothesis. Each rank clipping by its own rows' norm is a violation."""
    monkeypatch.setenv("FSDP_OPTIMIZER", "sgd")
    monkeypatch.setenv("FSDP_CLIP", "1")
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    proven = proven_tensors(report)
    assert {f"{kind}.{n}" for n in PARAMS for kind in ("grad", "updated")} <= proven, \
        sorted(proven)
    monkeypatch.setenv("TVSMT_BUG", "clip-local-norm")
    # concrete points refute the wrong stages: the solver's budget is short (five rounds
    # drop hypotheses the concrete run could not tell apart)
    report = check(FSDP2, Options(jobs=1, timeout=0.25))
    assert report.verdict == "violation", [f.message for f in report.failures]
    failed = {s[2] for s in report.to_dict()["stages"] if s[3] != "proven"}
    assert failed and all(t.split(".")[0] in ("grad", "updated") for t in failed), failed


def test_an_fsdp2_rank_stepping_with_another_learning_rate_is_a_violation_on_the_updates(
        monkeypatch):
    """Only the updated parameters are wrong, and only they fail: the gradient claims are
    the very tensors the optimizer reads (the DTensor gradient's local tensor, not a view
    of it), so the updates' stages start there (before: they reached back through the
    whole backward, hypotheses were merged away, 2 stages timed out, 17 s)."""
    monkeypatch.setenv("FSDP_OPTIMIZER", "sgd")
    monkeypatch.setenv("TVSMT_BUG", "lr-on-one-rank")
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "violation"
    failed = {s[2] for s in report.to_dict()["stages"] if s[3] != "proven"}
    assert failed == {f"updated.{n}" for n in PARAMS}
    assert report.hypotheses["dropped"] == 0


@pytest.mark.parametrize("bug, verdict", [("", "equivalent"), ("clip-local-norm", "violation")])
def test_fsdp2_with_bfloat16_parameters_is_checked_over_the_reals(monkeypatch, bug, verdict):
    """torchtitan's mixed precision (`MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`: parameters all-gathered in bf16, gradients reduced in float32),
    with clipping and AdamW: over the reals a cast is the value itself, and the concrete
    run that checks the proof runs in float64 (`capture/execute.py`), so it is equivalent;
    each rank clipping by its own rows' norm is still a violation."""
    monkeypatch.setenv("FSDP_MP", "bf16")
    monkeypatch.setenv("FSDP_OPTIMIZER", "adamw")
    monkeypatch.setenv("FSDP_CLIP", "1")
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(FSDP2, Options(jobs=1, timeout=5 if not bug else 0.25))
    assert report.verdict == verdict, [f.message for f in report.failures]
    if not bug:
        assert {f"updated.{n}" for n in PARAMS} <= proven_tensors(report)


@pytest.mark.parametrize("shape", ["even", "uneven"])
def test_a_loss_scaled_twice_under_fsdp2_is_a_violation_at_its_line(monkeypatch, shape):
    """Uneven: a rank's share of no rows relates to nothing and needs no lineage
    (stages/cutter.py), which must not let a wrong gradient through."""
    monkeypatch.setenv("FSDP_SHAPE", shape)
    monkeypatch.setenv("TVSMT_BUG", "loss-scaled-twice")
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "violation"
    at = f"fsdp2_mlp.py:{line_of(FSDP2, 'loss = loss / dist.get_world_size()')}"
    assert any(src.endswith(at) for src in sources(report)), sorted(sources(report))


def test_fsdp2_without_gradient_sync_is_a_violation(monkeypatch):
    """`set_requires_gradient_sync(False)` left on: FSDP2 keeps the unsharded gradients to
    itself and no rank holds its rows."""
    monkeypatch.setenv("TVSMT_BUG", "no-gradient-sync")
    report = check(FSDP2, Options(jobs=1, timeout=5))
    assert report.verdict == "violation"
    assert "computes no gradient" in report.failures[0].message


def test_fsdp2_reductions_the_capture_does_not_model_are_refused_in_one_line(monkeypatch):
    """A custom gradient divide factor makes FSDP2 reduce-scatter with NCCL's PREMUL_SUM,
    whose factor the traced op does not show: refused, never taken for a sum."""
    monkeypatch.setenv("TVSMT_BUG", "sum-not-average")
    with pytest.raises(InputError, match="reduction PREMUL_SUM is not supported") as e:
        check(FSDP2, Options(jobs=1, timeout=5))
    assert "\n" not in str(e.value)


def _fsdp_ops():
    import torch
    from torch.distributed.fsdp import fully_shard  # noqa: F401 - registers torch.ops.fsdp

    return torch, torch.ops.fsdp


@pytest.mark.parametrize("rows", [8, 7, 5, 1])
def test_fsdp2_kernels_are_traced_as_the_aten_ops_torch_runs(rows):
    """fsdp.py's decompositions of FSDP2's copy-in, copy-out and chunk-cat kernels compute
    what the kernels compute (their CPU implementations), on even and uneven rows."""
    from tvsmt.capture import fsdp

    torch, ops = _fsdp_ops()
    table = fsdp.decompositions()
    world = 4
    grads = [torch.randn(rows, 3), torch.randn(rows)]
    size = -(-rows // world)
    want = torch.empty(world, size * 4)
    got = torch.empty(world, size * 4)
    ops.chunk_cat.default(grads, 0, world, out=want)
    table[ops.chunk_cat.default](grads, 0, world, out=got)
    assert torch.equal(got, want)

    shards = [torch.randn(6), torch.randn(2)]
    out_a, out_b = torch.zeros(world * 8), torch.zeros(world * 8)
    a = ops.all_gather_copy_in.default(shards, out_a, [6, 2], 8, 2)
    b = table[ops.all_gather_copy_in.default](shards, out_b, [6, 2], 8, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(out_a, out_b)

    gathered = torch.randn(world, 8)
    outs_a = [torch.empty(world, 6), torch.empty(world, 2)]
    outs_b = [torch.empty(world, 6), torch.empty(world, 2)]
    ops.split_with_sizes_copy.default(gathered, [6, 2], dim=1, out=outs_a)
    table[ops.split_with_sizes_copy.default](gathered, [6, 2], dim=1, out=outs_b)
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))


FSDP2_TP = os.path.join(ROOT, "examples", "fsdp2_tp_mlp.py")


@pytest.mark.parametrize("bug", ["", "batch-by-tp-rank"])
def test_fsdp2_over_tensor_parallelism_on_a_2d_mesh(monkeypatch, bug):
    """FSDP2 on top of tensor parallelism: FSDP2 shards rows that tp already split with
    `_StridedShard(0)`, whose block torch's offsets give (and the values confirm:
    dtensor.check_values refuses a local tensor that is not its block)."""
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(FSDP2_TP, Options(jobs=1, timeout=5))
    if bug:
        assert report.verdict == "violation"
        return
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    blocks = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    # rank 1 is dp 0, tp 1: the first half of tp's second half of fc1's rows
    assert blocks[("param.fc1.weight", 1)] == [[8, 12], [0, 8]]
    assert blocks[("param.fc2.weight", 1)] == [[0, 4], [8, 16]]
    proven = proven_tensors(report)
    assert {"grad.fc1.weight", "grad.fc1.bias", "grad.fc2.weight", "grad.fc2.bias"} <= proven


ACCUMULATION = '''
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
WORLD_SIZE = 2
MB, BATCH = 2, 2


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build_single():
    return M(), torch.randn(WORLD_SIZE * MB * BATCH, 4)


def build_rank(rank):
    m, x = build_single()
    fully_shard(m.fc1)
    fully_shard(m.fc2)
    fully_shard(m)
    return m, x[rank * MB * BATCH:(rank + 1) * MB * BATCH]


def single_step(model, x):
    loss = (model(x) ** 2).mean()
    loss.backward()
    return loss


def train_step(model, x):
    total = 0
    for i, chunk in enumerate(x.split(BATCH)):
        model.set_requires_gradient_sync(i == SYNCED)
        loss = (model(chunk) ** 2).mean() / MB
        loss.backward()
        total = total + loss.detach()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total
'''


@pytest.mark.parametrize("synced, verdict", [("MB - 1", "equivalent"), ("0", "violation")])
def test_fsdp2_gradient_accumulation_syncs_at_the_last_micro_batch(tmp_path, synced, verdict):
    """Micro-batches under `set_requires_gradient_sync(False)`: FSDP2 accumulates the
    unsharded gradients and reduce-scatters them at the last one. Synced after the first
    micro-batch instead, the second one's gradients are never reduced: a violation."""
    path = tmp_path / "train.py"
    path.write_text(ACCUMULATION.replace("SYNCED", synced))
    assert check(str(path), Options(jobs=1, timeout=5)).verdict == verdict
