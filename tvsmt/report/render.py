"""Human-readable rendering of a Report with rich: a summary table and each failure.

Every value that comes from a plan (ids, tensors, file names, messages, counterexample
values) goes through `m` (tvsmt/textsafe.py): shown literally, on one line, never read as
rich markup, emoji codes or terminal escapes.
"""

from __future__ import annotations

from fractions import Fraction

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tvsmt.report.report import Report
from tvsmt.textsafe import markup as m

_STYLE = {"equivalent": "bold green", "violation": "bold red", "inconclusive": "bold yellow",
          "error": "bold red"}
_KIND_STYLE = {"solver-failure": "bold red reverse"}


def _text(markup_text: str) -> Text:
    """Our own markup (with every plan value already escaped by `m`), emoji codes off."""
    return Text.from_markup(markup_text, emoji=False)


def render(report: Report, console: Console | None = None, max_failures: int = 10) -> None:
    console = console or Console()

    def say(markup_text: str) -> None:
        console.print(_text(markup_text))

    style = _STYLE.get(report.verdict, "bold red")
    say(f"verdict: [{style}]{m(report.verdict)}[/]")
    t = Table(show_header=False, box=None, pad_edge=False)
    row = lambda label, value: t.add_row(label, _text(value))  # noqa: E731
    row("stages", f"{report.stages_total} ({report.stages_proven} proven, "
        f"{report.stages_violated} violated, {report.stages_inconclusive} inconclusive; "
        f"{report.assumptions} assumed input lineages)")
    row("templates", f"{report.stage_templates} distinct stage structures encoded")
    row("obligations", f"{report.obligations_total} total, {report.obligations_unique} "
        f"unique, {report.proven_without_solver} proven by term identity, "
        f"{report.cache_hits} cache hits")
    if report.cache or report.cache_refused:
        reused = ", ".join(f"{n} from {m(s)}" for s, n in sorted(report.cache.items()))
        refused = ", ".join(f"{n} ({m(why)})" for why, n in sorted(report.cache_refused.items()))
        row("corpus", f"verdicts reused: {reused or 'none'}"
            + (f"; not trusted, solved again: {refused}" if refused else ""))
    if report.fold:
        fo = report.fold
        exc = (f"; not copies: {', '.join(m(e) for e in fo['exceptions'][:4])}"
               if fo["exceptions"] else "")
        row("folding", f"{fo['replicas']} replicas x {fo['micro_batches']} micro-batches "
            f"checked to be copies; verified replicas {m(fo['kept_replicas'])} "
            f"({fo['kept_units']} (replica, micro-batch) units, batch x "
            f"{fo['batch_factor']}, so batch rows in slices are folded rows){exc}")
    elif report.fold_note:
        row("folding", f"not folded: {m(report.fold_note)}")
    if report.evaluated:
        ev = report.evaluated
        row("evaluated", f"{ev.get('obligations', 0)} obligations also evaluated at "
            f"{ev.get('points', 0)} random concrete points (real functions)")
    if report.unclaimed:
        shown = ", ".join(m(t) for t in report.unclaimed_tensors[:4])
        row("unclaimed", f"{report.unclaimed} parallel results no lineage claims "
            f"(not verified; --strict fails on them): {shown}"
            + (" ..." if report.unclaimed > 4 else ""))
    row("time", "  ".join(f"{m(k)} {v:.2f}s" for k, v in report.timings.items()))
    if report.solver_seconds:
        row("solvers", "  ".join(f"{m(k)} {v:.2f}s" for k, v in report.solver_seconds.items()))
    console.print(t)
    for f in report.failures[:max_failures]:
        stage = f"in stage {m(f.stage)}" if f.stage else ""
        style = _KIND_STYLE.get(f.kind, "bold")
        say(f"\n[{style}]{m(f.kind)}[/] {stage}: {m(f.message)}")
        if f.tensor:
            sl = f" slice {m(f.slice)}" if f.slice else ""
            say(f"  tensor {m(f.tensor)}{sl}")
        if f.parallel_tensors:
            say(f"  parallel tensors {', '.join(m(t) for t in f.parallel_tensors[:8])}"
                + (" ..." if len(f.parallel_tensors) > 8 else ""))
        for side in ("single_nodes", "parallel_nodes"):
            nodes = getattr(f, side)
            if nodes:
                shown = ", ".join(f"{m(n['id'])} ({m(n['op'])})" for n in nodes[:6])
                more = f" and {len(nodes) - 6} more" if len(nodes) > 6 else ""
                say(f"  {side.replace('_', ' ')}: {shown}{more}")
        for line in _source_lines(f.parallel_nodes or f.single_nodes, first=f.code):
            say(f"  code {m(line)}")
        cex = f.counterexample
        if cex:
            if cex.get("reduced_shape"):
                say(f"  counterexample at reduced shape {m(cex['reduced_shape'])}")
            for mm in cex.get("mismatches", [])[:4]:
                say(f"  at {m(mm['index'])} (lineage part {m(mm['part'])}): single = "
                    f"{m(mm['single'])}  parallel = {m(mm['parallel'])}")
            inputs = cex.get("inputs", {})
            if inputs:
                # where the point mixes integers with reals, the integers are what the plans
                # select on (token ids, labels, expert indices): up to 16 of them first
                ints = [kv for kv in inputs.items() if _integral(kv[1])]
                rest = [kv for kv in inputs.items() if not _integral(kv[1])]
                first = (ints[:16] + rest)[:max(6, min(len(ints), 16))] if rest else \
                    list(inputs.items())[:6]
                shown = ", ".join(f"{m(k)}={m(v)}" for k, v in first)
                say(f"  inputs: {shown}" + (" ..." if len(inputs) > len(first) else ""))
    if len(report.failures) > max_failures:
        say(f"\n... {len(report.failures) - max_failures} more failures in the JSON report")


def _integral(shown: str) -> bool:
    """Is a counterexample's value (as the report writes it: "3", "0.25", "1/3",
    "~0.3333") an integer?"""
    try:
        return Fraction(shown.lstrip("~")).denominator == 1
    except (ValueError, ZeroDivisionError):
        return False


def _source_lines(nodes, limit: int = 3, first=()) -> list[str]:
    """The producer's code lines of a failure's nodes (plan key "source", set by the PyTorch
    capture), nearest the failing tensor first, with the text of the line when readable;
    the failure's own `code` lines (`first`) come before them."""
    import linecache

    def shown(src: str, where: str = "") -> str:
        file, _, line = src.rpartition(":")
        text = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
        return src + (f" ({where})" if where else "") + (f": {text}" if text else "")

    out, seen = [shown(src) for src in first], set(first)
    for n in reversed(nodes):
        src = n.get("source")
        if not src or src in seen:
            continue
        seen.add(src)
        out.append(shown(src, f"rank {n.get('rank')}" + (f", micro-batch {n['mb']}"
                                                         if n.get("mb", -1) >= 0 else "")))
        if len(out) == limit + len(first):
            break
    return out
