"""Bugs that only show at size >= 2, through the whole pipeline (plan dicts -> verify).

Shape reduction keeps every dimension of size n >= 2 at >= 2 (tvsmt/shapes/reduce.py). These
tests are why: each bug below vanishes when the dimension it lives in has size 1 (a 1x1
matrix is its own transpose, the mean of one value is its sum, a size-1 axis broadcasts the
same either way). Each buggy plan must be a violation whose counterexample comes from the
shape-reduced stage, and the same plan without the bug must be equivalent (so the test can
tell the two apart). The mutation `reduce-to-one` of scripts/mutate.py must be killed here.
"""

from __future__ import annotations

import pytest
from handmade import PlanDict

from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

B, N = 4, 8  # batch (split over 2 data-parallel ranks), the dimension the bug lives in
DP = 2


def _pair(shape_x, extra_inputs, single_ops, parallel_ops, out_shape):
    """A single plan and a dp=2 parallel plan (each rank takes half the batch of `x`, and
    every other input whole). `single_ops(p, name)` / `parallel_ops(p, name, rank)` add the
    nodes computing `y` from `x` and the extra inputs (`name(t)` is the tensor id)."""
    single = PlanDict("single", "e2e_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    single.t("x", shape_x, "input")
    for t, shape in extra_inputs.items():
        single.t(t, shape, "input")
    single_ops(single, lambda t: t)
    single.d["outputs"] = ["y"]

    par = PlanDict("parallel", "e2e_parallel",
                   {"dp": DP, "tp": 1, "pp": 1, "mb": 1, "ranks": DP})
    b = shape_x[0] // DP
    rows = lambda d: (d * b, (d + 1) * b)  # noqa: E731
    full = lambda shape: [(0, n) for n in shape]  # noqa: E731
    for d in range(DP):
        par.t(f"x@{d}", shape_x, "input")
        par.t(f"xc@{d}", [b, *shape_x[1:]])
        for t, shape in extra_inputs.items():
            par.t(f"{t}@{d}", shape, "input")
        par.n(f"c@{d}", "chunk", [f"x@{d}"], [f"xc@{d}"], pass_=None, rank=d, dim=0,
              ranks=list(range(DP)), idx=d)
        parallel_ops(par, lambda t, d=d: f"xc@{d}" if t == "x" else f"{t}@{d}", d)
    par.lineage("x", [(full(shape_x), [f"x@{d}"]) for d in range(DP)])
    for t, shape in extra_inputs.items():
        par.lineage(t, [(full(shape), [f"{t}@{d}"]) for d in range(DP)])
    par.lineage("x", [([rows(d), *full(shape_x[1:])], [f"xc@{d}"]) for d in range(DP)])
    par.lineage("y", [([rows(d), *full(out_shape[1:])], [f"y@{d}"]) for d in range(DP)])
    return single.d, par.d


def _verify(single: dict, parallel: dict):
    s, p = plan_from_dict(single, "single.json"), plan_from_dict(parallel, "parallel.json")
    check_pair(s, p)
    return verify_plans(s, p, Options(jobs=1))


# ----------------------------------------------------------------------------- the cases


def transpose_case(bug: bool):
    """y = x^T per batch element (square N x N); the bug forgets the transpose."""
    def single_ops(p, name):
        p.t("y", [B, N, N])
        p.n("tr", "transpose", [name("x")], ["y"], dim0=1, dim1=2)

    def parallel_ops(p, name, rank):
        p.t(f"y@{rank}", [B // DP, N, N])
        if bug:
            p.n(f"tr@{rank}", "identity", [name("x")], [f"y@{rank}"], pass_=None, rank=rank)
        else:
            p.n(f"tr@{rank}", "transpose", [name("x")], [f"y@{rank}"], rank=rank, dim0=1,
                dim1=2)

    return _pair([B, N, N], {}, single_ops, parallel_ops, [B, N, N])


def mean_case(bug: bool):
    """y = mean of each row of x; the bug sums instead."""
    def single_ops(p, name):
        p.t("y", [B, 1])
        p.n("m", "mean", [name("x")], ["y"], dim=[1], keepdim=True)

    def parallel_ops(p, name, rank):
        p.t(f"y@{rank}", [B // DP, 1])
        p.n(f"m@{rank}", "sum" if bug else "mean", [name("x")], [f"y@{rank}"], rank=rank,
            dim=[1], keepdim=True)

    return _pair([B, N], {}, single_ops, parallel_ops, [B, 1])


def broadcast_case(bug: bool):
    """y = x * s with a per-row scale s [B, N, 1] broadcast along the last axis; the bug
    views s as [B, 1, N] and so broadcasts it along the other axis (a per-column scale)."""
    def single_ops(p, name):
        p.t("y", [B, N, N])
        p.n("mul", "mul", [name("x"), name("s")], ["y"])

    def parallel_ops(p, name, rank):
        p.t(f"y@{rank}", [B // DP, N, N])
        p.t(f"sc@{rank}", [B // DP, N, 1])
        p.n(f"cs@{rank}", "chunk", [name("s")], [f"sc@{rank}"], pass_=None, rank=rank, dim=0,
            ranks=list(range(DP)), idx=rank)
        scale = f"sc@{rank}"
        if bug:
            p.t(f"sv@{rank}", [B // DP, 1, N])
            p.n(f"v@{rank}", "view", [scale], [f"sv@{rank}"], rank=rank, size=[B // DP, 1, N])
            scale = f"sv@{rank}"
        p.n(f"mul@{rank}", "mul", [name("x"), scale], [f"y@{rank}"], rank=rank)

    return _pair([B, N, N], {"s": [B, N, 1]}, single_ops, parallel_ops, [B, N, N])


CASES = {"transpose-square": transpose_case, "mean-vs-sum": mean_case,
         "broadcast-axis": broadcast_case}


@pytest.mark.parametrize("name", sorted(CASES))
def test_correct_plan_is_equivalent(name):
    report = _verify(*CASES[name](bug=False))
    assert report.verdict == "equivalent", report.failures
    assert report.stages_proven == report.stages_total > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_bug_that_needs_size_two_is_a_violation(name):
    report = _verify(*CASES[name](bug=True))
    assert report.verdict == "violation", report.failures
    found = [f for f in report.failures if f.kind == "counterexample"]
    assert found, report.failures
    f = found[0]
    assert f.tensor == "y"
    cex = f.counterexample
    assert cex["mismatches"], cex
    # the stage was shape-reduced, and the dimension the bug lives in (x's axis 1) kept
    # size >= 2: the counterexample's inputs are elements of the reduced x
    xs = [key for key in cex["inputs"] if key.startswith(("s:x[", "p:x@", "p:xc@"))]
    assert xs, cex["inputs"]
    size = 1 + max(int(key.split("[")[1].rstrip("]").split(",")[1]) for key in xs)
    assert 2 <= size < N, (size, xs)
    # and the mismatching element is one where the bug shows: off the diagonal for the
    # transpose (the diagonal of x^T is x's), anywhere for the others
    if name == "transpose-square":
        assert all(m["index"][1] != m["index"][2] for m in cex["mismatches"]), cex
