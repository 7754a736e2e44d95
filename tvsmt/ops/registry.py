"""The operator registry: one small `OpSpec` per operator, in one place.

An entry knows everything about its operator (Alive2 style): its forward semantics, its
backward (vector-Jacobian product) semantics under the plan convention, and its shape rule
for shape reduction. The verifier never special-cases an operator; it only composes entries.

Backward convention (execplan v1, `../shared/plans/OPS.md`): a `bw` node's inputs are the
gradients of the forward outputs followed by the forward ("mirror") inputs, its outputs the
gradients of the forward inputs, `None` where a slot is absent.

Shape rules add constraints between the (reduced) dimensions of a node's tensors. Each tensor
is a `TShape`: `dims` are solver integer expressions (one per dimension) and `orig` the
original sizes from the plan. Rules use `c.eq(a, b)` and `c.add(constraint)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

from tvsmt.ops.backend import Backend

Arrays = Sequence["np.ndarray | None"]


@dataclass(frozen=True)
class NodeCtx:
    """What a semantic rule may need beyond its input arrays.

    `out_shapes` are the (reduced) shapes the node's outputs must have (None for absent slots);
    `orig_in`/`orig_out` are the original plan shapes of the inputs/outputs, so that a rule can
    rescale an attribute written for the full size (e.g. a vocabulary range) to the reduced size.
    """

    out_shapes: tuple["tuple[int, ...] | None", ...] = ()
    orig_in: tuple["tuple[int, ...] | None", ...] = ()
    orig_out: tuple["tuple[int, ...] | None", ...] = ()


Semantics = Callable[[Backend, Arrays, dict, NodeCtx], list]


@dataclass
class TShape:
    """A tensor's reduced dimensions (solver ints) next to its original sizes."""

    dims: list[Any]
    orig: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.dims)

    def __getitem__(self, i):
        return self.dims[i]


class ShapeConstraints:
    """Collects shape constraints; the shape-reduction phase hands one to every rule."""

    def __init__(self):
        self.constraints: list[Any] = []
        self.boundaries: list[KeepBoundary] = []  # for the shape reducer, not a constraint

    def add(self, constraint: Any) -> None:
        if constraint is False:
            raise ShapeRuleError("impossible shape constraint")
        if constraint is True:
            return
        self.constraints.append(constraint)

    def eq(self, a: Any, b: Any) -> None:
        if isinstance(a, int) and isinstance(b, int):
            if a != b:
                raise ShapeRuleError(f"dimension {a} != {b}")
            return
        self.constraints.append(a == b)

    def keep_boundary(self, dim: Any, position: int) -> None:
        """`position` (in original units) along `dim` must stay an integer position after
        reduction (e.g. the first row of a vocabulary shard)."""
        if not isinstance(dim, int) and position:
            self.boundaries.append(KeepBoundary(dim, position))

    def same(self, a: TShape, b: TShape) -> None:
        if len(a) != len(b):
            raise ShapeRuleError(f"rank {len(a)} != {len(b)}")
        for x, y in zip(a.dims, b.dims):
            self.eq(x, y)


@dataclass(frozen=True)
class KeepBoundary:
    """Position `at` (original units) along `dim` must stay an integer after reduction."""

    dim: Any
    at: int


class ShapeRuleError(ValueError):
    """A node's tensors cannot have the shapes its operator requires."""


class AttrError(ValueError):
    """A node's attributes are not valid for its operator (a declared input error: the
    entry checked them). Any other exception inside a rule is a bug of the entry."""


ShapeRule = Callable[[ShapeConstraints, list["TShape | None"], list["TShape | None"], dict], None]


