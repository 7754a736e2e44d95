"""Megatron-Core as shipped (megatron-core 0.16.1, a test dependency) in the capture:
`examples/megatron_core_mlp.py` (its tensor-parallel linear layers) and
`examples/megatron_core_gpt.py` (GPTModel: vocabulary-parallel embedding, attention, MLP,
vocabulary-parallel cross entropy) are equivalent as written with no annotation (the shards
come from Megatron's parameter attributes and parallel state, the biases' too, which start
at zero), their planted bugs are violations at the user's line, and a constant tensor's
block is taken only where it cannot be another."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from capture_helpers import line_of, proven_tensors, sources

from tvsmt.capture import capture, check
from tvsmt.capture.lineages import input_lineage, megatron_block
from tvsmt.capture.program import InputTensor
from tvsmt.capture.script import load_script
from tvsmt.capture.trace import trace_program
from tvsmt.errors import InputError
from tvsmt.verify import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "megatron_core_mlp.py")
GPT = os.path.join(ROOT, "examples", "megatron_core_gpt.py")
DDP = os.path.join(ROOT, "examples", "megatron_core_ddp.py")


@pytest.fixture(autouse=True)
def _no_bug(monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)
    monkeypatch.delenv("TVSMT_SP", raising=False)
    monkeypatch.delenv("GPT_DDP", raising=False)
    for name in ("DDP_OVERLAP", "DDP_SINGLE", "DDP_DISTOPT"):
        monkeypatch.delenv(name, raising=False)


def test_megatron_core_mlp_is_equivalent_with_shards_from_megatron_itself():
    report = check(MLP, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    how = {(i["tensor"], i["rank"]): i["how"] for i in report.inputs}
    shards = {(i["tensor"], i["rank"]): i["slice"] for i in report.inputs}
    for r in (0, 1):
        assert how[("param.fc1.weight", r)].startswith("Megatron attributes (partition_dim=0)")
        assert how[("param.fc2.weight", r)].startswith("Megatron attributes (partition_dim=1)")
        # zero at the start: the sharded bias by Megatron's tensor-parallel rank, the
        # replicated one as the only block of its shape
        assert how[("param.fc1.bias", r)] == (f"Megatron attributes (partition_dim=0, "
                                              f"tensor-parallel rank {r} of 2; its values "
                                              f"are constant)")
        assert how[("param.fc2.bias", r)] == "the only block of its shape (its values are " \
                                             "constant)"
    assert shards[("param.fc1.bias", 1)] == [[8, 16]]
    assert shards[("param.fc2.bias", 1)] == [[0, 8]]
    assert shards[("param.fc1.weight", 1)] == [[8, 16], [0, 8]]


def test_a_column_parallel_layer_that_does_not_reduce_its_input_gradient_is_a_violation(
        monkeypatch):
    """`disable_grad_reduce=True` with nobody reducing: the replicated projection in front
    gets a partial gradient on each rank. The failure names that gradient and the layer's
    call in the user's forward."""
    monkeypatch.setenv("TVSMT_BUG", "disable-grad-reduce")
    report = check(MLP, Options(jobs=1, timeout=3))
    assert report.verdict == "violation"
    wrong = [f for f in report.failures if f.kind == "counterexample"]
    assert {f.tensor for f in wrong} == {"grad.proj.weight"}, [f.tensor for f in wrong]
    line = line_of(MLP, "h, _ = self.fc1(self.proj(x))")
    assert any(s.endswith(f"megatron_core_mlp.py:{line}") for s in sources(report)), \
        sources(report)


def test_a_softmax_over_the_sharded_features_is_a_violation(monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "softmax-over-shard")
    report = check(MLP, Options(jobs=1, timeout=3))
    assert report.verdict == "violation"
    assert "loss" in {f.tensor for f in report.failures if f.kind == "counterexample"}
    line = line_of(MLP, "h = torch.softmax(h, dim=-1)")
    assert any(s.endswith(f"megatron_core_mlp.py:{line}") for s in sources(report)), \
        sources(report)


