"""Generator of execplan v1 plan pairs (single + parallel) for one training iteration.

    single, parallel = generate_pair("llama3", layers=2, dp=2, tp=2, pp=2, mb=2)
    write_pair("out/", "llama3", dp=2, tp=2, pp=2, mb=2)   # out/single.json.gz, parallel.json.gz

Design decisions (see also llama.py / mlp.py for the tensor-parallel layout):

* Loss: a plain `sum` of the final activations (logits for llama3). Every (replica,
  micro-batch) computes the sum over its own rows; the single loss is the sum of these partial
  losses, so no loss scaling is needed: every micro-batch is seeded with dL/dL itself (a graph
  input, role grad, shape [1]) and the weight gradients are plain sums (grad_accum over
  micro-batches, reducer over replicas, no averaging). The loss is an output of the single
  plan, so the parallel plan also computes the whole loss: each last-stage rank adds up its
  micro-batches' partial losses (one n-ary `grad_accum`) and an `all_reduce` over the
  data-parallel group sums the replicas' (Megatron's loss reporting, without its averaging). Its lineages:
  the partial losses (one part per tp rank, sum_of = every (replica, micro-batch)), the
  per-rank sums, then whole copies on every last-stage rank.
* Data parallelism and micro-batches: replica d, micro-batch m holds rows
  [(d*mb + m)*b, (d*mb + m + 1)*b) of the global batch (b = batch / (dp*mb)).
* Pipeline parallelism: layers are split into pp contiguous groups (balanced, the first stages
  take the extra layers); the embedding and the mask are on stage 0, the final norm, head and
  loss on the last stage. Activations (and the mask) move stage to stage with `move` node
  pairs (sender on the source rank writes an in-flight tensor, receiver on the destination
  reads it), gradients move back the same way. Every tp rank moves its own copy.
* Schedule: micro-batch by micro-batch (m outer, replica inner), forward then backward; weight
  gradients are summed by one n-ary `grad_accum` per rank after the last micro-batch's
  backward (n-ary, so that every micro-batch's part of the plan is the same, which replica
  folding relies on); reducers come last.
* Ranks: rank = dp_index*(pp*tp) + pp_stage*tp + tp_index (as the reference fixtures).
* Lineages: one per (single tensor, parallel representation), graph inputs first, then in
  creation order (a dependency order); a weight read by several micro-batches is listed once
  per (replica, micro-batch, tp rank), as in the fixtures; `aligned` hints on compute nodes
  (except multiref) and on reducers. Single-plan tensor ids are readable names
  (`L0.attn.q`, `L0.attn.wq.grad`, `loss`); parallel ids add `~version@r<rank>m<mb>`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tvsmt.frontends import llama, mlp, moe
from tvsmt.frontends.builder import PlanBuilder, write_plan
from tvsmt.frontends.spmd import Tracer, World
from tvsmt.heap import collector_paused

MODELS = {"llama3": llama.forward, "mlp": mlp.forward, "moe": moe.forward,
          "deepseek-v3": moe.deepseek_v3_forward}
SEED_KEY = "loss.grad"
RANK_LAYOUT = "rank = dp_index*(pp*tp) + pp_stage*tp + tp_index"


@dataclass(frozen=True)
class ModelConfig:
    model: str = "llama3"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 128
    seq: int = 8
    batch: int = 2
    eps: float = 1e-5


def default_batch(dp: int, mb: int) -> int:
    """Enough rows for every (replica, micro-batch) (at least 2 in total)."""
    n = dp * mb
    return n if n >= 2 else 2


def stage_of_layers(layers: int, pp: int) -> list[int]:
    """Balanced contiguous split of the layers over pp stages (first stages take the rest)."""
    base, extra = divmod(layers, pp)
    out = []
    for s in range(pp):
        out += [s] * (base + (1 if s < extra else 0))
    return out


def validate(cfg: ModelConfig, world: World) -> None:
    def positive(name: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")

    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r} (choose from {', '.join(MODELS)})")
    for name in ("layers", "hidden", "batch") + (("heads", "ffn", "vocab", "seq")
                                                 if cfg.model == "llama3" else ()):
        positive(name, getattr(cfg, name))
    for name in ("dp", "tp", "pp", "mb"):
        positive(name, getattr(world, name))
    dp, tp, pp, mb = world.dp, world.tp, world.pp, world.mb
    if cfg.batch % (dp * mb):
        raise ValueError(f"batch {cfg.batch} is not divisible by dp*mb = {dp}*{mb}")
    if pp > cfg.layers:
        raise ValueError(f"pp={pp} pipeline stages need at least {pp} layers, not {cfg.layers}")
    if cfg.model == "mlp":
        if tp > 1 and cfg.layers > 1 and cfg.hidden % tp:
            raise ValueError(f"hidden {cfg.hidden} is not divisible by tp={tp}")
        return
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden {cfg.hidden} is not divisible by heads {cfg.heads}")
    if (cfg.hidden // cfg.heads) % 2:
        raise ValueError(f"head_dim {cfg.hidden // cfg.heads} must be even (rotary pairs)")
    for name in ("heads", "ffn", "vocab"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name} {getattr(cfg, name)} is not divisible by tp={tp}")
    if cfg.model in ("moe", "deepseek-v3"):
        shaped = moe._WithShape(cfg, moe.DEEPSEEK_V3) if cfg.model == "deepseek-v3" else cfg
        moe.validate(shaped, tp, world.ep, cfg.batch // (dp * mb) * cfg.seq)
    elif world.ep is not None:
        raise ValueError(f"ep={world.ep}: expert parallelism exists for the moe models only")


def _world_dict(cfg: ModelConfig, world: World) -> dict[str, Any]:
    model: dict[str, Any] = {
        "family": cfg.model, "layers": cfg.layers, "hidden": cfg.hidden, "gbs": cfg.batch,
        "rank_layout": RANK_LAYOUT, "loss": "sum", "loss_tensor": "loss",
        "loss_grad_seed": SEED_KEY, "generator": "tvsmt.frontends.generator",
        "pipeline_stages": stage_of_layers(cfg.layers, world.pp),
    }
    if cfg.model == "llama3":
        model.update({"heads": cfg.heads, "head_dim": cfg.hidden // cfg.heads, "ffn": cfg.ffn,
                      "vocab": cfg.vocab, "seqlen": cfg.seq, "eps": cfg.eps,
                      "tensor_parallel": {
                          "attention": "q/k/v column-parallel (heads split), output "
                                       "row-parallel + all_reduce",
                          "ffn": "gate/up column-parallel, down row-parallel + all_reduce",
                          "norms": "replicated, no sequence parallelism",
                          "embedding": "replicated",
                          "lm_head": "column-parallel (vocab split), logits all_gather"}})
    else:
        model["tensor_parallel"] = {"layers": mlp.layer_modes(cfg.layers)}
    if cfg.model in ("moe", "deepseek-v3"):
        model["expert_parallel"] = {
            "ep": world.ep_size, "groups": "ep consecutive ranks of the tp group",
            "dispatch": "moe_dispatch + all_to_all, combine: all_to_all + moe_combine",
            "expert_grads": "one reducer over the expert-data-parallel group (dp * tp/ep)"}
    return {"dp": world.dp, "tp": world.tp, "pp": world.pp, "mb": world.mb,
            "ranks": world.ranks, "model": model}


def _trace(cfg: ModelConfig, world: World, kind: str, name: str) -> tuple[PlanBuilder, Tracer]:
    builder = PlanBuilder(f"{name}_{kind}", kind, _world_dict(cfg, world))
    tr = Tracer(builder, world)
    forward = MODELS[cfg.model]
    b = cfg.batch // (world.dp * world.mb)
    stage_of = stage_of_layers(cfg.layers, world.pp)
    losses = {}
    for m in range(world.mb):
        for d in range(world.dp):
            tr.start_run(d, m)
            losses[(d, m)] = loss = forward(tr, cfg, b, stage_of)
            tr.backward(loss, SEED_KEY)
    tr.finalize_gradients()
    tr.finalize_loss(losses)
    return builder, tr


def build_pair(cfg: ModelConfig, world: World) -> tuple[dict, dict]:
    """(single, parallel) plan dicts. The cyclic collector is paused while they are traced:
    millions of new acyclic dicts and lists made it run a full collection again and again
    (2.5x the tracing time of a 32-layer dp2 tp8 pp16 mb2 pair: scripts/bench_generate.py)."""
    with collector_paused():
        return _build_pair(cfg, world)


# What building a pair in memory costs, to refuse one that cannot fit before it is begun
# (`--layers 1000000000` took 15 GB in 15 s): at most this many parallel nodes per layer,
# replica, micro-batch and tensor-parallel rank (measured on small worlds: llama3 109-135,
# moe 124-155, deepseek-v3 114-135, mlp 3-7), each about this many bytes while built (1.49
# GB peak for the 494k nodes of a 4-layer llama3 dp16 pp4 tp8 mb8 pair).
NODES_PER_LAYER_AND_RANK_UNIT = 160
BYTES_PER_NODE = 3200


def estimated_nodes(cfg: ModelConfig, world: World) -> int:
    """An upper bound of the parallel plan's nodes (the generator's, not a measurement)."""
    return cfg.layers * world.dp * world.mb * world.tp * NODES_PER_LAYER_AND_RANK_UNIT


class TooLargeToBuild(ValueError):
    """A pair that would not fit in this machine's free memory (`check_fits_in_memory`)."""


