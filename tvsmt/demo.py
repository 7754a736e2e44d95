"""`tvsmt demo`: generate, verify, break, verify again — with nothing but the package."""

from __future__ import annotations

import json
import os
import tempfile

from rich.console import Console

from tvsmt.frontends import generate_pair, write_pair_dicts
from tvsmt.frontends.mutations import apply as apply_mutation
from tvsmt.report.render import render
from tvsmt.verify import Options, verify_pair

BUG = "drop-allreduce-keep-dataflow"


def run_demo(out_dir: str | None = None) -> int:
    """Returns 0 when the correct plan is equivalent and the broken one is caught."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tvsmt-demo-") as tmp:
        root = out_dir or tmp
        config = dict(layers=2, dp=2, tp=2, pp=2, mb=2)
        console.rule("1. generate a Llama3 plan pair: 2 layers, dp=2 tp=2 pp=2, 2 micro-batches")
        single, parallel = generate_pair("llama3", **config)
        good_dir = os.path.join(root, "llama3-dp2tp2pp2mb2")
        s_path, p_path = write_pair_dicts(good_dir, single, parallel)
        console.print(f"{len(single['nodes'])} single-device nodes, {len(parallel['nodes'])} "
                      f"parallel nodes on {parallel['world']['ranks']} ranks -> {good_dir}")

        console.rule("2. verify it")
        good = verify_pair(s_path, p_path, Options())
        render(good, console)

        console.rule(f"3. inject a real bug ({BUG}) and verify again")
        broken, record = apply_mutation(parallel, BUG)
        bad_dir = os.path.join(root, "llama3-dp2tp2pp2mb2-" + BUG)
        s2, p2 = write_pair_dicts(bad_dir, single, broken)
        with open(os.path.join(bad_dir, "mutation.json"), "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"mutation: {record['description']}; changed "
                      f"{', '.join(record.get('nodes', []))}")
        bad = verify_pair(s2, p2, Options())
        render(bad, console, max_failures=3)
        report_path = os.path.join(bad_dir, "report.json")
        bad.save(report_path)
        if out_dir:
            console.print(f"\nplans and the JSON report are in {root}")
        ok = good.verdict == "equivalent" and bad.verdict == "violation"
        console.rule("[green]demo passed[/]" if ok else "[red]demo FAILED[/]")
        return 0 if ok else 1
