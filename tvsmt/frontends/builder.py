"""A small builder for execplan v1 dicts (../shared/spec/execplan-v1.md).

`PlanBuilder` only knows the file format: tensors, nodes, outputs and lineages, with the
invariants a reader checks (unique node ids, SSA, declared tensors). What the nodes mean is the
business of the code that calls it (`spmd.py`).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Sequence

from tvsmt.atomic import atomic_file
from tvsmt.plan import load_plan

from tvsmt.plan.reader import FORMAT, VERSION  # the format has one home: the reader


class PlanBuilder:
    def __init__(self, name: str, kind: str, world: dict[str, Any]):
        if kind not in ("single", "parallel"):
            raise ValueError(f"kind must be single or parallel, not {kind!r}")
        self.name, self.kind, self.world = name, kind, world
        self.tensors: dict[str, dict[str, Any]] = {}
        self.nodes: list[dict[str, Any]] = []
        self.outputs: list[str] = []
        self.lineages: list[dict[str, Any]] = []
        self._node_ids: set[str] = set()
        self._written: set[str] = set()

    # ------------------------------------------------------------------ content

    def add_tensor(self, tid: str, shape: Sequence[int], role: str) -> str:
        if tid in self.tensors:
            raise ValueError(f"tensor {tid} declared twice")
        self.tensors[tid] = {"shape": [int(n) for n in shape], "role": role}
        return tid

    def add_node(self, nid: str, op: str, pass_: str | None, rank: int, mb: int,
                 inputs: Sequence[str | None], outputs: Sequence[str | None],
                 attrs: dict[str, Any] | None = None) -> str:
        if nid in self._node_ids:
            raise ValueError(f"node id {nid} used twice")
        for t in list(inputs) + list(outputs):
            if t is not None and t not in self.tensors:
                raise ValueError(f"node {nid} names undeclared tensor {t}")
        for t in outputs:
            if t is not None:
                if t in self._written:
                    raise ValueError(f"node {nid} writes {t} a second time (not SSA)")
                self._written.add(t)
        self._node_ids.add(nid)
        self.nodes.append({"id": nid, "op": op, "pass": pass_, "rank": rank, "mb": mb,
                           "inputs": list(inputs), "outputs": list(outputs),
                           "attrs": dict(attrs or {})})
        return nid

    def add_output(self, tid: str) -> None:
        if tid not in self.tensors:
            raise ValueError(f"output {tid} is not declared")
        self.outputs.append(tid)

    def add_lineage(self, single: str, parts: list[dict[str, Any]],
                    aligned: dict[str, list] | None = None) -> int:
        entry: dict[str, Any] = {"single": single, "parts": parts}
        if aligned is not None:
            entry["aligned"] = aligned
        self.lineages.append(entry)
        return len(self.lineages) - 1

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "kind": self.kind,
                "world": self.world, "tensors": self.tensors, "nodes": self.nodes,
                "outputs": self.outputs if self.kind == "single" else [],
                "lineages": self.lineages if self.kind == "parallel" else []}


def write_plan(path: str | os.PathLike, plan: dict[str, Any]) -> str:
    """Write one plan atomically: JSON Lines when the name ends in .jsonl or .jsonl.gz
    (tvsmt.plan.stream), else one JSON document; gzip-compressed when it ends in .gz. The
    file appears under its name only once complete (a temporary file is renamed over it)."""
    path = os.fspath(path)
    if path.endswith((".jsonl", ".jsonl.gz")):
        from tvsmt.plan.stream import write_stream

        return write_stream(path, plan)
    text = json.dumps(plan, separators=(",", ":"), allow_nan=False).encode()
    with atomic_file(path) as raw:
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as f:
                f.write(text)
        else:
            raw.write(text)
    return path


def read_plan_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The raw dict of a plan file in either form (a JSON Lines plan is validated on the way:
    tvsmt.plan.stream; a document is not: that is tvsmt.plan's job)."""
    path = os.fspath(path)
    if path.endswith((".jsonl", ".jsonl.gz")):
        return plan_dict(load_plan(path))
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def plan_dict(plan) -> dict[str, Any]:
    """A loaded `Plan` back as an execplan document dict."""
    from tvsmt.plan.stream import node_dict, part_dict

    lineages = []
    for lin in plan.lineages:
        entry: dict[str, Any] = {"single": lin.single, "parts": [part_dict(p) for p in lin.parts]}
        if lin.aligned is not None:
            entry["aligned"] = {"single": list(lin.aligned.single),
                                "parallel": list(lin.aligned.parallel),
                                "inputs": list(lin.aligned.inputs)}
        if lin.hypothesis:
            entry["hypothesis"] = True
        lineages.append(entry)
    return {"format": FORMAT, "version": VERSION, "name": plan.name, "kind": plan.kind,
            "world": plan.world,
            "tensors": {t: {"shape": list(i.shape), "role": i.role}
                        for t, i in plan.tensors.items()},
            "nodes": [node_dict(n) for n in plan.nodes], "outputs": list(plan.outputs),
            "lineages": lineages}


