"""The `tvsmt` command line: a thin layer over tvsmt.verify and the frontends."""

from __future__ import annotations

import errno
import os
import sys
from typing import NoReturn

import click

from tvsmt import heap
from tvsmt.cli_checks import Seconds, check_backend
from tvsmt.errors import InputError, InternalError, SolverFailure, StructuralViolation
from tvsmt.report.report import (
    EXIT_INCONCLUSIVE,
    EXIT_INPUT_ERROR,
    EXIT_INTERNAL,
    EXIT_VIOLATION,
)
from tvsmt.solving.types import DEFAULT_BACKEND
from tvsmt.textsafe import plain

EXIT_CODES_HELP = """\b
Exit codes (every command):
  0  equivalent (verify, report), or the command succeeded
  1  violation: a counterexample, or a claim the plans cannot support
     (replay: a recorded verdict was not reproduced, or a corpus file is damaged)
  2  input error: a malformed plan, report or corpus, or a bad option
     (one line on stderr naming the file, node or tensor); output that cannot be written;
     an exception in a capture script's own code (named by its line)
  3  inconclusive: a solver timeout, `unknown`, or solvers that disagree (never a pass)
  4  internal error: a bug in tvsmt (one line on stderr; TVSMT_DEBUG=1 shows the traceback)
  128+n  stopped by signal n: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (its solvers and
     workers killed);
     141: the reader of the output went away (`tvsmt plan bugs | head -1`)
"""


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class Cli(click.Group):
    """Turns every error into one line on stderr and its exit code (see EXIT_CODES_HELP),
    never a traceback. Ids and file names in messages are escaped (tvsmt/textsafe.py).

    SIGTERM and SIGHUP are handled like Ctrl-C (tvsmt/solving/lifeline.py): the run stops,
    its solver and worker processes are killed, and the exit code is 128 + the signal
    number."""

    def main(self, args=None, *a, **kw):
        program = args is None
        if program:  # the process ends with the command: nothing needs freeing (heap.py)
            heap.end_quickly()
        try:
            done = self._main(program, args, *a, **kw)
        except SystemExit as e:
            if program:
                heap.end_process(_flushed(e.code))
            raise
        if program:  # --version, --help: click returns their code
            heap.end_process(_flushed(done if isinstance(done, int) else 0))
        return done

    def _main(self, program: bool, args, *a, **kw):
        from tvsmt.solving.lifeline import activate

        with activate(program=program):
            try:
                return super().main(args, *a, **dict(kw, standalone_mode=False))
            except OSError as e:  # writing --help or --version, before any command runs
                code = _cannot_write(e)
                if code is None:
                    raise
                sys.exit(code)
            except _NO_ARGS_IS_HELP as e:  # `tvsmt` alone: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            except click.UsageError as e:  # one line, as every other input error
                where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                _fail(f"usage: {e.format_message()}{where}", EXIT_INPUT_ERROR)
            except click.ClickException as e:
                _fail(f"error: {e.format_message()}", e.exit_code)
            except click.Abort:
                _fail("aborted", EXIT_INPUT_ERROR)

    def invoke(self, ctx):
        try:
            return self._invoke(ctx)
        finally:  # however the command ended (its exit code is a SystemExit)
            _stop_if_interrupted()

    def _invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            _fail(f"error: {e}", EXIT_INPUT_ERROR)
        except StructuralViolation as e:
            _fail(f"violation: {e}", EXIT_VIOLATION)
        except SolverFailure as e:
            _fail(f"inconclusive: {e}", EXIT_INCONCLUSIVE)
        except InternalError as e:
            _fail(f"internal error: {e}", EXIT_INTERNAL)
        except KeyboardInterrupt as e:
            _interrupted(getattr(e, "exit_code", 130))
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:  # a bug in tvsmt: one line and exit 4, never a pass
            code = _cannot_write(e)
            if code is not None:  # ... unless it is the output that cannot be written
                sys.exit(code)
            if os.environ.get("TVSMT_DEBUG"):
                raise
            what = type(e).__name__ if type(e).__module__ == "builtins" else \
                f"{type(e).__module__}.{type(e).__name__}"
            _fail(f"internal error ({what}: {e}); this is a bug in tvsmt, please report it "
                  "(TVSMT_DEBUG=1 shows where)", EXIT_INTERNAL)


