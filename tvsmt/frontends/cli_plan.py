"""`tvsmt plan ...`: generate plan pairs, inject bugs, list the bug zoo.

    tvsmt plan generate --model llama3 --dp 2 --tp 2 --pp 2 --mb 2 -o out/
    tvsmt plan mutate out/ --bug drop-bw-reduction -o out-bug/
    tvsmt plan bugs
"""

from __future__ import annotations

import json
import os
import shutil

import click

from tvsmt.textsafe import plain


class PlanInputError(click.ClickException):
    """Bad input to a `plan` command: one line on stderr, exit code 2 (as for `verify`)."""

    exit_code = 2


SINGLE, PARALLEL, RECORD = "single.json.gz", "parallel.json.gz", "mutation.json"


@click.group("plan")
def plan():
    """Generate execution-plan pairs and inject known parallelization bugs."""


@plan.command()
@click.option("--model", type=click.Choice(["mlp", "llama3", "moe", "deepseek-v3"]), default="llama3",
              show_default=True)
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--hidden", type=int, default=64, show_default=True)
@click.option("--heads", type=int, default=4, show_default=True, help="llama3 only.")
@click.option("--ffn", type=int, default=128, show_default=True, help="llama3 only.")
@click.option("--vocab", type=int, default=128, show_default=True, help="llama3 only.")
@click.option("--seq", type=int, default=8, show_default=True, help="llama3 only.")
@click.option("--batch", type=int, default=None,
              help="Global batch (default: dp*mb, at least 2).")
@click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel replicas.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--mb", type=int, default=1, show_default=True, help="Micro-batches.")
@click.option("--ep", type=int, default=None,
              help="moe only: expert-parallel ranks, a divisor of tp (groups of ep tp ranks; "
                   "default tp).")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Folder for single.json.gz and parallel.json.gz (or .jsonl.gz).")
@click.option("--format", "form", type=click.Choice(["json", "jsonl"]), default="json",
              show_default=True,
              help="json: one JSON document per plan; jsonl: the streaming form, one record "
                   "per line (docs/format.md), written unit by unit for llama3 worlds with "
                   "more than 2 replicas or micro-batches, so that no plan is held whole. "
                   "Files appear only once complete.")
def generate(model, layers, hidden, heads, ffn, vocab, seq, batch, dp, tp, pp, mb, ep,
             out_dir, form):
    """Write a (single, parallel) plan pair of one training iteration."""
    from tvsmt.frontends.generator import TooLargeToBuild, generate_pair, write_pair_dicts

    streamable = model == "llama3" and batch is None and (dp > 2 or mb > 2)
    if form == "jsonl" and streamable:
        return _generate_streamed(layers, hidden, heads, ffn, vocab, seq, dp, tp, pp, mb,
                                  out_dir)
    suffix = ".jsonl.gz" if form == "jsonl" else ".json.gz"
    try:
        if ep is not None and model not in ("moe", "deepseek-v3"):
            raise ValueError(f"--ep {ep}: expert parallelism exists for --model moe and "
                             "deepseek-v3 only")
        single, parallel = generate_pair(model, layers=layers, hidden=hidden, heads=heads,
                                         ffn=ffn, vocab=vocab, seq=seq, batch=batch, dp=dp,
                                         tp=tp, pp=pp, mb=mb, ep=ep)
        s_path, p_path = write_pair_dicts(out_dir, single, parallel, suffix=suffix)
    except TooLargeToBuild as e:
        hint = (" (or --format jsonl: this world is then written unit by unit, its kept "
                "units only built)") if streamable else ""
        raise PlanInputError(f"{e}{hint}") from None
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    except OSError as e:
        raise PlanInputError(f"cannot write {out_dir}: {e}") from None
    click.echo(f"{plain(s_path)}: {len(single['nodes'])} nodes")
    click.echo(f"{plain(p_path)}: {len(parallel['nodes'])} nodes on {parallel['world']['ranks']} ranks, "
               f"{len(parallel['lineages'])} lineages")


