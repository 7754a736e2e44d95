"""A report a person can look at: one self-contained HTML file (`--html FILE`).

What it shows: the verdict and summary; a filterable table of every stage (status, lineage,
tensor, obligation hash, solver time); for each failure, the stage's dataflow drawn with
Graphviz (single side and parallel side next to each other, parallel nodes grouped by rank,
collectives marked with their groups, the differing tensor highlighted), the counterexample
values beside it (with the reduced shape they refer to) and the producer's source lines; for
a structural failure, the path from the claim to the graph inputs no lineage relates.

Layout is Graphviz's (`dot`, through the `graphviz` Python package), never hand-written;
large stages are collapsed to one box per rank except the failing path. Styles and scripts
are inlined and the drawings are inline SVG: the file opens without network access. Without
the `dot` binary the drawings are replaced by node lists (the report says so).
"""

from __future__ import annotations

import html
import json
import shutil
from typing import Any

from tvsmt.report.report import Failure, Report

EXPAND_LIMIT = 60  # nodes per side drawn one by one; beyond, other ranks are collapsed
_COMM = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "chunk",
         "move", "reducer", "grad_accum", "identity"}

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1 span.equivalent{color:#1a7f37} h1 span.violation{color:#cf222e}
h1 span.inconclusive{color:#9a6700}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:2px 6px}
th{background:#f3f3f3;text-align:left} tr.violated td{background:#ffebe9}
tr.inconclusive td{background:#fff8c5} .mono{font-family:ui-monospace,monospace}
.failure{border:2px solid #cf222e;border-radius:6px;padding:.8em;margin:1.2em 0}
.failure.inconclusive{border-color:#9a6700} .sides{display:flex;gap:1em;flex-wrap:wrap}
.side{flex:1;min-width:320px;overflow:auto;border:1px solid #eee;padding:.4em}
.values{min-width:260px} .differs{color:#cf222e;font-weight:bold}
#filters button{margin-right:.3em} .note{color:#666;font-size:12px}
.side svg{max-width:100%;height:auto}
"""

_JS = """
function filt(status){
  const q=document.getElementById('q').value.toLowerCase();
  document.querySelectorAll('#stages tbody tr').forEach(function(tr){
    const okS=(status==='all'||tr.dataset.status===status);
    const okQ=(!q||tr.textContent.toLowerCase().indexOf(q)>=0);
    tr.style.display=(okS&&okQ)?'':'none';});
  window.currentStatus=status;}
window.currentStatus='all';
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _dot_available() -> bool:
    return shutil.which("dot") is not None


def _differing(f: Failure) -> tuple[set[str], set[str]]:
    """(single tensors, parallel tensors) to highlight."""
    single = {f.tensor} if f.tensor else set()
    par = set(f.parallel_tensors)
    return single, par


def _graph(nodes: list[dict], highlight: set[str], free: set[str], side: str,
           cone: set[str]) -> str:
    """SVG of one side's dataflow (Graphviz `dot`)."""
    import graphviz

    g = graphviz.Digraph(side, format="svg", graph_attr={"rankdir": "TB", "fontsize": "10",
                                                          "bgcolor": "white"},
                         node_attr={"fontsize": "9", "height": "0.25"},
                         edge_attr={"fontsize": "8", "arrowsize": "0.5"})
    names: dict[str, str] = {}

    def key(x: str) -> str:  # Graphviz reads "a:b" as node:port: use neutral names
        return names.setdefault(x, f"v{len(names)}")

    drawn = [n for n in nodes if "outputs" in n]
    collapse = len(drawn) > EXPAND_LIMIT
    writer: dict[str, str] = {}
    shown: list[dict] = []
    collapsed: dict[int, int] = {}
    for n in drawn:
        keep = not collapse or n["id"] in cone or any(t in highlight for t in n["outputs"])
        if keep:
            shown.append(n)
            for t in n["outputs"]:
                writer[t] = n["id"]
        else:
            collapsed[n.get("rank", 0)] = collapsed.get(n.get("rank", 0), 0) + 1
            for t in n["outputs"]:
                writer[t] = f"collapsed{n.get('rank', 0)}"
    by_rank: dict[int, list[dict]] = {}
    for n in shown:
        by_rank.setdefault(n.get("rank", 0), []).append(n)
    for rank, group in sorted(by_rank.items()):
        with g.subgraph(name=f"cluster_{side}_{rank}") as c:
            c.attr(label=f"rank {rank}" if side == "parallel" else "single device",
                   color="#bbbbbb", fontsize="10")
            for n in group:
                comm = n["op"] in _COMM
                label = n["op"] + (f"\\n{n['group']}" if n.get("group") else "")
                if n.get("source"):
                    label += f"\\n{n['source']}"
                bad = any(t in highlight for t in n["outputs"])
                c.node(key(n["id"]), label=label, shape="box" if comm else "ellipse",
                       style="filled", fillcolor="#ffcfcf" if bad else
                       ("#dbe9ff" if comm else "#f6f6f6"),
                       color="#cf222e" if bad else "#888888", tooltip=n["id"])
            if rank in collapsed:
                c.node(key(f"collapsed{rank}"), label=f"{collapsed.pop(rank)} more nodes",
                       shape="folder", style="dashed")
    for rank, count in collapsed.items():
        g.node(key(f"collapsed{rank}"), label=f"rank {rank}: {count} nodes", shape="folder",
               style="dashed")
    for n in shown:
        for t in n["inputs"]:
            src = writer.get(t)
            if src is None:
                src = writer[t] = f"input {t}"
                g.node(key(src), label=t, shape="plaintext", fontcolor="#cf222e" if t in free
                       else "#555555")
            g.edge(key(src), key(n["id"]), color="#cf222e" if t in highlight else "#999999")
    return g.pipe(format="svg", quiet=True).decode("utf-8", "replace").split("?>", 1)[-1]


def _cone_ids(nodes: list[dict], tensors: set[str], free: set[str]) -> set[str]:
    """The failing path: nodes the highlighted tensors depend on; for an underivable claim,
    only those on a path from the unrelated graph inputs to the claim."""
    need, out = set(tensors), set()
    for n in reversed(nodes):
        if "outputs" in n and any(t in need for t in n["outputs"]):
            out.add(n["id"])
            need.update(n.get("inputs", []))
    if free:
        reach, on_path = set(free), set()
        for n in nodes:
            if n["id"] in out and any(t in reach for t in n.get("inputs", [])):
                on_path.add(n["id"])
                reach.update(n["outputs"])
        out = on_path or out
    return out


def _node_list(nodes: list[dict]) -> str:
    rows = "".join(f"<tr><td class=mono>{_e(n['id'])}</td><td>{_e(n['op'])}</td>"
                   f"<td>{_e(n.get('rank', ''))}</td><td class=mono>{_e(n.get('source', ''))}"
                   "</td></tr>" for n in nodes[:200])
    return ("<table><tr><th>node</th><th>op</th><th>rank</th><th>source</th></tr>"
            f"{rows}</table>")


def _values(f: Failure) -> str:
    cex = f.counterexample
    if not cex:
        return "<p class=note>no counterexample values</p>"
    out = []
    if cex.get("reduced_shape"):
        out.append(f"<p>counterexample at reduced shape <b>{_e(cex['reduced_shape'])}</b> "
                   f"<span class=note>({_e(cex.get('note', ''))})</span></p>")
    rows = "".join(
        f"<tr><td class='mono differs'>{_e(f.tensor)}[{_e(','.join(map(str, m['index'])))}]"
        f"</td><td>{_e(m.get('part'))}</td><td class=mono>{_e(m['single'])}</td>"
        f"<td class=mono>{_e(m['parallel'])}</td></tr>"
        for m in cex.get("mismatches", [])[:20])
    out.append("<table class=mismatches><tr><th>element</th><th>part</th><th>single</th>"
               f"<th>parallel</th></tr>{rows}</table>")
    inputs = list(cex.get("inputs", {}).items())[:24]
    if inputs:
        rows = "".join(f"<tr><td class=mono>{_e(k)}</td><td class=mono>{_e(v)}</td></tr>"
                       for k, v in inputs)
        out.append(f"<p>inputs</p><table>{rows}</table>")
    return "".join(out)


def _failure(k: int, f: Failure, draw: bool) -> str:
    cls = "failure" + ("" if f.kind in ("counterexample", "structural") else " inconclusive")
    head = (f"<h3 id=failure{k}>{_e(f.kind)}"
            f"{' in stage ' + _e(f.stage) if f.stage else ''}</h3>"
            f"<p>{_e(f.message)}</p>")
    facts = []
    if f.tensor:
        facts.append(f"tensor <span class='mono differs'>{_e(f.tensor)}</span>"
                     + (f" slice {_e(f.slice)}" if f.slice else ""))
    if f.parallel_tensors:
        facts.append("parallel tensors <span class=mono>"
                     + _e(", ".join(f.parallel_tensors[:12])) + "</span>")
    if f.free_tensors:
        facts.append("underivable from <span class='mono differs'>"
                     + _e(", ".join(f.free_tensors[:12])) + "</span>")
    sources = sorted({n["source"] for n in f.single_nodes + f.parallel_nodes
                      if n.get("source")})
    if sources:
        facts.append("source lines <span class=mono>" + _e(", ".join(sources[:12]))
                     + "</span>")
    body = "<p>" + "<br>".join(facts) + "</p>"
    hs, hp = _differing(f)
    free = set(f.free_tensors)
    sides = []
    for name, nodes, hl in (("single", f.single_nodes, hs), ("parallel", f.parallel_nodes, hp)):
        if not nodes:
            continue
        drawing = None
        if draw and any("outputs" in n for n in nodes):
            try:
                drawing = _graph(nodes, hl, free, name, _cone_ids(nodes, hl, free))
            except Exception as e:  # a drawing failure must not lose the report
                drawing = f"<p class=note>drawing failed: {_e(e)}</p>" + _node_list(nodes)
        sides.append(f"<div class=side><h4>{name} side ({len(nodes)} nodes)</h4>"
                     f"{drawing or _node_list(nodes)}</div>")
    sides.append(f"<div class='side values'><h4>values</h4>{_values(f)}</div>")
    return f"<div class='{cls}'>{head}{body}<div class=sides>{''.join(sides)}</div></div>"


def _stages_table(report: Report) -> str:
    rows = []
    for st in report.stages:
        sid, lin, tensor, status, digest, secs = (st + [""] * 6)[:6]
        rows.append(f"<tr class={_e(status)} data-status={_e(status)}><td>{_e(sid)}</td>"
                    f"<td>{_e(lin)}</td><td class=mono>{_e(tensor)}</td><td>{_e(status)}</td>"
                    f"<td class=mono>{_e(str(digest)[:16])}</td><td>{_e(secs)}</td></tr>")
    buttons = "".join(f"<button onclick=\"filt('{s}')\">{s}</button>"
                      for s in ("all", "violated", "inconclusive", "proven"))
    return (f"<div id=filters>{buttons}<input id=q placeholder='lineage / tensor' "
            "oninput='filt(window.currentStatus)'></div>"
            "<table id=stages><thead><tr><th>stage</th><th>lineage</th><th>tensor</th>"
            "<th>status</th><th>obligation</th><th>solver s</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def render_html(report: Report, max_failures: int = 20) -> str:
    draw = _dot_available()
    summary = [
        ("stages", f"{report.stages_total} ({report.stages_proven} proven, "
                   f"{report.stages_violated} violated, {report.stages_inconclusive} "
                   f"inconclusive; {report.assumptions} assumed input lineages)"),
        ("obligations", f"{report.obligations_total} total, {report.obligations_unique} "
                        f"unique, {report.proven_without_solver} proven by term identity, "
                        f"{report.cache_hits} cache hits"),
        ("solver", report.solver),
        ("plans", f"{report.single}  |  {report.parallel}"),
        ("time", "  ".join(f"{k} {v:.2f}s" for k, v in report.timings.items())),
    ]
    if report.fold:
        summary.append(("folding", json.dumps({k: v for k, v in report.fold.items()
                                                if k != "second_fold"})[:400]))
    elif report.fold_note:
        summary.append(("folding", f"not folded: {report.fold_note}"))
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary)
    failures = "".join(_failure(k, f, draw) for k, f in
                       enumerate(report.failures[:max_failures]))
    more = (f"<p>{len(report.failures) - max_failures} more failures in the JSON report</p>"
            if len(report.failures) > max_failures else "")
    nodraw = "" if draw else ("<p class=note>Graphviz's dot was not found: dataflow is listed, "
                              "not drawn (apt-get install graphviz).</p>")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>tvsmt: "
            f"{_e(report.verdict)}</title><style>{_CSS}</style><script>{_JS}</script></head>"
            f"<body><h1>verdict: <span class={_e(report.verdict)}>{_e(report.verdict)}"
            f"</span></h1><table>{rows}</table>{nodraw}"
            f"<h2>failures ({len(report.failures)})</h2>{failures}{more}"
            f"<h2>stages</h2>{_stages_table(report)}</body></html>")


def write_html(report: Report, path: str) -> None:
    """Write the HTML report atomically (a killed run leaves no half-written file)."""
    from tvsmt.errors import InputError
    from tvsmt.atomic import atomic_write

    try:
        atomic_write(path, render_html(report).encode("utf-8"))  # shareable: umask's mode
    except OSError as e:
        raise InputError(f"cannot write the HTML report: {e.strerror}", file=path) from None

