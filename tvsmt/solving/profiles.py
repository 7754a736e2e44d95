"""Declarative solver profiles (`<name>.toml`): how to find, run and read a solver.

A profile is looked up by name in the directories of `$TVSMT_SOLVERS_DIR` (os.pathsep-separated,
searched first) and then among the built-in profiles, package data in `tvsmt/solvers/` (so a
non-editable `pip install` has them too); a path to a `.toml` file is also accepted.
Adding a solver = adding a profile. Format: tvsmt/solvers/README.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
import math
import os
import re
import shutil
import string
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tvsmt.errors import PlanError

#: the built-in profiles: package data of `tvsmt` (found wherever the package is installed)
BUILTIN_DIR = Path(str(importlib.resources.files("tvsmt") / "solvers"))
#: how to find profiles, for `--help` texts and error messages
LOOKUP_HELP = ("a profile name is looked up in $TVSMT_SOLVERS_DIR (os.pathsep-separated "
               "folders of NAME.toml files), then among the built-in profiles (z3, cvc5, "
               "cvc5-bin); a path to a .toml file is read as is")

#: placeholders allowed in commands; "{options}" must be a whole list element (it is spliced)
PLACEHOLDERS = frozenset({"bin", "python", "python_dir", "file", "timeout_s", "timeout_ms",
                          "options"})
MODES = ("keepalive", "fresh")


class ProfileError(PlanError):
    """A malformed or unusable solver profile (one line, naming the file)."""


@dataclass(frozen=True)
class Profile:
    name: str
    source: str                              # the .toml file it was read from
    description: str = ""
    search: tuple[str, ...] = ()
    python_module: str | None = None
    version_command: tuple[str, ...] = ()
    version_regex: str = r"version ([0-9][0-9.]*)"
    options: tuple[str, ...] = ()
    file_command: tuple[str, ...] = ()
    stdin_command: tuple[str, ...] | None = None
    reset: str = "(reset)"
    mode: str = "keepalive"
    error_markers: tuple[str, ...] = ("(error",)
    timeout_words: tuple[str, ...] = ("timeout",)
    env: tuple[tuple[str, str], ...] = field(default=())
    #: sha256 of the profile file's bytes: a corpus verdict is reused only by the same profile
    digest: str = ""

    @property
    def keepalive(self) -> bool:
        return self.mode == "keepalive" and self.stdin_command is not None


def search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("TVSMT_SOLVERS_DIR", "").split(os.pathsep) if p]
    dirs.append(BUILTIN_DIR)
    return dirs


def _fail(path: Path | str, msg: str) -> ProfileError:
    return ProfileError(f"invalid solver profile: {msg}", file=str(path))


def _str_list(path, table: dict, key: str, where: str, required: bool = False,
              default=()) -> tuple[str, ...]:
    if key not in table:
        if required:
            raise _fail(path, f"missing [{where}] {key}")
        return tuple(default)
    val = table[key]
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        raise _fail(path, f"[{where}] {key} must be a list of strings")
    return tuple(val)


def _str(path, table: dict, key: str, where: str, default=None, required=False):
    if key not in table:
        if required:
            raise _fail(path, f"missing [{where}] {key}")
        return default
    if not isinstance(table[key], str):
        raise _fail(path, f"[{where}] {key} must be a string")
    return table[key]


def _check_command(path, cmd: tuple[str, ...], where: str, needs_file: bool) -> None:
    if not cmd:
        raise _fail(path, f"[run] {where} must not be empty")
    fmt = string.Formatter()
    seen_file = False
    for item in cmd:
        try:
            fields = [f for _, f, _, _ in fmt.parse(item) if f is not None]
        except ValueError as e:
            raise _fail(path, f"[run] {where}: bad placeholder in {item!r} ({e})") from None
        for f in fields:
            if f not in PLACEHOLDERS:
                raise _fail(path, f"[run] {where}: unknown placeholder {{{f}}} "
                                  f"(known: {', '.join(sorted(PLACEHOLDERS))})")
            if f == "options" and item != "{options}":
                raise _fail(path, f"[run] {where}: {{options}} must be a list element of its own")
            seen_file |= f == "file"
    if needs_file and not seen_file:
        raise _fail(path, f"[run] {where} must contain {{file}}")
    if not needs_file and seen_file:
        raise _fail(path, f"[run] {where} reads stdin and must not contain {{file}}")


_KNOWN = {
    "": {"name", "description", "binary", "run", "output"},
    "binary": {"search", "python_module", "version_command", "version_regex"},
    "run": {"options", "file", "stdin", "reset", "mode", "env"},
    "output": {"error_markers", "timeout_words"},
}


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate one profile file; any problem is a one-line `ProfileError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise _fail(path, "file not found") from None
    except IsADirectoryError:
        raise _fail(path, "is a directory") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    for section, keys in _KNOWN.items():
        table = data if not section else data.get(section, {})
        if not isinstance(table, dict):
            raise _fail(path, f"[{section}] must be a table")
        unknown = set(table) - keys
        if unknown:
            raise _fail(path, f"unknown key(s) in [{section or 'top level'}]: "
                              f"{', '.join(sorted(unknown))}")
    binary, run, output = data.get("binary", {}), data.get("run", {}), data.get("output", {})

    name = _str(path, data, "name", "top level", default=path.stem)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name):
        raise _fail(path, f"name {name!r} must be a simple identifier")
    search = _str_list(path, binary, "search", "binary", required=True)
    if not search:
        raise _fail(path, "[binary] search must not be empty")
    version_command = _str_list(path, binary, "version_command", "binary")
    version_regex = _str(path, binary, "version_regex", "binary",
                         default=r"version ([0-9][0-9.]*)")
    try:
        re.compile(version_regex)
    except re.error as e:
        raise _fail(path, f"[binary] version_regex: {e}") from None
    file_cmd = _str_list(path, run, "file", "run", required=True)
    _check_command(path, file_cmd, "file", needs_file=True)
    stdin_cmd = _str_list(path, run, "stdin", "run") or None
    if stdin_cmd is not None:
        _check_command(path, stdin_cmd, "stdin", needs_file=False)
    if version_command:
        _check_command(path, version_command, "version_command", needs_file=False)
    mode = _str(path, run, "mode", "run", default="keepalive" if stdin_cmd else "fresh")
    if mode not in MODES:
        raise _fail(path, f"[run] mode must be one of {', '.join(MODES)}, not {mode!r}")
    env = run.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise _fail(path, "[run] env must be a table of strings")
    return Profile(
        name=name,
        source=str(path),
        description=_str(path, data, "description", "top level", default=""),
        search=search,
        python_module=_str(path, binary, "python_module", "binary"),
        version_command=version_command,
        version_regex=version_regex,
        options=_str_list(path, run, "options", "run"),
        file_command=file_cmd,
        stdin_command=stdin_cmd,
        reset=_str(path, run, "reset", "run", default="(reset)"),
        mode=mode,
        error_markers=_str_list(path, output, "error_markers", "output", default=("(error",)),
        timeout_words=_str_list(path, output, "timeout_words", "output", default=("timeout",)),
        env=tuple(sorted(env.items())),
        digest=hashlib.sha256(raw).hexdigest(),
    )


def profile_files() -> dict[str, Path]:
    """name (file stem) -> profile file, first search directory wins."""
    found: dict[str, Path] = {}
    for d in search_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.toml")):
                found.setdefault(p.stem, p)
    return found


def get_profile(solver: "str | os.PathLike | Profile") -> Profile:
    """A profile by name (`"z3"`), by path to a .toml file, or a `Profile` as is."""
    if isinstance(solver, Profile):
        return solver
    text = os.fspath(solver)
    if text.endswith(".toml") or os.sep in text:
        return load_profile(text)
    files = profile_files()
    if text not in files:
        raise ProfileError(f"unknown solver {text!r} (profiles: {', '.join(sorted(files)) or 'none'}"
                           f" in {', '.join(str(d) for d in search_dirs())})")
    return load_profile(files[text])


def _placeholders(profile: Profile, binary: str = "") -> dict[str, str]:
    return {"bin": binary, "python": sys.executable,
            "python_dir": os.path.dirname(sys.executable)}


def find_binary(profile: Profile) -> str | None:
    """The first `search` entry that exists (None if the solver is not available here)."""
    if profile.python_module and importlib.util.find_spec(profile.python_module) is None:
        return None
    values = _placeholders(profile)
    for cand in profile.search:
        try:
            cand = cand.format(**values)
        except (KeyError, IndexError, ValueError):
            raise _fail(profile.source, f"[binary] search: bad placeholder in {cand!r}") from None
        if os.sep in cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
        else:
            hit = shutil.which(cand)
            if hit:
                return hit
    return None


def require_binary(profile: Profile) -> str:
    binary = find_binary(profile)
    if binary is None:
        what = f"Python module {profile.python_module!r} or " if profile.python_module else ""
        raise ProfileError(f"solver {profile.name!r} is not available: no {what}binary found "
                           f"(searched {', '.join(profile.search)})", file=profile.source)
    return binary


def backstop_seconds(timeout_s: float | None) -> int:
    """The solver's own time limit for a runner timeout of `timeout_s` seconds."""
    if timeout_s is None or timeout_s <= 0 or math.isinf(timeout_s):
        return 86400
    return math.ceil(1.5 * timeout_s + 1)