def test_megatron_core_gpt_model_is_equivalent():
    """One transformer layer of Megatron-Core's GPTModel (local spec) at tp2, traced on CPU:
    its fused QKV, attention (scores masked in place through a view of an uninitialised
    buffer's baddbmm), LayerNorms and Megatron's vocabulary-parallel cross entropy (its
    exponentials written with out=) all captured and proven."""
    report = check(GPT, Options(jobs=2, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    how = {(i["tensor"], i["rank"]): i["how"] for i in report.inputs}
    assert how[("param.embedding.word_embeddings.weight", 1)].startswith(
        "Megatron attributes (partition_dim=0)")
    assert how[("param.decoder.layers.0.self_attention.linear_qkv.bias", 1)].startswith(
        "Megatron attributes (partition_dim=0, tensor-parallel rank 1 of 2")
    assert how[("param.output_layer.weight", 0)].startswith("Megatron attributes")


def test_megatron_core_gpt_model_with_a_micro_batch_of_one_is_equivalent(tmp_path):
    """With a batch of one, Megatron-Core's make_viewless_tensor hands an activation over by
    assigning `.data` of a `torch.empty((1,))`, which no ATen operator records: the capture
    follows the assignment (it refused the read of uninitialised memory before)."""
    with open(GPT, encoding="utf-8") as f:
        source = f.read()
    constants = "VOCAB, SEQ, BATCH, HIDDEN, HEADS = 32, 4, 2, 16, 4"
    assert constants in source
    path = tmp_path / "megatron_core_gpt_b1.py"
    path.write_text(source.replace(constants, "VOCAB, SEQ, BATCH, HIDDEN, HEADS = 32, 4, 1, 16, 4"))
    report = check(str(path), Options(jobs=2, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]


def test_a_gpt_loss_divided_by_the_tensor_parallel_size_is_a_violation(monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "loss-over-tp")
    report = check(GPT, Options(jobs=2, timeout=30))
    assert report.verdict == "violation"
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert "loss" in wrong, wrong
    line = line_of(GPT, "loss = loss / parallel_state")
    assert any(s.endswith(f"megatron_core_gpt.py:{line}") for s in sources(report)), \
        sources(report)


def test_megatron_core_gpt_model_with_sequence_parallelism_is_equivalent(monkeypatch):
    """Megatron's sequence parallelism (TVSMT_SP=1): LayerNorms and dropouts on sequence
    shards, all-gathered before the column-parallel layers and reduce-scattered after the
    row-parallel ones; the LayerNorms' gradients summed over the tensor-parallel group by the
    step, which finds them by the `sequence_parallel` mark Megatron reads (set on the
    parameters, so it must stay readable on the stand-ins the trace swaps in)."""
    monkeypatch.setenv("TVSMT_SP", "1")
    pair = capture(GPT)
    ops = {n["op"] for n in pair.parallel["nodes"]}
    assert {"all_gather", "reduce_scatter"} <= ops, sorted(ops)
    report = check(GPT, Options(jobs=2, timeout=30))
    assert report.verdict == "equivalent", [f.message for f in report.failures]


def test_sequence_parallel_layernorm_gradients_left_unsummed_are_a_violation(monkeypatch):
    monkeypatch.setenv("TVSMT_SP", "1")
    monkeypatch.setenv("TVSMT_BUG", "sp-grads-unsynced")
    report = check(GPT, Options(jobs=2, timeout=30))
    assert report.verdict == "violation"
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    # exactly the parameters Megatron marks sequence_parallel: the LayerNorms and the biases
    # the row-parallel layers add after their reduce-scatter
    layer = "grad.decoder.layers.0."
    assert wrong == {"grad.decoder.final_layernorm.weight", "grad.decoder.final_layernorm.bias",
                     layer + "input_layernorm.weight", layer + "input_layernorm.bias",
                     layer + "pre_mlp_layernorm.weight", layer + "pre_mlp_layernorm.bias",
                     layer + "self_attention.linear_proj.bias",
                     layer + "mlp.linear_fc2.bias"}, wrong


def test_megatron_attributes_agree_with_inference_by_value():
    """Every Megatron-sharded weight's block found with its attributes is the block the
    inference by value finds without them, and its tensor-parallel place names that block."""
    sc = load_script(MLP)
    single = {i.id: i for i in trace_program(sc, None).inputs}
    compared = 0
    for r in range(sc.world_size):
        for inp in trace_program(sc, r).inputs:
            if not (isinstance(inp.declared, dict) and "megatron_tp" in inp.declared):
                continue
            assert inp.declared["megatron_tp"] == (r, 2), inp.declared
            if inp.name.endswith("bias"):
                continue  # zeros: values cannot tell (tested above)
            with_attrs = input_lineage(single[inp.id], r, inp, {}, sc.path)
            hidden = dataclasses.replace(inp, declared=None)
            by_value = input_lineage(single[inp.id], r, hidden, {}, sc.path)
            assert with_attrs.slice == by_value.slice == megatron_block(
                single[inp.id].shape, inp.shape, inp.declared), (inp.id, r)
            compared += 1
    assert compared == 4  # fc1 and fc2 weights on two ranks


def _inputs(single_values, rank_values, declared=None):
    s = InputTensor("param.b", "param", "b", tuple(single_values[0].shape), list(single_values))
    m = InputTensor("param.b", "param", "b", tuple(rank_values[0].shape), list(rank_values),
                    declared=declared)
    return s, m


def test_a_constant_shard_is_refused_unless_megatron_places_it():
    """Zeros of half the size match either half: refused by name without a declaration,
    taken at Megatron's tensor-parallel place with one, refused where the values there
    differ (a constant 1 is no block of zeros)."""
    zeros, half = [torch.zeros(8)] * 2, [torch.zeros(4)] * 2
    s, m = _inputs(zeros, half)
    with pytest.raises(InputError, match="degenerate"):
        input_lineage(s, 1, m, {}, "train.py")
    place = {"megatron_partition_dim": 0, "megatron_tp": (1, 2), "megatron_stride": 1}
    s, m = _inputs(zeros, half, place)
    assert input_lineage(s, 1, m, {}, "train.py").slice == ((4, 8),)
    s, m = _inputs(zeros, [torch.ones(4)] * 2, place)
    with pytest.raises(InputError, match="equals no block"):
        input_lineage(s, 1, m, {}, "train.py")
    # a strided partition is no single block: refused as without attributes
    s, m = _inputs(zeros, half, dict(place, megatron_stride=2))
    with pytest.raises(InputError, match="degenerate"):
        input_lineage(s, 1, m, {}, "train.py")


def test_a_constant_tensor_of_the_full_shape_is_its_only_block():
    s, m = _inputs([torch.zeros(3, 4)] * 2, [torch.zeros(3, 4)] * 2)
    prov = input_lineage(s, 0, m, {}, "train.py")
    assert prov.slice == ((0, 3), (0, 4)) and prov.how.startswith("the only block")
    s, m = _inputs([torch.zeros(3, 4)] * 2, [torch.full((3, 4), 2.0)] * 2)
    with pytest.raises(InputError, match="equals no block"):
        input_lineage(s, 0, m, {}, "train.py")


DDP_GRADS = {f"grad.module.{layer}.{w}" for layer in ("fc1", "fc2") for w in ("weight", "bias")}


@pytest.mark.parametrize("overlap, single, distopt", [("", "", ""), ("1", "plain", "1")])
def test_megatron_core_ddp_gradients_are_its_main_grads_and_proven(monkeypatch, overlap,
                                                                   single, distopt):
    """Megatron-Core's DistributedDataParallel, tp2 x dp2: the gradients live in its flat
    buffer (`main_grad`), added there by its backward hooks and all-reduced by
    finish_grad_sync, or, with overlap_grad_reduce and small buckets, by the hook of each
    bucket's last gradient; every one is claimed and proven. Against a single model without
    DDP (gradients in `.grad`) too: the traced hooks add each gradient once, scaled by 1/dp.
    With the distributed optimizer's layout each rank claims the pieces its shards of the
    reduce-scattered buckets hold, and together they cover every gradient."""
    monkeypatch.setenv("DDP_OVERLAP", overlap)
    monkeypatch.setenv("DDP_SINGLE", single)
    monkeypatch.setenv("DDP_DISTOPT", distopt)
    report = check(DDP, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    assert DDP_GRADS <= proven_tensors(report), sorted(proven_tensors(report))


def test_megatron_distributed_optimizer_claims_each_rank_s_shard(monkeypatch):
    """With buckets of one parameter each, every bucket is reduce-scattered in halves over
    the two data-parallel ranks: rank 2 * d + t claims half d of its tensor-parallel block
    (row-major: rows 0-3 of fc2's (8, 16) columns block, rows 8-15 of fc1's second
    half...), as a block of the single gradient."""
    monkeypatch.setenv("DDP_DISTOPT", "1")
    monkeypatch.setenv("DDP_OVERLAP", "1")
    pair = capture(DDP)
    parts = {lin["single"]: {p["sum_of"][0]: p["slice"] for p in lin["parts"]}
             for lin in pair.parallel["lineages"]}
    assert parts["grad.module.fc2.weight"] == {
        "r0:grad.module.fc2.weight": [[0, 4], [0, 16]],
        "r1:grad.module.fc2.weight": [[0, 4], [16, 32]],
        "r2:grad.module.fc2.weight": [[4, 8], [0, 16]],
        "r3:grad.module.fc2.weight": [[4, 8], [16, 32]]}
    assert parts["grad.module.fc1.weight"] == {
        "r0:grad.module.fc1.weight": [[0, 8], [0, 8]],
        "r1:grad.module.fc1.weight": [[16, 24], [0, 8]],
        "r2:grad.module.fc1.weight": [[8, 16], [0, 8]],
        "r3:grad.module.fc1.weight": [[24, 32], [0, 8]]}


@pytest.mark.parametrize("bug, distopt", [("no-grad-sync", ""), ("per-token-scaling", "1")])
def test_megatron_core_ddp_bugs_are_violations_of_the_gradients(monkeypatch, bug, distopt):
    """finish_grad_sync left out (each rank keeps its half batch's gradients), or DDP told
    the loss is per token (no 1/dp scaling: the ranks' mean gradients summed); with the
    distributed optimizer's reduce-scattered shards too."""
    monkeypatch.setenv("TVSMT_BUG", bug)
    monkeypatch.setenv("DDP_DISTOPT", distopt)
    report = check(DDP, Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    wrong = {f.tensor for f in report.failures if f.kind == "counterexample"}
    assert wrong and wrong <= DDP_GRADS, wrong


def test_no_gradient_of_a_gpt_model_under_megatron_ddp_is_refuted(monkeypatch):
    """GPTModel under Megatron's DDP (tp2 x dp2): each gradient is added into a view of
    DDP's flat buffer and read back, after the bucket's all-reduce, through another view of
    it. Shape reduction used to reduce the two views' axes independently (one gradient's
    slice of the buffer written as [2, 16] and read as [8, 4]): a reduced stage that is no
    instance of the program, and a correct gradient (linear_proj's weight) refuted. Only the
    outermost axis of a merged or split run is reduced now (tvsmt/ops/definitions/layout.py).
    One round, without the capture's rounds over hypotheses: hypotheses may be refuted
    (they are guesses), claims may time out (merged stages), none may be refuted."""
    from tvsmt.capture.build import capture_pair
    from tvsmt.pipeline import verify_plans

    monkeypatch.setenv("GPT_DDP", "1")
    single, parallel = capture_pair(GPT).plans()
    report = verify_plans(single, parallel, Options(jobs=2, timeout=5))
    refuted = [parallel.lineages[f.lineage].single for f in report.failures
               if f.kind == "counterexample" and not parallel.lineages[f.lineage].hypothesis]
    assert refuted == [], refuted
    claims = {lin.single for lin in parallel.lineages if not lin.hypothesis}
    assert "grad.module.decoder.layers.0.self_attention.linear_proj.weight" in claims
    assert report.stages_proven >= 60, report.stages_proven
