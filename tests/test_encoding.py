"""Canonical SMT-LIB printing, shape reduction, and the soundness of every shortcut."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fixture_pair
from handmade import parallel_mlp, single_mlp

from tvsmt.encoding.obligations import encode_one
from tvsmt.encoding.smtlib import print_obligation
from tvsmt.ops import SymbolicBackend
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.shapes import reduce_stage
from tvsmt.shapes.dims import DivisorSolver
from tvsmt.stages import cut_stages
from tvsmt.timing import Timer
from tvsmt.verify import Options, verify_plans


def test_printing_is_canonical_up_to_renaming():
    be = SymbolicBackend()
    m = be.mgr

    def build(names):
        a, b, c = (m.Symbol(n, be.real) for n in names)
        e = be.exp(__import__("numpy").array([a + b], dtype=object))[0]
        return [m.Equals(c, e * e)], [(a * b + e, b * a + e)]

    p1 = print_obligation(*build(["foo", "bar", "baz"]))
    p2 = print_obligation(*build(["t1@r0", "t9@r3", "q"]))
    assert p1.text == p2.text and p1.digest == p2.digest
    assert "uf_exp" in p1.text and "foo" not in p1.text
    p3 = print_obligation(*build(["bar", "foo", "baz"]))  # same shape, same text
    assert p3.digest == p1.digest
    assert p1.symbols == {"x0": "baz", "x1": "foo", "x2": "bar"}  # first-visit order
    # shared subterms are bound once
    assert p1.text.count("(uf_exp") == 1


def test_z3_binary_accepts_the_script(tmp_path):
    z3 = Path(sys.executable).with_name("z3")
    if not z3.exists():
        pytest.skip("z3 binary not installed next to the interpreter")
    be = SymbolicBackend()
    m = be.mgr
    a, b = m.Symbol("a", be.real), m.Symbol("b", be.real)
    p = print_obligation([], [(a * b, b * a)])
    f = tmp_path / "o.smt2"
    f.write_text(p.text)
    out = subprocess.run([str(z3), str(f)], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "unsat"
    p = print_obligation([], [(a * b, a + b)])
    f.write_text(p.text)
    out = subprocess.run([str(z3), str(f)], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "sat"


def test_a_pair_given_again_is_stated_once(tmp_path):
    """Identical (single, parallel) term pairs (a tensor replicated on every rank of a
    tensor-parallel group) are stated once; each occurrence keeps names (for the model),
    and the script still says sat exactly when some pair can differ."""
    be = SymbolicBackend()
    m = be.mgr
    a, b = m.Symbol("a", be.real), m.Symbol("b", be.real)
    same, differ = (a * b, b * a), (a * b, a + b)
    p = print_obligation([], [same, differ, same, differ, same])
    assert p.text.count("(declare-fun l") == 2 and p.text.count("(not (= l") == 2
    assert p.pairs == [("l0", "r0"), ("l1", "r1"), ("l0", "r0"), ("l1", "r1"), ("l0", "r0")]
    assert p.text == print_obligation([], [same, differ]).text
    z3 = Path(sys.executable).with_name("z3")
    if not z3.exists():
        pytest.skip("z3 binary not installed next to the interpreter")
    for pairs, answer in (([same, differ, same], "sat"), ([same, same, same], "unsat")):
        f = tmp_path / "o.smt2"
        f.write_text(print_obligation([], pairs).text)
        out = subprocess.run([str(z3), str(f)], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == answer


def test_a_wrong_copy_among_replicated_copies_is_caught_at_its_rank():
    """The all-reduce result is held by the 4 ranks of each tensor-parallel group: its
    lineage's pairs repeat, and are stated once (above). An all-reduce that reads one
    rank's partial sum twice, on the last rank only, is caught there, the mismatch named at
    that rank's part."""
    s = plan_from_dict(single_mlp(), "s")
    good = plan_from_dict(parallel_mlp(dp=2, tp=4), "p")
    # y's lineages: as partial sums of the 4 ranks' products, then as the 8 ranks' copies
    y = max(i for i, lin in enumerate(good.lineages) if lin.single == "y")
    assert len(good.lineages[y].parts) == 8
    stage = next(st for st in cut_stages(s, good).stages if st.target == y)
    printed = encode_one(stage, s, good, SymbolicBackend(), Timer()).printed
    assert len(set(printed.pairs)) < len(printed.pairs)  # the shortcut is taken here
    plan = parallel_mlp(dp=2, tp=4)
    node = next(n for n in plan["nodes"] if n["id"] == "ar@7")
    node["inputs"] = ["yp@4", "yp@5", "yp@5", "yp@7"]
    bad = verify_plans(s, plan_from_dict(plan, "p"), Options())
    assert bad.verdict == "violation"
    (f,) = [f for f in bad.failures if f.lineage == y]
    assert f.parallel_tensors == ["y@7"]
    parts = {mm["part"] for mm in f.counterexample["mismatches"]}
    assert parts == {7}, parts  # the lineage's parts are one per rank, in rank order


