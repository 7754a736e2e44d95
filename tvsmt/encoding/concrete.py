"""Evaluating a stage at random concrete inputs, with the real functions (no solver).

Used twice, as belt and braces around the solver:

* next to an `unsat`: a proof holds for every interpretation of the uninterpreted functions,
  so in particular for the real exp, rsqrt, ...; if the two sides differ at a concrete point
  that satisfies the stage's assumptions, the solver (or the encoding) is wrong and the stage
  is NOT proven (a solver failure, inconclusive);
* when the solver gives no usable answer: a mismatch is a concrete counterexample (a plain
  evaluation of both plans); finding none proves nothing.

The stage's assumptions are linear equalities between input symbols (an element defined by
two lineages, a partial sum). A random point on them is the closest point to a random positive
vector inside their null space (numpy least squares): the constraints hold up to rounding, and
the values stay mostly positive, inside the domains of rsqrt and pow. Elements that evaluate to
NaN or infinity (outside a real function's domain) tell nothing and are skipped.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pysmt.operators as op

from tvsmt.encoding.evaluate import ExactEvaluator, NotExact, PointsEvaluator
from tvsmt.encoding.stage import StageFormula

REL, ABS = 1e-7, 1e-9  # far above the rounding of a least-squares point, far below a bug


@dataclass
class Evaluation:
    """What random concrete points said about a stage."""

    points: int = 0  # points evaluated (0: the stage could not be evaluated)
    compared: int = 0  # element comparisons with finite values on both sides
    counterexample: dict | None = None  # first mismatch found, in plan terms
    note: str = ""  # why fewer points than asked were evaluated
    point: dict[str, float] | None = None  # that mismatch's input values, by symbol name

    def to_json(self) -> dict:
        return {"points": self.points, "compared": self.compared, "note": self.note,
                "mismatch": self.counterexample is not None}


class NotLinear(Exception):
    pass


def _linear(term, coef: Fraction, out: dict) -> None:
    """Add `coef * term` to the linear form `out` (symbol name -> coefficient)."""
    kind = term.node_type()
    if kind == op.SYMBOL:
        name = term.symbol_name()
        out[name] = out.get(name, Fraction(0)) + coef
    elif kind == op.PLUS:
        for a in term.args():
            _linear(a, coef, out)
    elif kind == op.MINUS:
        _linear(term.args()[0], coef, out)
        _linear(term.args()[1], -coef, out)
    elif kind == op.TIMES:
        consts = [a for a in term.args() if a.is_constant()]
        rest = [a for a in term.args() if not a.is_constant()]
        if len(rest) != 1:
            raise NotLinear()
        c = coef
        for k in consts:
            c *= Fraction(k.constant_value())
        _linear(rest[0], c, out)
    elif term.is_constant():
        out[""] = out.get("", Fraction(0)) + coef * Fraction(term.constant_value())
    else:
        raise NotLinear()


def _selections(formula: StageFormula) -> tuple[bool, dict[str, set[int]]]:
    """Does a compared term select by value (an if-then-else, e.g. [idx == e] in MoE
    routing or a token-id range)? Random reals never hit such a case's branch points. And
    the input symbols that select alone, each with the integers where its conditions change
    (`_branch_points`): a symbol that is the only one of a linear comparison in some
    if-then-else's condition (a token id against the rows of an embedding or against an
    ignored index, an expert index against an expert), unlike a maximum's condition, which
    compares two computed values."""
    ites = _ites(formula)
    alone: dict[str, set[int]] = {}
    for t in ites:
        for name, points in _branch_points_of(t.args()[0]).items():
            if name in formula.inputs:
                alone.setdefault(name, set()).update(points)
    return bool(ites), alone


_BRANCH_POINTS: dict = {}  # condition term -> _branch_points(it), kept while it is small
_BRANCH_POINTS_KEPT = 1 << 16


def _branch_points_of(cond) -> dict[str, set[int]]:
    """`_branch_points`, once per condition term (pysmt makes equal terms one object, and
    the stages of one node's outputs share their conditions: a MoE layer's 384 per stage);
    the memo holds its terms, so no id is reused while it lives."""
    got = _BRANCH_POINTS.get(cond)
    if got is None:
        if len(_BRANCH_POINTS) >= _BRANCH_POINTS_KEPT:
            _BRANCH_POINTS.clear()
        got = _BRANCH_POINTS[cond] = _branch_points(cond)
    return got


def _ites(formula: StageFormula) -> list:
    """The if-then-else terms in the stage's comparisons."""
    stack = [t for c in formula.comparisons for t in (c.lhs, c.rhs)]
    seen: set = set()
    out = []
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t.is_ite():
            out.append(t)
        stack.extend(t.args())
    return out