def _generate_streamed(layers, hidden, heads, ffn, vocab, seq, dp, tp, pp, mb, out_dir):
    """The streaming form of a large generated pair, unit by unit (tvsmt.frontends.stream)."""
    from tvsmt.fold.folder import FoldRefused
    from tvsmt.frontends.builder import plan_dict, write_plan, write_unit_source
    from tvsmt.frontends.stream import StreamedPlan

    try:
        source = StreamedPlan("llama3", layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                              vocab=vocab, seq=seq, dp=dp, tp=tp, pp=pp, mb=mb)
        os.makedirs(out_dir, exist_ok=True)
        s_path = write_plan(os.path.join(out_dir, "single.jsonl.gz"), plan_dict(source.single))
        p_path = write_unit_source(os.path.join(out_dir, "parallel.jsonl.gz"), source)
    except (ValueError, FoldRefused) as e:
        raise PlanInputError(str(e)) from None
    except OSError as e:
        raise PlanInputError(f"cannot write {out_dir}: {e}") from None
    click.echo(f"{plain(s_path)}: {len(source.single.nodes)} nodes")
    click.echo(f"{plain(p_path)}: {source.header.world.get('ranks')} ranks, "
               f"{len(source.header.lineages)} lineages, written unit by unit")


@plan.command()
@click.argument("in_dir", type=click.Path(file_okay=False))
@click.option("--bug", "name", required=True, help="Bug name (see `tvsmt plan bugs`).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Picks among the places the bug fits.")
@click.option("--where", default=None, help="Force the target: a node id, or a tensor id the "
                                            "node reads or writes.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Folder for the copied single plan, the mutated parallel plan and "
                   "mutation.json.")
def mutate(in_dir, name, seed, where, out_dir):
    """Inject one bug into IN_DIR/parallel.json.gz."""
    from tvsmt.frontends.builder import read_plan_dict, write_plan
    from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply

    if name not in MUTATIONS:
        raise PlanInputError(f"unknown bug {name!r}; `tvsmt plan bugs` lists them")
    if os.path.abspath(in_dir) == os.path.abspath(out_dir):
        raise PlanInputError("the output folder must differ from IN_DIR (the original "
                                   "plan would be overwritten)")
    src_single, src_parallel = (os.path.join(in_dir, f) for f in (SINGLE, PARALLEL))
    for path in (src_single, src_parallel):
        if not os.path.isfile(path):
            raise PlanInputError(f"{path}: no such file")
    try:
        parallel = read_plan_dict(src_parallel)
    except (OSError, EOFError, ValueError) as e:
        raise PlanInputError(f"{src_parallel}: cannot read plan: {e}") from None
    try:
        mutated, record = apply(parallel, name, seed=seed, where=where)
    except NotApplicable as e:
        raise PlanInputError(f"bug {name} does not apply to {src_parallel}: {e}") from None
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    try:
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(src_single, os.path.join(out_dir, SINGLE))
        write_plan(os.path.join(out_dir, PARALLEL), mutated)
        with open(os.path.join(out_dir, RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    except OSError as e:
        raise PlanInputError(f"cannot write {out_dir}: {e}") from None
    click.echo(f"{plain(name)}: changed {plain(', '.join(record['nodes']))}")
    click.echo(f"written to {plain(out_dir)} (record in {RECORD})")


@plan.command()
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON.")
def bugs(as_json):
    """List the bug zoo: name, category, description."""
    from tvsmt.frontends.mutations import MUTATIONS

    if as_json:
        click.echo(json.dumps([{"name": m.name, "category": m.category,
                                "description": m.description, "breaks_graph": m.breaks_graph}
                               for m in MUTATIONS.values()], indent=2))
        return
    width = max(len(n) for n in MUTATIONS)
    cwidth = max(len(m.category) for m in MUTATIONS.values())
    for m in MUTATIONS.values():
        click.echo(f"{m.name:<{width}}  {m.category:<{cwidth}}  {m.description}")