EXIT_OUTPUT_GONE = 128 + 13  # as if SIGPIPE had ended the command (a shell's 141)


def _output_gone() -> bool:
    """Whether the reader of standard output has gone (`tvsmt plan bugs | head -1`). If so,
    the rest of the output goes to /dev/null, so that nothing fails again at exit; the
    command then ends quietly, as a program ended by SIGPIPE does. A broken pipe to anything
    else (a solver) is not this, and stays an internal error."""
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(ev & select.POLLERR for _, ev in poll.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (AttributeError, OSError, ValueError):  # no real stdout (CliRunner): not this
        return False
    return True


# Errors of writing that are the environment's (a full disk, a quota, a device), never a bug
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def _cannot_write(e: BaseException) -> int | None:
    """The exit code of a command whose output cannot be written, None for any other error:
    a reader that went away ends it quietly (141); a full disk or a failing device is one
    line and an input error, as a report file that cannot be written is."""
    if isinstance(e, BrokenPipeError):
        return EXIT_OUTPUT_GONE if _output_gone() else None
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        _say(f"error: cannot write the output: {e.strerror}")
        return EXIT_INPUT_ERROR
    return None


def _flushed(code):
    """The exit code once standard output is flushed (what is still buffered is written at
    the end): a command that succeeded but whose output could not be written did not."""
    try:
        if sys.stdout is not None:  # None: started with standard output closed
            sys.stdout.flush()
    except (OSError, ValueError) as e:
        failed = _cannot_write(e)
        if failed is not None and code in (0, None):
            return failed
    return code


def _say(message: str) -> None:
    try:
        click.echo(f"tvsmt: {plain(message)}", err=True)
    except OSError:  # stderr cannot be written either: the exit code still tells
        pass


def _interrupted(code: int) -> NoReturn:
    """The command was interrupted (Ctrl-C: 130, SIGTERM: 143, SIGHUP: 129): one line, that
    exit code; a signal other than Ctrl-C's is named."""
    import signal

    from tvsmt.solving.lifeline import acknowledge

    acknowledge()
    name = f" ({signal.Signals(code - 128).name})" if code != 130 and code > 128 else ""
    click.echo("tvsmt: interrupted" + name, err=True)
    sys.exit(code)


def _stop_if_interrupted() -> None:
    """A signal received while the command ran, which it never acted on (the interrupt was
    swallowed and the command ended before it came again), still ends the run as
    interrupted: never with the command's own exit code."""
    from tvsmt.solving.lifeline import unacknowledged

    signum = unacknowledged()
    if signum:
        _interrupted(128 + signum)


def _fail(message: str, code: int) -> None:
    _say(message)
    sys.exit(code)


@click.group(cls=Cli, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="tvsmt")
def main():
    """Prove that a parallel training plan computes what the single-device plan computes.

    \b
    Solvers: --solver takes a profile name or a path to a .toml profile. A name is looked up
    in $TVSMT_SOLVERS_DIR (os.pathsep-separated folders of NAME.toml), then among the
    built-in profiles z3, cvc5 and cvc5-bin (installed with tvsmt). --crosscheck A,B,...
    (or --solver given twice or more) needs unsat from every solver for a pass.
    """


def _progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress("[progress.description]{task.description}", BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                    disable=sys.stderr is None  # started with stderr closed
                    or (not sys.stderr.isatty() and not os.environ.get("TVSMT_PROGRESS")),
                    console=__import__("rich.console").console.Console(stderr=True))


def run_verify(single: str, parallel: str, report_path: str | None,
               html_path: str | None = None, **opts) -> int:
    from tvsmt.verify import Options, verify_pair

    with _progress_bar() as bar:
        task = bar.add_task("verifying", total=None)
        options = Options(progress=lambda phase, done, total: bar.update(
            task, description=phase, completed=done, total=total), **opts)
        report = verify_pair(single, parallel, options)
    return show_report(report, report_path, html_path)


def show_report(report, report_path: str | None, html_path: str | None) -> int:
    """Write the JSON / HTML files asked for, then render; the exit code. Files are written
    before rendering: a saved report never depends on the terminal."""
    from tvsmt.report.render import render

    if report_path:
        report.save(report_path)
    if html_path:
        from tvsmt.report.html import write_html

        write_html(report, html_path)
    render(report)
    if report_path:
        click.echo(f"report written to {plain(report_path)}")
    if html_path:
        click.echo(f"HTML report written to {plain(html_path)}")
    return report.exit_code


def _check_folder(option: str, path: str | None) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise click.UsageError(f"{option}: the folder of {plain(path)} does not exist")


def default_corpus(parallel: str) -> str:
    """smt_corpus/<pair name>: the folder of a `parallel.json[.gz]`, else the file's stem."""
    path = os.path.abspath(parallel)
    base = os.path.basename(path)
    name = (os.path.basename(os.path.dirname(path)) if base.startswith("parallel.json")
            else base.split(".json")[0])
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "plans"
    return os.path.join("smt_corpus", safe)


def _solver_options(several: bool):
    """Options shared by `verify` and `replay` (`verify` takes --solver more than once)."""
    solver_help = ("Solver profile: a name (built-in z3, cvc5, cvc5-bin, or NAME.toml in a "
                   "folder of $TVSMT_SOLVERS_DIR, searched first) or a path to a .toml "
                   "profile." + (" Give it twice or more to cross-check (see --crosscheck)."
                                 if several else ""))
    solver = (click.option("--solver", multiple=True, default=(), metavar="PROFILE",
                           help=solver_help + "  [default: z3]") if several else
              click.option("--solver", default="z3", show_default=True, metavar="PROFILE",
                           help=solver_help))

    def decorate(f):
        for opt in reversed([
            click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
                         help="Parallel solver workers (default: all cores)."),
            # 3 s: tvsmt.policy.REFUTED_BUDGET_S (not imported here: the CLI starts light)
            click.option("--timeout", type=Seconds(), default=60.0, show_default=True,
                         help="Seconds per obligation, 0 for no limit; the solver is killed "
                              "after it. A timeout is inconclusive, never a pass. An "
                              "obligation that random concrete points already refute gets "
                              "at most 3 s: only `unsat` could change its outcome."),
            solver,
            click.option("--backend", type=click.Choice(["threading", "loky", "dask"]),
                         default=DEFAULT_BACKEND, show_default=True,
                         help="where the solvers are driven from: threads of this process, "
                         "loky worker processes, or a Dask cluster."),
            click.option("--scheduler", default=None, metavar="ADDRESS",
                         help="Dask scheduler address, tcp://HOST:PORT (with --backend dask; "
                              "checked to answer within a few seconds)."),
        ]):
            f = opt(f)
        return f

    return decorate


