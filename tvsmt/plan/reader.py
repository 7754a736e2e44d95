"""Reading and validating execplan v1 files.

Everything a plan producer can get wrong is checked here, once, and reported as a one-line
`PlanError` naming the file and the node or tensor: later phases may trust the dataclasses.
Checks that need both plans (lineages refer to single-plan tensors) are in `check_pair`.
"""

from __future__ import annotations

import gzip
import json
import os
from fractions import Fraction
from typing import Any

from tvsmt.errors import PlanError, UnsupportedOperator
from tvsmt.plan.model import Aligned, Lineage, LineagePart, Node, Plan, TensorInfo

FORMAT = "tvsmt.execplan"
VERSION = 1
KINDS = ("single", "parallel")
PASSES = ("fw", "bw", None)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a `.json` or `.json.gz` execplan file and validate it on its own."""
    path = os.fspath(path)
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        else:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
    except FileNotFoundError:
        raise PlanError("no such file", file=path) from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read plan: {e}", file=path) from None
    except json.JSONDecodeError as e:
        raise PlanError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                        file=path) from None
    return plan_from_dict(data, path)


def _require(cond: bool, msg: str, path: str, **where) -> None:
    if not cond:
        raise PlanError(msg, file=path, **where)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)


def plan_from_dict(data: Any, path: str = "<memory>") -> Plan:
    """Validate a decoded plan object and build the typed `Plan`."""
    from tvsmt.ops import get as get_op

    _require(isinstance(data, dict), "a plan must be a JSON object", path)
    fmt, ver = data.get("format"), data.get("version")
    _require(fmt == FORMAT, f"unknown format {fmt!r} (expected {FORMAT!r})", path)
    _require(ver == VERSION, f"unsupported version {ver!r} (this reader knows {VERSION})", path)
    kind = data.get("kind")
    _require(kind in KINDS, f"kind must be 'single' or 'parallel', not {kind!r}", path)
    for key, typ in (("tensors", dict), ("nodes", list)):
        _require(isinstance(data.get(key), typ), f"'{key}' must be a JSON {typ.__name__}", path)
    world = data.get("world") or {}
    _require(isinstance(world, dict), "'world' must be an object", path)

    tensors: dict[str, TensorInfo] = {}
    for tid, info in data["tensors"].items():
        _require(isinstance(info, dict) and _int_list(info.get("shape")),
                 "tensor needs a 'shape' list of ints", path, tensor=tid)
        _require(all(d >= 0 for d in info["shape"]), "negative dimension", path, tensor=tid)
        tensors[tid] = TensorInfo(tid, tuple(info["shape"]), str(info.get("role", "activation")))

    nodes: list[Node] = []
    writer: dict[str, str] = {}
    seen_ids: set[str] = set()
    for i, raw in enumerate(data["nodes"]):
        _require(isinstance(raw, dict), f"node #{i} is not an object", path)
        nid = raw.get("id")
        _require(isinstance(nid, str), f"node #{i} has no string 'id'", path)
        _require(nid not in seen_ids, "node id used twice", path, node=nid)
        seen_ids.add(nid)
        op = raw.get("op")
        _require(isinstance(op, str), "node has no 'op'", path, node=nid)
        if get_op(op) is None:
            raise UnsupportedOperator(f"unknown operator {op!r}", file=path, node=nid)
        pass_ = raw.get("pass")
        _require(pass_ in PASSES, f"'pass' must be fw, bw or null, not {pass_!r}", path, node=nid)
        ins, outs = raw.get("inputs"), raw.get("outputs")
        for key, lst in (("inputs", ins), ("outputs", outs)):
            _require(isinstance(lst, list) and all(t is None or isinstance(t, str) for t in lst),
                     f"'{key}' must be a list of tensor ids or null", path, node=nid)
        for t in ins:
            if t is None:
                continue
            _require(t in tensors, "reads an undeclared tensor", path, node=nid, tensor=t)
            # A tensor written by a later node means a cycle or nodes out of order.
        for t in outs:
            if t is None:
                continue
            _require(t in tensors, "writes an undeclared tensor", path, node=nid, tensor=t)
            _require(t not in writer, f"tensor written twice (also by {writer.get(t)}): "
                     "the plan is not SSA", path, node=nid, tensor=t)
            writer[t] = nid
        attrs = raw.get("attrs") or {}
        _require(isinstance(attrs, dict), "'attrs' must be an object", path, node=nid)
        rank, mb = raw.get("rank", 0), raw.get("mb", 0)
        _require(isinstance(rank, int) and isinstance(mb, int), "rank/mb must be ints",
                 path, node=nid)
        nodes.append(Node(nid, op, pass_, rank, mb, tuple(ins), tuple(outs), attrs))

    # Topological order: every input is a graph input or written by an earlier node.
    position = {n.id: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t is not None and t in writer and position[writer[t]] >= i:
                what = "itself" if writer[t] == n.id else f"later node {writer[t]}"
                raise PlanError(f"reads a tensor written by {what} (cycle or nodes out of "
                                "topological order)", file=path, node=n.id, tensor=t)

    outputs = data.get("outputs") or []
    _require(isinstance(outputs, list), "'outputs' must be a list of tensor ids", path)
    for t in outputs:
        _require(isinstance(t, str) and t in tensors, "output is not a declared tensor", path,
                 tensor=str(t))

    lineages = [_lineage(raw, i, tensors, path) for i, raw in
                enumerate(data.get("lineages") or [])]
    if kind == "single":
        _require(not lineages, "a single plan carries no lineages", path)
    return Plan(path, str(data.get("name", os.path.basename(path))), kind, world, tensors, nodes,
                list(outputs), lineages)


def _lineage(raw: Any, index: int, tensors: dict[str, TensorInfo], path: str) -> Lineage:
    where = f"lineage #{index}"
    _require(isinstance(raw, dict) and isinstance(raw.get("single"), str),
             f"{where} needs a 'single' tensor id", path)
    single = raw["single"]
    parts_raw = raw.get("parts")
    _require(isinstance(parts_raw, list) and parts_raw, f"{where} needs a non-empty 'parts' list",
             path, tensor=single)
    parts = []
    for j, p in enumerate(parts_raw):
        pw = f"{where} part {j}"
        _require(isinstance(p, dict), f"{pw} is not an object", path, tensor=single)
        sl = p.get("slice")
        _require(isinstance(sl, list) and all(_int_list(r) and len(r) == 2 for r in sl),
                 f"{pw}: 'slice' must be a list of [start, end] pairs", path, tensor=single)
        sum_of = p.get("sum_of")
        _require(isinstance(sum_of, list) and sum_of and all(isinstance(t, str) for t in sum_of),
                 f"{pw}: 'sum_of' must be a non-empty list of tensor ids", path, tensor=single)
        _require(len(set(sum_of)) == len(sum_of), f"{pw}: a tensor appears twice in sum_of",
                 path, tensor=single)
        scale = Fraction(1)
        if p.get("scale") is not None:
            sc = p["scale"]
            _require(_int_list(sc) and len(sc) == 2 and sc[1] != 0,
                     f"{pw}: 'scale' must be [num, den] ints with den != 0", path, tensor=single)
            scale = Fraction(sc[0], sc[1])
        part = LineagePart(tuple((a, b) for a, b in sl), tuple(sum_of), scale)
        for t in sum_of:
            _require(t in tensors, f"{pw} names an undeclared parallel tensor", path, tensor=t)
            _require(tensors[t].shape == part.shape,
                     f"{pw}: shape {list(tensors[t].shape)} differs from the slice shape "
                     f"{list(part.shape)} of {single}", path, tensor=t)
        parts.append(part)
    aligned = None
    if raw.get("aligned") is not None:
        a = raw["aligned"]
        ok = (isinstance(a, dict) and all(isinstance(a.get(k, []), list) for k in
                                          ("single", "parallel", "inputs")))
        _require(ok, f"{where}: malformed 'aligned' hint", path, tensor=single)
        ins = a.get("inputs", [])
        _require(_int_list(ins) and all(0 <= k < index for k in ins),
                 f"{where}: 'aligned.inputs' must name earlier lineages", path, tensor=single)
        aligned = Aligned(tuple(a.get("single", [])), tuple(a.get("parallel", [])), tuple(ins))
    return Lineage(index, single, tuple(parts), aligned)


def check_pair(single: Plan, parallel: Plan) -> None:
    """Cross-plan checks: kinds, lineage targets and slices, every single output has a lineage."""
    if single.kind != "single":
        raise PlanError(f"expected a single plan, found kind {single.kind!r}", file=single.path)
    if parallel.kind != "parallel":
        raise PlanError(f"expected a parallel plan, found kind {parallel.kind!r}",
                        file=parallel.path)
    for lin in parallel.lineages:
        if lin.single not in single.tensors:
            raise PlanError(f"lineage #{lin.index} names {lin.single!r}, which the single plan "
                            f"{single.path} does not declare", file=parallel.path,
                            tensor=lin.single)
        full = single.shape(lin.single)
        for j, part in enumerate(lin.parts):
            ok = len(part.slice) == len(full) and all(
                0 <= s < e <= n for (s, e), n in zip(part.slice, full))
            if not ok and not (len(full) == 0 and part.slice == ()):
                raise PlanError(f"lineage #{lin.index} part {j}: slice "
                                f"{[list(r) for r in part.slice]} is outside the full shape "
                                f"{list(full)}", file=parallel.path, tensor=lin.single)
    with_lineage = {lin.single for lin in parallel.lineages}
    for out in single.outputs:
        if out not in with_lineage:
            raise PlanError("output of the single plan has no lineage in the parallel plan",
                            file=parallel.path, tensor=out)
