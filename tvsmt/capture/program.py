"""The typed result of tracing: one rank's (or the single device's) program as SSA nodes.

Tensor ids are local to the program (the parallel plan prefixes them with the rank); node
inputs are tensor ids, and `call` keeps the real call (OpOverload and arguments, with `Ref`
markers where the tensors go) so that the capture can run the program on concrete values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Ref:
    """Position `k` in a node's `inputs`, inside a call's argument template; `dtype` names
    the dtype of a tensor that is not floating point (written into the plan's reference)."""

    k: int
    dtype: str | None = None


@dataclass(frozen=True)
class Collective:
    """A collective call resolved while its group existed (global ranks, group order)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv
    ranks: tuple[int, ...]  # the group; (source, destination) for send and recv
    reduce: str | None = None  # sum | avg | max for reductions
    src: int | None = None  # global source rank of a broadcast
    dim: int = 0
    tag: int = 0  # send/recv: messages pair per (source, destination, tag)


P2P = ("send", "recv")  # point-to-point kinds, paired by channel rather than by group


@dataclass
class CapNode:
    id: str
    op: str  # str(OpOverload) for ATen nodes, the registry's comm op name for collectives
    inputs: list[str | None]
    outputs: list[str | None]
    attrs: dict[str, Any]
    source: str | None = None
    call: tuple | None = None  # (OpOverload, args template, kwargs template) of ATen nodes
    comm: Collective | None = None
    mb: int | None = None  # micro-batch marked by tvsmt.capture.microbatch, if any


@dataclass
class InputTensor:
    """A graph input: a parameter (qualified name), a buffer, or a leaf of the batch."""

    id: str
    kind: str  # param | buffer | batch | state (an optimizer's, from steps taken when built)
    name: str
    shape: tuple[int, ...]
    draws: list[Any] = field(default_factory=list)  # concrete values, one per random draw
    declared: Any = None  # sharding declared by the code (attributes), see lineages.py
    # the single input this one holds a block of, where the ids differ (the blocks of a ZeRO-3
    # partition; the released parameter itself holds none, see zero.py)
    single_id: str | None = None


@dataclass
class Program:
    rank: int | None  # None for the single-device program
    inputs: list[InputTensor]
    nodes: list[CapNode]
    shapes: dict[str, tuple[int, ...]]
    loss: str | None
    grads: dict[str, str | None]  # parameter qualified name -> gradient tensor id
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> name of its tensor
    objects: dict[str, Any] = field(default_factory=dict)  # model/batch of draw 0 (values)
    # parameter -> block of the single gradient its .grad holds, where the code says so
    # (a DTensor gradient's placements; see dtensor.py); others use the parameter's block
    grad_slices: dict[str, tuple] = field(default_factory=dict)
    # parameter -> [(tensor id, its block of the single gradient)]: the pieces of DeepSpeed
    # ZeRO's gradient partition this rank holds (zero.py); such a program has no `grads`
    grad_pieces: dict[str, list[tuple[str, tuple]]] = field(default_factory=dict)
    # parameter -> tensor id of its value after the step, for each parameter the step wrote
    # in place (an optimizer's update: `optimizer.step()` inside train_step)
    updated: dict[str, str] = field(default_factory=dict)
    # parameter -> {key: tensor id} of the optimizer state the step leaves for the next
    # one, where it wrote it (trace.held_optimizers; step counters aside)
    states_left: dict[str, dict[str, str]] = field(default_factory=dict)


def state_id(param: str, key: str) -> str:
    """The id of an optimizer's state tensor of a parameter, as an input of the step (its
    value after the step: `updated.` + it)."""
    return f"state.{param}.{key}"


def tensor_slots(value: Any) -> list:
    """The tensor slots of an op result in schema order (nested lists flattened): tensors or
    tensor ids, and None for an absent optional tensor; other values are skipped."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in tensor_slots(v)]
    if value is None or isinstance(value, str) or hasattr(value, "shape"):
        return [value]
    return []
