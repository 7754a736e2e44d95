"""Human-readable rendering of a Report with rich: a summary table and each failure."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tvsmt.report.report import Report

_STYLE = {"equivalent": "bold green", "violation": "bold red", "inconclusive": "bold yellow",
          "error": "bold red"}


def render(report: Report, console: Console | None = None, max_failures: int = 10) -> None:
    console = console or Console()
    console.print(f"verdict: [{_STYLE[report.verdict]}]{report.verdict}[/]")
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_row("stages", f"{report.stages_total} ({report.stages_proven} proven, "
              f"{report.stages_violated} violated, {report.stages_inconclusive} inconclusive; "
              f"{report.assumptions} assumed input lineages)")
    t.add_row("templates", f"{report.stage_templates} distinct stage structures encoded")
    t.add_row("obligations", f"{report.obligations_total} total, {report.obligations_unique} "
              f"unique, {report.proven_without_solver} proven by term identity, "
              f"{report.cache_hits} cache hits")
    if report.fold:
        fo = report.fold
        exc = f"; not copies: {', '.join(fo['exceptions'][:4])}" if fo["exceptions"] else ""
        t.add_row("folding", f"{fo['replicas']} replicas x {fo['micro_batches']} micro-batches "
                  f"checked to be copies; verified replicas {fo['kept_replicas']} "
                  f"({fo['kept_units']} (replica, micro-batch) units, batch x "
                  f"{fo['batch_factor']}, so batch rows in slices are folded rows){exc}")
    elif report.fold_note:
        t.add_row("folding", f"not folded: {report.fold_note}")
    t.add_row("time", "  ".join(f"{k} {v:.2f}s" for k, v in report.timings.items()))
    if report.solver_seconds:
        t.add_row("solvers", "  ".join(f"{k} {v:.2f}s" for k, v in
                                       report.solver_seconds.items()))
    console.print(t)
    for f in report.failures[:max_failures]:
        console.print(f"\n[bold]{f.kind}[/] {('in stage ' + f.stage) if f.stage else ''}: "
                      f"{f.message}")
        if f.tensor:
            sl = f" slice {f.slice}" if f.slice else ""
            console.print(f"  tensor {f.tensor}{sl}")
        if f.parallel_tensors:
            console.print(f"  parallel tensors {', '.join(f.parallel_tensors[:8])}"
                          + (" ..." if len(f.parallel_tensors) > 8 else ""))
        for side in ("single_nodes", "parallel_nodes"):
            nodes = getattr(f, side)
            if nodes:
                shown = ", ".join(f"{n['id']} ({n['op']})" for n in nodes[:6])
                more = f" and {len(nodes) - 6} more" if len(nodes) > 6 else ""
                console.print(f"  {side.replace('_', ' ')}: {shown}{more}")
        for line in _source_lines(f.parallel_nodes or f.single_nodes):
            console.print(f"  code {line}", markup=False, highlight=False)
        cex = f.counterexample
        if cex:
            if cex.get("reduced_shape"):
                console.print(f"  counterexample at reduced shape {cex['reduced_shape']}")
            for m in cex.get("mismatches", [])[:4]:
                console.print(f"  at {m['index']} (lineage part {m['part']}): single = "
                              f"{m['single']}  parallel = {m['parallel']}")
            inputs = cex.get("inputs", {})
            if inputs:
                shown = ", ".join(f"{k}={v}" for k, v in list(inputs.items())[:6])
                console.print(f"  inputs: {shown}" + (" ..." if len(inputs) > 6 else ""))
    if len(report.failures) > max_failures:
        console.print(f"\n... {len(report.failures) - max_failures} more failures in the JSON "
                      "report")


def _source_lines(nodes, limit: int = 3) -> list[str]:
    """The producer's code lines of a failure's nodes (plan key "source", set by the PyTorch
    capture), nearest the failing tensor first, with the text of the line when readable."""
    import linecache

    out, seen = [], set()
    for n in reversed(nodes):
        src = n.get("source")
        if not src or src in seen:
            continue
        seen.add(src)
        file, _, line = src.rpartition(":")
        text = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
        out.append(f"{src} (rank {n.get('rank')}): {text}" if text else
                   f"{src} (rank {n.get('rank')})")
        if len(out) == limit:
            break
    return out