solver_options = _solver_options(several=False)


def verify_options(f):
    """The options of `verify`, shared with `check` (which takes exactly the same)."""
    for opt in reversed([
        click.option("--report", "report_path", type=click.Path(dir_okay=False),
                     help="Write the JSON report to this file."),
        click.option("--html", "html_path", type=click.Path(dir_okay=False),
                     help="Write a self-contained HTML report (failing stages drawn) to this "
                          "file."),
        _solver_options(several=True),
        click.option("--crosscheck", is_flag=False, flag_value="z3,cvc5", default=None,
                     metavar="[A,B,...]",
                     callback=lambda ctx, param, value: _crosscheck_value(value),
                     help="Solve with every listed solver profile (names or .toml paths; "
                          "alone: z3,cvc5, and then after the plan files or as "
                          "--crosscheck=A,B). A pass needs unsat from every solver; sat "
                          "against unsat, or a one-sided answer, is inconclusive. Giving "
                          "--solver twice or more does the same."),
        click.option("--corpus", "corpus", type=click.Path(file_okay=False), default=None,
                     help="SMT-LIB corpus folder (default: smt_corpus/<plan pair name>)."),
        click.option("--no-corpus", is_flag=True, help="Do not write or read a corpus."),
        click.option("--fresh", is_flag=True,
                     help="Ignore verdicts already in the corpus (and start over from a "
                          "damaged manifest)."),
        click.option("--no-fold", is_flag=True,
                     help="Verify every replica and micro-batch instead of folding the "
                          "copies."),
        click.option("--strict", is_flag=True,
                     help="Fail (inconclusive, exit 3) when the parallel plan computes "
                          "results that no lineage claims (they are listed in the report "
                          "either way)."),
    ]):
        f = opt(f)
    return f


