"""The `tvsmt` command line: a thin layer over tvsmt.verify and the frontends."""

from __future__ import annotations

import os
import sys

import click

from tvsmt.errors import TvsmtError


class Cli(click.Group):
    """Turns user errors into one line on stderr and exit code 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TvsmtError as e:
            click.echo(f"tvsmt: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("tvsmt: interrupted", err=True)
            sys.exit(130)


@click.group(cls=Cli)
@click.version_option(package_name="tvsmt")
def main():
    """Prove that a parallel training plan computes what the single-device plan computes."""


def _progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress("[progress.description]{task.description}", BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                    disable=not sys.stderr.isatty() and not os.environ.get("TVSMT_PROGRESS"),
                    console=__import__("rich.console").console.Console(stderr=True))


def run_verify(single: str, parallel: str, report_path: str | None, **opts) -> int:
    from tvsmt.report.render import render
    from tvsmt.verify import Options, verify_pair

    with _progress_bar() as bar:
        task = bar.add_task("verifying", total=None)
        options = Options(progress=lambda phase, done, total: bar.update(
            task, description=phase, completed=done, total=total), **opts)
        report = verify_pair(single, parallel, options)
    render(report)
    if report_path:
        report.save(report_path)
        click.echo(f"report written to {report_path}")
    return report.exit_code


def default_corpus(parallel: str) -> str:
    """smt_corpus/<pair name>: the folder of a `parallel.json[.gz]`, else the file's stem."""
    path = os.path.abspath(parallel)
    base = os.path.basename(path)
    name = (os.path.basename(os.path.dirname(path)) if base.startswith("parallel.json")
            else base.split(".json")[0])
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "plans"
    return os.path.join("smt_corpus", safe)


def solver_options(f):
    """Options shared by `verify` and `replay`."""
    for opt in reversed([
        click.option("--jobs", "-j", type=int, default=None,
                     help="Parallel solver workers (default: all cores)."),
        click.option("--timeout", type=float, default=60.0, show_default=True,
                     help="Seconds per obligation; the solver is killed after it. A timeout "
                          "is inconclusive, never a pass."),
        click.option("--solver", default="z3", show_default=True,
                     help="Solver profile (solvers/*.toml): z3, cvc5, ..."),
        click.option("--backend", type=click.Choice(["loky", "threading", "dask"]),
                     default="loky", show_default=True, help="joblib backend for solving."),
        click.option("--scheduler", default=None,
                     help="Dask scheduler address (with --backend dask)."),
    ]):
        f = opt(f)
    return f


@main.command()
@click.argument("single", type=click.Path(dir_okay=False))
@click.argument("parallel", type=click.Path(dir_okay=False))
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Write the JSON report to this file.")
@solver_options
@click.option("--crosscheck", is_flag=True,
              help="Solve with z3 AND cvc5; any disagreement or one-sided answer is "
                   "inconclusive.")
@click.option("--corpus", "corpus", type=click.Path(file_okay=False), default=None,
              help="SMT-LIB corpus folder (default: smt_corpus/<plan pair name>).")
@click.option("--no-corpus", is_flag=True, help="Do not write or read a corpus.")
@click.option("--fresh", is_flag=True, help="Ignore verdicts already in the corpus.")
@click.option("--no-fold", is_flag=True,
              help="Verify every replica and micro-batch instead of folding the copies.")
def verify(single, parallel, report_path, jobs, timeout, solver, backend, scheduler,
           crosscheck, corpus, no_corpus, fresh, no_fold):
    """Verify that PARALLEL computes what SINGLE computes."""
    if backend == "dask" and not scheduler:
        raise click.UsageError("--backend dask needs --scheduler ADDRESS")
    if crosscheck and solver != "z3":
        raise click.UsageError("--crosscheck runs z3 and cvc5; it takes no --solver")
    if report_path and not os.path.isdir(os.path.dirname(os.path.abspath(report_path))):
        raise click.UsageError(f"--report: the folder of {report_path} does not exist")
    corpus = None if no_corpus else (corpus or default_corpus(parallel))
    sys.exit(run_verify(single, parallel, report_path, jobs=jobs, timeout=timeout,
                        solver=solver, backend=backend, scheduler=scheduler,
                        crosscheck=crosscheck, corpus=corpus, fresh=fresh, fold=not no_fold))


@main.command()
@click.argument("single", type=click.Path(dir_okay=False))
@click.argument("parallel", type=click.Path(dir_okay=False))
@click.option("--corpus", "corpus", type=click.Path(file_okay=False), default=None,
              help="Corpus folder (default: smt_corpus/<plan pair name>).")
def export(single, parallel, corpus):
    """Write the SMT-LIB obligations of every stage to a corpus, without solving."""
    from tvsmt.plan import load_plan
    from tvsmt.plan.reader import check_pair
    from tvsmt.verify import export_obligations

    s, p = load_plan(single), load_plan(parallel)
    check_pair(s, p)
    corpus = corpus or default_corpus(parallel)
    report = export_obligations(s, p, corpus)
    click.echo(f"{report.obligations_unique} unique obligations ({report.obligations_total} "
               f"stages need a solver, {report.proven_without_solver} proven by term "
               f"identity) written to {corpus}")
    for f in report.failures[:5]:
        click.echo(f"not exported: {f.kind}: {f.message}", err=True)
    sys.exit(1 if report.failures else 0)