def check_fits_in_memory(cfg: ModelConfig, world: World) -> None:
    """TooLargeToBuild when building the pair would take more memory than this machine has
    free (`psutil`'s available memory): an error before the work, not the machine's memory
    exhausted after minutes of it."""
    import psutil

    nodes = estimated_nodes(cfg, world)
    need, free = nodes * BYTES_PER_NODE, psutil.virtual_memory().available
    if need > free:
        raise TooLargeToBuild(
            f"a plan of up to {nodes:,} parallel nodes would take about {need / 2**30:,.1f} GB "
            f"to build, more than the {free / 2**30:.1f} GB free: fewer layers or ranks")


def _build_pair(cfg: ModelConfig, world: World) -> tuple[dict, dict]:
    validate(cfg, world)
    check_fits_in_memory(cfg, world)
    name = (f"{cfg.model}_dp{world.dp}_tp{world.tp}_pp{world.pp}_mb{world.mb}"
            + (f"_ep{world.ep}" if world.ep is not None else "") + f"_ly{cfg.layers}")
    sb, st = _trace(cfg, World(), "single", name)
    sb.add_output("loss")
    for key in st.weight_grads:
        sb.add_output(key)
    pb, pt = _trace(cfg, world, "parallel", name)
    if pt.weight_grads != st.weight_grads:
        raise AssertionError("single and parallel traces disagree on the weights")
    pt.emit_lineages({tid: tuple(info["shape"]) for tid, info in sb.tensors.items()})
    return sb.to_dict(), pb.to_dict()


