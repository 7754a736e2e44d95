"""A plan's dataflow graph: producer and consumer indexes, backward slicing.

Like torch.fx, nodes stay in their (validated) topological order; tensors are edges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tvsmt.plan.model import Node, Plan


class Graph:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.nodes: list[Node] = plan.nodes
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(plan.nodes):
            for t in n.outputs:
                if t is not None:
                    self.producer[t] = i
            for t in n.inputs:
                if t is not None:
                    self.consumers.setdefault(t, []).append(i)

    def is_input(self, tensor: str) -> bool:
        """A graph input: written by no node (data, weights, constants, seeds)."""
        return tensor not in self.producer

    def backward_slice(self, targets: Iterable[str], stop: Callable[[str], bool]
                       ) -> tuple[list[int], list[str]]:
        """Nodes needed to compute `targets` from tensors where `stop` holds.

        Returns (node indices in topological order, frontier tensors). The frontier holds the
        stop tensors reached and the graph inputs reached (in first-reached order).
        """
        nodes: set[int] = set()
        frontier: dict[str, None] = {}
        seen: set[str] = set()
        stack = list(dict.fromkeys(targets))[::-1]
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if stop(t) or t not in self.producer:
                frontier[t] = None
                continue
            i = self.producer[t]
            if i in nodes:
                continue
            nodes.add(i)
            for u in reversed(self.nodes[i].inputs):
                if u is not None and u not in seen:
                    stack.append(u)
        return sorted(nodes), list(frontier)