def _branch_points(cond) -> dict[str, set[int]]:
    """The symbols that a condition's linear comparisons each involve alone, with the
    integers at which those comparisons change: v for x == v, both sides of the boundary of
    x < v or x <= v, through not/and/or."""
    out: dict[str, set[int]] = {}
    stack = [cond]
    while stack:
        c = stack.pop()
        kind = c.node_type()
        if kind in (op.NOT, op.AND, op.OR):
            stack.extend(c.args())
            continue
        if kind not in (op.EQUALS, op.LE, op.LT):
            continue
        lhs, rhs = c.args()
        if not (lhs.is_constant() or rhs.is_constant()):
            continue  # two computed values (a maximum): no input alone
        form: dict = {}
        try:
            _linear(lhs, Fraction(1), form)
            _linear(rhs, Fraction(-1), form)
        except NotLinear:
            continue
        names = [n for n, a in form.items() if n and a]
        if len(names) != 1:
            continue
        v = -form.get("", Fraction(0)) / form[names[0]]  # where a * x + b == 0
        lo = math.floor(v)
        out.setdefault(names[0], set()).update(
            {lo} if v == lo and kind == op.EQUALS else {lo - 1, lo, lo + 1})
    return out


def point_kinds(formula: StageFormula, points: int, selections=None
                ) -> list[tuple[int | None, dict[str, set[int]] | None]]:
    """The points evaluate_at_random draws first, as `_point`'s (ints, only) arguments:
    `points` real points; where the stage selects by value, more real points and then small
    integers everywhere, since a random real never equals an expert index or a token id."""
    selects, _ = selections or _selections(formula)
    if not selects:
        return [(None, None)] * points
    return [(None, None)] * max(points, 4) + [(b, None) for b in (4, 16, 64)]


def mixed_kinds(formula: StageFormula, int_points_failed: bool, selections=None
                ) -> list[tuple[int | None, dict[str, set[int]] | None]]:
    """The points evaluate_at_random draws next, when the first ones found no mismatch: the
    symbols that select alone (token ids, labels, expert indices) get integers beside real
    values everywhere else: small ones, or half the time one of their conditions' branch
    points that small integers never reach (a label ignored at -100); two points per bound.
    Only where it can tell more: some branch point is out of the small integers' reach, or
    some comparison at the integer points was not finite (small integers everywhere overflow
    a whole model's exponentials, or divide by zero in a LayerNorm of equal values)."""
    _, alone = selections or _selections(formula)
    rare = any(not 0 <= v < 64 for values in alone.values() for v in values)
    if not alone or not (rare or int_points_failed):
        return []
    return [(b, alone) for b in (4, 4, 16, 16, 64, 64)]


def _point(formula: StageFormula, rng: random.Random, ints: int | None = None,
           only: dict[str, set[int]] | None = None) -> dict[str, float] | None:
    """Random values for the stage's input symbols that satisfy its assumptions: reals in
    (0.5, 1.5); with `ints`, small integers below it instead, for every symbol, or, given
    `only` (symbol -> its branch points), for those symbols only, each of which takes one of
    its branch points outside range(ints) half the time, if it has any."""
    names = sorted(formula.inputs)
    env = {}
    for n in names:
        if ints is None or (only is not None and n not in only):
            env[n] = rng.uniform(0.5, 1.5)
            continue
        rare = sorted(v for v in (only or {}).get(n, ()) if not 0 <= v < ints)
        env[n] = float(rng.choice(rare) if rare and rng.random() < 0.5 else
                       rng.randrange(ints))
    if not formula.constraints:
        return env
    rows = []
    for c in formula.constraints:
        if c.node_type() != op.EQUALS:
            return None
        form: dict = {}
        lhs, rhs = c.args()
        _linear(lhs, Fraction(1), form)
        _linear(rhs, Fraction(-1), form)
        rows.append(form)
    cols = sorted({n for r in rows for n in r if n})
    index = {n: i for i, n in enumerate(cols)}
    a = np.zeros((len(rows), len(cols)))
    b = np.zeros(len(rows))
    for i, r in enumerate(rows):
        for n, v in r.items():
            if n:
                a[i, index[n]] = float(v)
            else:
                b[i] = -float(v)
    r0 = np.array([env.get(n, rng.uniform(0.5, 1.5)) for n in cols])
    # closest point to r0 with a @ x == b: x = r0 + a^+ (b - a @ r0)
    x = r0 + np.linalg.lstsq(a, b - a @ r0, rcond=None)[0]
    if not np.allclose(a @ x, b, rtol=1e-9, atol=1e-9):
        return None  # inconsistent assumptions: nothing to evaluate
    for n, v in zip(cols, x.tolist()):
        env[n] = v
    return env