def generate_pair(model: str = "llama3", layers: int = 2, hidden: int = 64, heads: int = 4,
                  ffn: int = 128, vocab: int = 128, seq: int = 8, batch: int | None = None,
                  dp: int = 1, tp: int = 1, pp: int = 1, mb: int = 1,
                  eps: float = 1e-5, ep: int | None = None) -> tuple[dict, dict]:
    """(single, parallel) execplan v1 dicts of one training iteration of `model`; `ep`: the
    expert-parallel size of the moe models (a divisor of tp, default tp).

    Raises ValueError for an unknown model or a configuration that does not divide (batch by
    dp*mb, heads/ffn/vocab by tp, hidden by heads, fewer layers than pipeline stages, ...)."""
    if batch is None:
        batch = default_batch(dp, mb) if isinstance(dp, int) and isinstance(mb, int) else 2
    cfg = ModelConfig(model, layers, hidden, heads, ffn, vocab, seq, batch, eps)
    return build_pair(cfg, World(dp, tp, pp, mb, ep))


def write_pair(out_dir: str | os.PathLike, model: str = "llama3", **kw) -> tuple[str, str]:
    """Generate a pair and write `single.json.gz` and `parallel.json.gz` into out_dir."""
    single, parallel = generate_pair(model, **kw)
    return write_pair_dicts(out_dir, single, parallel)


def write_pair_dicts(out_dir: str | os.PathLike, single: dict, parallel: dict,
                     suffix: str = ".json.gz") -> tuple[str, str]:
    """Write single{suffix} and parallel{suffix} (".jsonl.gz": the streaming form)."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    return (write_plan(os.path.join(out_dir, "single" + suffix), single),
            write_plan(os.path.join(out_dir, "parallel" + suffix), parallel))


__all__ = ["ModelConfig", "TooLargeToBuild", "World", "generate_pair", "write_pair",
           "write_pair_dicts", "build_pair", "validate", "stage_of_layers"]
