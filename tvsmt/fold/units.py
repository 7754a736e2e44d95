"""Replica units and the renamings that map one unit onto the representative unit.

A parallel plan with dp data-parallel replicas and mb micro-batches repeats the same work
dp*mb times. tvsmt names each repetition a *unit*:

* the instance unit (d, m): what replica d does for micro-batch m (forward, backward, the
  tensor- and pipeline-parallel communication inside the replica);
* the replica unit (d, None): what replica d holds across micro-batches (its weights, the
  accumulated gradients, the reducers and the loss all-reduce on its ranks).

Units are recognised from tensor ids of the form `<base>@r<rank>m<mb>` (instance) and
`<base>@r<rank>` (replica), the convention of the spec's examples, of the nnScaler exports and
of tvsmt's generator, with rank = d*(pp*tp) + pp_stage*tp + tp_index. Nothing relies on the
convention for soundness: a record that does not fit it simply fails to match its
representative, and the unit it belongs to is then verified as it is (see folder.py).

The renaming that maps unit (d, m) onto the representative (0, 0), and (d, None) onto
(0, None), is ranks r -> r - d*pp*tp and micro-batch m -> 0; ids of other units and global ids
are left alone (table.rename_ids does it on integer columns).
"""

from __future__ import annotations

from dataclasses import dataclass

Unit = tuple[int, "int | None"]  # (replica d, micro-batch m or None for the replica unit)
REPRESENTATIVE: Unit = (0, 0)
REPRESENTATIVE_REPLICA: Unit = (0, None)


def parse_id(tid: str) -> tuple[str, tuple[int, ...], int | None] | None:
    """`base@r12m3` -> ("base", (12,), 3); `base@r12` -> ("base", (12,), None); an in-flight
    message `base@r0>r4m1` -> ("base", (0, 4), 1); anything else -> None."""
    base, at, suffix = tid.rpartition("@")
    if not at or len(suffix) < 2 or suffix[0] != "r":
        return None
    ranks, sep, mb = suffix.partition("m")
    if sep and not mb.isdigit():
        return None
    out = []
    for tok in ranks.split(">"):
        if len(tok) < 2 or tok[0] != "r" or not tok[1:].isdigit():
            return None
        out.append(int(tok[1:]))
    return base, tuple(out), (int(mb) if sep else None)


@dataclass(frozen=True)
class WorldUnits:
    """The unit grid of one parallel plan."""

    dp: int
    mb: int
    per_replica: int  # ranks per replica = pp * tp

    @classmethod
    def of(cls, world: dict) -> "WorldUnits":
        def get(key: str) -> int:
            value = world.get(key, 1)
            return value if isinstance(value, int) and value > 0 else 1
        return cls(get("dp"), get("mb"), get("pp") * get("tp"))

    def unit_of(self, tid: str | None) -> Unit | None:
        parsed = parse_id(tid) if tid is not None else None
        if parsed is None:
            return None
        _, ranks, m = parsed
        d = ranks[0] // self.per_replica
        if d >= self.dp or (m is not None and m >= self.mb):
            return None
        if any(r // self.per_replica != d for r in ranks):
            return None  # a message between replicas belongs to no unit
        return (d, m)

    def instance_units(self) -> list[Unit]:
        return [(d, m) for d in range(self.dp) for m in range(self.mb)]
