"""Run obligations through external solvers: one process per worker batch, in parallel.

`solve_batch` runs a list of obligations in the calling process, one solver process at a time
(kept alive across obligations when the profile allows, `(reset)` in between), each obligation
bounded by `timeout_s` (the whole solver process tree is killed on timeout). `solve_all`
spreads the obligations over threads of this process (the default, `DEFAULT_BACKEND`: each
thread drives its own kept-alive solver), joblib's loky worker processes, or Dask
(`backend="dask"`). `crosscheck` runs several solvers and reconciles their answers.

Guarantees: an error of the solver or in its output is ERROR, never an answer; `unknown` and
timeouts stay UNKNOWN/TIMEOUT; no solver process outlives the call (try/finally, also on
KeyboardInterrupt or an exception raised by the progress callback).

How a script is fed: the obligation's text up to its last `(check-sat)` is sent, followed by
`(echo "<marker>")`; once the answer is read, `(get-value (<query>))` is sent only if the
answer is `sat` (a get-value after `unsat` is an error in both z3 and cvc5), so a trailing
get-value in the script is replaced by one built from `Obligation.query` (with no query,
`(get-model)` is asked instead). A `sat` whose model cannot be obtained is UNKNOWN.
Profiles without a stdin command get the same prefix as a file, without values.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import psutil

from tvsmt.forked import worker_count
from tvsmt.solving import lifeline
from tvsmt.solving.profiles import (Profile, build_command, child_env, get_profile,
                                    require_binary, solver_version)
from tvsmt.solving.sexpr import SExprError, parse_get_value
from tvsmt.solving.types import (DEFAULT_BACKEND, ERROR, SAT, TIMEOUT, UNKNOWN, UNSAT, Obligation,
                                 SolverResult)

ANSWERS = (SAT, UNSAT, UNKNOWN)
Progress = Callable[[int, SolverResult], object]
# time limits of some obligations (by digest) below the run's timeout (policy.refuted_budget)
Budgets = Mapping[str, float] | None

# --------------------------------------------------------------------------------------------
# Process bookkeeping shared by a run: pid files of live solvers plus a cancel flag, so that the
# caller can kill every solver of the run even when they are children of worker processes.


class Cancelled(Exception):
    """The run this batch belongs to was cancelled by its caller."""


def _host_id() -> str:
    return f"{socket.gethostname()}/{psutil.boot_time():.0f}"


class _Registry:
    """`token` = (host id, directory). Off the host that made it (a remote Dask worker) the
    registry is inert; on that host, a vanished directory means the run is over (cancelled)."""

    CANCEL = "CANCEL"

    def __init__(self, token: tuple[str, str] | None):
        self.path = None
        if token is not None and token[0] == _host_id():
            self.path = token[1]

    def register(self, pid: int) -> None:
        if self.path:
            try:
                ctime = psutil.Process(pid).create_time()
            except psutil.Error:
                ctime = 0.0
            try:
                with open(os.path.join(self.path, str(pid)), "w") as fh:
                    fh.write(repr(ctime))
            except OSError:
                raise Cancelled() from None  # the run's directory is gone

    def unregister(self, pid: int) -> None:
        if self.path:
            try:
                os.unlink(os.path.join(self.path, str(pid)))
            except OSError:
                pass

    def cancelled(self) -> bool:
        return bool(self.path) and (not os.path.isdir(self.path)
                                    or os.path.exists(os.path.join(self.path, self.CANCEL)))

    def cancel_and_kill(self) -> None:
        """Flag the run as cancelled, then kill every registered solver (race-free: a batch
        registers a new process before checking the flag)."""
        if not self.path:
            return
        open(os.path.join(self.path, self.CANCEL), "w").close()
        for name in os.listdir(self.path):
            if not name.isdigit():
                continue
            try:
                with open(os.path.join(self.path, name)) as fh:
                    ctime = float(fh.read() or 0)
                proc = psutil.Process(int(name))
                if ctime and abs(proc.create_time() - ctime) > 0.01:
                    continue  # pid reused by an unrelated process
                _kill_tree(proc.pid, reaped=False)
            except (OSError, ValueError, psutil.Error):
                continue


RUN_PREFIX = "tvsmt-run-"


def sweep_stale_runs() -> None:
    """Remove the run directories (pid files, temporary scripts) of tvsmt processes that no
    longer exist: a killed run cannot clean up after itself, the next one does."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(RUN_PREFIX):
            continue
        owner = name[len(RUN_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _kill_tree(pid: int, reaped: bool) -> None:
    """SIGKILL a solver and all its descendants (it leads its own session/process group)."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        procs = []
    if not reaped:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


# --------------------------------------------------------------------------------------------
# One solver process spoken to through stdin/stdout.


class _Died(Exception):
    pass


class _TimedOut(Exception):
    pass


class _SolverProcess:
    """A solver reading SMT-LIB commands on stdin; `exchange` sends text and waits for a marker."""

    def __init__(self, argv: list[str], env: dict[str, str], registry: _Registry):
        if registry.cancelled():
            raise Cancelled()
        self.stderr = tempfile.TemporaryFile()
        self.sel = selectors.DefaultSelector()
        self.registry = registry
        self.served = 0
        self.count = 0
        try:
            argv, preexec = lifeline.spawn_args(argv)
            self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self.stderr, env=env, start_new_session=True,
                                          bufsize=0, preexec_fn=preexec)
        except BaseException:
            self.stderr.close()
            self.sel.close()
            raise
        try:
            registry.register(self.popen.pid)  # register first, then look at the flag
            if registry.cancelled():
                raise Cancelled()
            os.set_blocking(self.popen.stdin.fileno(), False)
            os.set_blocking(self.popen.stdout.fileno(), False)
        except BaseException:
            self.close()
            raise

    def exchange(self, text: str, deadline: float) -> str:
        """Send `text` + an echo marker; return the output printed before the marker."""
        self.count += 1
        marker = f"@@tvsmt-{os.getpid()}-{self.count}@@"
        data = (text + f'\n(echo "{marker}")\n').encode("utf-8")
        out = bytearray()
        stdin_fd, stdout_fd = self.popen.stdin.fileno(), self.popen.stdout.fileno()
        sel = self.sel
        sel.register(stdout_fd, selectors.EVENT_READ)
        if data:
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        view, sent = memoryview(data), 0
        needle = marker.encode()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _TimedOut()
                for key, _ in sel.select(min(left, 3600)):
                    if key.fd == stdin_fd:
                        try:
                            sent += os.write(stdin_fd, view[sent:sent + 65536])
                        except BlockingIOError:
                            continue
                        except (BrokenPipeError, OSError):
                            sel.unregister(stdin_fd)
                            sent = len(data)
                            continue
                        if sent >= len(data):
                            sel.unregister(stdin_fd)
                    else:
                        try:
                            chunk = os.read(stdout_fd, 65536)
                        except BlockingIOError:
                            continue
                        if not chunk:
                            raise _Died(out.decode("utf-8", "replace"))
                        out += chunk
                        at = out.find(needle, max(0, len(out) - len(chunk) - len(needle)))
                        if at >= 0:
                            start = out.rfind(b"\n", 0, at) + 1
                            return out[:start].decode("utf-8", "replace")
        finally:
            for fd in (stdin_fd, stdout_fd):
                try:
                    sel.unregister(fd)
                except (KeyError, ValueError):
                    pass

    def stderr_tail(self, limit: int = 400) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - limit))
            return self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def exit_code(self, wait: float = 0.5) -> int | None:
        try:
            return self.popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        popen = self.popen
        try:
            _kill_tree(popen.pid, reaped=popen.returncode is not None)
        finally:
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
            for fh in (popen.stdin, popen.stdout, self.stderr):
                try:
                    fh.close()
                except OSError:
                    pass
            self.sel.close()
            self.registry.unregister(popen.pid)


# --------------------------------------------------------------------------------------------
# Reading answers.

_CHECK_SAT = "(check-sat)"
_SIMPLE_SYMBOL = re.compile(r"[A-Za-z~!@$%^&*_+=<>.?/\-][A-Za-z0-9~!@$%^&*_+=<>.?/\-]*\Z")


def _symbol(name: str) -> str:
    return name if _SIMPLE_SYMBOL.match(name) else f"|{name}|"


def script_prefix(smt2: str) -> str | None:
    """The script up to and including its last `(check-sat)` (None if there is none)."""
    at = smt2.rfind(_CHECK_SAT)
    return None if at < 0 else smt2[:at + len(_CHECK_SAT)]


def get_value_command(query: Sequence[str]) -> str:
    return "(get-value (" + " ".join(_symbol(q) for q in query) + "))"


def _first_error(text: str, markers: Sequence[str]) -> str | None:
    """The first error in the output (an `(error "...")` spanning lines joined into one)."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if any(m in line for m in markers):
            msg = line.strip()
            for more in lines[k + 1:k + 8]:
                if _balanced(msg) and msg.count('"') % 2 == 0:
                    break
                msg += " " + more.strip()
            return msg[:500]
    return None


_WARNING = re.compile(r"\(?warning\b", re.IGNORECASE)


def classify(output: str, profile: Profile) -> tuple[str, str]:
    """(status, message) from a solver's output up to its answer."""
    err = _first_error(output, profile.error_markers)
    if err is not None:
        return ERROR, err
    lines = [ln.strip() for ln in output.splitlines()
             if ln.strip() and not _WARNING.match(ln.strip())]
    if not lines:
        return ERROR, "no answer"
    first = lines[0]
    if first in ANSWERS:
        return first, ""
    if first in profile.timeout_words:
        return TIMEOUT, "solver reported a timeout"
    return ERROR, f"unexpected output: {first[:200]}"


# --------------------------------------------------------------------------------------------
# A batch in the calling process.


class _Batch:
    def __init__(self, profile: Profile, timeout_s: float | None, registry: _Registry):
        self.profile = profile
        self.timeout = math.inf if timeout_s is None or timeout_s <= 0 else float(timeout_s)
        self.timeout_s = timeout_s
        self.registry = registry
        self.binary = require_binary(profile)
        self.version = solver_version(profile)
        self.env = child_env(profile)
        self.proc: _SolverProcess | None = None

    def result(self, status: str, seconds: float, message: str = "", values=None) -> SolverResult:
        return SolverResult(status=status, solver=self.profile.name, version=self.version,
                            seconds=round(seconds, 6), values=values or {}, message=message,
                            profile=self.profile.digest)

    def _drop(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.close()

    def close(self) -> None:
        self._drop()

    # -- stdin protocol ------------------------------------------------------------------
    def _process(self) -> _SolverProcess:
        if self.proc is None:
            argv = build_command(self.profile, "stdin", self.binary, timeout_s=self.timeout_s)
            self.proc = _SolverProcess(argv, self.env, self.registry)
        return self.proc

    def limit(self, timeout_s: float | None) -> float:
        """The time limit of one obligation: the batch's, or a lower one of its own."""
        if timeout_s is None or timeout_s <= 0:
            return self.timeout
        return min(self.timeout, float(timeout_s))

    def _solve_stdin(self, ob: Obligation, prefix: str, limit: float) -> SolverResult:
        proc = self._process()
        text = prefix if proc.served == 0 else f"{self.profile.reset}\n{prefix}"
        t0 = time.monotonic()
        deadline = t0 + limit
        try:
            out = proc.exchange(text, deadline)
            status, message = classify(out, self.profile)
            values = {}
            if status == UNKNOWN and time.monotonic() - t0 >= limit:
                status, message = TIMEOUT, "unknown at the time limit"
            if status == SAT:
                # a sat must come with a model (cvc5 has answered sat without one on a valid
                # obligation): ask for the query values, or for the model if there is no query
                ask = get_value_command(ob.query) if ob.query else "(get-model)"
                vout = proc.exchange(ask, deadline)
                err = _first_error(vout, self.profile.error_markers)
                try:
                    values = parse_get_value(vout) if err is None and ob.query else {}
                except SExprError as e:
                    err = f"unreadable get-value answer: {e}"
                if err is not None:
                    values = {}
                    status, message = UNKNOWN, f"sat, but no model: {err}"
        except _TimedOut:
            self._drop()
            return self.result(TIMEOUT, time.monotonic() - t0, f"killed after {limit:g} s")
        except _Died as died:
            code = proc.exit_code()
            tail = " ".join(proc.stderr_tail().split())[-300:]
            self._drop()
            partial = _first_error(str(died), self.profile.error_markers)
            msg = partial or f"solver exited (code {code})" + (f": {tail}" if tail else "")
            return self.result(ERROR, time.monotonic() - t0, msg)
        proc.served += 1
        if status == ERROR:
            self._drop()  # never reuse a process that saw an error
        return self.result(status, time.monotonic() - t0, message, values)

    # -- file protocol (profiles without a stdin command) --------------------------------
    def _solve_file(self, ob: Obligation, prefix: str, limit: float) -> SolverResult:
        try:  # in the run's directory, when there is one: swept if this process is killed
            fd, path = tempfile.mkstemp(prefix=f"tvsmt-{ob.digest[:12]}-", suffix=".smt2",
                                        dir=self.registry.path)
        except FileNotFoundError:
            raise Cancelled() from None  # the run's directory is gone: the run is over
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                fh.write(prefix + "\n")
            return self.run_file(path, limit)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass

    def run_file(self, path: str, limit: float | None = None) -> SolverResult:
        """Run the profile's `file` command on a script file (one fresh process), for at most
        `limit` seconds (None: the batch's timeout)."""
        if self.registry.cancelled():
            raise Cancelled()
        limit = self.timeout if limit is None else limit
        argv = build_command(self.profile, "file", self.binary, file=path,
                             timeout_s=None if math.isinf(limit) else limit)
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
            argv, preexec = lifeline.spawn_args(argv)
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                     env=self.env, start_new_session=True, preexec_fn=preexec)
            reaped = False
            try:
                self.registry.register(popen.pid)  # register first, then look at the flag
                if self.registry.cancelled():
                    raise Cancelled()
                try:
                    code = popen.wait(timeout=None if math.isinf(limit) else limit)
                    reaped = True
                except subprocess.TimeoutExpired:
                    return self.result(TIMEOUT, time.monotonic() - t0,
                                       f"killed after {limit:g} s")
            finally:
                _kill_tree(popen.pid, reaped=reaped)  # also the descendants of a finished one
                popen.wait()
                self.registry.unregister(popen.pid)
            seconds = time.monotonic() - t0
            out_f.seek(0)
            err_f.seek(0)
            out = out_f.read().decode("utf-8", "replace")
            err = err_f.read().decode("utf-8", "replace")
        status, message = classify(out, self.profile)
        if status == ERROR:
            return self.result(ERROR, seconds, message)
        if code != 0:
            tail = " ".join(err.split())[-300:]
            return self.result(ERROR, seconds, f"solver exited with code {code}"
                               + (f": {tail}" if tail else f" after answering {status}"))
        values: dict = {}
        if status == UNKNOWN and seconds >= limit:
            status, message = TIMEOUT, "unknown at the time limit"
        if status == SAT:
            rest = out.split("\n", 1)[1] if "\n" in out.strip() else ""
            if rest.strip():
                try:
                    values = parse_get_value(rest)
                except SExprError:
                    values = {}
        return self.result(status, seconds, message, values)

    def solve(self, ob: Obligation, timeout_s: float | None = None) -> SolverResult:
        """One obligation's answer, within the batch's timeout or a lower `timeout_s`."""
        limit = self.limit(timeout_s)
        prefix = script_prefix(ob.smt2)
        if prefix is None:
            return self.result(ERROR, 0.0, "script has no (check-sat)")
        if self.profile.stdin_command is None:
            return self._solve_file(ob, prefix, limit)
        if not _balanced(prefix):
            # an unclosed parenthesis would swallow the end marker: let a one-off process
            # reading the script as a file report it
            return self._solve_file(ob, prefix, limit)
        fresh_process = self.proc is None or self.proc.served == 0
        res = self._solve_stdin(ob, prefix, limit)
        if res.status == ERROR and not fresh_process:
            # the error may come from the state left by earlier scripts: retry on a new process
            res = self._solve_stdin(ob, prefix, limit)
        if not self.profile.keepalive:
            self._drop()
        return res


_STRIP = re.compile(r'"(?:[^"]|"")*"|\|[^|]*\||;[^\n]*')


def _balanced(text: str) -> bool:
    """Parentheses balance (outside strings, quoted symbols and comments)."""
    if '"' in text or "|" in text or ";" in text:
        text = _STRIP.sub("", text)
    return text.count("(") == text.count(")")


def solve_batch(obligations: Sequence[Obligation], profile: "Profile | str",
                timeout_s: float | None = 60, *, registry: tuple[str, str] | None = None,
                budgets: Budgets = None) -> list[SolverResult]:
    """Solve `obligations` one after the other with one solver (kept-alive process when the
    profile allows). Each result's `seconds` is that obligation's solving time; `budgets`
    gives some obligations (by digest) a time limit below `timeout_s`."""
    profile = get_profile(profile)
    batch = _Batch(profile, timeout_s, _Registry(registry))
    budgets = budgets or {}
    try:
        return [batch.solve(ob, budgets.get(ob.digest)) for ob in obligations]
    finally:
        batch.close()


def run_file(path: str | os.PathLike, profile: "Profile | str", timeout_s: float | None = 60
             ) -> SolverResult:
    """Run a solver on a script file as is, with its `file` command (one fresh process)."""
    batch = _Batch(get_profile(profile), timeout_s, _Registry(None))
    return batch.run_file(os.fspath(path))


def _task(profile: Profile, items: list[tuple[int, Obligation]], timeout_s, registry,
          parent: int | None = None, budgets: Budgets = None):
    """One joblib task: a chunk of obligations for one solver. In a worker process of the
    tvsmt process `parent`, the worker first arranges to die with it (lifeline)."""
    lifeline.arm_worker(parent)
    results = solve_batch([ob for _, ob in items], profile, timeout_s, registry=registry,
                          budgets=budgets)
    return profile.name, [(i, r) for (i, _), r in zip(items, results, strict=True)]


# --------------------------------------------------------------------------------------------
# Parallel runs.


def _parallel_setup(backend: str, scheduler, jobs: int | None):
    """(context manager, n_jobs, client to close or None)."""
    import contextlib

    import joblib

    n_jobs = -1 if jobs is None else jobs
    if backend != "dask":
        return joblib.parallel_config(backend=backend, n_jobs=n_jobs), n_jobs, None
    try:
        from distributed import Client, get_client
    except ImportError:
        raise ValueError("backend='dask' needs the 'distributed' package "
                         "(pip install 'dask[distributed]')") from None
    own = None
    if scheduler is None:
        try:
            client = get_client()
        except ValueError:
            raise ValueError("backend='dask' needs scheduler=ADDRESS or an active "
                             "distributed.Client") from None
    elif isinstance(scheduler, str):
        client = own = Client(scheduler, set_as_default=False)
    else:
        client = scheduler
    stack = contextlib.ExitStack()
    stack.enter_context(joblib.parallel_config(backend="dask", n_jobs=n_jobs, client=client))
    return stack, n_jobs, own


def _chunks(indices: list[int], chunk_size: int) -> list[list[int]]:
    return [indices[i:i + chunk_size] for i in range(0, len(indices), chunk_size)]


def _run(obligations: list[Obligation], profiles: list[Profile], *, jobs, timeout_s, budgets,
         backend, scheduler, chunk_size,
         on_result: Callable[[str, int, SolverResult], None]) -> None:
    """Solve every (unique) obligation with every profile; on_result(solver, index, result)
    is called for every original index as results arrive."""

    if not obligations:
        return
    # identical scripts (same digest and query) are solved once
    first: dict[tuple, int] = {}
    copies: dict[int, list[int]] = {}
    for i, ob in enumerate(obligations):
        j = first.setdefault((ob.digest or f"#{i}", ob.query), i)
        copies.setdefault(j, []).append(i)
    unique = sorted(copies)
    if backend != "dask" or scheduler is None:
        for p in profiles:
            require_binary(p)  # fail fast, in the caller, with the profile's message
    sweep_stale_runs()
    registry_dir = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-")
    token = (_host_id(), registry_dir)
    registry = _Registry(token)

    def deliver(name: str, pairs) -> None:  # one result per original index (copies share it)
        for i, res in pairs:
            for c, idx in enumerate(copies[i]):
                on_result(name, idx, res if c == 0 else replace(res))

    if backend == "threading" or (jobs == 1 and backend != "dask"):
        # in this process: threads driving kept-alive solvers, no worker pool to start
        try:
            _run_threads(obligations, unique, profiles, jobs, timeout_s, budgets, token,
                         deliver)
        except BaseException:
            registry.cancel_and_kill()
            raise
        finally:
            shutil.rmtree(registry_dir, ignore_errors=True)
        return
    import joblib

    # workers of a local pool are our children and die with us (not Dask's, or others')
    parent = os.getpid() if backend in ("loky", "multiprocessing") else None
    if backend == "loky":
        lifeline.start_loky_tracker_deaf_to_hangup()
    if jobs is not None and jobs > 0:  # never more workers than tasks
        jobs = worker_count(jobs, len(unique) * len(profiles))
    try:
        ctx, n_jobs, own_client = _parallel_setup(backend, scheduler, jobs)
    except BaseException:
        os.rmdir(registry_dir)
        raise
    try:
        with ctx:
            workers = max(1, joblib.effective_n_jobs(n_jobs))
            if chunk_size is None:
                per = len(unique) * len(profiles) / (workers * 4)
                chunk_size = max(1, min(32, math.ceil(per / len(profiles))))
            tasks = []
            per_profile = [_chunks(unique, chunk_size) for _ in profiles]
            for k in range(max(len(c) for c in per_profile)):  # interleave solvers
                for p, chunks in zip(profiles, per_profile):
                    if k < len(chunks):
                        items = [(i, obligations[i]) for i in chunks[k]]
                        mine = {ob.digest: budgets[ob.digest] for _, ob in items
                                if ob.digest in budgets}
                        tasks.append(joblib.delayed(_task)(p, items, timeout_s, token,
                                                           parent, mine))
            gen = joblib.Parallel(n_jobs=n_jobs, batch_size=1, pre_dispatch="all",
                                  return_as="generator_unordered")(tasks)
            try:
                for name, pairs in gen:
                    deliver(name, pairs)
            except BaseException:
                # kill the run's solvers before joblib waits for (or kills) its workers
                registry.cancel_and_kill()
                raise
            finally:
                with warnings.catch_warnings():  # joblib warns about the cancelled tasks
                    warnings.simplefilter("ignore", UserWarning)
                    gen.close()
    finally:
        try:
            if own_client is not None:
                own_client.close()
        finally:
            shutil.rmtree(registry_dir, ignore_errors=True)


def _run_threads(obligations: list[Obligation], unique: list[int], profiles: list[Profile],
                 jobs: int | None, timeout_s, budgets: dict[str, float], token,
                 deliver) -> None:
    """Solve in threads of this process, each driving its own kept-alive solver per profile
    and taking the next obligation when it is free: the solvers do the work, so no worker
    processes are started (loky's cost ~0.3 s a run, measured by scripts/bench_solvers.py)
    and no solver is restarted between chunks. Results are delivered in this (the calling)
    thread, as they arrive. A thread's exception ends the run and is raised here; an
    exception here (KeyboardInterrupt, the progress callback's) stops the threads, whose
    solvers the caller's registry kills."""
    import queue
    import threading

    work = [(p, i) for i in unique for p in profiles]  # interleaved solvers, as the pool
    workers = max(1, min(len(work), jobs if jobs and jobs > 0 else (os.cpu_count() or 1)))
    taken = iter(work)
    take_lock = threading.Lock()
    stop = threading.Event()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    registry = _Registry(token)

    def worker() -> None:
        batches: dict[str, _Batch] = {}
        try:
            while not stop.is_set():
                with take_lock:
                    item = next(taken, None)
                if item is None:
                    return
                p, i = item
                batch = batches.get(p.name)
                if batch is None:
                    batch = batches[p.name] = _Batch(p, timeout_s, registry)
                ob = obligations[i]
                answers.put((p.name, i, batch.solve(ob, budgets.get(ob.digest))))
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            answers.put((None, None, e))
        finally:
            for batch in batches.values():
                batch.close()

    threads = [threading.Thread(target=worker, name=f"tvsmt-solver-{k}", daemon=True)
               for k in range(workers)]
    for t in threads:
        t.start()
    try:
        for _ in range(len(work)):
            name, i, got = answers.get()
            if name is None:
                raise got
            deliver(name, [(i, got)])
    except BaseException:
        stop.set()
        registry.cancel_and_kill()  # a thread waiting on its solver gets an answer now
        raise
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


def solve_all(obligations: Iterable[Obligation], solver: "str | Profile" = "z3",
              jobs: int | None = None, timeout_s: float | None = 60,
              backend: str = DEFAULT_BACKEND, scheduler=None, progress: Progress | None = None,
              *, chunk_size: int | None = None, budgets: Budgets = None) -> list[SolverResult]:
    """Solve every obligation with one solver, in parallel; results in input order.

    jobs: how many solvers at once (None = all cores / all Dask worker threads). backend:
    "threading" (threads of this process, one kept-alive solver each), a joblib backend
    ("loky", ...) or "dask", with `scheduler` an address
    ("tcp://host:8786") or a `distributed.Client` (None = the current default client).
    progress(index, result) is called in the caller's process as results arrive. Identical
    obligations (same digest) are solved once. `budgets` gives some obligations (by digest) a
    time limit of their own below `timeout_s`, in the same run.
    """
    obligations = list(obligations)
    profile = get_profile(solver)
    results: list[SolverResult | None] = [None] * len(obligations)

    def on_result(_name: str, i: int, res: SolverResult) -> None:
        results[i] = res
        if progress is not None:
            progress(i, res)

    _run(obligations, [profile], jobs=jobs, timeout_s=timeout_s, budgets=dict(budgets or {}),
         backend=backend, scheduler=scheduler, chunk_size=chunk_size, on_result=on_result)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Cross-checking.


def _brief(r: SolverResult) -> str:
    extra = f" ({r.message})" if r.message and r.status != SAT else ""
    return f"{r.solver} says {r.status}{extra}"


def reconcile(results: Sequence[SolverResult], *, strict: bool = False) -> SolverResult:
    """One verdict from several solvers' results on the same obligation.

    All agree -> that status. `sat` against `unsat` -> UNKNOWN ("solvers disagree: ...").
    Otherwise the decisive answer is kept (with strict=True it becomes UNKNOWN) and the other
    sides are named in `message`. The raw results are in `details`.
    """
    results = list(results)
    name = "+".join(r.solver for r in results)
    version = " ".join(f"{r.solver} {r.version}".strip() for r in results)
    seconds = sum(r.seconds for r in results)
    statuses = [r.status for r in results]
    decisive = {s for s in statuses if s in (SAT, UNSAT)}
    values = next((r.values for r in results if r.status == SAT and r.values), {})

    def make(status, message="", vals=None):
        return SolverResult(status=status, solver=name, version=version, seconds=seconds,
                            values=vals or {}, message=message, details=list(results))

    if len(set(statuses)) == 1:
        return make(statuses[0], "; ".join(_brief(r) for r in results if r.message)
                    if statuses[0] not in (SAT, UNSAT) else "", values)
    if len(decisive) == 2:
        return make(UNKNOWN, "solvers disagree: " + ", ".join(_brief(r) for r in results))
    if len(decisive) == 1:
        status = decisive.pop()
        others = ", ".join(_brief(r) for r in results if r.status != status)
        if strict:
            return make(UNKNOWN, f"not confirmed: {', '.join(_brief(r) for r in results)}")
        answered = ", ".join(r.solver for r in results if r.status == status)
        return make(status, f"only {answered} answered {status}; {others}", values)
    for status in (ERROR, TIMEOUT, UNKNOWN):
        if status in statuses:
            return make(status, "; ".join(_brief(r) for r in results))
    raise AssertionError(statuses)  # pragma: no cover


def crosscheck(obligations: Iterable[Obligation], solvers: Sequence["str | Profile"] = ("z3", "cvc5"),
               jobs: int | None = None, timeout_s: float | None = 60,
               backend: str = DEFAULT_BACKEND,
               scheduler=None, progress: Progress | None = None, *, strict: bool = False,
               chunk_size: int | None = None, budgets: Budgets = None) -> list[SolverResult]:
    """Run every solver on every obligation (all in one parallel run) and `reconcile`;
    `budgets` as for `solve_all`.

    progress(index, reconciled_result) is called once all solvers answered that obligation.
    """
    obligations = list(obligations)
    profiles = [get_profile(s) for s in solvers]
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise ValueError(f"crosscheck needs distinct solvers, got {names}")
    raw: list[dict[str, SolverResult]] = [{} for _ in obligations]
    results: list[SolverResult | None] = [None] * len(obligations)

    def on_result(name: str, i: int, res: SolverResult) -> None:
        raw[i][name] = res
        if len(raw[i]) == len(profiles):
            results[i] = reconcile([raw[i][n] for n in names], strict=strict)
            if progress is not None:
                progress(i, results[i])

    _run(obligations, profiles, jobs=jobs, timeout_s=timeout_s, budgets=dict(budgets or {}),
         backend=backend, scheduler=scheduler, chunk_size=chunk_size, on_result=on_result)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
