"""A loss normalised by a data-dependent token count (examples/token_loss.py): proven
equivalent as written, its two classic bugs violations at the line at fault.

The proof needs division by a tensor to be linear in what it divides (a micro-batch's summed
loss over the global count, summed over micro-batches and ranks, is the whole sum over the
count). With division as an uninterpreted function of both operands the run was
inconclusive: the solver's counterexample chose unrelated values for `s/c` and `s0/c + s1/c`."""

from __future__ import annotations

import io
import os

import pytest
import z3
from pysmt.logics import QF_UFNRA
from pysmt.shortcuts import Equals, Not, Plus, Symbol
from pysmt.smtlib.script import smtlibscript_from_formula
from pysmt.typing import REAL

from tvsmt.capture import check
from tvsmt.ops.backend import SymbolicBackend
from tvsmt.verify import Options
from capture_helpers import line_of, proven_tensors, sources

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "token_loss.py")


def is_valid(formula) -> bool:
    """Whether z3 proves `formula` for every real and every interpretation of its
    uninterpreted functions (pysmt's own z3 link takes no UF with nonlinear reals)."""
    text = io.StringIO()
    smtlibscript_from_formula(Not(formula), logic=QF_UFNRA).serialize(text, daggify=False)
    solver = z3.Solver()
    solver.from_string(text.getvalue())
    return solver.check() == z3.unsat


def test_division_by_a_tensor_is_linear_in_what_it_divides_and_nothing_more():
    be = SymbolicBackend.fresh()
    with be.active():
        a, b, c, d = (Symbol(n, REAL) for n in "abcd")
        [whole] = be.div([Plus(a, b)], [c])
        [left], [right] = be.div([a], [c]), be.div([b], [c])
        assert is_valid(Equals(whole, Plus(left, right)))
        # the divisor still matters, and a reciprocal is not known to be 1/c: both remain
        # counterexamples a proof must not get past
        [other] = be.div([a], [d])
        assert not is_valid(Equals(left, other))
        [half] = be.div([a], [Plus(c, c)])
        assert not is_valid(Equals(Plus(half, half), left))


def test_a_loss_over_the_global_token_count_is_proven(monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)
    report = check(EXAMPLE, Options(jobs=1, timeout=10))
    assert report.verdict == "equivalent", [f.message for f in report.failures]
    proven = proven_tensors(report)
    assert {"loss", "grad.out.weight", "grad.emb.weight"} <= proven, proven


@pytest.mark.parametrize("bug, marker", [
    ("micro-batch-mean", "loss = summed / _kept(lab) / micro"),
    ("rank-count", "loss = summed / count"),  # its count never all-reduced
])
def test_a_count_of_the_wrong_tokens_is_a_violation_at_its_line(bug, marker, monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", bug)
    report = check(EXAMPLE, Options(jobs=1, timeout=1))
    assert report.verdict == "violation", [f.message for f in report.failures]
    assert any(f.kind == "counterexample" for f in report.failures)
    line = line_of(EXAMPLE, marker)
    assert any(s.endswith(f"token_loss.py:{line}") for s in sources(report)), sources(report)
