"""Finding the processes a test started, however deep and wherever they were re-parented:
each carries a tag in its environment (children inherit it)."""

from __future__ import annotations

import psutil


def tagged(variable: str, tag: str) -> list[psutil.Process]:
    """Every live process (not a zombie: it has ended) whose environment has `variable` =
    `tag`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(variable) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def command_line(p: psutil.Process) -> str:
    """The process's command line, or "" once it is gone."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""