def write_unit_source(path: str | os.PathLike, source) -> str:
    """Write a unit source's parallel plan (tvsmt.fold.source.UnitSource, e.g. the generator's
    `StreamedPlan`) in the JSON Lines form, one (replica, micro-batch) unit at a time: the
    plan is never held whole, only the replica units and the records of no unit.

    Sections: first the tensors of the replica units and of no unit (weights, gradients),
    then one section per instance unit with its tensors and nodes, then the lineages. The
    nodes of the replica units and of no unit (gradient accumulation, reducers) are written
    as soon as every tensor they read has been written (a dependency count), so the order is
    topological; the reader checks it again."""
    import heapq

    from tvsmt.plan.model import replace as replace_struct
    from tvsmt.plan.stream import StreamWriter, node_dict, part_dict

    header = source.header
    units = source.units()
    instances = [u for u in units if u[1] is not None]
    replicas = [u for u in units if u[1] is None]
    glob = source.global_records()
    replica_recs = [source.records(u) for u in replicas]
    held = [n for recs in (*replica_recs, glob) for _, n in sorted(recs.nodes,
                                                                      key=lambda x: x[0])]
    held_tensors = {t.id for recs in (*replica_recs, glob) for t in recs.tensors}
    held_outputs = {t for n in held for t in n.outputs if t is not None}
    waiting: dict[str, list[int]] = {}
    missing = [0] * len(held)
    for k, n in enumerate(held):
        for t in dict.fromkeys(x for x in n.inputs if x is not None):
            if t in held_outputs or t not in held_tensors:  # written later, or a unit's
                waiting.setdefault(t, []).append(k)
                missing[k] += 1
    ready = [k for k, c in enumerate(missing) if c == 0]
    heapq.heapify(ready)
    parts: dict[int, list] = {}

    def keep_parts(recs, unit=(-1, -1)) -> None:
        # the tracer's order: micro-batch, then replica, then position within the unit; a
        # part a replica unit lists once per micro-batch counts its copies as micro-batches
        d, m = unit
        copies: dict = {}
        for j, (lin, pos, p) in enumerate(recs.parts):
            if recs.part_refs and not p.sum_of:  # a global part named by its SumRefs
                p = replace_struct(p, sum_of=recs.sum_of(j))
            if m is None:  # copies of one part are equal records
                c = copies[(lin, p)] = copies.get((lin, p), -1) + 1
            else:
                c = m
            parts.setdefault(lin, []).append(((c, d, pos), part_dict(p)))

    def satisfied(t: str) -> None:
        for k in waiting.pop(t, ()):
            missing[k] -= 1
            if missing[k] == 0:
                heapq.heappush(ready, k)

    def emit(w, n) -> None:
        w.node(node_dict(n))
        for t in n.outputs:
            if t is not None and t in waiting:
                satisfied(t)

    def drain(w) -> None:
        while ready:
            emit(w, held[heapq.heappop(ready)])

    with StreamWriter(path, "parallel", header.name, header.world, (),
                      sections=len(instances) + 2) as w:
        w.section("tensors of the replica units and of no unit")
        for recs in (*replica_recs, glob):
            for t in recs.tensors:
                w.tensor(t.id, t.shape, t.role)
        drain(w)
        for u in instances:
            recs = source.records(u)
            w.section(f"unit replica {u[0]} micro-batch {u[1]}")
            for t in recs.tensors:
                w.tensor(t.id, t.shape, t.role)
            for _, n in sorted(recs.nodes, key=lambda x: x[0]):
                emit(w, n)
            for t in recs.tensors:  # a unit's tensor that it did not write: a graph input
                if t.id in waiting and t.id not in held_outputs:
                    satisfied(t.id)
            keep_parts(recs, u)
            drain(w)
        left = [k for k, c in enumerate(missing) if c > 0]
        for k in left:  # nothing will unblock these: written as they come (the reader judges)
            w.node(node_dict(held[k]))
        for u, recs in zip(replicas, replica_recs):
            keep_parts(recs, u)
        keep_parts(glob)
        w.section("lineages")
        for lin in header.lineages:
            entry = {"single": lin.single,
                     "parts": [p for _, p in sorted(parts.get(lin.index, ()),
                                                    key=lambda x: x[0])]}
            if lin.hypothesis:
                entry["hypothesis"] = True
            w.lineage(entry)
    return os.fspath(path)
