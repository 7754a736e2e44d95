"""The MLP model description: a chain of bias-free linear layers (hidden -> hidden) and a sum
loss, like the reference's mlp fixture.

Tensor parallelism pairs the layers Megatron style: layer 2i column-parallel, layer 2i+1
row-parallel with its partial sums all-reduced; an odd last layer is replicated.
"""

from __future__ import annotations

from tvsmt.frontends.layers import COL, REP, ROW, linear, sum_loss
from tvsmt.frontends.spmd import Tracer, Val


def layer_modes(layers: int) -> list[str]:
    modes = [COL if i % 2 == 0 else ROW for i in range(layers)]
    if layers % 2:
        modes[-1] = REP
    return modes


def forward(tr: Tracer, cfg, b: int, stage_of: list[int]) -> Val:
    x = tr.data("x", (b, cfg.hidden))
    for layer, mode in enumerate(layer_modes(cfg.layers)):
        (x,) = tr.goto(stage_of[layer], x)
        if mode == COL:
            x = tr.tp_enter(x)
        x = linear(tr, f"L{layer}.out", x, f"L{layer}.weight", cfg.hidden, mode)
        if mode == ROW:
            x = tr.all_reduce(x)
    (x,) = tr.goto(tr.w.pp - 1, x)
    return sum_loss(tr, x)