@dataclass(frozen=True)
class OpSpec:
    name: str
    forward: Semantics
    shape: ShapeRule
    backward: Semantics | None = None
    # Number of forward outputs (used to split a bw node's inputs into grads and mirrors).
    n_outputs: Callable[[dict, int], int] = field(default=lambda attrs, n_in: 1)
    # Optional explicit shape rule for the bw node; default: derived from `shape` (see below).
    bw_shape: ShapeRule | None = None
    communication: bool = False
    doc: str = ""
    # What the semantics and shape rule read from a node's attrs, normalized (e.g. a group's
    # size, not its rank ids). Stage templates key on it; None = all attrs (always safe).
    semantic_attrs: Callable[[dict], Any] | None = None
    # Attributes that name ranks (a group, a source, a destination): renamed, not compared,
    # when folding moves a unit onto its representative.
    rank_attrs: tuple[str, ...] = ()
    # The op adds up its inputs, which may come from different replicas or micro-batches
    # (all_reduce, reducer, grad_accum): folding restricts such sums to the kept units.
    unit_sum: bool = False
    # Uninterpreted functions of the backend (backend.UNINTERPRETED) its rules may use; a
    # counterexample through them is re-checked with the real functions.
    abstracts: tuple[str, ...] = ()
    # Its backward reads the VALUES of its mirror inputs (not only their shapes): a mirror
    # fed the wrong tensor changes the gradient (the bug zoo's "wrong mirror" bugs).
    reads_mirrors: bool = False
    # Why there is no backward (required when backward is None, for the completeness test).
    no_backward: str = ""
    # Its outputs depend on its inputs' shapes only, never their values (a causal mask): every
    # unit computes the same tensor. The bug catalogue's re-routed message avoids such ones.
    shape_only: bool = False


REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in REGISTRY:
        raise ValueError(f"operator {spec.name} registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> OpSpec | None:
    _load_all()
    return REGISTRY.get(name)


# Leaf types whose repr is exact: equal reprs only for equal values of the same type (1, 1.0,
# True and "1" all differ). Dicts (with string keys), lists and tuples of them keep that.
_EXACT_LEAVES = frozenset((str, int, float, bool, type(None), Fraction))
_STR_KEYS = frozenset((str,))


def attrs_key(attrs) -> tuple:
    """Node attributes as a key that is equal only for attributes equal in value and type:
    their repr when every value is of a type whose repr is exact (anything read from a plan
    file, or captured from PyTorch), else a key equal to no other (nothing is merged on
    attributes that cannot be compared exactly). Used wherever nodes are deduplicated by
    their attributes: stage signatures, the shape-rule checks."""
    todo = [attrs]
    while todo:  # a walk, not recursion; the type tests run in C (sets of types)
        v = todo.pop()
        if type(v) is dict:
            if v and not _STR_KEYS.issuperset(map(type, v)):
                return ("unique", object())
            v = v.values()
        if _EXACT_LEAVES.issuperset(map(type, v)):
            continue
        for x in v:
            t = type(x)
            if t is dict or t is list or t is tuple:
                todo.append(x)
            elif t not in _EXACT_LEAVES:
                return ("unique", object())
    return ("repr", repr(attrs))


def derived_bw_shape(spec: OpSpec) -> ShapeRule:
    """Backward shape rule from the forward one: the gradient inputs have the shapes the forward
    rule gives the outputs on the mirror inputs; each gradient output has its mirror's shape."""

    def rule(c: ShapeConstraints, ins, outs, attrs):
        if spec.bw_shape is not None:
            return spec.bw_shape(c, ins, outs, attrs)
        k = spec.n_outputs(attrs, len(ins))
        grads, mirrors = list(ins[:k]), list(ins[k:])
        spec.shape(c, mirrors, grads, attrs)
        for g, m in zip(outs, mirrors):
            if g is not None and m is not None:
                c.same(g, m)

    return rule


def shape_rule(spec: OpSpec, backward: bool) -> ShapeRule:
    return derived_bw_shape(spec) if backward else spec.shape


_loaded = False


def _load_all() -> None:
    """Import the modules that register operators (kept lazy to avoid import cycles)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from tvsmt.ops import definitions  # noqa: F401


def all_ops() -> dict[str, OpSpec]:
    _load_all()
    return dict(REGISTRY)