def test_divisor_solver_keeps_partitions_products_and_minimums():
    s = DivisorSolver()
    H, h, d = s.new(4096), s.new(32), s.new(128)
    part = s.new(2048)
    s.add((h * d) == H)  # a view [.., 4096] -> [.., 32, 128]
    s.add(part * 2 == H)  # a tp=2 shard of H
    s.keep_divisible(H, 2048)  # the shard boundary
    s.add(s.new(7) >= 2)
    sizes = s.solve()
    assert sizes[h.id] * sizes[d.id] == sizes[H.id]
    assert sizes[part.id] * 2 == sizes[H.id]
    assert min(sizes) >= 2
    assert sizes[H.id] % 2 == 0 and sizes[H.id] <= 8


def test_divisor_search_over_thousands_of_related_classes_needs_no_recursion():
    """A stage with thousands of dimension classes tied by products (a reshape each) is
    searched without running into Python's recursion limit, and every product holds."""
    s = DivisorSolver()
    triples = [(s.new(64), s.new(8), s.new(8)) for _ in range(1500)]
    for a, b, c in triples:
        s.add((b * c) == a)
    sizes = s.solve()
    for a, b, c in triples:
        assert sizes[a.id] == sizes[b.id] * sizes[c.id]
        assert (sizes[a.id], sizes[b.id]) == (4, 2)  # reduced: divisors 16 and 4


def test_reduction_shrinks_the_llama_fixture_but_keeps_partitions():
    single, parallel = (load_plan(p) for p in fixture_pair("llama3-ly2-dp2pp2tp2mb2"))
    cut = cut_stages(single, parallel)
    biggest = 0
    for stage in cut.stages[:60]:
        shapes = reduce_stage(stage, single, parallel)
        biggest = max(biggest, max((max(s, default=1) for s in shapes.single.values()),
                                   default=1))
        lin = parallel.lineages[stage.target]
        full, red = single.shape(lin.single), shapes.single[lin.single]
        for part in lin.parts:  # boundaries map to integers, parts keep their share
            for (a, b), n, r in zip(part.slice, full, red):
                assert (a * r) % n == 0 and (b * r) % n == 0
    # hidden 4096, vocab 51200, batch 512 are all reduced; a view's inner axes keep their
    # sizes (only a merged or split run's outermost axis is reduced): hidden 4096 viewed as
    # 32 heads of 128 becomes 2 heads of 128
    assert biggest <= 256


@pytest.mark.parametrize("dp,tp", [(2, 4), (4, 2)])
def test_shortcuts_still_catch_a_bug_in_one_replica(dp, tp):
    """Shape reduction, term identity and dedup on a plan with many identical replicas: a
    wrong constant on the LAST rank only must still be caught, at that rank."""
    s = plan_from_dict(single_mlp(), "s")
    good = verify_plans(s, plan_from_dict(parallel_mlp(dp=dp, tp=tp), "p"), Options())
    assert good.verdict == "equivalent"
    assert good.obligations_unique < good.obligations_total or good.proven_without_solver
    last = dp * tp - 1
    bad = verify_plans(s, plan_from_dict(parallel_mlp(dp=dp, tp=tp, wrong_const_rank=last),
                                         "p"), Options())
    assert bad.verdict == "violation"
    assert any(f"n2@{last}" in [n["id"] for n in f.parallel_nodes] for f in bad.failures)


def test_drop_allreduce_with_wide_tensor_parallelism_is_caught():
    """Contraction dims stay >= 2 per shard: a missing all-reduce over 4 shards is visible."""
    s = plan_from_dict(single_mlp(), "s")
    bad = verify_plans(s, plan_from_dict(parallel_mlp(dp=1, tp=4, drop_allreduce=True), "p"),
                       Options())
    assert bad.verdict == "violation"


