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
    known_ops: set[str] = set()
    for i, raw in enumerate(data["nodes"]):  # hot loop: checks inline, messages built on error
        if not isinstance(raw, dict):
            raise PlanError(f"node #{i} is not an object", file=path)
        nid = raw.get("id")
        if not isinstance(nid, str):
            raise PlanError(f"node #{i} has no string 'id'", file=path)
        if nid in seen_ids:
            raise PlanError("node id used twice", file=path, node=nid)
        seen_ids.add(nid)
        op = raw.get("op")
        if type(op) is not str:
            raise PlanError("node has no string 'op'", file=path, node=nid)
        if op not in known_ops:
            if get_op(op) is None:
                raise UnsupportedOperator(f"unknown operator {op!r}", file=path, node=nid)
            known_ops.add(op)
        pass_ = raw.get("pass")
        if not (pass_ is None or type(pass_) is str) or pass_ not in PASSES:
            raise PlanError(f"'pass' must be fw, bw or null, not {pass_!r}", file=path, node=nid)
        ins, outs = raw.get("inputs"), raw.get("outputs")
        for key, lst in (("inputs", ins), ("outputs", outs)):
            if not isinstance(lst, list):
                raise PlanError(f"'{key}' must be a list of tensor ids or null", file=path,
                                node=nid)
        for t in ins:
            if t is not None and (type(t) is not str or t not in tensors):
                raise PlanError("reads an undeclared tensor", file=path, node=nid,
                                tensor=str(t))
        for t in outs:
            if t is None:
                continue
            if type(t) is not str or t not in tensors:
                raise PlanError("writes an undeclared tensor", file=path, node=nid,
                                tensor=str(t))
            if t in writer:
                raise PlanError(f"tensor written twice (also by {writer[t]}): the plan is not "
                                "SSA", file=path, node=nid, tensor=t)
            writer[t] = nid
        attrs = raw.get("attrs") or {}
        rank, mb = raw.get("rank", 0), raw.get("mb", 0)
        if not (isinstance(attrs, dict) and type(rank) is int and type(mb) is int):
            raise PlanError("'attrs' must be an object and rank/mb ints", file=path, node=nid)
        source = raw.get("source")
        if source is not None and type(source) is not str:
            raise PlanError("'source' must be a string (file:line) or null", file=path,
                            node=nid)
        nodes.append(Node(nid, op, pass_, rank, mb, tuple(ins), tuple(outs), attrs, source))

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

    raw_lineages = data.get("lineages") or []
    _require(isinstance(raw_lineages, list), "'lineages' must be a list", path)
    cache: dict = {}
    lineages = [_lineage(raw, i, tensors, path, cache) for i, raw in enumerate(raw_lineages)]
    if kind == "single":
        _require(not lineages, "a single plan carries no lineages", path)
    return Plan(path, str(data.get("name", os.path.basename(path))), kind, world, tensors, nodes,
                list(outputs), lineages)


def _lineage(raw: Any, index: int, tensors: dict[str, TensorInfo], path: str,
             cache: dict) -> Lineage:
    where = f"lineage #{index}"
    _require(isinstance(raw, dict) and isinstance(raw.get("single"), str),
             f"{where} needs a 'single' tensor id", path)
    single = raw["single"]
    parts_raw = raw.get("parts")
    _require(isinstance(parts_raw, list) and parts_raw, f"{where} needs a non-empty 'parts' list",
             path, tensor=single)
    parts = []
    checked: dict[tuple, tuple[int, ...]] = cache.setdefault("slices", {})  # slice -> shape
    for j, p in enumerate(parts_raw):
        pw = f"{where} part {j}"
        if not isinstance(p, dict):
            raise PlanError(f"{pw} is not an object", file=path, tensor=single)
        sl = p.get("slice")
        try:
            key = tuple((a, b) for a, b in sl)
            if not all(type(a) is int and type(b) is int for a, b in key):
                key = None
        except (TypeError, ValueError):
            key = None
        if key not in checked:  # compute each distinct slice's shape once
            _require(key is not None, f"{pw}: 'slice' must be a list of [start, end] int pairs",
                     path, tensor=single)
            checked[key] = tuple(e - s for s, e in key)
        shape = checked[key]
        sum_of = p.get("sum_of")
        if not (isinstance(sum_of, list) and sum_of and all(type(t) is str for t in sum_of)
                and len(set(sum_of)) == len(sum_of)):
            raise PlanError(f"{pw}: 'sum_of' must be a non-empty list of distinct tensor ids",
                            file=path, tensor=single)
        scale = Fraction(1)
        if p.get("scale") is not None:
            sc = p["scale"]
            _require(_int_list(sc) and len(sc) == 2 and sc[1] != 0,
                     f"{pw}: 'scale' must be [num, den] ints with den != 0", path, tensor=single)
            scale = Fraction(sc[0], sc[1])
        for t in sum_of:
            info = tensors.get(t) if isinstance(t, str) else None
            if info is None:
                raise PlanError(f"{pw} names an undeclared parallel tensor", file=path,
                                tensor=str(t))
            if info.shape != shape:
                raise PlanError(f"{pw}: shape {list(info.shape)} differs from the slice shape "
                                f"{list(shape)} of {single}", file=path, tensor=t)
        parts.append(LineagePart(key, tuple(sum_of), scale))
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
    hypothesis = raw.get("hypothesis", False)
    _require(type(hypothesis) is bool, f"{where}: 'hypothesis' must be true or false", path,
             tensor=single)
    return Lineage(index, single, tuple(parts), aligned, hypothesis)


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
    if not single.outputs:
        # Nothing would be claimed, so nothing proven: a pass here would be vacuous (the
        # reference verifier reports success on such exports).
        raise PlanError("the single plan lists no outputs: nothing to verify (an execution "
                        "plan must name the loss and the final weight gradients)",
                        file=single.path)
    with_lineage = {lin.single for lin in parallel.lineages}
    for out in single.outputs:
        if out not in with_lineage:
            raise PlanError("output of the single plan has no lineage in the parallel plan",
                            file=parallel.path, tensor=out)
