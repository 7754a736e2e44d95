"""Building a `Failure` in plan terms: the stage, its lineage, and the nodes at fault."""

from __future__ import annotations

from tvsmt.plan import Plan
from tvsmt.report.report import Failure
from tvsmt.stages import Stage


MAX_DRAWN = 400  # nodes per side whose dataflow a failure records (for the HTML drawing)


def node_entries(plan: Plan, idxs, edges: bool = True) -> list[dict]:
    """Report entries of plan nodes: id, op, rank, the producer's source line if known and,
    for the first MAX_DRAWN, the dataflow (inputs, outputs, a collective's group) that the
    HTML report draws."""
    out = []
    with_mb = isinstance(plan.world.get("mb"), int) and plan.world["mb"] > 1
    for k, i in enumerate(idxs):
        n = plan.nodes[i]
        entry = {"id": n.id, "op": n.op, "rank": n.rank}
        if with_mb:  # the micro-batch, where the plan has several (-1: none, e.g. grad sync)
            entry["mb"] = n.mb
        if n.source:
            entry["source"] = n.source
        if edges and k < MAX_DRAWN:
            entry["inputs"] = [t for t in n.inputs if t is not None]
            entry["outputs"] = [t for t in n.outputs if t is not None]
            ranks = n.attrs.get("ranks")
            if isinstance(ranks, list) and ranks:
                entry["group"] = ranks[:64]
        out.append(entry)
    return out


def cone(plan: Plan, node_idxs, tensors) -> list[int]:
    """The stage nodes that the given tensors depend on (to point at the failing part)."""
    need, out = set(tensors), []
    for i in reversed(node_idxs):
        n = plan.nodes[i]
        if any(t in need for t in n.outputs if t is not None):
            out.append(i)
            need.update(t for t in n.inputs if t is not None)
    return out[::-1]


def stage_failure(kind: str, message: str, stage: Stage | None, single: Plan, parallel: Plan,
                  part: int | None = None, node: str | None = None, tensor: str | None = None,
                  **extra) -> Failure:
    if stage is None:
        return Failure(kind, message, node=node, tensor=tensor, **extra)
    lin = parallel.lineages[stage.target]
    parts = lin.parts if part is None else [lin.parts[part]]
    return Failure(
        kind, message, stage=stage.id, lineage=stage.target, tensor=tensor or lin.single,
        slice=[list(r) for r in parts[0].slice] if part is not None else None,
        parallel_tensors=sorted({t for p in parts for t in p.sum_of}),
        single_nodes=node_entries(single, stage.single_nodes),
        parallel_nodes=node_entries(parallel, cone(parallel, stage.parallel_nodes,
                                                   [t for p in parts for t in p.sum_of])),
        node=node, **extra)


def underivable(stage: Stage, single: Plan, parallel: Plan) -> Failure:
    """A claim whose computation reaches graph inputs that no input lineage relates."""
    lin = parallel.lineages[stage.target]
    why = []
    if stage.free_single:
        why.append("the single plan computes it from " + ", ".join(stage.free_single[:4])
                   + (" ..." if len(stage.free_single) > 4 else ""))
    if stage.free_parallel:
        why.append("the parallel plan computes it from " + ", ".join(stage.free_parallel[:4])
                   + (" ..." if len(stage.free_parallel) > 4 else ""))
    msg = (f"claimed {lin.label} cannot be derived from the graph: "
           + "; ".join(why) + ", which no earlier lineage relates to the other plan")
    failure = stage_failure("structural", msg, stage, single, parallel,
                            free_tensors=list(stage.free_single) + list(stage.free_parallel))
    # Point at the parallel nodes whose outputs the lineage claims (issue 9 item 8): they may
    # lie outside the stage, when an earlier lineage already names the same tensors.
    claimed = set(lin.parallel_tensors())
    failure.parallel_nodes = node_entries(parallel, sorted(
        set(cone(parallel, stage.parallel_nodes, claimed)) |
        {i for i, n in enumerate(parallel.nodes) if any(t in claimed for t in n.outputs)}))
    return failure
