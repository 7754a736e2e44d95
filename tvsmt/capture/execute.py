"""Running captured programs on concrete values (torch, CPU), collectives computed across
ranks: the values that lineage inference and the intermediate hypotheses are matched on.

It runs the converted nodes themselves (the functional form of every in-place op, the comm
nodes with their group inputs), so what is matched is what the plans say. It runs them in
float64, whatever floating dtype the code computes in (a cast to bfloat16 or float32 is a
cast to float64): the proofs are over the reals, and the run is their concrete check, so
the rounding of a low precision (bf16 autocast: 1e-2 apart) must not read as a difference
between the programs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from tvsmt.capture.program import CapNode, Ref, tensor_slots
from tvsmt.errors import InputError, InternalError


def _fill(template: Any, tensors: list) -> Any:
    if isinstance(template, Ref):
        return tensors[template.k]
    if isinstance(template, torch.dtype) and template.is_floating_point:
        return torch.float64
    if isinstance(template, list):
        return [_fill(x, tensors) for x in template]
    if isinstance(template, tuple):
        return tuple(_fill(x, tensors) for x in template)
    if isinstance(template, dict):
        return {k: _fill(x, tensors) for k, x in template.items()}
    return template


def _piece(x: torch.Tensor, n: int, idx: int, dim: int) -> torch.Tensor:
    return torch.chunk(x, n, dim=dim)[idx]


def _collective(node: CapNode, xs: list[torch.Tensor], rank: int) -> torch.Tensor:
    c = node.comm
    pos = list(c.ranks).index(rank)
    if c.kind == "all_reduce" and c.reduce == "max":
        return torch.stack(xs).amax(0)
    if c.kind == "all_reduce":
        total = torch.stack(xs).sum(0)
        return total / len(xs) if c.reduce == "avg" else total
    if c.kind == "all_gather":
        return torch.cat(xs, dim=c.dim)
    if c.kind == "reduce_scatter":
        total = torch.stack(xs).sum(0)
        total = total / len(xs) if c.reduce == "avg" else total
        return _piece(total, len(xs), pos, c.dim)
    if c.kind == "all_to_all":
        return torch.cat([_piece(x, len(xs), pos, c.dim) for x in xs], dim=c.dim)
    if c.kind == "recv":  # a move: the sender's tensor
        return xs[0]
    if c.kind == "broadcast":
        return xs[list(c.ranks).index(c.src)]
    raise InputError(f"no concrete semantics for collective {c.kind}")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def run(nodes: list[tuple[int, CapNode]], values: dict[str, torch.Tensor]) -> dict:
    """Execute (rank, node) pairs in order; `values` holds the inputs and receives the rest
    (floating ones in float64)."""
    for t, v in list(values.items()):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float64:
            values[t] = v.double()
    with torch.no_grad(), _default_dtype(torch.float64):  # factories without a dtype
        for rank, n in nodes:
            xs = [None if t is None else values[t] for t in n.inputs]
            try:
                if n.comm is not None:
                    outs = [_collective(n, xs, rank)]
                else:
                    target, args, kwargs = n.call
                    outs = tensor_slots(target(*_fill(args, xs), **_fill(kwargs, xs)))
            except (InputError, InternalError):
                raise
            except Exception as e:  # noqa: BLE001 - the converted program is tvsmt's own
                at = f" at {n.source}" if n.source else ""
                raise InternalError(f"while executing the captured program of rank {rank}, "
                                    f"node {n.id} ({n.op}){at}: {type(e).__name__}: {e}",
                                    node=n.id, op=n.op) from e
            for t, v in zip(n.outputs, outs):
                if t is not None and isinstance(v, torch.Tensor):
                    values[t] = v
    return values