def test_direct_infix_builds_the_very_nodes_pysmt_builds():
    """`a + b`, `a - b`, `a * b` of two terms go straight to the formula manager
    (backend._direct_infix): on random terms, numbers and bit vectors, the node built is the
    one pysmt's own operators build (the same hash-consed object, or the same error)."""
    import random

    from pysmt.fnode import FNode
    from pysmt.typing import BVType

    be = SymbolicBackend.fresh()
    assert FNode._tvsmt_direct_infix
    add, sub, mul = FNode._tvsmt_pysmt_infix
    pairs = [(FNode.__add__, add), (FNode.__sub__, sub), (FNode.__mul__, mul)]
    rng = random.Random(0)
    with be.active():
        m = be.mgr
        pool = [m.Symbol(f"x{i}", be.real) for i in range(4)] + [m.Real(3), m.Real(-1)]
        for _ in range(400):
            a, b = rng.choice(pool), rng.choice(pool + [2, 0.5])
            direct, pysmts = rng.choice(pairs)
            got = direct(a, b)
            assert got is pysmts(a, b)
            pool.append(got)
        bv = [m.Symbol(f"v{i}", BVType(8)) for i in range(2)]
        for direct, pysmts in pairs:
            assert direct(bv[0], bv[1]) is pysmts(bv[0], bv[1])
            assert direct(bv[0], bv[1]).node_type() != direct(pool[0], pool[1]).node_type()
        # a Boolean sum is refused alike (fresh symbols each time: pysmt keeps the ill-typed
        # node it made before refusing it, and would hand it out the next time)
        for k, (direct, pysmts) in enumerate(pairs):
            p, q = m.Symbol(f"p{k}"), m.Symbol(f"q{k}")
            with pytest.raises(Exception) as theirs:
                pysmts(p, p)
            with pytest.raises(theirs.type):
                direct(q, q)


def _formula(constraints, comparisons, names):
    from types import SimpleNamespace

    return SimpleNamespace(constraints=constraints, inputs={n: (f"s:{n}", ()) for n in names},
                           comparisons=[SimpleNamespace(lhs=a, rhs=b) for a, b in comparisons])


def test_a_refuting_point_made_exact_keeps_the_assumptions_and_the_difference():
    """A point of a float evaluation satisfies the stage's linear assumptions only up to
    rounding; made exact, the free inputs keep the point's values, the others are computed
    from them exactly, every uninterpreted application gets one value per argument, and a
    solver given all of them answers sat at once. Where the sides agree there is nothing."""
    import hashlib
    from fractions import Fraction

    from pysmt.typing import REAL, FunctionType

    from tvsmt.encoding.concrete import exact_refutation
    from tvsmt.encoding.evaluate import ExactEvaluator
    from tvsmt.encoding.smtlib import pin_symbols
    from tvsmt.solving.runner import solve_batch
    from tvsmt.solving.types import SAT, Obligation

    be = SymbolicBackend.fresh()
    m = be.mgr
    s, p0, p1, q = (m.Symbol(n, REAL) for n in ("s", "p0", "p1", "q"))
    uf = m.Symbol("uf_exp", FunctionType(REAL, [REAL]))

    def exp(t):
        return m.Function(uf, [t])

    assumed = [m.Equals(s, m.Plus(p0, p1)), m.Equals(q, p0)]
    same = (exp(s), exp(m.Plus(p0, p1)))  # equal under the assumptions
    wrong = (m.Times(m.Real(2), exp(s)), m.Plus(exp(m.Plus(p0, p1)), exp(q)))
    point = {"s": 0.7500000000000001, "p0": 0.25, "p1": 0.5, "q": 0.25000000000000006}
    names = sorted(point)
    assert exact_refutation(_formula(assumed, [same], names), point) is None
    inputs, applications = exact_refutation(_formula(assumed, [same, wrong], names), point)
    ev = ExactEvaluator(inputs)
    assert all(ev.walk(c) for c in assumed)  # exactly, not up to rounding
    assert sum(inputs[n] == Fraction(point[n]) for n in names) == 2  # two free, kept
    args = [a for (name, a) in applications]
    assert len(args) == len(set(args)) == 2  # exp(s) and exp(p0 + p1): one argument
    printed = print_obligation(assumed, [same, wrong])
    text = pin_symbols(printed.text, printed, inputs, applications)
    ob = Obligation(hashlib.sha256(text.encode()).hexdigest(), text)
    assert solve_batch([ob], "z3", timeout_s=20)[0].status == SAT


def test_pinned_inputs_are_constants_the_solver_must_meet():
    """A pinned script fixes each real input at its value (a `define-fun` in place of the
    declaration): pinned where the compared sides agree it is unsat, where they differ sat
    with the pinned values in the model; the unpinned obligation is sat either way."""
    import hashlib
    from fractions import Fraction

    from pysmt.typing import REAL

    from tvsmt.encoding.smtlib import pin_symbols
    from tvsmt.solving.runner import solve_batch
    from tvsmt.solving.types import SAT, UNSAT, Obligation

    be = SymbolicBackend.fresh()
    m = be.mgr
    x, y = m.Symbol("x", REAL), m.Symbol("y", REAL)
    printed = print_obligation([], [(m.Times(x, x), y)])  # "x * x != y" is the obligation
    names = {orig: canon for canon, orig in printed.symbols.items()}

    def answer(values: dict[str, Fraction]):
        text = (pin_symbols(printed.text, printed, values, {}) if values else printed.text)
        query = (names["x"], names["y"])
        ob = Obligation(hashlib.sha256(text.encode()).hexdigest(), text, query)
        return solve_batch([ob], "z3", timeout_s=20)[0]

    assert answer({}).status == SAT
    assert answer({"x": Fraction(3, 2), "y": Fraction(9, 4)}).status == UNSAT
    res = answer({"x": Fraction(3, 2), "y": Fraction(2)})
    assert res.status == SAT
    assert (Fraction(res.values[names["x"]]), Fraction(res.values[names["y"]])) == (
        Fraction(3, 2), Fraction(2))


