"""Carrying a capture's lineages over to the same code at other widths (Llama-3-8B sizes
traced with fake tensors, where no value can be computed to infer anything).

The small capture infers every lineage from values; the wide programs are traced with fake
tensors and must have exactly the small ones' structure (the same nodes, ops and dataflow
on every rank; only sizes differ). Every slice is then scaled per dimension by the ratio of
the single tensor's sizes, and each rank tensor must have the scaled block's shape. The
input lineages stay assumptions, now *carried over by structure* (the report says so);
hypotheses only cut stages as always, so a wrongly scaled one is dropped, never a pass.
"""

from __future__ import annotations

from tvsmt.capture.assemble import rid
from tvsmt.capture.lineages import CapLineage, Part, Provenance
from tvsmt.capture.program import Program
from tvsmt.errors import InputError


def _scaled(sl, small_shape, big_shape, what: str, path: str):
    out = []
    for (a, b), n, m in zip(sl, small_shape, big_shape):
        if m % n:
            raise InputError(f"{what}: size {m} is not a multiple of {n} at the small widths; "
                             f"its lineage cannot be carried over", file=path, tensor=what)
        f = m // n
        out.append((a * f, b * f))
    return tuple(out)


def carried_lineages(small, single: Program, ranks: dict[int, Program], path: str
                     ) -> tuple[list[CapLineage], list[Provenance]]:
    """The small pair's lineages at the sizes of the traced wide programs."""
    s_big = single.shapes
    s_small = {t: tuple(v["shape"]) for t, v in small.single["tensors"].items()}
    p_big = {rid(r, t): shape for r, p in ranks.items() for t, shape in p.shapes.items()}
    inputs = {rid(r, i.id) for r, p in ranks.items() for i in p.inputs}
    out: list[CapLineage] = []
    for lin in small.parallel["lineages"]:
        single_t = lin["single"]
        if single_t not in s_big or single_t not in s_small:
            raise InputError(f"the wide single program has no tensor {single_t}: its "
                             f"structure differs from the small one", file=path)
        parts = []
        for p in lin["parts"]:
            sl = _scaled([tuple(r) for r in p["slice"]], s_small[single_t], s_big[single_t],
                         single_t, path)
            for t in p["sum_of"]:
                want = tuple(b - a for a, b in sl)
                if p_big.get(t) != want:
                    raise InputError(f"{t} has shape {list(p_big.get(t) or [])} at these "
                                     f"widths, not the scaled block {list(want)} of "
                                     f"{single_t}: the lineage cannot be carried over",
                                     file=path, tensor=t)
            scale = tuple(p["scale"]) if p.get("scale") else None
            parts.append(Part(sl, tuple(p["sum_of"]), scale))
        tensors = {t for p in parts for t in p.sum_of}
        kind = ("hypothesis" if lin.get("hypothesis") else
                "input" if tensors <= inputs else "claim")
        out.append(CapLineage(single_t, parts, kind == "hypothesis",
                              -1 if kind == "input" else 0, kind))
    prov = []
    for p in small.provenance:
        sl = _scaled(p.slice, s_small[p.tensor], s_big[p.tensor], p.tensor, path)
        prov.append(Provenance(p.tensor, p.rank, sl, f"carried over by structure from the "
                                                     f"small widths, where it was {p.how}"))
    return out, prov


def _skeleton(plan: dict) -> list[tuple]:
    return [(n["id"], n["op"], n["rank"], tuple(n["inputs"]), tuple(n["outputs"]))
            for n in plan["nodes"]]


def check_same_structure(small, big) -> None:
    """Refuse a wide capture whose programs are not the small ones' (a lineage carried over
    to a different program would be a guess)."""
    for kind in ("single", "parallel"):
        a, b = _skeleton(getattr(small, kind)), _skeleton(getattr(big, kind))
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            node = b[at][0] if at < len(b) else None
            raise InputError(f"the {kind} program at these widths differs in structure from "
                             f"the small one (node {at} of {len(a)}/{len(b)}): lineages "
                             f"cannot be carried over", file=big.script, node=node)
