"""Reading a plan file of either form: which one it is (by name and content), and its reader.

A JSON document (`.json`, `.json.gz`) is decoded by `tvsmt.plan.reader`; JSON Lines
(`.jsonl`, `.jsonl.gz`) are read record by record by `tvsmt.plan.stream`, which builds on the
reader's checks. This module sits above both, so neither imports the other's caller.
"""

from __future__ import annotations

import os

from tvsmt.errors import PlanError
from tvsmt.plan import reader
from tvsmt.plan.model import Plan
from tvsmt.plan.numbering import arrow_meanwhile


def load_plan(path: str | os.PathLike, lazy: bool = False) -> Plan:
    """Read an execplan file in either form and validate it on its own (`lazy`: see
    `reader.decode_document`)."""
    path = os.fspath(path)
    try:
        with reader.open_binary(path) as f:
            head = f.peek(64)[:64] if hasattr(f, "peek") else b""
            if reader.is_stream(path, head):
                from tvsmt.plan.stream import read_stream  # its imports only when needed

                return read_stream(path, f)
            limit = reader.byte_limit(reader.PLAN_LIMIT_ENV, reader.DEFAULT_PLAN_LIMIT)
            gz = isinstance(f, reader.igzip.IGzipFile)
            importer = arrow_meanwhile(reader.text_size(path)) if gz else None
            try:
                text = reader.gunzip_whole(path, limit) if gz else None
                if text is None:
                    text = reader.read_document(path, f, limit)
            finally:
                if importer is not None:  # before decode_document forks
                    importer.join()
    except reader.READ_ERRORS as e:
        raise PlanError(f"cannot read plan: {reader.os_reason(e)}", file=path) from None
    return reader.decode_document(text, path, lazy)
