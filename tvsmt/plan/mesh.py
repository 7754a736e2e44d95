"""The world layout: one `Mesh` of named axes, the one place where ranks and coordinates meet.

Like JAX's `Mesh`, a mesh is a shape over named axes. The execplan v1 world is the mesh
`("dp", "pp", "tp")` with rank = d*(pp*tp) + stage*tp + t (the layout of the nnScaler exports
and of tvsmt's generator). Every module that needs to know which replica, pipeline stage or
tensor-parallel index a rank is asks this one; none computes it itself, and no module reads
it out of tensor or node names: a node carries `rank` and `mb` fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the named axes, slowest-varying first (row-major rank numbering)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            n = getattr(self, axis)
            if type(n) is not int or n < 1:
                raise ValueError(f"mesh axis {axis} must be a positive int, not {n!r}")

    @classmethod
    def of(cls, world: Mapping[str, Any]) -> "Mesh":
        """The mesh of a plan's `world` (missing axes are 1; bad values raise ValueError)."""
        return cls(**{axis: world.get(axis, 1) for axis in AXES})

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def per_replica(self) -> int:
        """Ranks in one data-parallel replica (pp * tp)."""
        return self.pp * self.tp

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        for axis, i in zip(AXES, (dp, pp, tp)):
            if not 0 <= i < getattr(self, axis):
                raise ValueError(f"{axis} index {i} outside the mesh {self}")
        return (dp * self.pp + pp) * self.tp + tp

    def coords_of(self, rank: int) -> dict[str, int]:
        """{"dp": d, "pp": stage, "tp": t} of a rank of this mesh."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside the mesh {self}")
        return {"dp": rank // self.per_replica, "pp": (rank // self.tp) % self.pp,
                "tp": rank % self.tp}

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica holding `rank` (called once per node: kept cheap)."""
        if not 0 <= rank < self.dp * self.pp * self.tp:
            raise ValueError(f"rank {rank} outside the mesh {self}")
        return rank // (self.pp * self.tp)

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (its group on that axis)."""
        c = self.coords_of(rank)
        out = []
        for i in range(getattr(self, axis)):
            c2 = dict(c, **{axis: i})
            out.append(self.rank_of(c2["dp"], c2["pp"], c2["tp"]))
        return out

    def move_replica(self, rank: int, replica: int) -> int:
        """The rank holding the same (stage, tp index) in another replica."""
        c = self.coords_of(rank)
        return self.rank_of(replica, c["pp"], c["tp"])
