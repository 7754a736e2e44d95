"""torch's foreach kernels (`torch._foreach_mul_(grads, c)`: a list of tensors in, a list or
nothing out) traced as the per-tensor loop they stand for.

An in-place foreach op returns nothing the tracer can follow, and a list of norms is no
operator the registry models; per tensor they are the ordinary ATen ops the registry has
(`mul_`, `add_`, `linalg_vector_norm`, ...), the same arithmetic. Optimizers and
`clip_grad_norm_` take them when the code asks (`foreach=True`) or when a tensor type
declares support (DTensor, see `as_loops`).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

PREFIX = "_foreach_"
# the per-tensor op where it is not the foreach op's name without its prefix
PER_TENSOR = {"norm": "linalg_vector_norm", "maximum_": "maximum", "minimum_": "minimum"}
# in-place foreach ops whose per-tensor op is out of place: the result copied back
COPIED_BACK = frozenset({"maximum_", "minimum_"})
# arguments the foreach schema takes by position and the per-tensor op by keyword only
# (`_foreach_addcmul_(self, t1, t2, value)` against `addcmul_(self, t1, t2, *, value)`),
# with the per-tensor keyword
KEYWORD_ONLY = {"value": "value", "alpha": "alpha", "dtype": "dtype"}
ADDC = frozenset({"addcmul", "addcmul_", "addcdiv", "addcdiv_"})  # their `scalars` is `value`
# overloads with a tensor of one scalar per list element (`scalars[i]` would be a read of
# values): refused in one line
REFUSED_OVERLOADS = frozenset({"Tensor"})


def _nth(arg, i: int, n: int):
    """Element i of a list argument of the foreach call (a list of n tensors or scalars);
    any other argument is the same for every element."""
    if isinstance(arg, (list, tuple)) and len(arg) == n:
        return arg[i]
    return arg


def _loop(base: str, qualified: str, schema):
    per_tensor = getattr(torch.ops.aten, PER_TENSOR.get(base, base))
    in_place = base.endswith("_")
    names = [a.name for a in schema.arguments]
    keywords = {**KEYWORD_ONLY, "scalars": "value"} if base in ADDC else KEYWORD_ONLY

    def loop(*args, **kwargs):
        moved = [i for i, name in enumerate(names[:len(args)]) if name in keywords]
        kwargs = {keywords.get(k, k): v for k, v in kwargs.items()}
        kwargs.update({keywords[names[i]]: args[i] for i in moved})
        args = tuple(a for i, a in enumerate(args) if i not in moved)
        lists = [a for a in args if isinstance(a, (list, tuple))]
        n = len(lists[0]) if lists else 0
        results = []
        for i in range(n):
            out = per_tensor(*[_nth(a, i, n) for a in args],
                             **{k: _nth(v, i, n) for k, v in kwargs.items()})
            if base in COPIED_BACK:
                out = args[0][i].copy_(out)
            results.append(out)
        return None if in_place else results

    loop.__name__ = f"{qualified} as a loop"
    return loop


def _refused(qualified: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{qualified} (a tensor of one scalar per element) is not "
                                  f"captured; the per-tensor form (foreach=False) is")
    return refuse


@functools.cache
def loop_decompositions() -> dict:
    """{foreach OpOverload: its per-tensor loop} for every foreach op of the pinned torch
    whose per-tensor op exists (built once per process)."""
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith(f"aten::{PREFIX}")}
    table = {}
    for name in sorted(names):
        base = name[len(PREFIX):]
        if not hasattr(torch.ops.aten, PER_TENSOR.get(base, base)):
            continue  # _foreach_powsum: no per-tensor op, left to fail as it does
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            if overload.endswith("out"):
                continue
            qualified = f"aten.{name}.{overload}"
            refused = overload in REFUSED_OVERLOADS and base in ADDC
            op = getattr(packet, overload)
            table[op] = _refused(qualified) if refused else _loop(base, qualified, op._schema)
    return table


@contextmanager
def as_loops():
    """torch's per-tensor loops where it would take a foreach kernel over DTensors.

    DTensor registers itself as a type foreach kernels support, so `clip_grad_norm_` over
    FSDP2's or `parallelize_module`'s gradients runs `_foreach_norm` and `_foreach_mul_` on
    the local tensors. Without DTensor in that list torch takes its own loop
    (`linalg_vector_norm` and `mul_` per gradient), the same arithmetic, and the one the
    single program's plain tensors take under the trace (fake tensors are not foreach
    types either). Code that asks for foreach kernels itself gets `loop_decompositions`."""
    import torch.utils._foreach_utils as foreach_utils

    types = foreach_utils._foreach_supported_types
    saved = list(types)
    types[:] = [t for t in types if t.__name__ != "DTensor"]
    try:
        yield
    finally:
        types[:] = saved
