"""Checks of what every operator rule must respect beyond its values, shared by
test_ops_torch.py (every operator's case) and test_ops_moe.py (the MoE operators)."""

from __future__ import annotations

import numpy as np


def assert_inputs_kept(rule, backend, ins: list, attrs: dict, ctx, what: str) -> None:
    """`rule` leaves its input arrays as they were: the same values, the very same terms
    (a tensor's array is shared by its readers and kept by the node memo)."""
    before = [None if a is None else np.array(a, copy=True) for a in ins]
    rule(backend, ins, attrs, ctx)
    for k, (a, b) in enumerate(zip(ins, before, strict=True)):
        if a is None:
            continue
        a = np.asarray(a)
        assert a.shape == b.shape, f"{what}: input {k} reshaped in place"
        if a.dtype == object:
            assert all(x is y for x, y in zip(a.flat, b.flat)), f"{what}: input {k}"
        else:
            assert np.array_equal(a, b, equal_nan=True), f"{what}: input {k}"


def assert_same_terms(rule, backend, ins: list, attrs: dict, ctx, what: str) -> None:
    """Run twice on the same input terms in one backend, `rule` gives the very same output
    terms (the node memo's premise: no fresh symbol per call)."""
    first, again = rule(backend, ins, attrs, ctx), rule(backend, ins, attrs, ctx)
    assert len(first) == len(again), what
    for a, b in zip(first, again, strict=True):
        assert (a is None) == (b is None), what
        if a is not None:
            a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
            assert a.shape == b.shape, what
            assert all(x is y for x, y in zip(a.flat, b.flat)), what


def uninterpreted_in(outputs) -> set[str]:
    """The uninterpreted functions (backend.UNINTERPRETED names) the output terms apply."""
    found: set[str] = set()
    for out in outputs:
        if out is None:
            continue
        for term in np.asarray(out, dtype=object).flat:
            if hasattr(term, "get_free_variables"):
                found.update(s.symbol_name() for s in term.get_free_variables()
                             if s.symbol_type().is_function_type())
    return found


def assert_declared_abstractions(rule, backend, ins: list, attrs: dict, ctx,
                                 declared: tuple[str, ...], what: str) -> None:
    """`rule` applies only the uninterpreted functions its operator declares
    (`OpSpec.abstracts`: what a counterexample through an abstraction is re-checked for)."""
    used = uninterpreted_in(rule(backend, ins, attrs, ctx))
    assert used <= set(declared), f"{what}: applies {sorted(used - set(declared))}, " \
        f"not in its OpSpec.abstracts {declared}"
