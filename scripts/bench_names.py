#!/usr/bin/env python3
"""What the numbering of a large document's tensor names costs, by way of parsing it, and
what the C library's huge pages do to a whole verification: the measurements behind
docs/performance.md's "2026-12-05, night" section (alternatives measured and not kept).

    python scripts/bench_names.py [DIR] [--repeat 3] [--runs 0]

DIR (default ../shared/plans/moe-ly2-dp16pp2tp4mb16) holds parallel.json.gz. Per way, the
fastest of `--repeat`, the cyclic collector off (as the reader runs):

* `skip`: msgspec decoding nothing (the floor: scanning the text);
* `names` (what tvsmt does, tvsmt/plan/numbering.py): msgspec decodes the tensor ids and
  every node's inputs and outputs as strings (schema.NamesPlan), Arrow converts them to list
  arrays and numbers them with `index_in`;
* `raw lists`: msgspec decodes the tensor ids and keeps every node's inputs and outputs as
  undecoded text (msgspec.Raw), joined into one buffer whose names are cut out between quotes
  with numpy, then numbered by `index_in` (no check of the lists' syntax, no escapes, no
  nulls: a lower bound of that way's cost);
* `arrow json`: the tensor ids decoded by msgspec; the nodes array rewritten as JSON Lines and
  read by Arrow's JSON reader with a schema of inputs and outputs (one thread; then threads),
  its names numbered by `index_in`;
* `polars`: the same with polars reading the lines (only where polars is installed; not a
  dependency).

Each way ends with the numbers of every input and output name.

With `--runs N`, the in-process verification of DIR is then run N times alternately with and
without `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (the C library's heap on transparent huge
pages), each in a fresh interpreter, and its wall time, CPU time and page faults printed
(medians).
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from tvsmt.plan.numbering import Numbering, NameColumns, _name_columns  # noqa: E402
from tvsmt.plan.reader import gunzip_whole  # noqa: E402
from tvsmt.plan.schema import NamesPlan  # noqa: E402


class _Nothing(msgspec.Struct):
    pass


class _NoFields(msgspec.Struct):
    pass


class _RawNode(msgspec.Struct, gc=False):
    inputs: msgspec.Raw
    outputs: msgspec.Raw


class _RawPlan(msgspec.Struct):
    tensors: dict[str, _NoFields]
    nodes: list[_RawNode]


class _NodesSpan(msgspec.Struct):
    nodes: msgspec.Raw


def _skip(text: bytes) -> int:
    msgspec.json.decode(text, type=_Nothing)
    return 0


def _names(text: bytes) -> int:
    doc = msgspec.json.decode(text, type=NamesPlan)
    got = Numbering(list(doc.tensors)).of_prepared(NameColumns.by_arrow(_name_columns(doc)))
    return sum(len(x) for _, x in got)


def _raw_lists(text: bytes) -> int:
    import pyarrow as pa
    import pyarrow.compute as pc

    doc = msgspec.json.decode(text, type=_RawPlan)
    joined = np.frombuffer(b"".join([bytes(n.inputs) for n in doc.nodes]
                                    + [bytes(n.outputs) for n in doc.nodes]), np.uint8)
    quotes = np.flatnonzero(joined == 34)
    starts, ends = quotes[0::2] + 1, quotes[1::2]
    lens = ends - starts
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = joined[np.repeat(starts - offsets[:-1], lens) + np.arange(offsets[-1])]
    names = pa.LargeStringArray.from_buffers(len(starts), pa.py_buffer(offsets),
                                             pa.py_buffer(data))
    found = pc.index_in(names, value_set=pa.array(list(doc.tensors), pa.large_string()))
    return len(found)


class _Ids(msgspec.Struct):
    tensors: dict[str, _NoFields]


def _numbered(text: bytes, inputs, outputs) -> int:
    """Arrow list arrays of names numbered against the document's tensor ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = pa.array(list(msgspec.json.decode(text, type=_Ids).tensors), pa.large_string())
    names = pa.concat_arrays([inputs.flatten().cast(pa.large_string()),
                              outputs.flatten().cast(pa.large_string())])
    return len(pc.index_in(names, value_set=ids))


def _node_lines(text: bytes) -> bytes:
    span = bytes(msgspec.json.decode(text, type=_NodesSpan).nodes)
    return span[1:-1].replace(b'},{"id"', b'}\n{"id"')


def _arrow_json(threads: bool):
    def run(text: bytes) -> int:
        import pyarrow as pa
        import pyarrow.json as pj

        schema = pa.schema([("inputs", pa.list_(pa.string())),
                            ("outputs", pa.list_(pa.string()))])
        table = pj.read_json(
            io.BytesIO(_node_lines(text)),
            read_options=pj.ReadOptions(use_threads=threads, block_size=16 << 20),
            parse_options=pj.ParseOptions(explicit_schema=schema,
                                          unexpected_field_behavior="ignore"))
        return _numbered(text, *(c.combine_chunks() for c in table.columns))
    return run


def _polars(text: bytes) -> int:
    import polars as pl

    schema = {"inputs": pl.List(pl.String), "outputs": pl.List(pl.String)}
    frame = pl.read_ndjson(io.BytesIO(_node_lines(text)), schema=schema)
    return _numbered(text, frame["inputs"].to_arrow(), frame["outputs"].to_arrow())


def best(fn, text: bytes, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.disable()
        t = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - t)
        gc.enable()
        gc.collect()
    return min(times)


_VERIFY = """
import resource, sys, time
from tvsmt.verify import Options, verify_pair
t = time.perf_counter()
r = verify_pair(sys.argv[1] + "/single.json.gz", sys.argv[1] + "/parallel.json.gz",
                Options(jobs=2))
wall = time.perf_counter() - t
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(r.verdict, wall, me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime,
      me.ru_minflt + kids.ru_minflt)
"""


def huge_pages(folder: str, runs: int) -> None:
    rows: dict[str, list] = {"off": [], "hugetlb=1": []}
    for _ in range(runs):
        for name in rows:
            env = dict(os.environ)
            if name != "off":
                env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
            out = subprocess.run([sys.executable, "-c", _VERIFY, folder], env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            rows[name].append([float(x) for x in out[1:]])
    print(f"\nverify_pair of {folder}, medians of {runs} alternating runs "
          "(user, system and faults include the children it waited for):")
    for name, got in rows.items():
        wall, user, system, faults = (statistics.median(col) for col in zip(*got))
        print(f"  huge pages {name:10s} wall {wall:.2f} s  user {user:.2f} s  "
              f"system {system:.2f} s  minor faults {faults:,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?", default=str(ROOT.parent / "shared/plans/"
                                                  "moe-ly2-dp16pp2tp4mb16"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=0)
    args = ap.parse_args()
    text = gunzip_whole(os.path.join(args.dir, "parallel.json.gz"), 1 << 31)
    ways = [("skip", _skip), ("names", _names), ("raw lists", _raw_lists),
            ("arrow json", _arrow_json(False)), ("arrow json, threads", _arrow_json(True))]
    try:
        import polars  # noqa: F401
        ways.append(("polars", _polars))
    except ImportError:
        print("(polars not installed: not measured)")
    print(f"{args.dir}: {len(text) / 1e6:.0f} MB of text, best of {args.repeat}")
    base = None
    for name, fn in ways:
        seconds = best(fn, text, args.repeat)
        base = base or seconds
        print(f"  {name:22s} {seconds:6.3f} s  ({seconds / base:.1f}x skip)")
    if args.runs:
        huge_pages(args.dir, args.runs)


if __name__ == "__main__":
    main()
