#!/usr/bin/env python3
"""One line per plan pair: its stages, its obligations and one hash over every stage's
obligation digest (or failure kind), encoded serially as `tvsmt verify` would encode them
(folded where the pair folds). Run it at two revisions and compare the lines: a change meant
to speed up the encoding must leave every obligation byte-identical.

    python scripts/obligation_digests.py DIR [DIR ...]

DIR holds single.json.gz and parallel.json.gz (default: the real plans of 8 to 128 ranks in
../shared/plans). Used for docs/performance.md's "fifth session" section.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TVSMT_FOLD_IN_CHILD", "never")  # the pair loaded here, then folded

from real_plans import SHARED_PLANS, folded_stages  # noqa: E402  (scripts/real_plans.py)

from tvsmt.encoding.obligations import encode_one  # noqa: E402
from tvsmt.ops.backend import SymbolicBackend  # noqa: E402
from tvsmt.timing import Timer  # noqa: E402

DEFAULT = ["llama3-ly2-dp2pp2tp2mb2", "llama3moe-ly2-dp2pp2tp2mb2", "mlp-ly2-dp2pp2tp2mb2",
           "moe-ly4-dp2pp2tp2mb2", "llama3-ly2-dp2pp8tp2mb2", "br0-llama3-ly1-dp2pp2tp2mb2",
           "llama3-ly2-dp4pp4tp8mb8", "moe-ly2-dp16pp2tp4mb16"]


def digest_line(folder: Path) -> str:
    single, parallel, stages = folded_stages(folder)
    be, h, obligations = SymbolicBackend.fresh(), hashlib.sha256(), 0
    for st in stages:
        out = encode_one(st, single, parallel, be, Timer())
        if out.obligation is not None:
            obligations += 1
            h.update(out.obligation.digest.encode())
        else:
            h.update(repr(("failure", out.failure.kind) if out.failure else None).encode())
    return f"{folder.name} stages {len(stages)} obligations {obligations} {h.hexdigest()[:16]}"


def main() -> None:
    folders = [Path(d) for d in sys.argv[1:]] or [SHARED_PLANS / n for n in DEFAULT]
    for folder in folders:
        print(digest_line(folder), flush=True)


if __name__ == "__main__":
    main()
