"""A content-addressed directory of SMT-LIB obligations and the verdicts recorded for them.

Layout of a corpus directory:

    <digest>.smt2     one obligation; `digest` = sha256 (hex) of the script body. An optional
                      header of `; tvsmt: <key>: <json>` comment lines (stage ids, plan
                      tensors, ...) comes first and is NOT hashed (see `split_header`).
    manifest.json     {"format": "tvsmt-corpus/1",
                       "stages":   {stage id: digest},
                       "verdicts": {digest: {solver: {"status", "seconds", "version",
                                                      ["values"], ["message"]}}}}

Every write goes to a temporary file in the same directory, then `os.replace`: a killed run
leaves whole files or none (at worst a stray `.tmp-*` file, ignored and swept on the next open
once older than an hour). Problems with the files are one-line `PlanError`s naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

from tvsmt.errors import PlanError
from tvsmt.solving.types import ERROR, SAT, TIMEOUT, UNKNOWN, UNSAT, Obligation, SolverResult

FORMAT = "tvsmt-corpus/1"
MANIFEST = "manifest.json"
HEADER_PREFIX = "; tvsmt: "
SUFFIX = ".smt2"
TMP_PREFIX = ".tmp-"
STATUSES = (UNSAT, SAT, UNKNOWN, TIMEOUT, ERROR)
_DIGEST = re.compile(r"[0-9a-f]{64}\Z")
_STALE_TMP_SECONDS = 3600


def digest_of(body: str) -> str:
    """The digest of a script body: sha256 hex of its UTF-8 bytes."""
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def make_header(meta: dict) -> str:
    """Header lines for `meta` (one `; tvsmt: key: json` line per item, in key order)."""
    lines = []
    for key in sorted(meta):
        skey = str(key).replace("\n", " ").replace(":", "_")
        value = json.dumps(meta[key], sort_keys=True, ensure_ascii=True, default=str)
        lines.append(f"{HEADER_PREFIX}{skey}: {value}\n")
    return "".join(lines)


def split_header(text: str) -> tuple[dict, str]:
    """(meta, body): the leading `; tvsmt: ` lines parsed into a dict, and the rest (hashed).

    A header value that is not JSON is kept as its raw text.
    """
    meta: dict = {}
    pos = 0
    while text.startswith(HEADER_PREFIX, pos):
        end = text.find("\n", pos)
        line = text[pos + len(HEADER_PREFIX):] if end < 0 else text[pos + len(HEADER_PREFIX):end]
        pos = len(text) if end < 0 else end + 1
        key, sep, raw = line.partition(": ")
        if not sep:
            key, raw = line.rstrip(":"), ""
        try:
            meta[key] = json.loads(raw)
        except ValueError:
            meta[key] = raw
    return meta, text[pos:]


def atomic_write(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """Write `data` to `path` via a temporary file in the same directory and `os.replace`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
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


@dataclass
class FileProblem:
    """A corpus file that does not match the manifest or its own name."""

    path: str
    problem: str          # "hash mismatch", "missing", "unreadable", "bad name"
    expected: str = ""    # digest from the name / the manifest
    actual: str = ""      # digest of the body as found

    def __str__(self) -> str:
        extra = f" (body hashes to {self.actual[:16]}...)" if self.actual else ""
        return f"{self.path}: {self.problem}{extra}"


def _value_to_json(v) -> str:
    return str(v)


def _value_from_json(s: str) -> Fraction | str:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return s