def build_command(profile: Profile, which: str, binary: str, *, file: str | None = None,
                  timeout_s: float | None = None) -> list[str]:
    """Expand the `file`/`stdin`/`version_command` command of a profile into argv.

    `{timeout_s}`/`{timeout_ms}` receive the solver's own limit, a backstop set to
    1.5 x `timeout_s` + 1 s (whole seconds): the runner kills the process at `timeout_s`, and
    the backstop only stops a solver whose runner died. No timeout: one day.
    """
    cmd = {"file": profile.file_command, "stdin": profile.stdin_command,
           "version": profile.version_command}[which]
    if cmd is None:
        raise ProfileError(f"solver {profile.name!r} has no [run] {which} command",
                           file=profile.source)
    values = _placeholders(profile, binary)
    limit = backstop_seconds(timeout_s)
    values.update(file=file or "", timeout_s=str(limit), timeout_ms=str(limit * 1000))
    argv: list[str] = []
    for item in cmd:
        if item == "{options}":
            argv.extend(profile.options)
        else:
            argv.append(item.format(**values))
    return argv


def child_env(profile: Profile) -> dict[str, str]:
    """Environment of solver processes: ours, the profile's `env`, and `tvsmt` importable
    (for shims run with `python -m`)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(profile.env)
    return env


@functools.lru_cache(maxsize=None)
def _version(profile: Profile, binary: str) -> str:
    if not profile.version_command:
        return ""
    argv = build_command(profile, "version", binary)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                             env=child_env(profile), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(profile.version_regex, out.stdout + out.stderr)
    return (m.group(1) if m.groups() else m.group(0)) if m else ""


def solver_version(profile: "Profile | str") -> str:
    """Version string of the solver (cached per process); "" if it cannot be determined."""
    profile = get_profile(profile)
    binary = find_binary(profile)
    if binary is None:
        return ""
    return _version(profile, binary)


def available_solvers() -> list[str]:
    """Names of the profiles whose solver can run on this machine."""
    names = []
    for name, path in profile_files().items():
        if find_binary(load_profile(path)) is not None:  # a malformed profile raises
            names.append(name)
    return sorted(names)
