"""The hypothesis driver: verify a captured pair, drop every hypothesis whose stage is not
proven, verify again (the neighbouring stages merge), until every remaining hypothesis is
proven.

Why this is sound: the verdict is taken from the last run, in which no hypothesis failed,
so every assumption used there is either an input lineage or proven (`unsat`). A failing
hypothesis never makes a violation; only the claims (gradients, losses) can, and a failing
claim whose stage assumed hypotheses drops them too and is verified again over the merged
stage, so a violation is only reported where the claim fails without any hypothesis (as
when the pair is verified with no hypotheses at all). Inconclusive stays inconclusive.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tvsmt.capture.build import CapturedPair, capture_pair
from tvsmt.errors import InputError, StructuralViolation
from tvsmt.plan.model import Plan
from tvsmt.report.report import VIOLATION, Failure, Report


@dataclass
class CaptureReport(Report):
    """A verify report plus what the capture did: how each input's lineage was obtained and
    what became of the hypotheses."""

    script: str | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    hypotheses: dict[str, int] = field(default_factory=dict)
    capture_timings: dict[str, float] = field(default_factory=dict)


def drop_lineages(plan: Plan, drop: set[int]) -> Plan:
    """The plan without the lineages at the given indices (the rest renumbered)."""
    kept = [lin for lin in plan.lineages if lin.index not in drop]
    lineages = [dataclasses.replace(lin, index=i) for i, lin in enumerate(kept)]
    return dataclasses.replace(plan, lineages=lineages)


def hypotheses_to_drop(single: Plan, parallel: Plan, report: Report) -> set[int]:
    """The hypotheses a run's failures discredit: every failing hypothesis, and every
    hypothesis that a failing claim's stage assumed (a claim can fail only because its
    stage was cut at a hypothesis that holds but says too little: merging decides)."""
    from tvsmt.stages import cut_stages

    lins = parallel.lineages
    failing = {f.lineage for f in report.failures if f.lineage is not None}
    drop = {i for i in failing if lins[i].hypothesis}
    claims = {i for i in failing if not lins[i].hypothesis}
    if claims:
        for stage in cut_stages(single, parallel).stages:
            if stage.target in claims:
                drop.update(i for i in stage.inputs if lins[i].hypothesis)
    return drop


def verify_with_hypotheses(single: Plan, parallel: Plan, opts=None, max_rounds: int = 50
                           ) -> tuple[Report, dict[str, int]]:
    """Verify; drop discredited hypotheses and re-verify until none is left to drop."""
    from tvsmt.verify import Options, verify_plans

    opts = opts or Options()
    proposed = sum(lin.hypothesis for lin in parallel.lineages)
    dropped, rounds = 0, 0
    while True:
        rounds += 1
        report = verify_plans(single, parallel, opts)
        bad = hypotheses_to_drop(single, parallel, report)
        if not bad:
            break
        if rounds >= max_rounds:  # never a pass: give up as inconclusive
            report.verdict = "inconclusive"
            report.failures.append(Failure("inconclusive", f"hypotheses still failing after "
                                                           f"{rounds} rounds"))
            break
        dropped += len(bad)
        parallel = drop_lineages(parallel, bad)
    return report, {"proposed": proposed, "dropped": dropped, "kept": proposed - dropped,
                    "rounds": rounds}


def _as_capture_report(report: Report, pair: CapturedPair | None, hyp: dict) -> CaptureReport:
    base = {f.name: getattr(report, f.name) for f in dataclasses.fields(Report)}
    out = CaptureReport(**base, hypotheses=hyp)
    if pair is not None:
        out.script = pair.script
        out.inputs = [{"tensor": p.tensor, "rank": p.rank, "slice": [list(r) for r in p.slice],
                       "how": p.how} for p in pair.provenance]
        out.capture_timings = {k: round(v, 4) for k, v in pair.timings.items()}
    return out


def check_pair(pair: CapturedPair, opts=None) -> CaptureReport:
    from tvsmt.verify import Options

    opts = opts or Options()
    opts = dataclasses.replace(opts, fold=False)  # captured ids never follow the fold layout
    single, parallel = pair.plans()
    t0 = time.perf_counter()
    report, hyp = verify_with_hypotheses(single, parallel, opts)
    pair.timings["verify"] = time.perf_counter() - t0
    return _as_capture_report(report, pair, hyp)


def check(script, opts=None) -> CaptureReport:
    """Capture a script (path or module) and verify it: the Python API of `tvsmt check`."""
    try:
        pair = capture_pair(script)
    except StructuralViolation as e:
        path = os.fspath(script) if not hasattr(script, "__name__") else script.__name__
        report = Report(VIOLATION, f"{path} (single)", f"{path} (parallel)")
        report.failures = [Failure("structural", str(e), tensor=e.tensor)]
        return _as_capture_report(report, None, {})
    return check_pair(pair, opts)


def _write_atomic(path: str, data: bytes) -> None:
    from tvsmt.solving.corpus import atomic_write  # the project's one atomic write

    atomic_write(path, data, fsync=True)


def write_pair(pair: CapturedPair, out_dir: str) -> tuple[str, str]:
    """Write single.json.gz, parallel.json.gz (what `tvsmt verify` reads) and capture.json
    (how each input's lineage was obtained)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        paths = []
        for kind in ("single", "parallel"):
            path = os.path.join(out_dir, f"{kind}.json.gz")
            raw = json.dumps(getattr(pair, kind)).encode()
            _write_atomic(path, gzip.compress(raw, mtime=0))
            paths.append(path)
        meta = {"script": pair.script, "hypotheses": pair.hypotheses,
                "inputs": [{"tensor": p.tensor, "rank": p.rank,
                            "slice": [list(r) for r in p.slice], "how": p.how}
                           for p in pair.provenance]}
        _write_atomic(os.path.join(out_dir, "capture.json"),
                      json.dumps(meta, indent=2).encode())
    except OSError as e:
        raise InputError(f"cannot write the plans: {e.strerror}", file=out_dir) from None
    return paths[0], paths[1]
