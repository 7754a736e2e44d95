"""From a capture script to the execplan pair: trace every program, join the ranks, run
both sides on concrete values, and write nodes, tensors and lineages (execplan v1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tvsmt.capture.assemble import PlacedNode, join, live_nodes, rid
from tvsmt.capture.execute import run
from tvsmt.capture.lineages import (
    CapLineage,
    Provenance,
    cast_inputs,
    hypotheses,
    input_and_claim_lineages,
)
from tvsmt.capture.program import CapNode, Program, state_id
from tvsmt.capture.script import CaptureScript, load_script
from tvsmt.capture.trace import trace_program
from tvsmt.plan.mesh import Mesh


# ATen ops whose result depends on their input's shape only (the seed of the backward pass is
# ones_like(loss)): what they make is a constant, like a mask, whatever feeds them.
VALUE_FREE = {"aten.ones_like.default", "aten.zeros_like.default", "aten.full_like.default",
              "aten.empty_like.default", "aten.new_ones.default", "aten.new_zeros.default",
              "aten.new_full.default", "aten.new_empty.default"}


@dataclass
class CapturedPair:
    """The two plans as execplan dicts, plus what the report shows about the capture."""

    script: str
    single: dict
    parallel: dict
    provenance: list[Provenance]
    timings: dict[str, float] = field(default_factory=dict)
    hypotheses: int = 0
    # claims (single tensor -> what differs) whose values differ between the programs on
    # the concrete run: a real bug, witnessed by a random input (see driver.py)
    witnessed: dict[str, str] = field(default_factory=dict)

    def plans(self):
        from tvsmt.plan.reader import check_pair, plan_from_dict

        s = plan_from_dict(self.single, f"{self.script} (single)")
        p = plan_from_dict(self.parallel, f"{self.script} (parallel)")
        check_pair(s, p)
        return s, p


def _node_dict(n: CapNode, rank: int, unmarked: int = 0) -> dict:
    d = {"id": n.id, "op": n.op, "pass": None if n.comm is not None else "fw", "rank": rank,
         "mb": unmarked if n.mb is None else n.mb, "inputs": list(n.inputs), "outputs": list(n.outputs), "attrs": n.attrs}
    if n.source:
        d["source"] = n.source
    return d


def _roles(prog: Program, prefix) -> dict[str, str]:
    roles = {prefix(i.id): {"param": "param", "buffer": "const", "batch": "input",
                            "state": "input"}[i.kind]
             for i in prog.inputs}
    roles.update({prefix(g): "grad" for g in prog.grads.values() if g is not None})
    roles.update({prefix(g): "grad" for pieces in prog.grad_pieces.values() for g, _ in pieces})
    roles.update({prefix(u): "param" for u in prog.updated.values()})
    if prog.loss is not None:
        roles[prefix(prog.loss)] = "loss"
    return roles


def _tensors(ids, shapes: dict, roles: dict) -> dict:
    return {t: {"shape": list(shapes[t]), "role": roles.get(t, "activation")} for t in ids}


def _used(nodes: list[CapNode], inputs: list[str]) -> list[str]:
    seen = dict.fromkeys(inputs)
    for n in nodes:
        for t in list(n.inputs) + list(n.outputs):
            if t is not None:
                seen.setdefault(t, None)
    return list(seen)


def capture_pair(script: str | Any, *, with_hypotheses: bool = True,
                 carry_from: CapturedPair | None = None) -> CapturedPair:
    """Trace the script's single step and every rank's step; build the plan pair.

    carry_from: a pair captured from the same code at other (small) widths. The programs are
    then traced with fake tensors (no values: any width costs nothing), must have exactly
    its structure, and take its lineages with every slice scaled to the new sizes
    (tvsmt/capture/scale.py); the report says so for every input."""
    sc: CaptureScript = load_script(script)
    timings: dict[str, float] = {}
    fake = carry_from is not None
    t0 = time.perf_counter()
    single = trace_program(sc, None, fake=fake)
    ranks = {r: trace_program(sc, r, fake=fake) for r in range(sc.world_size)}
    timings["trace"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    order = join(ranks, sc.path)
    if carry_from is None:
        lineages, provenance = input_and_claim_lineages(single, ranks, sc.param_sharding,
                                                        sc.path)
    else:
        from tvsmt.capture.scale import carried_lineages

        lineages, provenance = carried_lineages(carry_from, single, ranks, sc.path)
        with_hypotheses = False  # carried over with the rest
    claimed = {lin.single for lin in lineages if lin.kind == "claim"}
    # a gradient the ranks zeroed after their optimizer step is not a result: the update is
    s_out = ([single.loss] if single.loss is not None else []) + list(
        dict.fromkeys(g for n, g in single.grads.items() if g is not None
                      and (g in claimed or n not in single.updated))) + list(
        single.updated.values()) + [t for left in single.states_left.values()
                                    for t in left.values() if t in claimed]
    s_nodes = live_nodes(single.nodes, set(s_out))
    claim_ids = {t for lin in lineages if lin.kind == "claim" for p in lin.parts
                 for t in p.sum_of}
    p_nodes: list[PlacedNode] = live_nodes(order, claim_ids)
    timings["convert"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    n_hyp, witnessed = 0, {}
    produced = [t for pn in p_nodes for t in pn.node.outputs if t is not None]
    position = {t: i for i, t in enumerate(produced)}
    if with_hypotheses:
        s_values = run([(0, n) for n in s_nodes], {i.id: i.draws[0] for i in single.inputs})
        p_inputs = {rid(r, i.id): i.draws[0] for r, p in ranks.items() for i in p.inputs}
        p_inputs.update(cast_inputs(single, lineages, p_inputs))
        p_values = run([(pn.rank, pn.node) for pn in p_nodes], p_inputs)
        p_shapes = {rid(r, t): s for r, p in ranks.items() for t, s in p.shapes.items()}
        s_order = [t for n in s_nodes for t in n.outputs if t is not None]
        s_ops = {t: n.op for n in s_nodes for t in n.outputs if t is not None}
        p_ops = {t: pn.node.op for pn in p_nodes for t in pn.node.outputs if t is not None}
        # tensors computed from constants alone (rotary tables, masks) are recomputed by any
        # stage that needs them: never hypothesised
        varying = {rid(r, i.id) for r, p in ranks.items() for i in p.inputs}
        for pn in p_nodes:
            if pn.node.op not in VALUE_FREE and any(t in varying for t in pn.node.inputs
                                                    if t is not None):
                varying.update(t for t in pn.node.outputs if t is not None)
        constant = {t for t in produced if t not in varying}
        # a square is never cut: the stage that takes its root must see that it is a
        # square (>= 0) to know sqrt(t) ** 2 = t (SymbolicBackend.ipow, clipping's norms)
        squares = {t for pn in p_nodes if _squares(pn.node) for t in pn.node.outputs if t}
        hyps = hypotheses(single, s_values, produced, p_values, p_shapes,
                          claim_ids | constant | squares, s_order, s_ops, p_ops)
        n_hyp = len(hyps)
        before = {t: f"param.{n}" for n, t in single.updated.items()}
        before |= {t: state_id(n, k) for n, left in single.states_left.items()
                   for k, t in left.items() if state_id(n, k) in s_values}
        witnessed = concrete_mismatches(lineages, s_values, p_values, before)
        lineages += hyps
    for lin in lineages:
        if lin.kind == "claim" or (lin.kind == "hypothesis" and fake):
            lin.position = max(position.get(t, -1) for p in lin.parts for t in p.sum_of)
    lineages.sort(key=lambda lin: (lin.position, lin.kind != "hypothesis"))
    timings["lineages"] = time.perf_counter() - t0

    s_roles = _roles(single, lambda t: t)
    p_roles: dict[str, str] = {}
    p_shapes: dict[str, tuple] = {}
    for r, prog in ranks.items():
        p_roles.update(_roles(prog, lambda t, r=r: rid(r, t)))
        p_shapes.update({rid(r, t): s for t, s in prog.shapes.items()})
    s_ids = _used(s_nodes, [i.id for i in single.inputs])
    p_ids = _used([pn.node for pn in p_nodes],
                  [rid(r, i.id) for r, p in ranks.items() for i in p.inputs])
    world = sc.world_size
    mesh, layout = world_layout(world, [pn.node.comm.ranks for pn in p_nodes
                                        if pn.node.comm is not None])
    marked = sorted({pn.node.mb for pn in p_nodes if pn.node.mb is not None})
    n_mb = max(marked) + 1 if marked else 1
    name = _name(sc.path)
    single_dict = {
        "format": "tvsmt.execplan", "version": 1, "name": name, "kind": "single",
        "world": {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1,
                  "model": {"capture": sc.path}},
        "tensors": _tensors(s_ids, single.shapes, s_roles),
        "nodes": [_node_dict(n, 0) for n in s_nodes],
        "outputs": s_out, "lineages": []}
    parallel_dict = {
        "format": "tvsmt.execplan", "version": 1, "name": name, "kind": "parallel",
        "world": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "mb": n_mb, "ranks": world,
                  "model": {"capture": sc.path, "layout": layout}},
        "tensors": _tensors(p_ids, p_shapes, p_roles),
        # outside the marked micro-batches (gradient synchronisation): no micro-batch
        "nodes": [_node_dict(pn.node, pn.rank, -1 if marked else 0) for pn in p_nodes],
        "outputs": [],
        "lineages": [_lineage_dict(lin) for lin in lineages]}
    pair = CapturedPair(sc.path, single_dict, parallel_dict, provenance, timings,
                        n_hyp or sum(lin.kind == "hypothesis" for lin in lineages), witnessed)
    if carry_from is not None:
        from tvsmt.capture.scale import check_same_structure

        check_same_structure(carry_from, pair)
    return pair


def world_layout(world: int, groups: list[tuple[int, ...]]) -> tuple[Mesh, str]:
    """The (dp, tp) mesh that the code's collective groups fit, and how it was found.

    A factorisation dp x tp of the world fits when every group is a tensor-parallel group
    (ranks d*tp .. d*tp+tp-1) or a data-parallel one (ranks t, t+tp, ...) of it and both
    axes of size > 1 carry a collective. Exactly one must fit; otherwise (no collective,
    pipeline stages, several fits such as one group over the whole world) the world stays
    one axis of WORLD_SIZE ranks and the layout says so."""
    seen = {tuple(sorted(g)) for g in groups}
    fits = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        mesh = Mesh(dp=world // tp, tp=tp)
        axes = {ax: {tuple(mesh.group(r, ax)) for r in range(world)} for ax in ("dp", "tp")}
        if all(any(g in axes[ax] for ax in axes) for g in seen) and all(
                any(g in axes[ax] for g in seen) for ax in axes if getattr(mesh, ax) > 1):
            fits.append(mesh)
    if len(fits) == 1 and fits[0].dp > 1 and fits[0].tp > 1:
        m = fits[0]
        return m, f"dp {m.dp} x tp {m.tp}, from the groups the code creates"
    return Mesh(tp=world), ("captured ranks: the groups do not determine a dp x tp layout, "
                            "so none is assumed")


def _squares(node) -> bool:
    """Does the node square its input (`x ** 2`, as a norm computes)?"""
    args = node.call[1] if node.call is not None else ()
    return node.op == "aten.pow.Tensor_Scalar" and len(args) > 1 and args[1] == 2


def concrete_mismatches(lineages: list[CapLineage], s_values: dict, p_values: dict,
                        before: dict[str, str] | None = None) -> dict[str, str]:
    """The claims that the concrete run (random draw 0, every rank) already contradicts:
    single tensor -> the rank tensor and how far it is off.

    before: updated parameter (or optimizer state) -> the single input it was before the
    step. An update is
    compared as the step it took (after - before, the same `before` on both sides: the
    ranks' parameters are drawn as blocks of the single ones): a wrong step of a small
    learning rate is well inside the parameters' own tolerance. The tolerance then adds
    float32's rounding of the values the steps are taken from."""
    out = {}
    for lin in lineages:
        if lin.kind != "claim" or lin.single not in s_values:
            continue
        start_id = (before or {}).get(lin.single, "")
        base = s_values.get(start_id)
        whose = "optimizer state's" if start_id.startswith("state.") else "parameter's"
        for part in lin.parts:
            t = part.sum_of[0]
            block = tuple(slice(a, b) for a, b in part.slice)
            want, got = s_values[lin.single][block].double(), p_values.get(t)
            if got is None or got.shape != want.shape:
                continue
            got, step = got.double(), False
            atol = 1e-5 * (1 + float(want.abs().max()))
            if base is not None and base[block].shape == want.shape:
                start = base[block].double()
                slack = 4 * torch.finfo(torch.float32).eps * float(
                    torch.maximum(want.abs(), got.abs()).max())
                want, got, step = want - start, got - start, True
                atol = 1e-4 * float(want.abs().max()) + slack  # the step's own scale
            if not torch.allclose(got, want, rtol=1e-3, atol=atol):
                err = float((got - want).abs().max())
                how = f" (the step from the {whose} value before it)" if step else ""
                out[lin.single] = (f"on the concrete run (random inputs) {t} differs from "
                                   f"its block of {lin.single} by up to {err:.3g}{how}")
                break
    return out


def _lineage_dict(lin: CapLineage) -> dict:
    parts = []
    for p in lin.parts:
        d: dict[str, Any] = {"slice": [list(r) for r in p.slice], "sum_of": list(p.sum_of)}
        if p.scale is not None:
            d["scale"] = list(p.scale)
        parts.append(d)
    out: dict[str, Any] = {"single": lin.single, "parts": parts}
    if lin.hypothesis:
        out["hypothesis"] = True
    return out


def _name(path: str) -> str:
    import os

    return "capture_" + os.path.splitext(os.path.basename(path))[0]
