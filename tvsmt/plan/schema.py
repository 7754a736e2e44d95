"""The execplan records as msgspec structs: the JSON decoder checks the types in C.

Both forms of the format (one JSON document, or JSON Lines: docs/format.md) decode into these
structs. They mirror the checks of `reader.plan_from_dict` field by field (`int` refuses
booleans and floats, `tuple[int, int]` is exactly a pair); whatever they refuse, the reader
explains with its precise one-line messages. Unknown keys are ignored, as the spec allows.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Literal, Optional

import msgspec

from tvsmt.plan.model import LineagePart, MicroBatch, Node, Rank, TensorInfo

_INT64 = range(-(1 << 63), 1 << 63)
_ONE = Fraction(1)


def decode_scale(kind: type, value: Any) -> Any:
    """The decoder's hook for `LineagePart.scale`: `[num, den]` ints (den != 0) or null.
    Anything else (booleans, floats, 65-bit integers) fails the typed decoding and the generic
    path words the error."""
    if kind is Fraction:
        if value is None:
            return _ONE
        if (type(value) is list and len(value) == 2 and type(value[0]) is int
                and type(value[1]) is int and value[1] != 0 and value[0] in _INT64
                and value[1] in _INT64):
            return Fraction(value[0], value[1])
        raise ValueError("'scale' must be [num, den] ints with den != 0")
    raise NotImplementedError(kind)  # pragma: no cover (no other custom type)

# A document's tensors and nodes decode straight into the model's `TensorInfo` and `Node`
# (tvsmt.plan.model), whose annotations bound dimensions, passes, ranks and micro-batches in
# the decoder: a tensor's id (its key) is the reader's to set; a node's missing
# inputs/outputs (UNSET) are the reader's to refuse. A role that is not a string and null
# attrs fail the typed decoding, and the generic path reads them (`str(role)`, `{}`).


class RawPart(msgspec.Struct, gc=False):
    """A part of a JSON Lines lineage record (a document's decode as `LineagePart`)."""

    slice: tuple[tuple[int, int], ...]
    sum_of: tuple[str, ...]
    scale: Optional[tuple[int, int]] = None


class RawLineage(msgspec.Struct):
    single: str
    parts: list[LineagePart]  # decoded as the model's (scale: `decode_scale`)
    aligned: Any = None
    hypothesis: bool = False


class RawPlan(msgspec.Struct):
    """One execplan document. Header fields stay `Any`: the reader checks them by value."""

    tensors: dict[str, TensorInfo]
    nodes: list[Node]
    format: Any = None
    version: Any = None
    kind: Any = None
    name: Any = msgspec.UNSET  # absent: the file's name; null: "None" (as plan_from_dict)
    world: Any = None
    outputs: Optional[list[str]] = None
    lineages: Optional[list[RawLineage]] = None


# ------------------------------------------------------------------ JSON Lines records
# Each line of the streaming form is one object tagged by "r" (docs/format.md).


class HeaderRec(msgspec.Struct, tag_field="r", tag="header"):
    format: Any = None
    version: Any = None
    kind: Any = None
    name: Any = None
    world: Any = None
    outputs: Optional[list[str]] = None
    plan_id: Any = None
    sections: Any = None


class SectionRec(msgspec.Struct, tag_field="r", tag="section"):
    index: int
    name: str = ""


class TensorRec(msgspec.Struct, tag_field="r", tag="tensor"):
    id: str
    shape: list[int]
    role: Any = "activation"


class NodeRec(msgspec.Struct, tag_field="r", tag="node", rename={"pass_": "pass"}):
    id: str
    op: str
    inputs: tuple[Optional[str], ...]
    outputs: tuple[Optional[str], ...]
    pass_: Optional[str] = None
    rank: int = 0
    mb: int = 0
    attrs: Optional[dict[str, Any]] = None
    source: Optional[str] = None


class LineageRec(msgspec.Struct, tag_field="r", tag="lineage"):
    single: str
    parts: list[RawPart]
    aligned: Any = None
    hypothesis: bool = False


class TrailerRec(msgspec.Struct, tag_field="r", tag="trailer"):
    plan_id: Any = None
    tensors: int = -1
    nodes: int = -1
    lineages: int = -1
    sections: int = -1
    crc32: int = -1


Record = HeaderRec | SectionRec | TensorRec | NodeRec | LineageRec | TrailerRec


# ------------------------------------------------------------------ a document's names only
# What a forked process decodes to number a document's tensor names (numbering.py
# `ForkedNumbering`) while this one decodes the whole document with `RawPlan`: the same
# fields under the same types, everything else skipped (a node's attributes kept as their
# text); the same decoder on the same bytes gives the same names in the same order.


class _NoFields(msgspec.Struct, gc=False):
    pass


class NamesNode(msgspec.Struct, gc=False):
    # required, as a node's lists are: the reader's lazy nodes (HeadNode) leave their
    # presence and types to this decoding
    inputs: tuple[Optional[str], ...]
    outputs: tuple[Optional[str], ...]


class NamesAttrsNode(NamesNode, gc=False):
    attrs: msgspec.Raw = msgspec.Raw(b"")  # the text, undecoded (absent: empty)


class NamesPart(msgspec.Struct, gc=False):
    sum_of: tuple[str, ...] = ()


class NamesLineage(msgspec.Struct, gc=False):
    parts: list[NamesPart] = []


class NamesPlan(msgspec.Struct):
    tensors: dict[str, _NoFields]
    nodes: list[NamesNode]
    lineages: Optional[list[NamesLineage]] = None


class NamesAttrsPlan(NamesPlan):
    """`NamesPlan` with each node's attributes as text (their codes are computed from it
    where the other process decodes the attributes themselves, `RawPlan`)."""

    nodes: list[NamesAttrsNode]


# ------------------------------------------------------------------ a document without names
# A large document read while the forked process numbers its names (above): this process
# then decodes each node without its inputs and outputs (their lengths and numbers come from
# that process, their names from the tensor table) and keeps its attributes as text, so it
# builds a node only where the fold looks at one (reader._lazy_nodes). The same checks as `Node`
# on every field it decodes; the others are NamesNode's.


class HeadNode(msgspec.Struct, frozen=True, gc=False, rename={"pass_": "pass"}):
    id: str
    op: str
    pass_: Optional[Literal["fw", "bw"]] = None
    rank: Rank = 0
    mb: MicroBatch = 0
    attrs: msgspec.Raw = msgspec.Raw(b"")  # the text (absent: empty, as NamesNode's)
    source: Optional[str] = None


class HeadPart(msgspec.Struct, gc=False):
    """A lineage part without its tensors (NamesPart's, numbered by the forked process): its
    slice as text, decoded once per distinct text (reader._lazy_lineages); its scale as
    `decode_scale` takes it (null and absent: 1; the pair's bounds and denominator checked
    there too)."""

    slice: msgspec.Raw
    scale: Optional[tuple[int, int]] = None


class HeadLineage(msgspec.Struct):
    single: str
    parts: list[HeadPart]
    aligned: Any = None
    hypothesis: bool = False


class HeadPlan(RawPlan):
    """`RawPlan` with `HeadNode`s and `HeadLineage`s."""

    nodes: list[HeadNode]
    lineages: Optional[list[HeadLineage]] = None
