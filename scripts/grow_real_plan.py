#!/usr/bin/env python3
"""Grow a real nnScaler plan pair's data parallelism: a stand-in for real plans larger than
those in `../shared/plans`.

Issue 12 measured a 512-rank real plan (Llama3, dp16 pp4 tp8 mb8, 345k parallel nodes) that is
not in `../shared/plans`. Its 128-rank sibling `llama3-ly2-dp4pp4tp8mb8` is: the same model,
the same pipeline and tensor parallelism and micro-batches, dp4 (86,272 nodes). This script
copies that plan's replica 0 to every replica of a larger data-parallel world, the way
nnScaler lays one out (`rank = dp_index*(pp*tp) + pp_stage*tp + tp_index`), so the result has
the real plan's operators, ids, collectives, pipeline moves, loss broadcasts and weight
reducers, only more replicas:

* a node or tensor of replica 0 is copied to replica k with every rank in its name, its
  `rank` and its rank attributes (`src`, `dst`, `ranks`) moved by k*(pp*tp) (`ranks` kept
  where the original's replica 1 keeps replica 0's, as nnScaler does for two backward
  all-reduces); a negative rank
  in a name (nnScaler's `-(rank+1)` for a message in flight) moves the same way; `dp`,
  `num_dp`, `batch_index` and `num_batches` are set for the new world;
* the weight reducers (the only nodes that read across replicas) and every lineage part that
  sums over the replicas read all new replicas;
* a lineage part of replica 0 alone is copied to replica k with its slice moved by k times the
  step between replicas 0 and 1 in the original (the batch rows of a replica);
* the single plan's batch grows by the same factor (its tensors' batch dimension and its
  `view` sizes), so every replica still holds its own rows of the batch.

Only the layout above is supported (ranks of one replica contiguous, the reducers the only
nodes across replicas); anything else stops with a message. The result is a test input, not
an nnScaler export: its verdict must be the original's.

    python scripts/grow_real_plan.py ../shared/plans/llama3-ly2-dp4pp4tp8mb8 --dp 16 \\
        --out /tmp/llama3-ly2-dp16pp4tp8mb8-grown

Measured (2026-12-06): see docs/performance.md, "a grown 512-rank real plan".
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
import sys
import time
from pathlib import Path

import msgspec

_NAME = re.compile(r"@r(-?\d+)m(-?\d+)$")


class Layout:
    """Where ranks and replicas meet in the original plan: `per` ranks to a replica."""

    def __init__(self, world: dict, new_dp: int):
        self.per = int(world["pp"]) * int(world["tp"])
        self.dp, self.new_dp, self.mb = int(world["dp"]), new_dp, int(world["mb"])
        if new_dp < self.dp:
            sys.exit(f"grow_real_plan: --dp {new_dp} is smaller than the plan's dp {self.dp}")

    def replica(self, rank: int) -> int:
        return (rank if rank >= 0 else -rank - 1) // self.per

    def rank_to(self, rank: int, k: int) -> int:
        return rank + k * self.per if rank >= 0 else rank - k * self.per

    def name_replica(self, name: str) -> int:
        return self.replica(_parsed(name)[1])

    def name_to(self, name: str, k: int) -> str:
        head, rank, mb = _parsed(name)
        return f"{head}@r{self.rank_to(rank, k)}m{mb}"


@functools.lru_cache(maxsize=None)
def _parsed(name: str) -> tuple[str, int, str]:
    """(what precedes @r, the rank, the micro-batch's text): once per name, as each name of
    replica 0 is moved to every new replica."""
    m = _NAME.search(name)
    if m is None:
        sys.exit(f"grow_real_plan: name {name!r} does not end in @r<rank>m<mb>")
    return name[:m.start()], int(m.group(1)), m.group(2)


def _moved_attrs(attrs: dict, lay: Layout, k: int, mb: int, ranks_move: bool) -> dict:
    out = dict(attrs)
    for key in ("src", "dst"):
        if isinstance(out.get(key), int):
            out[key] = lay.rank_to(out[key], k)
    if isinstance(out.get("ranks"), list) and ranks_move:
        out["ranks"] = [lay.rank_to(r, k) for r in out["ranks"]]
    if "dp" in out:
        out["dp"], out["num_dp"] = k, lay.new_dp
    if "batch_index" in out:
        out["batch_index"], out["num_batches"] = k * lay.mb + mb, lay.new_dp * lay.mb
    return out


def grow_parallel(par: dict, lay: Layout) -> dict:
    for n in par["nodes"]:
        names = [x for x in n["inputs"] + n["outputs"] if x]
        reps = {lay.name_replica(x) for x in names}
        if n["op"] != "reducer" and len(reps) > 1:
            sys.exit(f"grow_real_plan: node {n['id']} reads across replicas {sorted(reps)}")
    template = [n for n in par["nodes"] if lay.replica(n["rank"]) == 0]
    by_id = {n["id"]: n for n in par["nodes"]}

    def ranks_move(n: dict) -> bool:
        """nnScaler writes some backward all-reduces of every replica with replica 0's
        `ranks` (n6232 and n8203 of the tp8 plan): copied as they are."""
        twin = by_id.get(lay.name_to(n["id"], 1)) if lay.dp > 1 else None
        return twin is None or twin["attrs"].get("ranks") != n["attrs"].get("ranks")

    moves = {n["id"]: ranks_move(n) for n in template}  # once per node, not per replica
    pos = {n["id"]: i for i, n in enumerate(par["nodes"])}
    keyed = []
    for k in range(lay.new_dp):
        for n in template:
            twin = lay.name_to(n["id"], k % lay.dp)
            if twin not in pos:
                sys.exit(f"grow_real_plan: node {n['id']} has no copy {twin} in replica "
                         f"{k % lay.dp}")
            moved = dict(n, id=lay.name_to(n["id"], k), rank=lay.rank_to(n["rank"], k),
                         outputs=[x and lay.name_to(x, k) for x in n["outputs"]],
                         attrs=_moved_attrs(n["attrs"], lay, k, n["mb"], moves[n["id"]]))
            if n["op"] == "reducer":
                first = n["inputs"][0]
                if [lay.name_replica(x) for x in n["inputs"]] != list(range(lay.dp)):
                    sys.exit(f"grow_real_plan: reducer {n['id']} does not read one input "
                             "per replica in order")
                moved["inputs"] = [lay.name_to(first, j) for j in range(lay.new_dp)]
            else:
                moved["inputs"] = [x and lay.name_to(x, k) for x in n["inputs"]]
            # in the original's order: replica k where the original has replica k % dp
            keyed.append(((pos[twin], k // lay.dp), moved))
    keyed.sort(key=lambda e: e[0])
    nodes = [n for _, n in keyed]
    tpos = {t: i for i, t in enumerate(par["tensors"])}
    grown = [((tpos[lay.name_to(t, k % lay.dp)], k // lay.dp), lay.name_to(t, k), info)
             for k in range(lay.new_dp)
             for t, info in par["tensors"].items() if lay.name_replica(t) == 0]
    grown.sort(key=lambda e: e[0])
    tensors = {t: info for _, t, info in grown}
    return dict(par, world=_world(par["world"], lay), tensors=tensors, nodes=nodes,
                lineages=[_grow_lineage(lin, lay) for lin in par["lineages"]],
                name=par["name"].replace(f"dp{lay.dp}", f"dp{lay.new_dp}") + "-grown")


def _grow_lineage(lin: dict, lay: Layout) -> dict:
    by_members = {tuple(p["sum_of"]): i for i, p in enumerate(lin["parts"])}
    parts = []  # (the original's position of the part it copies, k // dp), the part
    for p in lin["parts"]:
        reps = [lay.name_replica(x) for x in p["sum_of"]]
        if set(reps) == {0}:
            twins = [by_members.get(tuple(lay.name_to(x, j) for x in p["sum_of"]))
                     for j in range(lay.dp)]
            if None in twins:
                sys.exit(f"grow_real_plan: lineage of {lin['single']}: the part summing "
                         f"{p['sum_of'][:2]} is not in every replica")
            twin = lin["parts"][twins[1]] if lay.dp > 1 else p
            step = [b[0] - a[0] for a, b in zip(p["slice"], twin["slice"])]
            for k in range(lay.new_dp):
                parts.append(((twins[k % lay.dp], k // lay.dp),
                              dict(p, sum_of=[lay.name_to(x, k) for x in p["sum_of"]],
                                   slice=[[a + k * s, b + k * s]
                                          for (a, b), s in zip(p["slice"], step)])))
        elif set(reps) == set(range(lay.dp)):
            mine = [x for x, r in zip(p["sum_of"], reps) if r == 0]
            if reps != sorted(reps) or len(mine) * lay.dp != len(reps):
                sys.exit(f"grow_real_plan: lineage of {lin['single']}: a part sums replicas "
                         "unevenly")
            parts.append(((by_members[tuple(p["sum_of"])], 0),
                          dict(p, sum_of=[lay.name_to(x, k) for k in range(lay.new_dp)
                                          for x in mine])))
        elif 0 not in reps:
            continue  # a copy of a replica-0 part, made again above
        else:
            sys.exit(f"grow_real_plan: lineage of {lin['single']}: a part sums replicas "
                     f"{sorted(set(reps))}")
    parts.sort(key=lambda e: e[0])
    return dict(lin, parts=[p for _, p in parts])


def _world(world: dict, lay: Layout) -> dict:
    model = dict(world.get("model") or {})
    if "gbs" in model:
        model["gbs"] = model["gbs"] * lay.new_dp // lay.dp
    if "plan_ndevs" in model and world.get("ranks", 1) > 1:
        model["plan_ndevs"] = model["plan_ndevs"] * lay.new_dp // lay.dp
    out = dict(world, model=model)
    if out.get("ranks", 1) > 1:
        out["dp"], out["ranks"] = lay.new_dp, lay.new_dp * lay.per
    return out


def grow_single(single: dict, par: dict, lay: Layout) -> dict:
    """The single plan on a batch grown by new_dp/dp: every dimension of the batch's size
    (dim 0 of the activations and their gradients, as the plan's lineages slice it)."""
    batch = None
    for lin in par["lineages"]:
        parts = lin["parts"]
        if len(parts) > 1 and parts[0]["slice"][0] != parts[-1]["slice"][0]:
            batch = single["tensors"][lin["single"]]["shape"][0]
            break
    if batch is None:
        sys.exit("grow_real_plan: no lineage slices the batch")
    grown = batch * lay.new_dp // lay.dp
    tensors = {}
    for t, info in single["tensors"].items():
        shape = list(info["shape"])
        if info["role"] not in ("param", "const") and shape and shape[0] == batch:
            shape[0] = grown
        tensors[t] = dict(info, shape=shape)
    nodes = []
    for n in single["nodes"]:
        size = n["attrs"].get("size")
        if n["op"] == "view" and isinstance(size, list) and size and size[0] == batch:
            n = dict(n, attrs=dict(n["attrs"], size=[grown] + size[1:]))
        nodes.append(n)
    return dict(single, tensors=tensors, nodes=nodes, world=_world(single["world"], lay))


def _write(doc: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(msgspec.json.encode(doc))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path, help="a real plan pair's folder (single/parallel.json.gz)")
    ap.add_argument("--dp", type=int, required=True, help="the new number of replicas")
    ap.add_argument("--out", type=Path, required=True, help="folder to write the pair to")
    a = ap.parse_args()
    t0 = time.perf_counter()
    with gzip.open(a.plan / "parallel.json.gz") as f:
        par = json.load(f)
    with gzip.open(a.plan / "single.json.gz") as f:
        single = json.load(f)
    lay = Layout(par["world"], a.dp)
    new_par = grow_parallel(par, lay)
    new_single = grow_single(single, par, lay)
    a.out.mkdir(parents=True, exist_ok=True)
    _write(new_single, a.out / "single.json.gz")
    _write(new_par, a.out / "parallel.json.gz")
    (a.out / "source").write_text(a.plan.resolve().name + "\n")  # for bench_real.py --extra
    print(f"{a.out}: {len(new_par['nodes'])} parallel nodes, {len(new_par['tensors'])} tensors,"
          f" {new_par['world']['ranks']} ranks, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
