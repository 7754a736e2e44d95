"""Joining the rank programs into one parallel program: collectives paired across ranks,
one global execution order, dead code removed.

Collectives are paired per group in program order: the k-th collective a rank issues on a
group meets the k-th of every other member. A pairing that does not match (another kind,
another reduction, a member that issues fewer) is an error naming the rank and source line,
never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvsmt.capture.program import CapNode, Program
from tvsmt.errors import InputError


def rid(rank: int, tensor: str | None) -> str | None:
    """A rank's tensor (or node) id in the parallel plan."""
    return None if tensor is None else f"r{rank}:{tensor}"


@dataclass
class PlacedNode:
    """A node of the joined parallel program (ids global, inputs of collectives from every
    member of the group in group order)."""

    rank: int
    node: CapNode  # ids already global


def _where(rank: int, node: CapNode) -> str:
    return f"rank {rank}" + (f" at {node.source}" if node.source else "")


def pair_collectives(programs: dict[int, Program], path: str) -> dict[tuple[int, int], list]:
    """(rank, node index) -> the group's input tensor ids (global), for every collective."""
    per_group: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for r, prog in programs.items():
        for i, n in enumerate(prog.nodes):
            if n.comm is not None:
                if r not in n.comm.ranks:
                    raise InputError(f"{_where(r, n)}: a collective over group "
                                     f"{list(n.comm.ranks)} that does not contain this rank",
                                     file=path, node=n.id)
                per_group.setdefault(n.comm.ranks, {}).setdefault(r, []).append(i)
    inputs: dict[tuple[int, int], list] = {}
    for ranks, by_rank in per_group.items():
        for m in ranks:
            if m not in programs:
                raise InputError(f"group {list(ranks)} names rank {m}, outside the world",
                                 file=path)
        counts = {m: len(by_rank.get(m, [])) for m in ranks}
        if len(set(counts.values())) != 1:
            short = min(counts, key=counts.get)
            long = max(counts, key=counts.get)
            extra = programs[long].nodes[by_rank[long][counts[short]]]
            raise InputError(f"{_where(long, extra)}: collective {extra.op} over "
                             f"{list(ranks)} has no partner on rank {short} (rank {short} "
                             f"issues {counts[short]} collectives on this group, rank {long} "
                             f"{counts[long]})", file=path, node=extra.id)
        for k in range(counts[ranks[0]]):
            members = [(m, programs[m].nodes[by_rank[m][k]]) for m in ranks]
            first = members[0][1]
            for m, n in members[1:]:
                if (n.op, n.comm.src) != (first.op, first.comm.src) or (
                        programs[m].shapes[n.inputs[0]] != programs[ranks[0]].shapes[first.inputs[0]]):
                    raise InputError(f"{_where(m, n)}: collective {n.op} is paired with "
                                     f"{first.op} of rank {ranks[0]}"
                                     f"{' at ' + first.source if first.source else ''} "
                                     f"(collective #{k} on group {list(ranks)}) but they differ "
                                     f"in kind, source rank or shape", file=path, node=n.id)
            group_inputs = [rid(m, n.inputs[0]) for m, n in members]
            for m, _ in members:
                inputs[(m, by_rank[m][k])] = group_inputs
    return inputs


def join(programs: dict[int, Program], path: str) -> list[PlacedNode]:
    """Every rank's nodes with global ids, in one valid execution order."""
    comm_inputs = pair_collectives(programs, path)
    placed: dict[int, list[CapNode]] = {}
    for r, prog in programs.items():
        out = []
        for i, n in enumerate(prog.nodes):
            ins = comm_inputs[(r, i)] if n.comm is not None else [rid(r, t) for t in n.inputs]
            out.append(replace(n, id=rid(r, n.id), inputs=ins,
                               outputs=[rid(r, t) for t in n.outputs]))
        placed[r] = out
    available = {rid(r, i.id) for r, p in programs.items() for i in p.inputs}
    cursor = {r: 0 for r in programs}
    order: list[PlacedNode] = []
    while True:
        progressed = False
        for r in sorted(programs):
            nodes = placed[r]
            while cursor[r] < len(nodes):
                n = nodes[cursor[r]]
                if any(t is not None and t not in available for t in n.inputs):
                    break
                order.append(PlacedNode(r, n))
                available.update(t for t in n.outputs if t is not None)
                cursor[r] += 1
                progressed = True
        if all(cursor[r] == len(placed[r]) for r in programs):
            return order
        if not progressed:
            r = next(r for r in sorted(programs) if cursor[r] < len(placed[r]))
            n = placed[r][cursor[r]]
            raise InputError(f"{_where(r, n)}: {n.op} waits for a tensor no rank produces "
                             f"first (collectives issued in an order that would deadlock)",
                             file=path, node=n.id)


def live_nodes(nodes: list, outputs: set[str]) -> list:
    """The nodes some output depends on (dead code, such as the buffers of in-place
    collectives, removed). Works on CapNode and PlacedNode lists."""
    need, keep = set(outputs), []
    for item in reversed(nodes):
        n = item.node if isinstance(item, PlacedNode) else item
        if any(t in need for t in n.outputs if t is not None):
            keep.append(item)
            need.update(t for t in n.inputs if t is not None)
    return keep[::-1]
