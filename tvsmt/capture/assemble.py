"""Joining the rank programs into one parallel program: collectives paired across ranks,
one global execution order, dead code removed.

Collectives are paired per group in program order: the k-th collective a rank issues on a
group meets the k-th of every other member. A pairing that does not match (another kind,
another reduction, a member that issues fewer) is an error naming the rank and source line,
never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvsmt.capture.program import P2P, CapNode, Program
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
            if n.comm is not None and n.comm.kind not in P2P:
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


def pair_point_to_point(programs: dict[int, Program], path: str) -> dict[tuple[int, int], list]:
    """(rank, node index) of every receive -> [the sender's tensor id (global)].

    The k-th send from rank s to rank d with tag t meets the k-th receive on d from s with
    tag t (torch matches messages by source and tag, in order). A send or receive without
    its partner, or a partner of another shape, is an error naming the rank and line."""
    channels: dict[tuple[int, int, int], dict[str, list[tuple[int, int]]]] = {}
    for r, prog in programs.items():
        for i, n in enumerate(prog.nodes):
            if n.comm is not None and n.comm.kind in P2P:
                src, dst = n.comm.ranks
                for m in (src, dst):
                    if m not in programs:
                        raise InputError(f"{_where(r, n)}: {n.comm.kind} with rank {m}, "
                                         f"outside the world of {len(programs)} ranks",
                                         file=path, node=n.id)
                side = channels.setdefault((src, dst, n.comm.tag), {"send": [], "recv": []})
                side[n.comm.kind].append((r, i))
    inputs: dict[tuple[int, int], list] = {}
    for (src, dst, tag), side in sorted(channels.items()):
        sends, recvs = side["send"], side["recv"]
        for k in range(max(len(sends), len(recvs))):
            if k >= len(sends) or k >= len(recvs):
                r, i = recvs[k] if k >= len(sends) else sends[k]
                n = programs[r].nodes[i]
                what = (f"receives from rank {src} but rank {src} sends only {len(sends)}"
                        if k >= len(sends) else
                        f"sends to rank {dst} but rank {dst} receives only {len(recvs)}")
                raise InputError(f"{_where(r, n)}: {n.comm.kind} #{k} {what} message(s) "
                                 f"on this channel (tag {tag}): it has no partner",
                                 file=path, node=n.id)
            (sr, si), (rr, ri) = sends[k], recvs[k]
            sent, got = programs[sr].nodes[si], programs[rr].nodes[ri]
            s_shape = programs[sr].shapes[sent.inputs[0]]
            r_shape = programs[rr].shapes[got.outputs[0]]
            if s_shape != r_shape:
                raise InputError(f"{_where(rr, got)}: receives a {list(r_shape)} tensor but "
                                 f"the paired send of rank {sr}"
                                 f"{' at ' + sent.source if sent.source else ''} sends "
                                 f"{list(s_shape)}", file=path, node=got.id)
            inputs[(rr, ri)] = [rid(sr, sent.inputs[0])]
    return inputs


def join(programs: dict[int, Program], path: str) -> list[PlacedNode]:
    """Every rank's nodes with global ids, in one valid execution order (sends are only
    markers: a receive is a `move` from the sender's tensor)."""
    comm_inputs = pair_collectives(programs, path)
    comm_inputs.update(pair_point_to_point(programs, path))
    placed: dict[int, list[CapNode]] = {}
    for r, prog in programs.items():
        out = []
        for i, n in enumerate(prog.nodes):
            if n.comm is not None and n.comm.kind == "send":
                continue
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
