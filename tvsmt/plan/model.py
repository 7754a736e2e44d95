"""The in-memory form of an execution plan (see ../shared/spec/execplan-v1.md).

Plain frozen dataclasses: every later phase reads these and never the raw JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    id: str
    shape: tuple[int, ...]
    role: str = "activation"


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    op: str
    pass_: str | None  # "fw", "bw" or None (communication / finalization)
    rank: int
    mb: int
    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    # Where the node came from in the producer's code ("train.py:42"), for reports only:
    # never semantic, never compared (optional "source" key of a plan node).
    source: str | None = field(default=None, hash=False, compare=False)

    @property
    def is_backward(self) -> bool:
        return self.pass_ == "bw"

    def describe(self) -> str:
        kind = f"{self.op}/{self.pass_}" if self.pass_ else self.op
        return f"{self.id} ({kind} on rank {self.rank}, mb {self.mb})"


@dataclass(frozen=True, slots=True)
class LineagePart:
    """`single[slice] == scale * sum(sum_of)` elementwise."""

    slice: tuple[tuple[int, int], ...]
    sum_of: tuple[str, ...]
    scale: Fraction = Fraction(1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.slice)


@dataclass(frozen=True)
class Aligned:
    single: tuple[str, ...]
    parallel: tuple[str, ...]
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class Lineage:
    index: int
    single: str
    parts: tuple[LineagePart, ...]
    aligned: Aligned | None = None
    # A hypothesis only serves to cut stages (a frontend inferred it, e.g. the PyTorch
    # capture): if its stage is not proven it is dropped and the neighbouring stages merge;
    # only a failing claim that is not a hypothesis can make a violation.
    hypothesis: bool = False

    def parallel_tensors(self) -> list[str]:
        """Every parallel tensor named by a part, first occurrence order, no duplicates."""
        seen: dict[str, None] = {}
        for part in self.parts:
            for t in part.sum_of:
                seen.setdefault(t, None)
        return list(seen)


@dataclass
class Plan:
    path: str
    name: str
    kind: str  # "single" | "parallel"
    world: dict[str, Any]
    tensors: dict[str, TensorInfo]
    nodes: list[Node]
    outputs: list[str]
    lineages: list[Lineage]

    def shape(self, tensor: str) -> tuple[int, ...]:
        return self.tensors[tensor].shape