def assumption_pivots(formula: StageFormula) -> dict[str, dict[str, Fraction]] | None:
    """The input symbols that the stage's assumptions (linear equalities) determine, each
    with its value as a linear form ("" the constant) of symbols that are either free or
    determined later in the dict's order: one per independent assumption, by forward
    elimination over exact fractions. None when an assumption is not a linear equality."""
    pivots: dict[str, dict[str, Fraction]] = {}
    for c in formula.constraints:
        if c.node_type() != op.EQUALS:
            return None
        row: dict[str, Fraction] = {}
        lhs, rhs = c.args()
        try:
            _linear(lhs, Fraction(1), row)
            _linear(rhs, Fraction(-1), row)
        except NotLinear:
            return None
        todo = [n for n in row if n in pivots]
        while todo:  # each pivot replaced by its form, whose pivots (later ones) in turn
            name = todo.pop()
            coef = row.pop(name, None)
            if not coef:
                continue
            for n, v in pivots[name].items():
                row[n] = row.get(n, Fraction(0)) + coef * v
                if n in pivots:
                    todo.append(n)
        rest = sorted(n for n, v in row.items() if n and v)
        if rest:  # else the assumption follows from the earlier ones (or contradicts them)
            coef = row.pop(rest[0])
            pivots[rest[0]] = {n: -v / coef for n, v in row.items() if v}
    return pivots


def exact_refutation(formula: StageFormula, point: dict[str, float]
                     ) -> tuple[dict[str, Fraction], dict[tuple, Fraction]] | None:
    """The refuting `point` made exact: the values of the input symbols (the free ones as
    the point has them, the ones the assumptions determine computed from them) and of every
    uninterpreted function's application (`ExactEvaluator`), provided the two sides still
    differ there; else None. Given to a solver, they leave it a ground query."""
    pivots = assumption_pivots(formula)
    if pivots is None:
        return None
    try:
        exact = {n: Fraction(v) for n, v in point.items() if n not in pivots}
        for p in reversed(list(pivots)):  # a form holds free symbols and later pivots only
            exact[p] = sum((c * exact[n] if n else c for n, c in pivots[p].items()),
                           Fraction(0))
        ev = ExactEvaluator(exact)
        differ = False
        for c in formula.comparisons:
            differ |= ev.walk(c.lhs) != ev.walk(c.rhs)
    except (NotExact, KeyError):
        return None
    if not differ:
        return None
    return {n: exact[n] for n in sorted(formula.inputs) if n in exact}, ev.applications


def evaluate_at_random(formula: StageFormula, points: int = 2, seed: int = 0) -> Evaluation:
    """Evaluate every compared element of the stage at random inputs (`point_kinds`, then
    `mixed_kinds` if those found no mismatch), each batch of points in one walk of the
    terms (PointsEvaluator)."""
    ev_out = Evaluation()
    if not formula.comparisons:
        return ev_out
    selections = _selections(formula)
    kinds = point_kinds(formula, points, selections)
    batch = _evaluate_points(formula, kinds, seed, ev_out)
    if batch is None or ev_out.counterexample is not None:
        return ev_out
    ints = [k for k, (bound, only) in enumerate(kinds[:batch.shape[1]])
            if bound is not None and only is None]
    more = mixed_kinds(formula, bool(ints) and not batch[:, ints].all(), selections)
    if more:
        _evaluate_points(formula, more, seed + len(kinds), ev_out)
    return ev_out


