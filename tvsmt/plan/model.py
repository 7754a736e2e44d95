"""The in-memory form of an execution plan (see ../shared/spec/execplan-v1.md).

Frozen records: every later phase reads these and never the raw JSON. The three kinds a plan
holds by the million (`Node`, `TensorInfo`, `LineagePart`) are msgspec Structs, not
dataclasses: the reader decodes nodes straight into `Node` in C, and building the others
costs a tenth of a frozen dataclass (scripts/bench_read.py). They are frozen, positional
and keyword constructible like the dataclasses they replaced; `replace` below copies
either kind with changes (`dataclasses.replace` refuses a Struct). They are not tracked by
the cyclic garbage collector (`gc=False`): plans hold no reference cycles, and millions of tracked
objects make every collection slow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Annotated, Any, Literal, Optional

import dataclasses

import msgspec

_ONE = Fraction(1)
MAX_DIM = 2**53  # dimensions and slice bounds: beyond this, sizes are no longer exact floats

# Bounds the JSON decoder checks in C while it builds the records (tvsmt.plan.reader); they
# constrain decoding only, never construction.
Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Rank = Annotated[int, msgspec.Meta(ge=0)]
MicroBatch = Annotated[int, msgspec.Meta(ge=-1)]


def replace(obj, /, **changes):
    """A copy of a model record (Struct or dataclass) with some fields changed."""
    if isinstance(obj, msgspec.Struct):
        return msgspec.structs.replace(obj, **changes)
    return dataclasses.replace(obj, **changes)


class TensorInfo(msgspec.Struct, frozen=True, gc=False):
    """A declared tensor. `id` and `shape` have defaults only because a plan document's
    tensors decode straight into this struct (the id is the object's key, set by the reader
    afterwards; a missing shape stays UNSET, which the reader refuses); every constructor
    call names both."""

    id: str = ""
    shape: tuple[Dim, ...] = msgspec.UNSET
    role: str = "activation"


class Node(msgspec.Struct, frozen=True, gc=False, rename={"pass_": "pass"}):
    """One operation on one rank. Fields after `op` have defaults only because the plan format
    lets a node omit pass/rank/mb: `inputs` and `outputs` default to UNSET, which the reader
    refuses (a node must list them)."""

    id: str
    op: str
    pass_: Optional[Literal["fw", "bw"]] = None  # None: communication / finalization
    rank: Rank = 0
    mb: MicroBatch = 0
    inputs: tuple[Optional[str], ...] = msgspec.UNSET
    outputs: tuple[Optional[str], ...] = msgspec.UNSET
    attrs: dict[str, Any] = {}  # a document's `"attrs": null` is read by the generic path
    # Where the node came from in the producer's code ("train.py:42"), for reports only:
    # never semantic, never compared (optional "source" key of a plan node).
    source: Optional[str] = None

    def _key(self) -> tuple:
        return (self.id, self.op, self.pass_, self.rank, self.mb, self.inputs, self.outputs)

    def __eq__(self, other: object) -> bool:  # attrs and source are not compared
        if not isinstance(other, Node):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def is_backward(self) -> bool:
        return self.pass_ == "bw"

    def describe(self) -> str:
        kind = f"{self.op}/{self.pass_}" if self.pass_ else self.op
        return f"{self.id} ({kind} on rank {self.rank}, mb {self.mb})"


class LineagePart(msgspec.Struct, frozen=True, gc=False):
    """`single[slice] == scale * sum(sum_of)` elementwise."""

    slice: tuple[tuple[int, int], ...]
    sum_of: tuple[str, ...]
    scale: Fraction = _ONE

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

    @property
    def label(self) -> str:
        """How messages name it: lineages have no id, so by index and single tensor."""
        return f"lineage #{self.index} of {self.single}"

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
    # what the reader numbered while checking the nodes, for the fold (tvsmt/fold/columns.py,
    # which uses it only while the plan still holds the same node objects and tensor ids)
    columns: "PlanColumns | None" = field(default=None, repr=False, compare=False)

    def shape(self, tensor: str) -> tuple[int, ...]:
        return self.tensors[tensor].shape


class LazySequence:
    """A read-only sequence whose items are built on demand (`build(list of indices)`): the
    records of a plan read into columns (a JSON Lines scan, a large document's nodes), of
    which the fold looks at a few. Immutable, so a plan and its columns may share one."""

    def __init__(self, n: int, build):
        self._n, self._build = n, build

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(*i.indices(self._n)))
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._build([i])[0]

    def take(self, indices) -> list:
        return self._build([int(i) for i in indices])

    def __iter__(self):  # in batches: iterating a lazy sequence builds every item
        for a in range(0, self._n, 1 << 16):
            yield from self._build(list(range(a, min(a + (1 << 16), self._n))))


@dataclass
class PlanColumns:
    """A plan's dataflow as tensor numbers (a tensor's number: its position in the plan's
    tensor table; -1 an absent slot), for exactly the node objects in `nodes` and the tensor
    ids in `tids` (tvsmt/fold/columns.py `columns_of` checks that the plan still holds those
    before using them). Per node, in plan order: how many inputs and outputs, and their
    numbers concatenated."""

    nodes: list  # the node objects described (a copy of the list: compared by identity)
    tids: list[str]
    number: Any  # tensor id -> number (None -> -1): a numbering.Numbering (or a dict)
    in_len: Any
    in_num: Any
    out_len: Any
    out_num: Any
    rank: Any  # per node
    mb: Any
    op: Any  # per node: its op, as the number of the first node with that op
    infos: list  # the plan's TensorInfo objects, in tensor order (compared by identity)
    t_shape: Any  # per tensor: its shape, as the number of the first tensor with that shape
    lineages: list  # the Lineage objects described (compared by identity)
    s_len: Any  # per lineage part (all lineages' parts in order): how many tensors
    s_num: Any  # their numbers, concatenated
    slice_index: Any  # per part: its slice, as an index into `slices`
    slices: list  # the distinct slices
    # per node: a code of its attributes' JSON text as the file holds it (equal codes: equal
    # texts, hence equal attributes), when the reader had it computed (numbering.py); None:
    # the fold encodes the attributes itself
    attr_text: Any = None
    # Codes a reader may have computed already (the JSON Lines scan, tvsmt/plan/scan.py,
    # whose `nodes`, `infos`, `tids` and `parts` are lazy: built on demand), so that the fold
    # never touches every record: per node its op and pass as an index into the names; per
    # tensor its shape as an index into `shapes`; per lineage part (all lineages' parts in
    # order) its lineage, position in it and scale (an index into `scales`); the numbers of
    # the plan's outputs. None: the fold computes them from the records.
    op_code: Any = None
    op_names: list | None = None
    pass_code: Any = None
    pass_names: list | None = None
    shape_code: Any = None
    shapes: list | None = None
    parts: Any = None
    part_lineage: Any = None
    part_pos: Any = None
    scale_code: Any = None
    scales: list | None = None
    output_num: Any = None
    # () -> the fold's split of these columns computed meanwhile (fold/split.py: a reader's
    # forked numbering, plan/numbering.py), or None; used only if computed from these inputs
    presplit: Any = None
