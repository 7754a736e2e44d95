"""Every registered operator owns its whole contract (Alive2 style): this walks the registry
and checks that each entry states every fact the phases read from it."""

from __future__ import annotations

import inspect

import pytest

from tvsmt.ops import all_ops
from tvsmt.ops.backend import UNINTERPRETED, SymbolicBackend

OPS = sorted(all_ops())


@pytest.mark.parametrize("name", OPS)
def test_entry_is_complete(name):
    spec = all_ops()[name]
    assert spec.name == name
    assert spec.doc.strip(), f"{name}: no doc string"
    assert callable(spec.forward) and callable(spec.shape)
    if spec.backward is None:
        assert spec.no_backward.strip(), f"{name}: no backward and no reason given"
    else:
        assert callable(spec.backward)
    for f in spec.abstracts:
        assert f in UNINTERPRETED, f"{name}: abstracts {f}, which has no real function"
    if spec.unit_sum:
        assert spec.communication, f"{name}: a sum over units is a communication op"
    assert isinstance(spec.rank_attrs, tuple)
    assert isinstance(spec.shape_only, bool)  # which: tests/test_ops_torch.py


def test_every_uninterpreted_function_is_used_by_some_operator_or_the_backend():
    used = {f for spec in all_ops().values() for f in spec.abstracts}
    backend_src = inspect.getsource(SymbolicBackend)
    for name in UNINTERPRETED:
        assert name in used or f'"{name}"' in backend_src, name


def test_symbolic_backend_refuses_a_function_without_a_real_counterpart():
    be = SymbolicBackend()
    with pytest.raises(AssertionError):
        be._uf("uf_made_up", 1)


def test_sum_ops_come_from_the_registry():
    from tvsmt.fold.folder import SUM_OPS

    assert SUM_OPS == {"all_reduce", "reducer", "grad_accum"}
