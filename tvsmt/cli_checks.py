"""Validation of the command line's options, before any work starts.

A bad option is refused at once with a usage error (exit 2): a NaN or negative timeout would
otherwise reach the solver runner, and a Dask scheduler address where nothing listens would
only fail after distributed's 30 s connect timeout, with an OSError.
"""

from __future__ import annotations

import importlib.util
import math
import socket
from urllib.parse import urlsplit

import click

from tvsmt.errors import InputError
from tvsmt.textsafe import plain

SCHEDULER_PROBE_SECONDS = 3.0
DASK_DEFAULT_PORT = 8786
_TCP_SCHEMES = ("tcp", "tls", "ws", "wss")


class Seconds(click.ParamType):
    """A finite, non-negative number of seconds; 0 means no limit."""

    name = "SECONDS"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            try:
                seconds = float(str(value).strip())
            except ValueError:
                self.fail(f"{plain(value)!s} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{plain(value)} is not a finite number of seconds (0 means no limit)",
                      param, ctx)
        if seconds < 0:
            self.fail(f"{plain(value)} is negative (give 0 for no limit)", param, ctx)
        return seconds


def check_backend(backend: str, scheduler: str | None) -> None:
    """`--backend dask` needs a reachable `--scheduler`; `--scheduler` needs dask."""
    if backend != "dask":
        if scheduler:
            raise click.UsageError("--scheduler is only used with --backend dask")
        return
    if not scheduler:
        raise click.UsageError("--backend dask needs --scheduler ADDRESS")
    if importlib.util.find_spec("distributed") is None:
        raise InputError("--backend dask needs the dask extra: pip install 'tvsmt[dask]'")
    probe_scheduler(scheduler)


def scheduler_endpoint(address: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of a TCP-based scheduler address, None for other transports
    (ucx, ...) that cannot be probed with a socket; a usage error if it cannot be parsed."""
    text = address.strip()
    if "://" not in text:
        text = "tcp://" + text
    try:
        parts = urlsplit(text)
    except ValueError:
        raise click.UsageError(f"--scheduler {plain(address)}: expected tcp://HOST:PORT") \
            from None
    scheme = parts.scheme.lower()
    if scheme == "inproc":
        raise click.UsageError(f"--scheduler {plain(address)}: an inproc:// address exists "
                               "only inside one Python process; give tcp://HOST:PORT")
    if scheme not in _TCP_SCHEMES:
        return None
    try:
        port = parts.port or DASK_DEFAULT_PORT
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise click.UsageError(f"--scheduler {plain(address)}: expected tcp://HOST:PORT")
    return scheme, parts.hostname, port


def probe_scheduler(address: str, seconds: float = SCHEDULER_PROBE_SECONDS) -> None:
    """Ask the scheduler who it is, within `seconds`: an InputError in a few seconds when
    nothing (or something other than a Dask scheduler) answers there, instead of an OSError
    or a hang after distributed's 30 s connect timeout. A bare TCP connect is not enough: a
    firewall or proxy may accept any connection and never answer."""
    endpoint = scheduler_endpoint(address)
    if endpoint is None:
        return
    scheme, host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=seconds):
            pass
    except socket.timeout:
        raise InputError(f"no Dask scheduler answered at {plain(address)} within {seconds:g} s "
                         "(is `dask scheduler` running there?)") from None
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise InputError(f"cannot reach the Dask scheduler at {plain(address)}: {why} "
                         "(is `dask scheduler` running there?)") from None
    try:
        who = _identity(f"{scheme}://{host}:{port}", seconds)
    except Exception as e:  # the peer spoke something else, or nothing in time
        why = "no answer" if isinstance(e, TimeoutError) else "not the Dask protocol"
        raise InputError(f"no Dask scheduler answered at {plain(address)} within {seconds:g} s "
                         f"({why})") from None
    if not (isinstance(who, dict) and who.get("type") == "Scheduler"):
        raise InputError(f"{plain(address)} is not a Dask scheduler (it is "
                         f"{plain(who.get('type') if isinstance(who, dict) else who)})")


def _identity(address: str, seconds: float):
    """The `identity` answer of a Dask server (distributed's own comm layer and handshake)."""
    import asyncio

    from distributed.comm import connect

    async def ask():
        comm = await connect(address, timeout=seconds)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    async def bounded():
        return await asyncio.wait_for(ask(), seconds)

    return asyncio.run(bounded())
