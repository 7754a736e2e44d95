"""The project's one way to write a file: into a temporary file beside it, then `os.replace`.

Why: a run killed at any moment (Ctrl-C, SIGKILL, a full disk) must leave either the old file
or the whole new one under the name, never a half-written file that reads as complete. Plans,
reports, HTML pages and corpus files all go through here.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def partial_prefix(path: str | os.PathLike) -> str:
    """The name prefix of `path`'s temporary files: `.NAME.partial-PID-` (hidden, and the pid
    says whose it is when one is left behind by a killed process)."""
    return f".{Path(path).name}.partial-{os.getpid()}-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: str | os.PathLike, *, prefix: str | None = None, fsync: bool = True,
                private: bool = False) -> Iterator[IO[bytes]]:
    """A binary file that appears under `path` only when the `with` block ends normally; on
    any exception (KeyboardInterrupt included) the temporary file is removed and `path` is
    left as it was. `prefix` names the temporary file (default `partial_prefix(path)`). The
    file gets the permissions `open` would give it (the umask's), or 0600 when `private`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix or partial_prefix(path), dir=path.parent or ".")
    try:
        if not private:
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            yield fh
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write(path: str | os.PathLike, data: bytes, *, prefix: str | None = None,
                 fsync: bool = False, private: bool = False) -> None:
    """Write `data` to `path` atomically (see `atomic_file`)."""
    with atomic_file(path, prefix=prefix, fsync=fsync, private=private) as fh:
        fh.write(data)