def verify_option_values(name: str, report_path, html_path, jobs, timeout, solver, backend,
                         scheduler, crosscheck, corpus, no_corpus, fresh, no_fold, strict
                         ) -> dict:
    """Options keywords from verify's options, checked (`name`: the default corpus's)."""
    check_backend(backend, scheduler)
    solver, crosscheck = _solver_choice(solver, crosscheck)
    _check_folder("--report", report_path)
    _check_folder("--html", html_path)
    corpus = None if no_corpus else (corpus or default_corpus(name))
    return dict(jobs=jobs, timeout=timeout, solver=solver, backend=backend,
                scheduler=scheduler, crosscheck=crosscheck, corpus=corpus, fresh=fresh,
                fold=not no_fold, strict=strict)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("single", type=click.Path(dir_okay=False))
@click.argument("parallel", type=click.Path(dir_okay=False))
@verify_options
def verify(single, parallel, report_path, html_path, **options):
    """Verify that PARALLEL computes what SINGLE computes."""
    opts = verify_option_values(parallel, report_path, html_path, **options)
    sys.exit(run_verify(single, parallel, report_path, html_path, **opts))


def _crosscheck_value(value: str | None) -> tuple[str, ...] | None:
    """The --crosscheck list, checked at once: a bare --crosscheck before the plan files
    swallows the first one as its value, which deserves a clear message."""
    from tvsmt.options import crosscheck_list
    from tvsmt.solving.profiles import ProfileError, get_profile

    if value is None:
        return None
    names = crosscheck_list(value)
    if not names:
        raise click.BadParameter("an empty list of solvers", param_hint="--crosscheck")
    for name in names:
        try:
            get_profile(name)
        except ProfileError as e:
            hint = (" (to cross-check z3 and cvc5 put --crosscheck after the plan files, or "
                    "write --crosscheck=z3,cvc5)" if ".json" in name else "")
            raise click.BadParameter(f"{e}{hint}", param_hint="--crosscheck") from None
    return names


def _solver_choice(solvers: tuple[str, ...], crosscheck: tuple[str, ...] | None
                   ) -> tuple[str, tuple[str, ...] | bool]:
    """(solver, crosscheck) for Options from --solver (repeatable) and --crosscheck."""
    from tvsmt.options import check_solver_choice

    if crosscheck is not None and solvers:
        raise click.UsageError("--crosscheck takes its solvers as a list (--crosscheck z3,cvc5);"
                               " it takes no --solver")
    if crosscheck is None and len(solvers) > 1:
        crosscheck = solvers
    solver = solvers[0] if len(solvers) == 1 else "z3"
    try:
        check_solver_choice(solver, crosscheck or False)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return solver, crosscheck or False


@main.command(epilog=EXIT_CODES_HELP)
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
               f"identity) written to {plain(corpus)}")
    for f in report.failures[:5]:
        click.echo(f"not exported: {f.kind}: {plain(f.message)}", err=True)
    violated = any(f.kind in ("counterexample", "structural") for f in report.failures)
    sys.exit(EXIT_VIOLATION if violated else EXIT_INCONCLUSIVE if report.failures else 0)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("corpus", type=click.Path(file_okay=False, exists=True))
