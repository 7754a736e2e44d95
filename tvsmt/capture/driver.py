"""The hypothesis driver: verify a captured pair, drop every hypothesis whose stage is not
proven, verify again (the neighbouring stages merge), until every remaining hypothesis is
proven.

Why this is sound: the verdict is taken from the last run, in which no hypothesis failed,
so every assumption used there is either an input lineage or proven (`unsat`). A failing
hypothesis never makes a violation; only the claims (gradients, losses) can. A failing
claim whose stage assumed hypotheses drops them too and is verified again over the merged
stage, unless the concrete run of the captured programs already shows that claim wrong
(`witnessed`): its counterexample then stands (the bug is real: the programs differ on a
random input), and merging it, which is what times out on the Llama block, is skipped. A
witnessed claim that gets proven makes the run inconclusive. Inconclusive stays
inconclusive.
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
from tvsmt.report.report import EQUIVALENT, INCONCLUSIVE, VIOLATION, Failure, Report


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


def hypotheses_to_drop(single: Plan, parallel: Plan, report: Report,
                       witnessed: dict[str, str] | None = None) -> set[int]:
    """The hypotheses a run's failures discredit: every failing hypothesis, and every
    hypothesis that a failing claim's stage assumed (a claim can fail only because its
    stage was cut at a hypothesis that holds but says too little: merging decides), unless
    the claim's counterexample is witnessed by the concrete run: then the bug is real and
    the stage that shows it stays small."""
    from tvsmt.stages import cut_stages

    witnessed = witnessed or {}
    lins = parallel.lineages
    real = _confirmed(report, parallel, witnessed)
    # A solver's timeout discredits nothing: a claim that timed out is kept as it was cut
    # (merging its stage only makes it larger); a hypothesis that timed out is dropped in
    # the hope that a merged stage proves what it could not, unless a witnessed bug already
    # makes the run a violation (dropping it would only grow stages that time out again).
    failing = {f.lineage for f in report.failures if f.lineage is not None
               and (f.kind != "inconclusive" or (lins[f.lineage].hypothesis and not real))}
    drop = {i for i in failing if lins[i].hypothesis}
    claims = {i for i in failing if not lins[i].hypothesis} - real
    stages = {st.target: st for st in cut_stages(single, parallel).stages} \
        if claims or real else {}
    for i in claims:
        if i in stages:
            drop.update(j for j in stages[i].inputs if lins[j].hypothesis)
    drop |= _small_merges(single, parallel, real, stages, drop)
    return drop


MERGE_LIMIT = 200  # parallel nodes of a merged stage worth showing for a witnessed claim


def _small_merges(single: Plan, parallel: Plan, real: set[int], stages: dict, drop: set[int]
                  ) -> set[int]:
    """For each witnessed claim whose stage assumes hypotheses: if its stage with no
    hypothesis at all stays small (at most MERGE_LIMIT parallel nodes), every hypothesis
    inside that stage, so that the next round shows the whole computation of the wrong
    result (a missing collective has no line of its own). Larger stages keep their small
    counterexample: merging them is what times out. One step, never a chain of rounds."""
    from tvsmt.stages import cut_stages

    lins = parallel.lineages
    todo = [i for i in sorted(real) if i in stages
            and any(lins[j].hypothesis for j in stages[i].inputs)]
    if not todo:
        return set()
    hyps = {lin.index for lin in lins if lin.hypothesis}
    bare = drop_lineages(parallel, hyps)
    wide = {bare.lineages[st.target].single: st for st in cut_stages(single, bare).stages}
    out: set[int] = set()
    for i in todo:
        st = wide.get(lins[i].single)
        if st is None or len(st.parallel_nodes) > MERGE_LIMIT:
            continue
        inside = {t for k in st.parallel_nodes for t in bare.nodes[k].outputs if t}
        out |= {j for j in hyps if any(t in inside for p in lins[j].parts for t in p.sum_of)}
    return out - drop


def verify_with_hypotheses(single: Plan, parallel: Plan, opts=None, max_rounds: int = 50,
                           witnessed: dict[str, str] | None = None
                           ) -> tuple[Report, dict[str, int]]:
    """Verify; drop discredited hypotheses and re-verify until none is left to drop.

    witnessed: claims (single tensor -> how) that the concrete run of the captured
    programs contradicts. Their counterexamples stand as violations even when their stage
    assumed hypotheses (all proven in that run), and one of them proven equivalent would
    contradict the real programs: the verdict is then inconclusive, never equivalent."""
    from tvsmt.options import Options
    from tvsmt.pipeline import verify_plans
    from tvsmt.policy import settled_hypothesis_budget
    from tvsmt.solving.dispatch import answers_remembered

    opts = opts or Options()
    witnessed = witnessed or {}
    proposed = sum(lin.hypothesis for lin in parallel.lineages)
    dropped, rounds = 0, 0
    with answers_remembered():  # a stage no drop changed is the same script: asked once
        while True:
            rounds += 1
            report = verify_plans(single, parallel, opts)
            bad = hypotheses_to_drop(single, parallel, report, witnessed)
            if not bad:
                break
            if rounds >= max_rounds:  # never a pass: give up as inconclusive
                report.verdict = INCONCLUSIVE
                report.failures.append(Failure("inconclusive", f"hypotheses still failing "
                                                               f"after {rounds} rounds"))
                break
            if opts.hypothesis_budget is None and _confirmed(report, parallel, witnessed):
                # the verdict is a violation from now on: the hypotheses left only decide
                # how the stages are cut, not worth the run's whole timeout each
                opts = dataclasses.replace(
                    opts, hypothesis_budget=settled_hypothesis_budget(opts.timeout))
            dropped += len(bad)
            parallel = drop_lineages(parallel, bad)
    _account_for_witnesses(report, parallel, witnessed)
    _name_consequences(report, single, parallel, witnessed)
    return report, {"proposed": proposed, "dropped": dropped, "kept": proposed - dropped,
                    "rounds": rounds}


def _confirmed(report: Report, parallel: Plan, witnessed: dict[str, str]) -> set[int]:
    """The lineages whose counterexample the concrete run witnessed: real bugs (one makes
    the run a violation whatever the hypotheses)."""
    lins = parallel.lineages
    return {f.lineage for f in report.failures if f.lineage is not None
            and f.kind == "counterexample" and lins[f.lineage].single in witnessed}


def _name_consequences(report: Report, single: Plan, parallel: Plan,
                       witnessed: dict[str, str]) -> None:
    """Say on each failing claim that the concrete run did not confirm, and whose stage
    assumed another failing claim, which one: its counterexample may only follow from the
    wrong assumption (a parameter's update reads the optimizer state its stage took as
    proven). The verdict does not change: a violation either way."""
    from tvsmt.stages import cut_stages

    lins = parallel.lineages
    failing = {f.lineage: f for f in report.failures
               if f.kind == "counterexample" and f.lineage is not None
               and f.lineage < len(lins) and not lins[f.lineage].hypothesis}
    if len(failing) < 2:
        return
    stages = {st.target: st for st in cut_stages(single, parallel).stages}
    for i, f in failing.items():
        wrong = [j for j in (stages[i].inputs if i in stages else ()) if j in failing]
        if wrong and lins[i].single not in witnessed:
            f.message += (f"; its stage assumed lineage #{wrong[0]} ({lins[wrong[0]].single}), "
                          f"found wrong: this may only follow from it")


def _account_for_witnesses(report: Report, parallel: Plan, witnessed: dict[str, str]) -> None:
    """Say on each failing claim what the concrete run saw; a witnessed claim that did not
    fail makes the run inconclusive (the proof contradicts the real programs)."""
    failed = set()
    for f in report.failures:
        if f.lineage is None or f.lineage >= len(parallel.lineages):
            continue
        single = parallel.lineages[f.lineage].single
        if single in witnessed and not parallel.lineages[f.lineage].hypothesis:
            failed.add(single)
            if f.kind == "counterexample":
                f.message += f"; confirmed {witnessed[single]}"
    missed = [t for t in witnessed if t not in failed]
    for t in missed:
        report.failures.append(Failure(
            "inconclusive", f"{t} was not found wrong by the solver, but {witnessed[t]}: "
            f"the proof contradicts the real programs, so it is not trusted", tensor=t))
    if missed and report.verdict == EQUIVALENT:
        report.verdict = INCONCLUSIVE


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
    from tvsmt.options import Options

    opts = opts or Options()
    opts = dataclasses.replace(opts, fold=False)  # captured ids never follow the fold layout
    single, parallel = pair.plans()
    t0 = time.perf_counter()
    report, hyp = verify_with_hypotheses(single, parallel, opts,
                                         witnessed=pair.witnessed)
    pair.timings["verify"] = time.perf_counter() - t0
    _first_wrong_result_first(report, single)
    _point_at_parameter_uses(report, single)
    return _as_capture_report(report, pair, hyp)


def _first_wrong_result_first(report: Report, single: Plan) -> None:
    """Order failures by where the single program starts computing what failed (the first
    node of the failing stage's single side): the earliest wrong result, such as a loss
    normalised wrongly in the forward pass before the gradients it scales, comes first."""
    at = {n.id: i for i, n in enumerate(single.nodes)}
    produced = {t: i for i, n in enumerate(single.nodes) for t in n.outputs if t is not None}

    def start(f: Failure) -> int:
        nodes = [at[n["id"]] for n in f.single_nodes if n.get("id") in at]
        return min(nodes) if nodes else produced.get(f.tensor, -1)

    report.failures.sort(key=start)


def _point_at_parameter_uses(report: Report, single: Plan, most: int = 2) -> None:
    """A failing gradient claim `grad.NAME` shows first the user's lines that use parameter
    NAME (the module call, e.g. `h = self.norm(x)`): the traced backward nodes all carry the
    line of `loss.backward()`, which says nothing about which layer is wrong."""
    for f in report.failures:
        if not (f.tensor or "").startswith("grad."):
            continue
        param = "param." + f.tensor[len("grad."):]
        lines: list[str] = []
        for n in single.nodes:
            if n.source and param in n.inputs and n.source not in lines:
                lines.append(n.source)
        f.code = lines[:most]


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
