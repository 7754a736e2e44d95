#!/usr/bin/env python3
"""What each part of a large plan document costs to decode, as the two loading processes
decode it (tvsmt/plan/reader.py's reading process: schema.HeadPlan; the forked numbering,
tvsmt/plan/numbering.py: schema.NamesPlan): the measurements behind docs/performance.md's
"2026-12-05, late" section.

    python scripts/bench_decode_parts.py [DIR] [--repeat 3]

DIR (default ../shared/plans/moe-ly2-dp16pp2tp4mb16) holds parallel.json.gz. Per way, the
fastest of `--repeat` msgspec decodes of the whole text, the cyclic collector off (as the
reader runs). A part's cost is a way's time less `skip` (decoding nothing: scanning the text).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvsmt.plan import schema as S  # noqa: E402
from tvsmt.plan.model import TensorInfo  # noqa: E402
from tvsmt.plan.reader import gunzip_whole  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "plans" / "moe-ly2-dp16pp2tp4mb16"


class Skip(msgspec.Struct):
    pass


class TensorIds(msgspec.Struct):
    tensors: dict[str, S._NoFields]


class Tensors(msgspec.Struct):
    tensors: dict[str, TensorInfo]


class HeadNodes(msgspec.Struct):
    nodes: list[S.HeadNode]


class _NodeNoId(msgspec.Struct, gc=False):
    op: str
    rank: int = 0
    mb: int = 0


class HeadNodesNoId(msgspec.Struct):
    nodes: list[_NodeNoId]


class HeadLineages(msgspec.Struct):
    lineages: list[S.HeadLineage]


class HeadWithoutTensors(S.HeadPlan):
    tensors: msgspec.Raw


WAYS = [
    ("skip", Skip, "nothing decoded: the floor"),
    ("tensor ids", TensorIds, "the tensor table's keys"),
    ("tensors", Tensors, "the tensor table as the reader decodes it (TensorInfo)"),
    ("node heads", HeadNodes, "nodes without their names (schema.HeadNode)"),
    ("node heads, no id", HeadNodesNoId, "the same without the node ids"),
    ("lineage heads", HeadLineages, "lineages without their tensors (schema.HeadLineage)"),
    ("head", S.HeadPlan, "the reading process's decode (schema.HeadPlan)"),
    ("head, no tensors", HeadWithoutTensors, "the same with the tensor table undecoded"),
    ("names", S.NamesPlan, "the numbering process's decode (schema.NamesPlan)"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    text = gunzip_whole(str(Path(args.dir) / "parallel.json.gz"), 1 << 32)
    print(f"{Path(args.dir).name}: {len(text) / 1e6:.0f} MB of text")
    gc.disable()
    times = {}
    for name, typ, what in WAYS:
        dec = msgspec.json.Decoder(typ, dec_hook=S.decode_scale)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            doc = dec.decode(text)
            best = min(best, time.perf_counter() - t0)
            del doc
        times[name] = best
        print(f"{name:18s} {best:6.3f} s  (+{best - times['skip']:.3f})  {what}")


if __name__ == "__main__":
    main()