@main.command()
@click.argument("corpus", type=click.Path(file_okay=False, exists=True))
@solver_options
def replay(corpus, jobs, timeout, solver, backend, scheduler):
    """Re-solve every obligation of a corpus and compare with the recorded verdicts."""
    from tvsmt.errors import PlanError
    from tvsmt.solving.replay import replay as run_replay

    if not (os.path.exists(os.path.join(corpus, "manifest.json"))
            or any(name.endswith(".smt2") for name in os.listdir(corpus))):
        raise PlanError("not a tvsmt corpus (no manifest.json and no .smt2 files)", file=corpus)
    rep = run_replay(corpus, solver=solver, jobs=jobs, timeout=timeout, backend=backend,
                     scheduler=scheduler)
    click.echo(f"{rep.total} obligations re-solved with {rep.solver} {rep.version}: "
               f"{rep.agree} agree, {len(rep.differences)} differ, {len(rep.unrecorded)} "
               f"had no recorded verdict, {len(rep.file_problems)} damaged files "
               f"({rep.seconds:.2f}s)")
    for d in rep.differences:
        click.echo(f"DIFFERENT {d}")
    for fp in rep.file_problems:
        click.echo(f"DAMAGED {fp}")
    sys.exit(0 if rep.ok else 1)


@main.command("report")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON instead of the summary.")
def report_cmd(path, as_json):
    """Re-render a saved JSON report."""
    from tvsmt.report import load_report
    from tvsmt.report.render import render

    report = load_report(path)
    if as_json:
        click.echo(report.to_json())
    else:
        render(report)
    sys.exit(report.exit_code)


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Keep the generated plans and reports here (default: a temporary folder).")
def demo(out_dir):
    """Generate a small parallel plan, verify it, break it, and show the localized report."""
    from tvsmt.demo import run_demo

    sys.exit(run_demo(out_dir))


@main.group(cls=type("LazyPlan", (click.Group,), {
    "get_command": lambda self, ctx, name: _plan_group().get_command(ctx, name),
    "list_commands": lambda self, ctx: _plan_group().list_commands(ctx)}))
def plan():
    """Generate plan pairs and inject known parallelization bugs."""


def _plan_group() -> click.Group:
    """The `plan` commands live in tvsmt.frontends; imported only when used."""
    from tvsmt.frontends.cli_plan import plan as real

    return real


@main.command("capture")
@click.argument("script", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Folder for single.json.gz, parallel.json.gz and capture.json.")
def capture_cmd(script, out_dir):
    """Trace a PyTorch capture SCRIPT into an execplan pair that `tvsmt verify` reads."""
    from tvsmt.capture import capture, write_pair

    pair = capture(script)
    single, parallel = write_pair(pair, out_dir)
    click.echo(f"captured {pair.parallel['world']['ranks']} ranks: {single}, {parallel} "
               f"({len(pair.parallel['lineages'])} lineages, {pair.hypotheses} hypotheses)")


@main.command("check")
@click.argument("script", type=click.Path(dir_okay=False))
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Write the JSON report to this file.")
@solver_options
@click.option("--crosscheck", is_flag=True,
              help="Solve with z3 AND cvc5; any disagreement or one-sided answer is "
                   "inconclusive.")
@click.option("--corpus", "corpus", type=click.Path(file_okay=False), default=None,
              help="SMT-LIB corpus folder (default: none).")
@click.option("--fresh", is_flag=True, help="Ignore verdicts already in the corpus.")
def check_cmd(script, report_path, jobs, timeout, solver, backend, scheduler, crosscheck,
              corpus, fresh):
    """Capture a PyTorch SCRIPT and verify it (verify's report and exit codes)."""
    from tvsmt.capture import check
    from tvsmt.report.render import render
    from tvsmt.verify import Options

    if backend == "dask" and not scheduler:
        raise click.UsageError("--backend dask needs --scheduler ADDRESS")
    if crosscheck and solver != "z3":
        raise click.UsageError("--crosscheck runs z3 and cvc5; it takes no --solver")
    with _progress_bar() as bar:
        task = bar.add_task("capturing", total=None)
        opts = Options(jobs=jobs, timeout=timeout, solver=solver, backend=backend,
                       scheduler=scheduler, crosscheck=crosscheck, corpus=corpus, fresh=fresh,
                       progress=lambda phase, done, total: bar.update(
                           task, description=phase, completed=done, total=total))
        report = check(script, opts)
    render(report)
    for inp in report.inputs:
        if inp["rank"] == 0:
            click.echo(f"input {inp['tensor']}: {inp['how']}")
    if report.hypotheses:
        h = report.hypotheses
        click.echo(f"hypotheses: {h['proposed']} proposed, {h['dropped']} dropped, "
                   f"{h['rounds']} verification rounds")
    if report_path:
        report.save(report_path)
        click.echo(f"report written to {report_path}")
    sys.exit(report.exit_code)


if __name__ == "__main__":
    main()
