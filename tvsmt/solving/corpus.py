"""A content-addressed directory of SMT-LIB obligations and the verdicts recorded for them.

Layout of a corpus directory:

    <digest>.smt2     one obligation; `digest` = sha256 (hex) of the script body. An optional
                      header of `; tvsmt: <key>: <json>` comment lines (stage ids, plan
                      tensors, ...) comes first and is NOT hashed (see `split_header`).
    manifest.json     {"format": "tvsmt-corpus/2",
                       "pairs":    {plan pair: {stage id: digest}},
                       "verdicts": {digest: {solver: {"status", "seconds", "version",
                                                      "profile", "seal",
                                                      ["values"], ["message"]}}}}
    .tvsmt-key        32 random bytes: the key of the verdicts' seals
    .lock             taken (fcntl) around every read-merge-write of the manifest

Trust: a verdict is reused only if tvsmt wrote it (`seal` = HMAC-SHA256 under the corpus key
of the canonical entry: a hand-edited `sat` -> `unsat` breaks it), by a solver of the same
name, version and profile (sha256 of the profile file). Stage ids are kept per plan pair
(`pair_key`), so pairs sharing a corpus do not overwrite each other's maps, and `save`
merges this run's changes into the manifest found on disk under the lock, so concurrent runs
lose no verdict. A `tvsmt-corpus/1` manifest is read (its verdicts, unsealed, are not
trusted) and written back as version 2.

Every write goes to a temporary file in the same directory, then `os.replace`: a killed run
leaves whole files or none (at worst a stray `.tmp-*` file, ignored and swept on the next open
once older than an hour). Problems with the files are one-line `PlanError`s naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

from tvsmt.atomic import atomic_write as _atomic_write
from tvsmt.errors import PlanError
from tvsmt.solving.types import ERROR, SAT, TIMEOUT, UNKNOWN, UNSAT, Obligation, SolverResult

FORMAT = "tvsmt-corpus/2"
OLD_FORMATS = ("tvsmt-corpus/1",)
MANIFEST = "manifest.json"
KEY_FILE = ".tvsmt-key"
LOCK_FILE = ".lock"
LEGACY_PAIR = "(unknown pair, tvsmt-corpus/1)"
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


def pair_key(parallel_path: str) -> str:
    """The manifest key of a plan pair: the parallel plan file's absolute path (it names the
    pair; a name like `<generated ...>` is kept as is)."""
    return parallel_path if parallel_path.startswith("<") else os.path.abspath(parallel_path)


def seal(key: bytes, digest: str, solver: str, entry: dict) -> str:
    """HMAC-SHA256 of a verdict entry (without its seal), its digest and solver name."""
    body = {k: v for k, v in entry.items() if k != "seal"}
    text = json.dumps([digest, solver, body], sort_keys=True, ensure_ascii=True,
                      separators=(",", ":"), default=str)
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def _snapshot(pairs: dict, verdicts: dict) -> tuple[dict, dict]:
    return ({p: dict(m) for p, m in pairs.items()},
            {dg: {s: dict(v) for s, v in per.items()} for dg, per in verdicts.items()})


def _merge(base: dict, mine: dict, theirs: dict) -> dict:
    """Three-way merge by key: what we changed since `base` wins, the rest is `theirs`.
    A pair's stage map counts as one value (missing = empty)."""
    out = dict(theirs)
    for k in set(mine) | set(base):
        ours, was = mine.get(k), base.get(k)
        if ours == was or (not ours and not was):
            continue
        if ours is None:
            out.pop(k, None)
        else:
            out[k] = ours
    return out


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive advisory lock (fcntl.flock) held for the block."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, atomic writes only
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise PlanError(f"cannot lock the corpus: {e.strerror}", file=str(path)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _parse_manifest(path: Path) -> tuple[dict, dict]:
    """(pairs, verdicts) of a manifest file ({} and {} if there is none); a damaged one is a
    one-line PlanError that names the file and the way out (--fresh)."""
    if not path.exists():
        return {}, {}
    where = str(path)

    def bad(msg: str) -> PlanError:
        return PlanError(f"corrupt corpus manifest: {msg} (--fresh starts it over)", file=where)

    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise bad(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise bad("nested too deeply") from None
    except OSError as e:
        raise PlanError(f"cannot read corpus manifest: {e.strerror}", file=where) from None
    if not isinstance(data, dict):
        raise bad("top level is not an object")
    if data.get("format") in OLD_FORMATS:
        stages = data.get("stages", {})
        if not isinstance(stages, dict):
            raise bad("'stages' is not an object")
        pairs = {LEGACY_PAIR: stages}
    elif data.get("format") == FORMAT:
        pairs = data.get("pairs", {})
        if not isinstance(pairs, dict) or not all(isinstance(m, dict) for m in pairs.values()):
            raise bad("'pairs' is not an object of objects")
    else:
        raise bad(f"format is {data.get('format')!r}, expected {FORMAT!r}")
    for pair, stages in pairs.items():
        for sid, dg in stages.items():
            if not isinstance(dg, str) or not _DIGEST.match(dg):
                raise bad(f"stage {sid!r} maps to {dg!r}, not a sha256 digest")
    verdicts = data.get("verdicts", {})
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
                    or not isinstance(v.get("profile", ""), str)
                    or not isinstance(v.get("seal", ""), str)
                    or not isinstance(v.get("values", {}), dict)):
                raise bad(f"verdict of {solver!r} for {dg[:16]}... is malformed")
    return ({p: dict(m) for p, m in pairs.items()},
            {k: {s: dict(v) for s, v in per.items()} for k, per in verdicts.items()})


def atomic_write(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """The project's atomic write (tvsmt/atomic.py) with the corpus's temporary-file prefix,
    which `Corpus` sweeps on open; corpus files stay private to their owner (0600, as the
    seal key must)."""
    _atomic_write(path, data, prefix=TMP_PREFIX + Path(path).name + ".", fsync=fsync,
                  private=True)


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

    `pair`: the plan pair whose stages `add` maps (see `pair_key`); `stages` is that pair's
    stage id -> digest map, `pairs` all of them. `verdicts`: digest -> solver -> recorded
    verdict (dicts as in manifest.json). `fresh=True` starts over from a damaged manifest
    instead of refusing it.
    """

    def __init__(self, root: str | os.PathLike, *, create: bool = True, pair: str = "",
                 fresh: bool = False):
        self.root = Path(root)
        if not self.root.is_dir():
            if not create:
                raise PlanError("corpus directory not found", file=str(self.root))
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PlanError(f"cannot create corpus directory: {e.strerror}",
                                file=str(self.root)) from None
        self.pair = pair
        self.fresh = fresh
        self.pairs: dict[str, dict[str, str]] = {}
        self.verdicts: dict[str, dict[str, dict]] = {}
        self._sweep_stale_tmp()
        self.pairs, self.verdicts = self._read_manifest()
        self._base = _snapshot(self.pairs, self.verdicts)  # what we read: the merge base
        self._key = self._read_key()

    @property
    def stages(self) -> dict[str, str]:
        """Stage id -> digest for this corpus's `pair` (a live dict)."""
        return self.pairs.setdefault(self.pair, {})

    # -- paths -------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    @property
    def key_path(self) -> Path:
        return self.root / KEY_FILE

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
    def _read_manifest(self) -> tuple[dict, dict]:
        """(pairs, verdicts) as on disk; a damaged manifest is a one-line PlanError, or
        nothing at all with `fresh`."""
        try:
            return _parse_manifest(self.manifest_path)
        except PlanError:
            if self.fresh:
                return {}, {}
            raise

    def _read_key(self) -> bytes | None:
        try:
            key = self.key_path.read_bytes()
        except OSError:
            return None
        return key if len(key) >= 32 else None

    def _ensure_key(self) -> bytes:
        """The corpus's sealing key, created on first use (call with the lock held)."""
        key = self._read_key()
        if key is None:
            key = secrets.token_bytes(32)
            atomic_write(self.key_path, key, fsync=True)
            os.chmod(self.key_path, 0o600)
        self._key = key
        return key

    def save(self) -> None:
        """Merge our changes into the manifest on disk and write it atomically.

        Under an exclusive lock (`.lock`), the manifest is read again and every stage map and
        verdict that this object changed since it read the manifest replaces the one on disk;
        everything else is kept as found, so concurrent runs on one corpus lose nothing.
        Verdicts we wrote are sealed (see `seal`).
        """
        with _locked(self.root / LOCK_FILE):
            key = self._ensure_key()
            disk_pairs, disk_verdicts = self._read_manifest()
            base_pairs, base_verdicts = self._base
            pairs = _merge(base_pairs, self.pairs, disk_pairs)
            mine = {(dg, s): v for dg, per in self.verdicts.items() for s, v in per.items()}
            base = {(dg, s): v for dg, per in base_verdicts.items() for s, v in per.items()}
            theirs = {(dg, s): v for dg, per in disk_verdicts.items() for s, v in per.items()}
            changed = {k for k in set(mine) | set(base) if mine.get(k) != base.get(k)}
            merged = _merge(base, mine, theirs)
            verdicts: dict[str, dict[str, dict]] = {}
            for (dg, solver), entry in merged.items():
                if (dg, solver) in changed:
                    entry = dict(entry, seal=seal(key, dg, solver, entry))
                verdicts.setdefault(dg, {})[solver] = entry
            data = {"format": FORMAT,
                    "pairs": {p: dict(sorted(m.items())) for p, m in sorted(pairs.items()) if m},
                    "verdicts": {k: dict(sorted(v.items())) for k, v in sorted(verdicts.items())}}
            text = json.dumps(data, indent=1, sort_keys=False) + "\n"
            atomic_write(self.manifest_path, text.encode("utf-8"), fsync=True)
            self.pairs = {p: dict(m) for p, m in pairs.items()}
            self.verdicts = verdicts
            self._base = _snapshot(self.pairs, self.verdicts)

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
        """The stage ids (of every plan pair) mapped to `digest`."""
        return sorted({s for m in self.pairs.values() for s, d in m.items() if d == digest})

    # -- verdicts ----------------------------------------------------------------------------
    def record(self, digest: str, result: SolverResult) -> None:
        """Remember `result` as `result.solver`'s verdict on `digest` (call `save()` after)."""
        self.path_for(digest)  # validates the digest
        entry: dict = {"status": result.status, "seconds": round(float(result.seconds), 6),
                       "version": result.version, "profile": result.profile}
        if result.values:
            entry["values"] = {k: _value_to_json(v) for k, v in sorted(result.values.items())}
        if result.message:
            entry["message"] = result.message
        self.verdicts.setdefault(digest, {})[result.solver] = entry

    def refusal(self, digest: str, solver: str, *, version: str | None = None,
                profile: str | None = None) -> str | None:
        """Why the recorded verdict of `solver` on `digest` must not be reused (None: it may).

        Reasons: "none recorded", "not decisive" (a timeout or error is worth trying again),
        "changed outside tvsmt" (its seal does not match: hand-edited, or written by another
        tool or another corpus's key), "other version", "other profile" (same name, another
        profile file). `version`/`profile` (the profile's sha256) None: not compared.
        """
        entry = self.verdicts.get(digest, {}).get(solver)
        if entry is None:
            return "none recorded"
        if entry.get("status") not in (SAT, UNSAT):
            return "not decisive"
        if self._key is None or not hmac.compare_digest(
                str(entry.get("seal", "")), seal(self._key, digest, solver, entry)):
            return "changed outside tvsmt"
        if version is not None and entry.get("version", "") != version:
            return "other version"
        if profile is not None and entry.get("profile", "") != profile:
            return "other profile"
        return None

    def lookup(self, digest: str, solver: str, *, version: str | None = None,
               profile: str | None = None) -> SolverResult | None:
        """The recorded verdict of `solver` on `digest` if it may be reused (see `refusal`):
        decisive, sealed by tvsmt, and recorded by that solver version and profile."""
        if self.refusal(digest, solver, version=version, profile=profile) is not None:
            return None
        entry = self.verdicts[digest][solver]
        values = {k: _value_from_json(str(v)) for k, v in entry.get("values", {}).items()}
        return SolverResult(status=entry["status"], solver=solver,
                            version=entry.get("version", ""),
                            seconds=float(entry.get("seconds", 0.0)), values=values,
                            message=entry.get("message", ""), profile=entry.get("profile", ""))

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
        wanted = {d for m in self.pairs.values() for d in m.values()} | set(self.verdicts)
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