@solver_options
def replay(corpus, jobs, timeout, solver, backend, scheduler):
    """Re-solve every obligation of a corpus and compare with the recorded verdicts (sat or
    unsat; a recorded timeout or unknown is no verdict to reproduce)."""
    from tvsmt.errors import PlanError
    from tvsmt.solving.replay import replay as run_replay

    check_backend(backend, scheduler)
    if not os.path.isdir(corpus):
        raise PlanError("not a folder (a corpus is a folder of .smt2 files)", file=corpus)
    if not (os.path.exists(os.path.join(corpus, "manifest.json"))
            or any(name.endswith(".smt2") for name in os.listdir(corpus))):
        raise PlanError("not a tvsmt corpus (no manifest.json and no .smt2 files)", file=corpus)
    rep = run_replay(corpus, solver=solver, jobs=jobs, timeout=timeout, backend=backend,
                     scheduler=scheduler)
    click.echo(f"{rep.total} obligations re-solved with {rep.solver} {rep.version}: "
               f"{rep.agree} agree, {len(rep.differences)} differ, {len(rep.unrecorded)} "
               f"had no recorded verdict, {len(rep.file_problems)} damaged files, "
               f"{len(rep.unsealed)} verdicts changed outside tvsmt ({rep.seconds:.2f}s)")
    for d in rep.differences:
        click.echo(f"DIFFERENT {plain(d)}")
    for fp in rep.file_problems:
        click.echo(f"DAMAGED {plain(fp)}")
    for entry in rep.unsealed:
        digest, solver = entry.split(" ", 1)
        click.echo(f"UNSEALED {digest[:16]}...: the verdict of {plain(solver)} was changed "
                   "outside tvsmt (its seal does not match)")
    sys.exit(0 if rep.ok else 1)


@main.command("report", epilog=EXIT_CODES_HELP)
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON instead of the summary.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write the report as a self-contained HTML file.")
def report_cmd(path, as_json, html_path):
    """Re-render a saved JSON report."""
    from tvsmt.policy import load_trusted_report

    _check_folder("--html", html_path)
    report = load_trusted_report(path)
    if as_json:
        click.echo(report.to_json())
        if html_path:
            from tvsmt.report.html import write_html

            write_html(report, html_path)
        sys.exit(report.exit_code)
    sys.exit(show_report(report, None, html_path))


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Keep the generated plans and reports here (default: a temporary folder).")
def demo(out_dir):
    """Generate a small parallel plan, verify it, break it, and show the localized report;
    then the same from PyTorch code (a tensor-parallel MLP captured, proven and broken)."""
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


@main.command("check", epilog=EXIT_CODES_HELP)
@click.argument("script", type=click.Path(dir_okay=False))
@verify_options
def check_cmd(script, report_path, html_path, **options):
    """Capture a PyTorch SCRIPT and verify it: verify's options, report and exit codes
    (captured pairs are verified unfolded; the corpus defaults to
    smt_corpus/capture_<script name>)."""
    from tvsmt.capture import check
    from tvsmt.verify import Options

    stem = os.path.splitext(os.path.basename(script))[0]
    opts = verify_option_values(f"capture_{stem}.json", report_path, html_path, **options)
    with _progress_bar() as bar:
        task = bar.add_task("capturing", total=None)
        report = check(script, Options(progress=lambda phase, done, total: bar.update(
            task, description=phase, completed=done, total=total), **opts))
    code = show_report(report, report_path, html_path)
    for inp in report.inputs:
        if inp["rank"] == 0:
            click.echo(f"input {inp['tensor']}: {inp['how']}")
    if report.hypotheses:
        h = report.hypotheses
        click.echo(f"hypotheses: {h['proposed']} proposed, {h['dropped']} dropped, "
                   f"{h['rounds']} verification rounds")
    sys.exit(code)


if __name__ == "__main__":
    main()
