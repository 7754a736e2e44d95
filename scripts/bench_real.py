#!/usr/bin/env python3
"""Verify every real plan pair in ../shared/plans and print per plan: verdict (and the
README's expected one), tvsmt's time, the ratio to the 8-rank llama3-ly2-dp2pp2tp2mb2 fixture
measured in the same run (the fixture is run again just before every plan and the ratio taken
to that neighbouring run, so that the machine's changing load moves both sides of a ratio
alike), peak memory (of any one process: tvsmt, its workers, its solvers), whether it was
folded (units checked) and the reference verifier's time as quoted in
../shared/plans/README.md.

Two times per plan, each from its own child process:

* **command**: the wall time of `python -m tvsmt verify --no-corpus -j JOBS`, from starting
  the process to its exit: what a user waits for (the interpreter's start, the imports and
  the end of the process included);
* **in-process**: `verify_pair` timed inside a child that has already imported tvsmt (no
  start, no imports; the loaded plans are freed before it returns, as a library caller's are).

Issue 12's target: every real plan of 64 ranks or more at most 5x the 8-rank fixture and
under 4 GB.

    python scripts/bench_real.py [--jobs 2] [--only NAME ...] [--json out.json] [--repeat N]

`--extra DIR ...`: plan folders outside ../shared/plans measured the same way (e.g. a plan
grown by `scripts/grow_real_plan.py`, which names its source in `DIR/source`: the expected
verdict is the source's).

`--repeat N`: the fixture and each plan are run N times, alternating, and each side's
fastest run is kept (the machine's other load comes in spikes of a few seconds that land on
one side of a ratio; the fastest of a few alternating runs is the least disturbed of each).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from real_plans import SHARED_PLANS as PLANS  # scripts/real_plans.py

BASELINE = "llama3-ly2-dp2pp2tp2mb2"


def readme_table() -> dict[str, tuple[str, str, int]]:
    """folder -> (expected verdict, reference time, ranks) from the plans' README table."""
    out = {}
    for line in (PLANS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        verdict = re.search(r"`(equivalent|violation)`", cells[4])
        out[name] = (verdict.group(1) if verdict else "input error", cells[5], ranks_of(name))
    return out


def ranks_of(name: str) -> int:
    """dp * pp * tp read off a plan's folder name (1 if it has none)."""
    found = re.search(r"dp(\d+)pp(\d+)tp(\d+)", name)
    n = 1
    for g in found.groups() if found else ():
        n *= int(g)
    return n


def child(folder: str, jobs: int) -> None:
    """Runs in the child: verify one pair, print one JSON line."""
    import resource
    import time

    from tvsmt.errors import TvsmtError
    from tvsmt.verify import Options, verify_pair

    t0 = time.perf_counter()
    row: dict = {}
    try:
        report = verify_pair(str(Path(folder) / "single.json.gz"),
                             str(Path(folder) / "parallel.json.gz"),
                             Options(jobs=jobs))
        row.update(verdict=report.verdict, fold=report.fold, fold_note=report.fold_note,
                   timings=report.timings, stages=report.stages_total)
    except TvsmtError as e:
        row.update(verdict="input error", error=str(e).splitlines()[0][:120])
    row["seconds"] = time.perf_counter() - t0
    kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
             resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    row["peak_mb"] = kb / 1024
    print("BENCH " + json.dumps(row, default=str))


FOLDERS: dict[str, Path] = {}  # plan name -> its folder (../shared/plans/NAME or --extra)


def folder_of(name: str) -> Path:
    return FOLDERS.get(name, PLANS / name)


def command(name: str, jobs: int) -> dict:
    """`python -m tvsmt verify` on one pair: its wall time, peak memory, and from its JSON
    report the verdict, fold and phase timings."""
    import os
    import tempfile
    import time

    folder = folder_of(name)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        err = Path(tmp) / "stderr"
        with open(err, "wb") as err_file:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tvsmt", "verify", "--no-corpus", "-j", str(jobs),
                 "--report", str(report), str(folder / "single.json.gz"),
                 str(folder / "parallel.json.gz")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, cwd=tmp)
            _, status, usage = os.wait4(proc.pid, 0)
            seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        row: dict = {"seconds": seconds, "peak_mb": usage.ru_maxrss / 1024,
                     "exit": proc.returncode}
        if proc.returncode == 2:
            row.update(verdict="input error",
                       error=(err.read_text().strip().splitlines() or [""])[-1][:120])
        elif report.exists():
            got = json.loads(report.read_text())
            row.update(verdict=got.get("verdict"), fold=got.get("fold"),
                       fold_note=got.get("fold_note"), timings=got.get("timings"))
        else:
            row.update(verdict=f"crashed (exit {proc.returncode})",
                       error=(err.read_text().strip().splitlines() or [""])[-1][:120])
    return row