def _gathered_pair(const_on_rank1: float, also_z: bool = False):
    """single y = x + 1; on two ranks each adds 1 to its half of x, then both gather the
    halves into y@r (a whole copy of y). `const_on_rank1` is rank 1's constant (1.0 is
    correct); `also_z`: the single plan has a second input z, held by rank 0, and rank 1's x
    is said to hold z as well (a second claim on one parallel tensor)."""
    from handmade import PlanDict

    s = PlanDict("single", "s", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    s.t("x", [4, 2], "input"), s.t("y", [4, 2])
    s.n("n", "add", ["x"], ["y"], consts=[1.0])
    s.d["outputs"] = ["y"]
    p = PlanDict("parallel", "p", {"dp": 1, "tp": 2, "pp": 1, "mb": 1, "ranks": 2})
    for r in (0, 1):
        p.t(f"x@{r}", [4, 2], "input"), p.t(f"xc@{r}", [2, 2]), p.t(f"a@{r}", [2, 2])
        p.t(f"y@{r}", [4, 2])
        p.n(f"c@{r}", "chunk", [f"x@{r}"], [f"xc@{r}"], pass_=None, rank=r, dim=0, idx=r,
            ranks=[0, 1])
        p.n(f"n@{r}", "add", [f"xc@{r}"], [f"a@{r}"], rank=r,
            consts=[const_on_rank1 if r else 1.0])
    for r in (0, 1):
        p.n(f"g@{r}", "all_gather", ["a@0", "a@1"], [f"y@{r}"], pass_=None, rank=r, dim=0,
            ranks=[0, 1])
    p.d["outputs"] = ["y@0", "y@1"]
    if also_z:  # z's claim on x@1 first: x's own claim then meets a defined tensor
        s.t("z", [4, 2], "input"), p.t("z@0", [4, 2], "input")
        p.lineage("z", [([(0, 4), (0, 2)], ["x@1"])])
        p.lineage("z", [([(0, 4), (0, 2)], ["z@0"])])
    p.lineage("x", [([(0, 4), (0, 2)], [f"x@{r}"]) for r in (0, 1)])
    p.lineage("y", [([(0, 4), (0, 2)], [f"y@{r}"]) for r in (0, 1)])
    return plan_from_dict(s.d, "single"), plan_from_dict(p.d, "parallel")


def _y_stage(single, parallel):
    stage = next(st for st in cut_stages(single, parallel).stages
                 if parallel.lineages[st.target].single == "y")
    return encode_one(stage, single, parallel, SymbolicBackend.fresh(), Timer())


def test_a_copy_whose_terms_are_partly_the_single_sides_is_compared_element_by_element():
    """A target part that is one tensor at scale 1 is equal by construction only when every
    one of its elements is the single side's very term. Here rank 0's rows of the gathered y
    are (the same terms), rank 1's rows carry a wrong constant: they must be compared and
    found, and only they."""
    assert verify_plans(*_gathered_pair(1.0), Options(jobs=1)).verdict == "equivalent"
    single, parallel = _gathered_pair(2.0)
    out = _y_stage(single, parallel)
    rows = {c.single_index[0] for c in out.formula.comparisons}
    assert out.formula.trivially_equal > 0 and rows and rows <= {2, 3}
    assert verify_plans(single, parallel, Options(jobs=1)).verdict == "violation"


def test_an_entry_tensor_claimed_twice_is_constrained_not_redefined():
    """A parallel entry tensor that two lineage parts name is defined by the first and
    constrained by the second: rank 1's x, said to hold both x and z, makes `x == z` an
    assumption of the stage that reads it (and y is still proven from x)."""
    single, parallel = _gathered_pair(1.0, also_z=True)
    out = _y_stage(single, parallel)
    assert any("s|z|" in str(c) and "s|x|" in str(c) for c in out.formula.constraints), \
        out.formula.constraints
    assert verify_plans(single, parallel, Options(jobs=1)).verdict == "equivalent"