_EVALUATORS: dict = {}  # points (n, names and values) -> their PointsEvaluator, the last few
_EVALUATORS_KEPT = 4


def _evaluator_for(columns: dict[str, np.ndarray], n: int) -> PointsEvaluator:
    """A PointsEvaluator of these points: one of the last few again where its points are the
    same (names and values), so that its memo of term values serves again. The stages of one
    node's several outputs (a grouped GEMM's backward: five) have the same input symbols, so
    they draw the same points, and their terms, one object each in pysmt, are walked once."""
    key = (n, tuple((name, col.tobytes()) for name, col in sorted(columns.items())))
    ev = _EVALUATORS.pop(key, None)
    if ev is None:
        ev = PointsEvaluator(columns, n)
        while len(_EVALUATORS) >= _EVALUATORS_KEPT:
            del _EVALUATORS[next(iter(_EVALUATORS))]
    _EVALUATORS[key] = ev  # the most recent last
    return ev


def _evaluate_points(formula: StageFormula, kinds: list, seed: int, ev_out: Evaluation
                     ) -> np.ndarray | None:
    """Evaluate the stage at the points `kinds` describes (point k drawn with seed + k),
    adding to ev_out's counts and setting its counterexample at the first point with a
    mismatch; returns the (comparison x point) matrix of finite comparisons, None if no point
    could be evaluated (ev_out.note says why)."""
    envs = []
    for k, (bound, only) in enumerate(kinds):
        rng = random.Random(seed + k)
        try:
            env = _point(formula, rng, bound, only)
        except NotLinear:
            ev_out.note = "assumptions are not linear"
            break
        if env is None:
            ev_out.note = "assumptions have no concrete point"
            break
        envs.append(env)
    if not envs:
        return None
    n = len(envs)
    try:
        columns = {name: np.array([e[name] for e in envs]) for name in envs[0]}
    except KeyError as e:  # points over different symbols: cannot happen, never a pass
        ev_out.note = f"no value for {e}"
        return None
    ev = _evaluator_for(columns, n)
    comps = formula.comparisons
    try:
        # each distinct term once (the copies of a gathered tensor on every rank of a group
        # are compared with the same single terms, 2048 comparisons of 256 pairs), then the
        # comparisons as (comparison x point) arrays
        vectors: dict = {}
        for c in comps:
            for t in (c.lhs, c.rhs):
                if id(t) not in vectors:
                    vectors[id(t)] = ev.vector(t)
    except KeyError as e:  # a symbol without a value: not a stage we can evaluate
        ev_out.note = f"no value for {e}"
        return None
    single = np.array([vectors[id(c.lhs)] for c in comps], dtype=np.float64).reshape(-1, n)
    par = np.array([vectors[id(c.rhs)] for c in comps], dtype=np.float64).reshape(-1, n)
    finite = np.isfinite(single) & np.isfinite(par)  # elsewhere a point tells nothing
    with np.errstate(invalid="ignore"):
        near = np.abs(single - par) <= np.maximum(
            ABS, REL * np.maximum(np.abs(single), np.abs(par)))  # `close`, elementwise
    differ = finite & ~near
    ev_out.points += n
    ev_out.compared += int(finite.sum())
    for k in range(n):
        rows = np.flatnonzero(differ[:, k]).tolist()
        if rows:
            ev_out.point = envs[k]
            inputs = {}
            for name in sorted(formula.inputs):
                side_tensor, idx = formula.inputs[name]
                inputs[f"{side_tensor}[{','.join(map(str, idx))}]"] = repr(envs[k][name])
            ev_out.counterexample = {
                "inputs": inputs, "found_by": "evaluation",
                "mismatches": [{"part": comps[i].part, "index": list(comps[i].single_index),
                                "part_index": list(comps[i].index),
                                "single": repr(float(single[i, k])),
                                "parallel": repr(float(par[i, k]))} for i in rows],
                "reduced_shape": list(formula.target_shape),
                "note": "element indices refer to the shape-reduced tensors of the stage"}
            break
    return finite
