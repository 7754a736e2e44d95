"""Counterexamples in plan terms, and their confirmation with the real functions.

A solver model names canonical symbols (`x3`, `l0`, `r0`); this module maps them back to plan
tensors and elements, and, for obligations that use an abstraction (uninterpreted `uf_exp`,
`uf_rsqrt`, ..., or the `neg_inf` symbol), re-evaluates both sides with the real functions so
that only a mismatch that survives is reported as a violation.
"""

from __future__ import annotations

from fractions import Fraction

from tvsmt.encoding.evaluate import FloatEvaluator, as_float, close
from tvsmt.encoding.smtlib import Printed
from tvsmt.encoding.stage import StageFormula


def _show(v) -> str:
    """A model's value: an integer or a float where it is exactly one (the inputs fixed at a
    concrete point are), else exact where that is short, else the nearest float after "~"."""
    if isinstance(v, Fraction):
        if v.denominator == 1:
            return str(v.numerator)
        f = float(v)
        if Fraction(f) == v:
            return repr(f)
        exact = f"{v.numerator}/{v.denominator}"
        return exact if len(exact) <= 40 else f"~{f!r}"
    return str(v)


def counterexample(printed: Printed, formula: StageFormula, values: dict) -> dict:
    """Inputs and mismatching element values of a model, in plan terms."""
    inputs = {}
    for canon, original in printed.symbols.items():
        if canon in values:
            side_tensor, idx = formula.inputs.get(original, (original, ()))
            inputs[f"{side_tensor}[{','.join(map(str, idx))}]"] = _show(values[canon])
    mismatches = []
    for (ln, rn), comp in zip(printed.pairs, formula.comparisons, strict=True):
        lv, rv = values.get(ln), values.get(rn)
        if lv is not None and rv is not None and lv != rv:
            mismatches.append({"part": comp.part, "index": list(comp.single_index),
                               "part_index": list(comp.index), "single": _show(lv),
                               "parallel": _show(rv)})
    return {"inputs": inputs, "mismatches": mismatches,
            "reduced_shape": list(formula.target_shape),
            "note": "element indices refer to the shape-reduced tensors of the stage"}


def uses_abstraction(printed: Printed) -> bool:
    """Does the obligation use an uninterpreted function or the -inf symbol?"""
    return "(declare-fun uf_" in printed.text or "neg_inf" in printed.symbols.values()


def confirm(printed: Printed, formula: StageFormula, values: dict, cex: dict) -> bool:
    """Re-evaluate the model with the real functions; True if a mismatch survives.
    Adds the real-function values to the counterexample's mismatches."""
    env = {}
    for canon, original in printed.symbols.items():
        if original == "neg_inf":
            continue
        v = as_float(values.get(canon))
        if v is None:
            return False
        env[original] = v
    ev = FloatEvaluator(env)
    try:
        if not all(ev.walk(c) for c in formula.constraints):
            return False
        confirmed = False
        by_index = {tuple(m["index"]) + (m["part"],): m for m in cex["mismatches"]}
        for comp in formula.comparisons:
            a, b = ev.walk(comp.lhs), ev.walk(comp.rhs)
            if not close(a, b) and not (a != a or b != b):
                confirmed = True
                m = by_index.get(tuple(comp.single_index) + (comp.part,))
                if m is not None:
                    m["single_eval"], m["parallel_eval"] = repr(a), repr(b)
        return confirmed
    except KeyError:
        return False


def first_mismatch_part(cex: dict) -> int | None:
    return cex["mismatches"][0]["part"] if cex.get("mismatches") else None
