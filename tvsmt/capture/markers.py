"""What a training script may mark for the capture: `tvsmt.capture.microbatch(i)`.

    for i, mb in enumerate(batch.chunk(n)):
        with tvsmt.capture.microbatch(i):
            loss = model(mb).sum() / n
            loss.backward()

Every ATen op traced inside the block (forward and the backward that `loss.backward()` runs
there) carries micro-batch `i` in the execplan (`mb`), so reports say the micro-batch.
Outside a capture the block does nothing (it only annotates fx nodes, through torch's
`torch.fx.traceback.annotate`, which records only under `preserve_node_meta`).
"""

from __future__ import annotations

from contextlib import contextmanager

KEY = "tvsmt_mb"


@contextmanager
def microbatch(index: int):
    """Mark the ops run inside the block as micro-batch `index` (a non-negative int)."""
    if type(index) is not int or index < 0:
        raise ValueError(f"microbatch(index): a non-negative int, not {index!r}")
    import torch.fx.traceback as fx_traceback

    with fx_traceback.annotate({KEY: index}):
        yield


def microbatch_of(fx_node) -> int | None:
    """The micro-batch a traced fx node was marked with, or None."""
    custom = fx_node.meta.get("custom") or {}
    mb = custom.get(KEY)
    return mb if type(mb) is int else None
