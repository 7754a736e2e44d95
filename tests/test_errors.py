"""One error hierarchy (tvsmt/errors.py): input errors are the user's (exit 2), a bug inside an
operator's entry is tvsmt's own (internal error, exit 4, naming the node it executed)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main
from tvsmt.errors import InputError, InternalError, PlanError, StructuralViolation, TvsmtError
from tvsmt.ops import registry


def test_the_hierarchy():
    assert PlanError is InputError
    for cls in (InputError, StructuralViolation, InternalError):
        assert issubclass(cls, TvsmtError)


def _write(tmp_path, single, parallel):
    s, p = tmp_path / "s.json", tmp_path / "p.json"
    s.write_text(json.dumps(single))
    p.write_text(json.dumps(parallel))
    return str(s), str(p)


def test_an_exception_inside_an_operator_rule_is_an_internal_error(tmp_path, monkeypatch):
    registry._load_all()
    spec = registry.REGISTRY["div"]

    def broken(be, ins, attrs, ctx):
        raise ZeroDivisionError("a bug in the entry")

    monkeypatch.setitem(registry.REGISTRY, "div", replace(spec, forward=broken))
    r = CliRunner().invoke(main, ["verify", *_write(tmp_path, single_mlp(), parallel_mlp()),
                                  "--no-corpus"])
    assert r.exit_code == 4, r.output
    assert "internal error while executing node" in r.output and "(div/fw)" in r.output
    assert "Traceback" not in r.output


def test_a_declared_attribute_error_stays_an_input_error(tmp_path):
    par = parallel_mlp()
    node = next(n for n in par["nodes"] if n["op"] == "div")
    node["attrs"]["rounding_mode"] = "floor"
    r = CliRunner().invoke(main, ["verify", *_write(tmp_path, single_mlp(), par), "--no-corpus"])
    assert r.exit_code == 2, r.output
    assert node["id"] in r.output and "rounding_mode" in r.output


@pytest.mark.parametrize("attrs", [{"times": "two"}, {"times": -1}])
def test_malformed_multiref_times_is_an_input_error(attrs):
    import numpy as np

    from tvsmt.ops import AttrError, NodeCtx, NumericBackend, all_ops

    with pytest.raises(AttrError):
        all_ops()["multiref"].forward(NumericBackend(), [np.zeros(2)], attrs, NodeCtx())
