"""Minimal in-process z3 solving (fallback when no external solver is configured)."""

from __future__ import annotations

import time

from tvsmt.solving.sexpr import parse_get_value
from tvsmt.solving.types import ERROR, SAT, UNKNOWN, UNSAT, Obligation, SolverResult


def solve_one(ob: Obligation, timeout_s: float = 60.0) -> SolverResult:
    import z3

    t0 = time.perf_counter()
    ctx = z3.Context()
    script = f"(set-option :timeout {int(timeout_s * 1000)})\n" + ob.smt2
    try:
        out = z3.Z3_eval_smtlib2_string(ctx.ref(), script).strip()
    except z3.Z3Exception as e:
        return SolverResult(ERROR, "z3-inprocess", z3.get_version_string(),
                            time.perf_counter() - t0, message=str(e))
    status = out.splitlines()[-1].strip() if out else ""
    res = SolverResult({"unsat": UNSAT, "sat": SAT}.get(status, UNKNOWN), "z3-inprocess",
                       z3.get_version_string(), 0.0, message="" if status in ("sat", "unsat")
                       else out[:200])
    if "(error" in out:
        res.status, res.message = ERROR, out[:500]
    if res.status == SAT and ob.query:
        vals = z3.Z3_eval_smtlib2_string(ctx.ref(), f"(get-value ({' '.join(ob.query)}))")
        try:
            res.values = parse_get_value(vals)
        except ValueError as e:
            res.message = f"cannot read model: {e}"
    res.seconds = time.perf_counter() - t0
    return res


def solve_all(obligations, solver="z3", jobs=None, timeout_s=60.0, progress=None, **_):
    out = []
    for i, ob in enumerate(obligations):
        out.append(solve_one(ob, timeout_s))
        if progress:
            progress(i + 1, len(obligations))
    return out