def run(name: str, jobs: int) -> dict:
    """`verify_pair` timed in a child process (`child`)."""
    proc = subprocess.run([sys.executable, __file__, "--child", str(folder_of(name)),
                           "--jobs", str(jobs)], capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if line is None:
        return {"verdict": f"crashed (exit {proc.returncode})",
                "error": (proc.stderr.strip().splitlines() or [""])[-1][:120]}
    return json.loads(line[len("BENCH "):])


def folded(row: dict) -> str:
    f = row.get("fold")
    if not f:
        note = row.get("fold_note") or ""
        return "no" + (f" ({note[:60]})" if note else "")
    units = f["replicas"] * f["micro_batches"]
    return (f"yes: {units} units checked ({f['checked']['nodes']} nodes), kept "
            f"{f['kept_units']}, exceptions {len(f['exceptions'])}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--extra", nargs="*", default=[], type=Path,
                    help="plan folders outside ../shared/plans, measured the same way")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of the fixture and of each plan, alternating; the fastest kept")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.jobs)
        return 0
    table = readme_table()
    names = sorted(p.name for p in PLANS.iterdir() if (p / "parallel.json.gz").exists())
    if args.only:
        names = [n for n in names if n in args.only or n == BASELINE]
    for extra in args.extra:
        FOLDERS[extra.name] = extra.resolve()
        names.append(extra.name)
        source = extra / "source"
        if source.exists():  # a grown plan: the expected verdict is its source's
            expected, _, _ = table.get(source.read_text().strip(), ("?", "", 0))
            table[extra.name] = (expected, "-", ranks_of(extra.name))
    names.sort(key=lambda n: (n != BASELINE, table.get(n, ("", "", 0))[2], n))
    measures = {"command": command, "in-process": run}
    rows: dict[str, dict[str, dict]] = {m: {} for m in measures}  # measure -> plan -> row
    base_of: dict[str, dict[str, float]] = {m: {} for m in measures}  # the fixture's, before
    verdicts: dict[str, set] = {}  # plan -> the verdicts of all its runs
    for name in names:
        for _ in range(max(1, args.repeat)):
            for measure, how in measures.items():
                if name != BASELINE:
                    base = how(BASELINE, args.jobs).get("seconds")
                    best = base_of[measure].get(name)
                    if base is not None and (best is None or base < best):
                        base_of[measure][name] = base
                row = how(name, args.jobs)
                verdicts.setdefault(name, set()).add(row.get("verdict"))
                best = rows[measure].get(name, {}).get("seconds")
                if best is None or (row.get("seconds") is not None and row["seconds"] < best):
                    rows[measure][name] = row
        for measure in measures:
            if len(verdicts[name]) > 1:  # never hide a run that disagrees behind a faster one
                rows[measure][name]["verdict"] = "unstable: " + "/".join(
                    sorted(map(str, verdicts[name])))
        print(f"... {name}: {rows['command'][name].get('verdict')} "
              f"{rows['command'][name].get('seconds', 0):.1f} s (command), "
              f"{rows['in-process'][name].get('seconds', 0):.1f} s (in-process)",
              file=sys.stderr, flush=True)
    for measure in measures:
        base_of[measure][BASELINE] = rows[measure].get(BASELINE, {}).get("seconds")
        for name, secs in base_of[measure].items():
            if name in rows[measure]:
                rows[measure][name]["baseline_seconds"] = secs

    def timing(measure: str, name: str) -> tuple[str, str]:
        secs = rows[measure][name].get("seconds")
        base = base_of[measure].get(name)
        if secs is None:
            return "-", "-"
        return f"{secs:.1f}", f"{secs / base:.1f} ({base:.1f} s)" if base else "-"

    print(f"| plan | ranks | verdict (expected) | command (s) | x {BASELINE} | in-process (s) "
          "| x fixture | peak MB | folded | reference (s) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name in names:
        r = rows["command"][name]
        expected, ref, ranks = table.get(name, ("?", "?", 0))
        mark = "" if r.get("verdict") == expected else " **MISMATCH**"
        cmd_s, cmd_x = timing("command", name)
        inp_s, inp_x = timing("in-process", name)
        peak = max(rows[m][name].get("peak_mb", 0) for m in measures)
        print(f"| `{name}` | {ranks} | {r.get('verdict')} ({expected}){mark} | {cmd_s} | "
              f"{cmd_x} | {inp_s} | {inp_x} | {peak:.0f} | {folded(r)} | {ref} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
