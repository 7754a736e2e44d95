"""The `tvsmt` command line: a thin layer over tvsmt.verify and the frontends."""

from __future__ import annotations

import os
import sys

import click

from tvsmt.errors import TvsmtError
from tvsmt.frontends.cli_plan import plan


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


@main.command()
@click.argument("single", type=click.Path(dir_okay=False))
@click.argument("parallel", type=click.Path(dir_okay=False))
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Write the JSON report to this file.")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel workers (default: all cores).")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds per solver call; a timeout is inconclusive, never a pass.")
def verify(single, parallel, report_path, jobs, timeout):
    """Verify that PARALLEL computes what SINGLE computes."""
    sys.exit(run_verify(single, parallel, report_path, jobs=jobs, timeout=timeout))


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


main.add_command(plan)

if __name__ == "__main__":
    main()