class Corpus:
    """A corpus directory (created if missing). Call `save()` to write the manifest.

    `stages`: stage id -> digest; `verdicts`: digest -> solver -> recorded verdict (dicts as
    in manifest.json).
    """

    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        self.root = Path(root)
        if not self.root.is_dir():
            if not create:
                raise PlanError("corpus directory not found", file=str(self.root))
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PlanError(f"cannot create corpus directory: {e.strerror}",
                                file=str(self.root)) from None
        self.stages, self.verdicts = {}, {}
        self._sweep_stale_tmp()
        self._load_manifest()

    # -- paths -------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def path_for(self, digest: str) -> Path:
        if not _DIGEST.match(digest):
            raise ValueError(f"not a sha256 hex digest: {digest!r}")
        return self.root / f"{digest}{SUFFIX}"

    def digests(self) -> list[str]:
        """Digests of the .smt2 files present (sorted)."""
        return sorted(p.name[:-len(SUFFIX)] for p in self.root.glob("*" + SUFFIX)
                      if _DIGEST.match(p.name[:-len(SUFFIX)]))

    def _sweep_stale_tmp(self) -> None:
        now = time.time()
        for p in self.root.glob(TMP_PREFIX + "*"):
            try:
                if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                    p.unlink()
            except OSError:
                pass

    # -- manifest ----------------------------------------------------------------------------
    def _load_manifest(self) -> None:
        path = self.manifest_path
        if not path.exists():
            return
        where = str(path)
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise PlanError("corrupt corpus manifest: not UTF-8 text", file=where) from None
        except json.JSONDecodeError as e:
            raise PlanError(f"corrupt corpus manifest: {e.msg} at line {e.lineno} column "
                            f"{e.colno}", file=where) from None
        except OSError as e:
            raise PlanError(f"cannot read corpus manifest: {e.strerror}", file=where) from None

        def bad(msg: str) -> PlanError:
            return PlanError(f"corrupt corpus manifest: {msg}", file=where)

        if not isinstance(data, dict):
            raise bad("top level is not an object")
        if data.get("format") != FORMAT:
            raise bad(f"format is {data.get('format')!r}, expected {FORMAT!r}")
        stages, verdicts = data.get("stages", {}), data.get("verdicts", {})
        if not isinstance(stages, dict):
            raise bad("'stages' is not an object")
        for sid, dg in stages.items():
            if not isinstance(dg, str) or not _DIGEST.match(dg):
                raise bad(f"stage {sid!r} maps to {dg!r}, not a sha256 digest")
        if not isinstance(verdicts, dict):
            raise bad("'verdicts' is not an object")
        for dg, per_solver in verdicts.items():
            if not _DIGEST.match(dg):
                raise bad(f"verdict key {dg!r} is not a sha256 digest")
            if not isinstance(per_solver, dict):
                raise bad(f"verdicts of {dg[:16]}... are not an object")
            for solver, v in per_solver.items():
                if (not isinstance(v, dict) or v.get("status") not in STATUSES
                        or not isinstance(v.get("seconds", 0), (int, float))
                        or not isinstance(v.get("version", ""), str)
                        or not isinstance(v.get("values", {}), dict)):
                    raise bad(f"verdict of {solver!r} for {dg[:16]}... is malformed")
        self.stages, self.verdicts = dict(stages), {k: dict(v) for k, v in verdicts.items()}

    def save(self) -> None:
        """Write manifest.json atomically (sorted keys: stable, diff-friendly)."""
        data = {"format": FORMAT, "stages": dict(sorted(self.stages.items())),
                "verdicts": {k: dict(sorted(v.items())) for k, v in sorted(self.verdicts.items())}}
        text = json.dumps(data, indent=1, sort_keys=False) + "\n"
        atomic_write(self.manifest_path, text.encode("utf-8"), fsync=True)

    # -- obligations -------------------------------------------------------------------------
    def add(self, ob: Obligation, stage_ids: Iterable[str] = (), header: dict | None = None
            ) -> Path:
        """Store `ob` as <digest>.smt2 (if not already there) and map `stage_ids` to it.

        `header` (default: `ob.meta`) is written as `; tvsmt:` comment lines before the body.
        """
        body = ob.smt2
        if digest_of(body) != ob.digest:
            raise ValueError(f"obligation digest {ob.digest[:16]}... is not the sha256 of its "
                             f"script")
        if body.startswith(HEADER_PREFIX):
            raise ValueError("a script body must not start with the header prefix "
                             f"{HEADER_PREFIX!r}")
        path = self.path_for(ob.digest)
        data = (make_header(ob.meta if header is None else header) + body).encode("utf-8")
        try:
            current = path.read_bytes()
        except OSError:
            current = None
        if current != data:  # new, edited/damaged, or a different header: (re)write
            atomic_write(path, data)
        for sid in stage_ids:
            self.stages[str(sid)] = ob.digest
        return path

    def read_text(self, digest: str) -> str:
        path = self.path_for(digest)
        try:
            return path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise PlanError("obligation file missing from corpus", file=str(path)) from None
        except UnicodeDecodeError:
            raise PlanError("corrupt obligation file: not UTF-8 text", file=str(path)) from None
        except OSError as e:
            raise PlanError(f"cannot read obligation file: {e.strerror}", file=str(path)) from None

    def read(self, digest: str, *, check: bool = True) -> Obligation:
        """The obligation stored under `digest` (its header as `meta`, `query` from the
        header key `query` or the script's trailing get-value)."""
        meta, body = split_header(self.read_text(digest))
        if check and digest_of(body) != digest:
            raise PlanError("corrupt obligation file: its content does not match its name "
                            "(edited?)", file=str(self.path_for(digest)))
        query = meta.get("query")
        if not (isinstance(query, list) and all(isinstance(q, str) for q in query)):
            query = _query_of(body)
        return Obligation(digest=digest, smt2=body, query=tuple(query), meta=meta)

    def obligations(self, *, check: bool = True) -> Iterator[Obligation]:
        for dg in self.digests():
            yield self.read(dg, check=check)

    def stage_ids(self, digest: str) -> list[str]:
        return sorted(s for s, d in self.stages.items() if d == digest)

    # -- verdicts ----------------------------------------------------------------------------
    def record(self, digest: str, result: SolverResult) -> None:
        """Remember `result` as `result.solver`'s verdict on `digest` (call `save()` after)."""
        self.path_for(digest)  # validates the digest
        entry: dict = {"status": result.status, "seconds": round(float(result.seconds), 6),
                       "version": result.version}
        if result.values:
            entry["values"] = {k: _value_to_json(v) for k, v in sorted(result.values.items())}
        if result.message:
            entry["message"] = result.message
        self.verdicts.setdefault(digest, {})[result.solver] = entry

    def lookup(self, digest: str, solver: str, *, version: str | None = None,
               decisive_only: bool = True) -> SolverResult | None:
        """The recorded verdict of `solver` on `digest`, for incremental runs.

        decisive_only: only `sat`/`unsat` (a timeout or error is worth trying again).
        version: if given, only a verdict recorded with that solver version.
        """
        entry = self.verdicts.get(digest, {}).get(solver)
        if entry is None:
            return None
        if decisive_only and entry["status"] not in (SAT, UNSAT):
            return None
        if version is not None and entry.get("version", "") != version:
            return None
        values = {k: _value_from_json(str(v)) for k, v in entry.get("values", {}).items()}
        return SolverResult(status=entry["status"], solver=solver,
                            version=entry.get("version", ""),
                            seconds=float(entry.get("seconds", 0.0)), values=values,
                            message=entry.get("message", ""))

    # -- integrity ---------------------------------------------------------------------------
    def verify_files(self) -> list[FileProblem]:
        """Files whose body no longer hashes to their name, unreadable files, and digests the
        manifest mentions that have no file. Empty list = all good."""
        problems: list[FileProblem] = []
        present = set()
        for p in sorted(self.root.glob("*" + SUFFIX)):
            name = p.name[:-len(SUFFIX)]
            if not _DIGEST.match(name):
                problems.append(FileProblem(str(p), "bad name (not <sha256>.smt2)"))
                continue
            present.add(name)
            try:
                _, body = split_header(p.read_bytes().decode("utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                problems.append(FileProblem(str(p), f"unreadable ({type(e).__name__})", name))
                continue
            actual = digest_of(body)
            if actual != name:
                problems.append(FileProblem(str(p), "hash mismatch", name, actual))
        wanted = set(self.stages.values()) | set(self.verdicts)
        for dg in sorted(wanted - present):
            problems.append(FileProblem(str(self.path_for(dg)), "missing", dg))
        return problems


_GET_VALUE = re.compile(r"\(get-value\s*\(([^()]*)\)\s*\)\s*(?:\(exit\)\s*)?\Z")


def _query_of(body: str) -> list[str]:
    m = _GET_VALUE.search(body.rstrip())
    if not m:
        return []
    syms = re.findall(r"\|[^|]*\||[^\s|]+", m.group(1))
    return [s[1:-1] if s.startswith("|") else s for s in syms]
