"""The capture script convention: a user's Python file (or module) that defines the training
step twice, once on one device and once per rank (see docs/capture.md).

The script is the user's own code and runs in this process; nothing else of theirs is loaded
(no pickles).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from tvsmt.errors import InputError


@dataclass
class CaptureScript:
    """What a capture script defines (`WORLD_SIZE`, `build_single`, `build_rank`,
    `train_step`, optional `single_step` and `PARAM_SHARDING`)."""

    path: str
    world_size: int
    build_single: Callable[[], Any]
    build_rank: Callable[[int], Any]
    train_step: Callable[[Any, Any], Any]
    single_step: Callable[[Any, Any], Any]
    param_sharding: dict[str, Any] = field(default_factory=dict)
    module: types.ModuleType | None = None


def _module_from_file(path: str) -> types.ModuleType:
    if not os.path.isfile(path):
        raise InputError("no such capture script", file=path)
    name = "tvsmt_capture_" + "".join(c if c.isalnum() else "_" for c in
                                     os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError("cannot load this file as Python", file=path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling-free introspection need it
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise InputError(f"syntax error at line {e.lineno}: {e.msg}", file=path) from None
    except (Exception, SystemExit) as e:  # the script's own code failed as it was imported
        raise user_code_failed(e, "importing the script", path) from None
    return module


def user_code_failed(e: BaseException, doing: str, path: str, where: str = "",
                     why: str | None = None) -> InputError:
    """The one-line input error for an exception the user's own code raised while tvsmt ran
    it (importing the script, building a model, tracing the step): the user's source line
    and the exception, never "a bug in tvsmt". `where`: the rank it ran for, named first as
    the capture's other errors do ("rank 1 at train.py:13: ..."); `why`: what the failure
    means, said instead of the exception's own text."""
    if isinstance(e, InputError):
        return e
    if why is not None:
        what = why
    elif isinstance(e, SystemExit):
        what = f"the script called sys.exit({e.code!r})"
    else:
        text = str(e).splitlines()[0] if str(e) else ""
        what = f"{type(e).__name__}: {text}" if text else type(e).__name__
    at = _user_line(e, path)
    message = f"{where}{at}: {doing} failed: {what}" if where else f"{doing} failed{at}: {what}"
    return InputError(message, file=path)


def _user_line(e: BaseException, script_path: str) -> str:
    """' at file:line' of the innermost frame of the user's script in an exception."""
    import traceback

    mine = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == script_path]
    if not mine:
        return ""
    shown = os.path.relpath(mine[-1].filename)
    return f" at {shown if not shown.startswith('..') else mine[-1].filename}:{mine[-1].lineno}"


def load_script(script: str | os.PathLike | types.ModuleType) -> CaptureScript:
    """Load a capture script from a file path or an already imported module."""
    if isinstance(script, types.ModuleType):
        module = script
        path = os.path.abspath(getattr(module, "__file__", None) or module.__name__)
    else:
        path = os.path.abspath(os.fspath(script))
        module = _module_from_file(path)

    def need(name: str, kind: str):
        value = getattr(module, name, None)
        if value is None:
            raise InputError(f"the capture script must define {name} ({kind})", file=path)
        return value

    world = need("WORLD_SIZE", "the number of ranks")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InputError(f"WORLD_SIZE must be a positive int, not {world!r}", file=path)
    fns = {n: need(n, "a function") for n in ("build_single", "build_rank", "train_step")}
    for n, f in fns.items():
        if not callable(f):
            raise InputError(f"{n} must be a function", file=path)
    single_step = getattr(module, "single_step", None) or fns["train_step"]
    sharding = getattr(module, "PARAM_SHARDING", None) or {}
    if not isinstance(sharding, dict):
        raise InputError("PARAM_SHARDING must be a dict: parameter name -> sharding", file=path)
    return CaptureScript(path, world, fns["build_single"], fns["build_rank"], fns["train_step"],
                         single_step, dict(sharding), module)
