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

from tvsmt.plan import load_plan

FORMAT, VERSION = "tvsmt.execplan", 1


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
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{base}.partial-{os.getpid()}")
    text = json.dumps(plan, separators=(",", ":"), allow_nan=False).encode()
    try:
        with open(tmp, "wb") as raw:
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as f:
                    f.write(text)
            else:
                raw.write(text)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
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
