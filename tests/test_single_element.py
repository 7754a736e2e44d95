"""Bugs that touch ONE element (issue 15, item 1).

The bug zoo changes many elements at once, so a verifier that forgets one element (an
off-by-one in its element loop, a dropped comparison, a merged position) still finds those.
Here the single and the parallel plan differ in exactly one element of the target tensor.

How a plan can differ in one element: operators are SIMD-like (the same expression at every
position), so only a boundary can single an element out: a lineage slice or a chunk piece
one element wide. Every boundary divides shape reduction's factor (tvsmt/shapes/reduce.py),
so the dimensions that single the element out keep their size and the element keeps its
index; the other dimensions (the reduced and contracted ones) are still reduced. Each test
checks that: the reduced target keeps its full shape, the counterexample names exactly that
element, and the failure names the lineage part that holds it and the node that is wrong.

The parallel plans tile the target y [R, C] into rectangles, one per rank, with boundaries at
the offending element (i, j) and at the middle row, so the element is its own 1x1 piece.
For each operator class (elementwise, reduction, contraction, layout, communication,
finalisation), the element is placed first, last, in the interior, and on each side of the
middle partition boundary; the bug is one `add 1` on the rank (or the micro-batch, or the
partial sum of one of two ranks) that computes it. Without the bug every plan is equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from handmade import PlanDict

from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

R, C, K, BT = 8, 4, 8, 8  # target rows and columns, contracted/reduced size, batch
MID = R // 2  # a regular partition boundary between rows MID-1 and MID

POSITIONS = {
    "first": (0, 0),
    "last": (R - 1, C - 1),
    "interior": (2, 1),
    "before-boundary": (MID - 1, C - 1),
    "after-boundary": (MID, 0),
}


@dataclass(frozen=True)
class Piece:
    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def slice(self):
        return [self.rows, self.cols]


def tiling(i: int, j: int) -> list[Piece]:
    """Rectangles covering [R] x [C], with (i, j) alone in one of them (row-major order)."""
    rb = sorted({0, i, i + 1, MID, R})
    cb = sorted({0, j, j + 1, C})
    cells = [((r0, r1), (c0, c1)) for r0, r1 in zip(rb, rb[1:]) for c0, c1 in zip(cb, cb[1:])]
    return [Piece(k, rows, cols) for k, (rows, cols) in enumerate(cells)]


def _len(span):
    return span[1] - span[0]


# ----------------------------------------------------------------------------- op classes
# Each class: the single plan's inputs and nodes, and how one piece is computed on a rank.
# `piece_inputs(piece)` gives (input tensor, slice, shape) that the rank holds; `compute`
# adds the rank's nodes and returns the id of its piece of y; `bug` says where the extra
# `add 1` goes (None: nowhere).


class OpClass:
    name = ""
    inputs: dict[str, list[int]] = {}

    def single(self, p: PlanDict) -> None:
        raise NotImplementedError

    def piece_inputs(self, pc: Piece) -> list[tuple[str, list, list[int]]]:
        raise NotImplementedError

    def compute(self, p: PlanDict, pc: Piece, held: dict[str, str], bug: bool) -> str:
        raise NotImplementedError

    def extra_lineages(self, p: PlanDict, pieces: list[Piece]) -> None:
        """Lineages between the inputs and the final one (partial sums)."""


def _maybe_bug(p: PlanDict, value: str, rank: int, bug: bool, mb: int = 0) -> str:
    if not bug:
        return value
    shape = p.d["tensors"][value]["shape"]
    out = p.t(f"bug_{value}", shape)
    p.n(f"BUG@{rank}m{mb}", "add", [value], [out], rank=rank, mb=mb, alpha=1, consts=[1.0])
    return out


class Elementwise(OpClass):
    name = "elementwise"
    inputs = {"x": [R, C]}

    def single(self, p):
        p.n("op", "mul", ["x"], ["y"], consts=[2.0])

    def piece_inputs(self, pc):
        return [("x", [pc.rows, pc.cols], [_len(pc.rows), _len(pc.cols)])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        v = p.t(f"v@{r}", [_len(pc.rows), _len(pc.cols)])
        p.n(f"op@{r}", "mul", [held["x"]], [v], rank=r, consts=[2.0])
        return _maybe_bug(p, v, r, bug)


class Deep(OpClass):
    """A chain of eight elementwise operators: the two sides of the offending element differ
    only deep inside its term (a printer that truncates would call them equal)."""
    name = "deep-elementwise"
    inputs = {"x": [R, C]}
    CHAIN = [("mul", 2.0), ("add", 1.0), ("mul", 3.0), ("add", 1.0), ("mul", 2.0),
             ("add", 1.0), ("mul", 3.0), ("add", 1.0)]

    def _chain(self, p, x, y, shape, rank, tag, bug):
        cur = x
        for k, (op, c) in enumerate(self.CHAIN):
            if bug and k == 0:
                c = 5.0  # the wrong constant, at the bottom of the term
            out = y if k == len(self.CHAIN) - 1 else p.t(f"c{k}{tag}", shape)
            attrs = {"alpha": 1} if op == "add" else {}
            p.n(f"op{k}{tag}", op, [cur], [out], rank=rank, consts=[c], **attrs)
            cur = out
        return cur

    def single(self, p):
        self._chain(p, "x", "y", [R, C], 0, "", False)

    def piece_inputs(self, pc):
        return [("x", [pc.rows, pc.cols], [_len(pc.rows), _len(pc.cols)])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        shape = [_len(pc.rows), _len(pc.cols)]
        v = p.t(f"v@{r}", shape)
        return self._chain(p, held["x"], v, shape, r, f"@{r}", bug)


class Reduction(OpClass):
    name = "reduction"
    inputs = {"x": [R, C, K]}

    def single(self, p):
        p.n("op", "sum", ["x"], ["y"], dim=[2], keepdim=False)

    def piece_inputs(self, pc):
        return [("x", [pc.rows, pc.cols, (0, K)], [_len(pc.rows), _len(pc.cols), K])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        v = p.t(f"v@{r}", [_len(pc.rows), _len(pc.cols)])
        p.n(f"op@{r}", "sum", [held["x"]], [v], rank=r, dim=[2], keepdim=False)
        return _maybe_bug(p, v, r, bug)


class Contraction(OpClass):
    name = "contraction"
    inputs = {"x": [R, K], "w": [C, K]}

    def single(self, p):
        p.n("op", "linear", ["x", "w"], ["y"], bias=None)

    def piece_inputs(self, pc):
        return [("x", [pc.rows, (0, K)], [_len(pc.rows), K]),
                ("w", [pc.cols, (0, K)], [_len(pc.cols), K])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        v = p.t(f"v@{r}", [_len(pc.rows), _len(pc.cols)])
        p.n(f"op@{r}", "linear", [held["x"], held["w"]], [v], rank=r, bias=None)
        return _maybe_bug(p, v, r, bug)


class Layout(OpClass):
    name = "layout"
    inputs = {"x": [C, R]}

    def single(self, p):
        p.n("op", "transpose", ["x"], ["y"], dim0=0, dim1=1)

    def piece_inputs(self, pc):
        return [("x", [pc.cols, pc.rows], [_len(pc.cols), _len(pc.rows)])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        v = p.t(f"v@{r}", [_len(pc.rows), _len(pc.cols)])
        p.n(f"op@{r}", "transpose", [held["x"]], [v], rank=r, dim0=0, dim1=1)
        return _maybe_bug(p, v, r, bug)


class Communication(OpClass):
    """Each piece is a contraction split over K between two ranks (a, a + n) and summed by an
    all_reduce on rank a; the bug is in the partial sum of the second rank only. An
    intermediate lineage states the partial sums, so the bug is found in that stage."""
    name = "communication"
    inputs = {"x": [R, K], "w": [C, K]}
    n = 0  # number of pieces (set by the builder)

    def single(self, p):
        p.n("op", "linear", ["x", "w"], ["y"], bias=None)

    def piece_inputs(self, pc):
        h = K // 2
        return [("x", [pc.rows, (0, h)], [_len(pc.rows), h]),
                ("w", [pc.cols, (0, h)], [_len(pc.cols), h]),
                ("x", [pc.rows, (h, K)], [_len(pc.rows), h]),
                ("w", [pc.cols, (h, K)], [_len(pc.cols), h])]

    def compute(self, p, pc, held, bug):
        a, b = pc.rank, pc.rank + self.n
        shape = [_len(pc.rows), _len(pc.cols)]
        qa, qb = p.t(f"q@{a}", shape), p.t(f"q@{b}", shape)
        p.n(f"op@{a}", "linear", [held["x"], held["w"]], [qa], rank=a, bias=None)
        p.n(f"op@{b}", "linear", [held["x#1"], held["w#1"]], [qb], rank=b, bias=None)
        qb = _maybe_bug(p, qb, b, bug)
        self.partial[pc.rank] = (qa, qb)
        v = p.t(f"v@{a}", shape)
        p.n(f"ar@{a}", "all_reduce", [qa, qb], [v], pass_=None, rank=a, ranks=[a, b])
        return v

    def extra_lineages(self, p, pieces):
        p.lineage("y", [(pc.slice, list(self.partial[pc.rank])) for pc in pieces])


class Finalisation(OpClass):
    """y sums x over a batch (a weight gradient): each rank sums two micro-batches' halves of
    the batch and accumulates them (grad_accum); the bug is in micro-batch 1 only."""
    name = "finalisation"
    inputs = {"x": [BT, R, C]}

    def single(self, p):
        p.n("op", "sum", ["x"], ["y"], dim=[0], keepdim=False)

    def piece_inputs(self, pc):
        h = BT // 2
        return [("x", [(0, h), pc.rows, pc.cols], [h, _len(pc.rows), _len(pc.cols)]),
                ("x", [(h, BT), pc.rows, pc.cols], [h, _len(pc.rows), _len(pc.cols)])]

    def compute(self, p, pc, held, bug):
        r = pc.rank
        shape = [_len(pc.rows), _len(pc.cols)]
        g0, g1 = p.t(f"g@{r}m0", shape), p.t(f"g@{r}m1", shape)
        p.n(f"op@{r}m0", "sum", [held["x"]], [g0], rank=r, mb=0, dim=[0],
            keepdim=False)
        p.n(f"op@{r}m1", "sum", [held["x#1"]], [g1], rank=r, mb=1, dim=[0],
            keepdim=False)
        g1 = _maybe_bug(p, g1, r, bug, mb=1)
        v = p.t(f"v@{r}", shape)
        p.n(f"acc@{r}", "grad_accum", [g0, g1], [v], pass_=None, rank=r, mb=1)
        return v


CLASSES = {c.name: c for c in (Elementwise, Deep, Reduction, Contraction, Layout,
                               Communication, Finalisation)}


# ----------------------------------------------------------------------------- plans


def build(cls_name: str, i: int, j: int, bug: bool) -> tuple[dict, dict, Piece]:
    """(single plan, parallel plan, the piece that holds element (i, j))."""
    oc = CLASSES[cls_name]()
    oc.partial = {}
    single = PlanDict("single", "one_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    for t, shape in oc.inputs.items():
        single.t(t, shape, "input")
    single.t("y", [R, C])
    oc.single(single)
    single.d["outputs"] = ["y"]

    pieces = tiling(i, j)
    oc.n = len(pieces)
    ranks = 2 * len(pieces) if isinstance(oc, Communication) else len(pieces)
    mb = 2 if isinstance(oc, Finalisation) else 1
    par = PlanDict("parallel", "one_parallel",
                   {"dp": 1, "tp": ranks, "pp": 1, "mb": mb, "ranks": ranks})
    parts: dict[str, list] = {t: [] for t in oc.inputs}
    outs = []
    (hit,) = [pc for pc in pieces if pc.rows == (i, i + 1) and pc.cols == (j, j + 1)]
    for pc in pieces:
        held = {}
        for t, slc, shape in oc.piece_inputs(pc):
            key = f"{t}#1" if t in held else t  # a second slice of the same input
            tid = par.t(f"{key.replace('#', '_')}@{pc.rank}", shape, "input")
            held[key] = tid
            parts[t].append((slc, [tid]))
        y = oc.compute(par, pc, held, bug and pc is hit)
        outs.append((pc, y))
    for t, ps in parts.items():
        par.lineage(t, ps)
    oc.extra_lineages(par, pieces)
    par.lineage("y", [(pc.slice, [y]) for pc, y in outs])
    return single.d, par.d, hit


def verify(single: dict, parallel: dict):
    s, p = plan_from_dict(single, "single.json"), plan_from_dict(parallel, "parallel.json")
    check_pair(s, p)
    return verify_plans(s, p, Options(jobs=1))


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cls_name", sorted(CLASSES))
def test_without_the_bug_every_tiling_is_equivalent(cls_name):
    for where in ("first", "interior", "after-boundary"):
        report = verify(*build(cls_name, *POSITIONS[where], bug=False)[:2])
        assert report.verdict == "equivalent", (where, report.failures)
        assert report.stages_proven == report.stages_total > 0


@pytest.mark.parametrize("where", sorted(POSITIONS))
@pytest.mark.parametrize("cls_name", sorted(CLASSES))
def test_one_wrong_element_is_a_violation_naming_it(cls_name, where):
    i, j = POSITIONS[where]
    single, parallel, hit = build(cls_name, i, j, bug=True)
    report = verify(single, parallel)
    assert report.verdict == "violation", report.failures
    found = [f for f in report.failures if f.kind == "counterexample"]
    assert found, [f.message for f in report.failures]
    for f in found:
        assert f.tensor == "y"
        # the lineage part that holds the element, and the node that is wrong
        assert f.slice == [[i, i + 1], [j, j + 1]], f.slice
        assert any(n["id"].startswith("BUG@") or n["id"].startswith("op0@")
                   for n in f.parallel_nodes), f.parallel_nodes
        cex = f.counterexample
        # the boundaries around the element kept its dimensions whole ...
        assert cex["reduced_shape"] == [R, C], cex["reduced_shape"]
        # ... so the counterexample names exactly that element, and only it
        assert cex["mismatches"], cex
        assert {tuple(m["index"]) for m in cex["mismatches"]} == {(i, j)}, cex["mismatches"]
        assert all(m["single"] != m["parallel"] for m in cex["mismatches"])


def test_reduced_and_contracted_dimensions_are_still_reduced():
    """The boundaries pin the target's dimensions, not the others: the contraction over K
    and the batch sum are checked at reduced size (so the tests above exercise shape
    reduction, not an unreduced stage)."""
    from tvsmt.graph import Graph
    from tvsmt.shapes import reduce_stage
    from tvsmt.stages import cut_stages

    for cls_name, tensor, axis, full in (("contraction", "x", 1, K),
                                         ("finalisation", "x", 0, BT)):
        single, parallel, _ = build(cls_name, *POSITIONS["interior"], bug=True)
        s, p = plan_from_dict(single, "s"), plan_from_dict(parallel, "p")
        cut = cut_stages(s, p, Graph(s), Graph(p))
        (stage,) = [st for st in cut.stages if p.lineages[st.target].single == "y"][-1:]
        shapes = reduce_stage(stage, s, p)
        assert 2 <= shapes.single[tensor][axis] < full, (cls_name, shapes.single[tensor])


def _window_pair(claim_start: int, input_start: int, width: int = 4):
    """y = 2 x over [R, C]; rank 0 computes it whole, rank 1 computes a window: it holds
    x[input_start : +width] and claims y[claim_start : +width]."""
    single = PlanDict("single", "w_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    single.t("x", [R, C], "input"), single.t("y", [R, C])
    single.n("op", "mul", ["x"], ["y"], consts=[2.0])
    single.d["outputs"] = ["y"]
    par = PlanDict("parallel", "w_parallel", {"dp": 1, "tp": 2, "pp": 1, "mb": 1, "ranks": 2})
    par.t("x@0", [R, C], "input"), par.t("y@0", [R, C])
    par.t("xw@1", [width, C], "input"), par.t("yw@1", [width, C])
    par.n("op@0", "mul", ["x@0"], ["y@0"], rank=0, consts=[2.0])
    par.n("op@1", "mul", ["xw@1"], ["yw@1"], rank=1, consts=[2.0])
    par.lineage("x", [([(0, R), (0, C)], ["x@0"]),
                      ([(input_start, input_start + width), (0, C)], ["xw@1"])])
    par.lineage("y", [([(claim_start, claim_start + width), (0, C)], ["yw@1"])])
    par.lineage("y", [([(0, R), (0, C)], ["y@0"])])
    return single.d, par.d


def test_an_off_by_one_slice_is_a_violation():
    """Rank 1 holds x[3:7] and claims to hold 2 x[2:6]: every element of its window is its
    neighbour's. Only the odd boundaries tell the two windows apart (both are 4 wide), so
    shape reduction must keep them (a reduction by 4 would map both to row 0)."""
    assert verify(*_window_pair(3, 3)).verdict == "equivalent"
    report = verify(*_window_pair(2, 3))
    assert report.verdict == "violation", report.failures
    (f,) = [f for f in report.failures if f.kind == "counterexample"]
    assert f.slice == [[2, 6], [0, C]]
    assert f.counterexample["mismatches"]
    assert all(2 <= m["index"][0] < 6 for m in f.counterexample["mismatches"])
