"""The bug zoo: mutations that inject one realistic parallelization bug into a parallel plan.

    mutated, record = apply(parallel_dict, "drop-bw-reduction", seed=0)

`apply` never modifies its argument. `record` says what changed: `nodes` (ids of the nodes
changed or added), `tensors` (the tensors whose values change first: the outputs of those
nodes), `target` (the main node), plus the bug's name, category and description. A test or a
report reader can check that a verifier's failure points at them (or at a tensor computed from
them).

Targets are found structurally (operators, tensor roles, lineages, aligned hints), never by
parsing tensor or node ids, so the mutations also apply to plans from other producers (e.g.
the reference fixtures) where the pattern exists. `seed` picks among the candidates; `where`
(a node id, or a tensor id the node reads or writes) forces the target. A mutation that has no
candidate in the plan (e.g. a tensor-parallel bug in a plan with tp=1) raises `NotApplicable`.

Every mutated plan stays a valid execplan (declared tensors, SSA, topological order, matching
shapes), except the mutations marked `breaks_graph`, whose point is a broken dataflow.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import random
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from tvsmt.ops import get as get_op


class NotApplicable(ValueError):
    """The plan has no place where this bug can be injected."""


def _copy_of(plan: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a plan dict. Plans are JSON values: a MessagePack round trip copies them
    twice as fast as `copy.deepcopy` (tests/test_fold.py copies a plan for each of up to 60
    seeds to place one bug); a tuple comes back a list, as a plan file would give it. What
    MessagePack cannot carry (an integer beyond 64 bits, another type) is deep-copied."""
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(plan))
    except (TypeError, OverflowError, msgspec.MsgspecError):
        return copy.deepcopy(plan)


# ----------------------------------------------------------------------------- plan access


class PlanView:
    """Indexes over a plan dict, rebuilt after every structural edit."""

    def __init__(self, plan: dict[str, Any]):
        self.plan = plan
        self._n = 0
        self.refresh()

    def refresh(self) -> None:
        self.nodes: list[dict] = self.plan["nodes"]
        self.pos = {n["id"]: i for i, n in enumerate(self.nodes)}
        self.producer: dict[str, dict] = {}
        self.consumers: dict[str, list[dict]] = {}
        for n in self.nodes:
            for t in n["outputs"]:
                if t is not None:
                    self.producer[t] = n
            for t in n["inputs"]:
                if t is not None:
                    self.consumers.setdefault(t, []).append(n)
        self.parts_of: dict[str, list[tuple[int, tuple]]] = {}
        for i, lin in enumerate(self.plan.get("lineages") or []):
            for p in lin["parts"]:
                sl = tuple(tuple(r) for r in p["slice"])
                for t in p["sum_of"]:
                    self.parts_of.setdefault(t, []).append((i, sl))
        self._instances: dict[tuple, list[dict]] | None = None  # built when first asked
        self._shape_only: dict[str, bool | None] = {}

    # -- facts
    @property
    def world(self) -> dict:
        return self.plan.get("world") or {}

    def w(self, key: str) -> int:
        return int(self.world.get(key) or 1)

    def shape(self, t: str) -> list[int]:
        return self.plan["tensors"][t]["shape"]

    def role(self, t: str) -> str:
        return self.plan["tensors"][t].get("role", "activation")

    def rank_of(self, t: str) -> int | None:
        p = self.producer.get(t)
        return p["rank"] if p is not None else None

    def before(self, t: str, node: dict) -> bool:
        """t is a graph input or written before `node`."""
        p = self.producer.get(t)
        return p is None or self.pos[p["id"]] < self.pos[node["id"]]

    def instance(self, n: dict) -> list[dict]:
        """The nodes of one collective: same operator, same inputs (every member of a
        collective lists the inputs of the whole group)."""
        if self._instances is None:
            self._instances = {}
            for m in self.nodes:
                self._instances.setdefault((m["op"], tuple(m["inputs"])), []).append(m)
        return list(self._instances[(n["op"], tuple(n["inputs"]))])

    def shape_only(self, t: str) -> bool:
        """t's value depends on no plan input's value: every node it comes from reads its
        inputs' shapes only (operator fact `shape_only`, a causal mask) or reads only such
        tensors (or nothing). Units of the same shapes hold the same such tensor: re-routing
        it from one to another changes nothing."""
        memo = self._shape_only  # tensor -> answer; None while its inputs are looked at
        stack = [t]
        while stack:  # iterative: chains through a plan are long
            x = stack[-1]
            if memo.get(x) is not None:
                stack.pop()
                continue
            node = self.producer.get(x)
            spec = get_op(node["op"]) if node is not None else None
            if node is None or (spec is not None and spec.shape_only):
                memo[x] = node is not None  # no producer: a plan input (data, weights)
                stack.pop()
                continue
            ins = [i for i in node["inputs"] if i is not None]
            todo = [i for i in ins if i not in memo]
            if x not in memo and todo:
                memo[x] = None
                stack.extend(todo)
                continue
            # a cycle (not a plan, but this may be handed one) reads as not shape-only
            memo[x] = all(memo.get(i) is True for i in ins)
            stack.pop()
        return bool(memo[t])

    def tp_group(self, rank: int) -> set[int]:
        tp = self.w("tp")
        start = rank - rank % tp
        return set(range(start, start + tp))

    # -- edits
    def fresh_tensor(self, base: str, shape, role: str) -> str:
        while True:
            self._n += 1
            tid = _tagged(base, f"~bug{self._n}")
            if tid not in self.plan["tensors"]:
                break
        self.plan["tensors"][tid] = {"shape": list(shape), "role": role}
        return tid

    def fresh_node_id(self, base: str) -> str:
        while True:
            self._n += 1
            nid = _tagged(base, f"~bug{self._n}")
            if nid not in self.pos:
                return nid

    def insert(self, index: int, node: dict) -> dict:
        self.nodes.insert(index, node)
        self.refresh()
        return node

    def add_to_hints(self, existing: str, new: str) -> None:
        """Add node `new` to every aligned hint that lists node `existing`."""
        for lin in self.plan.get("lineages") or []:
            a = lin.get("aligned")
            if a and existing in a.get("parallel", []) and new not in a["parallel"]:
                a["parallel"].append(new)


def _tagged(name: str, tag: str) -> str:
    """`x@r2m0` -> `x@r2m0~bug1`: a new tensor or node is named after the one it comes from;
    ids are opaque (a record's unit comes from its node's rank and micro-batch)."""
    return f"{name}{tag}"


def _node(nid: str, op: str, pass_: str | None, rank: int, mb: int, inputs, outputs,
          attrs: dict | None = None) -> dict:
    return {"id": nid, "op": op, "pass": pass_, "rank": rank, "mb": mb, "inputs": list(inputs),
            "outputs": list(outputs), "attrs": dict(attrs or {})}


def _pick(cands: list, rng: random.Random, where: str | None, what: str,
          node_of: Callable[[Any], dict] = lambda c: c) -> Any:
    if where is not None:
        cands = [c for c in cands if where == node_of(c)["id"] or where in node_of(c)["inputs"]
                 or where in node_of(c)["outputs"]]
        if not cands:
            raise NotApplicable(f"{where} is not a place for this bug ({what})")
    if not cands:
        raise NotApplicable(f"the plan has no {what}")
    return cands[rng.randrange(len(cands))]


def _record(target: dict, nodes: list[str], tensors: list[str], **extra) -> dict:
    seen: dict[str, None] = {}
    for t in tensors:
        if t is not None:
            seen.setdefault(t, None)
    return {"target": target["id"], "nodes": list(dict.fromkeys(nodes)), "tensors": list(seen),
            **extra}


def _local_input(v: PlanView, n: dict) -> str:
    """The input of a collective node that its own rank contributes."""
    for t in n["inputs"]:
        if t is not None and v.rank_of(t) == n["rank"]:
            return t
    ranks = n["attrs"].get("ranks") or []
    if n["rank"] in ranks and len(ranks) == len(n["inputs"]):
        return n["inputs"][ranks.index(n["rank"])]
    raise NotApplicable(f"cannot tell which input of {n['id']} is local")


def _is_grad(v: PlanView, n: dict) -> bool:
    return any(t is not None and v.role(t) == "grad" for t in n["outputs"])


# ----------------------------------------------------------------------------- communication


def _fw_all_reduces(v: PlanView) -> list[dict]:
    """Forward all_reduces; those of activations (tensor parallelism) before any other (e.g.
    the loss reporting's)."""
    fw = [n for n in v.nodes if n["op"] == "all_reduce" and not _is_grad(v, n)]
    act = [n for n in fw if all(v.role(t) == "activation" for t in n["outputs"] if t)]
    return act or fw


def _bw_all_reduces(v: PlanView) -> list[dict]:
    return [n for n in v.nodes if n["op"] == "all_reduce" and _is_grad(v, n)]


def _to_identity(v: PlanView, n: dict) -> dict:
    local = _local_input(v, n)
    n.update(op="identity", inputs=[local], attrs={})
    v.refresh()
    return _record(n, [n["id"]], n["outputs"], kept_input=local)


def drop_allreduce_keep_dataflow(v: PlanView, rng, where):
    n = _pick(_fw_all_reduces(v), rng, where, "forward all_reduce")
    return _to_identity(v, n)


def drop_allreduce_break_dataflow(v: PlanView, rng, where):
    n = _pick(_fw_all_reduces(v), rng, where, "forward all_reduce")
    v.nodes.remove(n)
    v.refresh()
    # The output stays declared but nothing writes it any more: its readers see an undefined
    # tensor, which only its (computed, not assumed) lineage mentions.
    return _record(n, [n["id"]], n["outputs"], removed=True)


def allreduce_to_allgather(v: PlanView, rng, where):
    n = _pick(_fw_all_reduces(v), rng, where, "forward all_reduce")
    inst = v.instance(n)
    shape = v.shape(n["inputs"][0])
    k = len(n["inputs"])
    dims = [i for i in range(len(shape)) if shape[i] % k == 0 and shape[i] >= k]
    if not dims:
        raise NotApplicable(f"no axis of {shape} splits into {k} pieces")
    dim = dims[-1]
    ranks = [v.rank_of(t) for t in n["inputs"]]
    first = min(v.pos[m["id"]] for m in inst)
    piece = list(shape)
    piece[dim] //= k
    chunks, added = [], []
    for i, (t, r) in enumerate(zip(n["inputs"], ranks)):
        c = v.fresh_tensor(t, piece, v.role(t))
        nid = v.fresh_node_id(f"{n['id']}:chunk")
        v.insert(first + i, _node(nid, "chunk", None, r, n["mb"], [t], [c],
                                  {"dim": dim, "ranks": ranks, "idx": i}))
        chunks.append(c)
        added.append(nid)
    for m in inst:
        m.update(op="all_gather", inputs=list(chunks), attrs={"dim": dim, "ranks": ranks})
    v.refresh()
    return _record(n, [m["id"] for m in inst] + added, [o for m in inst for o in m["outputs"]])


def allgather_to_allreduce(v: PlanView, rng, where):
    cands = [n for n in v.nodes if n["op"] == "all_gather" and not _is_grad(v, n)]
    cands = cands or [n for n in v.nodes if n["op"] == "all_gather"]
    n = _pick(cands, rng, where, "all_gather")
    inst = v.instance(n)
    ranks = n["attrs"].get("ranks") or [v.rank_of(t) for t in n["inputs"]]
    by_rank = {m["rank"]: m for m in inst}
    first = min(v.pos[m["id"]] for m in inst)
    shape = v.shape(n["inputs"][0])
    sums, added = {}, []
    for i, r in enumerate(ranks):
        s = v.fresh_tensor(n["inputs"][0], shape, v.role(n["inputs"][0]))
        nid = v.fresh_node_id(f"{n['id']}:all_reduce")
        mb = by_rank[r]["mb"] if r in by_rank else n["mb"]
        v.insert(first + i, _node(nid, "all_reduce", None, r, mb, n["inputs"], [s],
                                  {"ranks": ranks}))
        sums[r] = s
        added.append(nid)
    gathered = [sums[r] for r in ranks]
    for m in inst:
        m["inputs"] = list(gathered)
    v.refresh()
    return _record(n, [m["id"] for m in inst] + added,
                   [o for m in inst for o in m["outputs"]] + list(sums.values()))


def drop_bw_reduction(v: PlanView, rng, where):
    n = _pick(_bw_all_reduces(v), rng, where, "backward all_reduce (tp > 1)")
    return _to_identity(v, n)


def _same_lineage_elsewhere(v: PlanView, t: str, node: dict, avoid_ranks: set[int],
                            by_lineage: dict[int, list[tuple[int, str]]]) -> list[str]:
    """Tensors that some lineage relates to the same single tensor as t, with t's shape, held
    by a rank outside `avoid_ranks` and written before `node`, in the order of their writers
    (`by_lineage`: `_tensors_by_lineage`)."""
    lins = {i for i, _ in v.parts_of.get(t, [])}
    out = []
    for k, u in {e for i in lins for e in by_lineage[i]}:
        if u == t:
            continue
        r = v.rank_of(u)
        if r is None or r in avoid_ranks or v.shape(u) != v.shape(t) or not v.before(u, node):
            continue
        out.append((v.pos[v.producer[u]["id"]], k, u))
    return [u for *_, u in sorted(out)]


def _tensors_by_lineage(v: PlanView) -> dict[int, list[tuple[int, str]]]:
    """Lineage index -> (position in `v.parts_of`, tensor) of every tensor its parts name: a
    512-rank plan's collectives are too many to scan every part for each of their inputs."""
    out: dict[int, list[tuple[int, str]]] = {}
    for k, (u, parts) in enumerate(v.parts_of.items()):
        for i in {i for i, _ in parts}:
            out.setdefault(i, []).append((k, u))
    return out


def wrong_group(v: PlanView, rng, where):
    cands = []
    by_lineage = _tensors_by_lineage(v)
    for n in v.nodes:
        if n["op"] not in ("all_reduce", "all_gather", "reducer"):
            continue
        inst = v.instance(n)
        first = min(inst, key=lambda m: v.pos[m["id"]])
        group = {v.rank_of(t) for t in n["inputs"] if t is not None}
        for j, t in enumerate(n["inputs"]):
            subs = _same_lineage_elsewhere(v, t, first, group, by_lineage)
            if subs:
                cands.append((n, j, subs[-1]))
                break
    fw = [c for c in cands if c[0]["op"] == "all_reduce"
          and all(v.role(t) == "activation" for t in c[0]["outputs"] if t)]
    n, j, sub = _pick(fw or cands, rng, where, "collective with a same-shaped tensor on a rank "
                      "outside its group (dp > 1)", node_of=lambda c: c[0])
    inst = v.instance(n)
    old = n["inputs"][j]
    for m in inst:
        m["inputs"][j] = sub
        ranks = m["attrs"].get("ranks")
        if isinstance(ranks, list) and len(ranks) == len(m["inputs"]):
            m["attrs"]["ranks"] = list(ranks)
            m["attrs"]["ranks"][j] = v.rank_of(sub)
    v.refresh()
    return _record(n, [m["id"] for m in inst], [o for m in inst for o in m["outputs"]],
                   replaced=old, by=sub)


# ----------------------------------------------------------------------------- rank assignment


def pp_wrong_stage(v: PlanView, rng, where):
    """Re-route a point-to-point receive: the receiver reads another sender's message that
    carries a different slice of the same tensor (another replica or micro-batch)."""

    def slices(t):
        return set(v.parts_of.get(t, []))

    receivers = []
    for n in v.nodes:
        if n["op"] != "move" or len(n["inputs"]) != 1:
            continue
        sender = v.producer.get(n["inputs"][0])
        if sender is None or sender["op"] != "move" or sender["rank"] == n["rank"]:
            continue
        receivers.append((n, sender))
    # Each receiver's alternative: the latest earlier sender of another rank (else of the
    # same rank) among the receivers of the same shape that share a lineage with it but no
    # slice; without a lineage, the latest earlier sender of another replica. Found through
    # indexes sorted by the senders' positions: a 512-rank plan has 16k receivers.
    per_replica = v.w("pp") * v.w("tp")
    spos = [v.pos[s2["id"]] for _, s2 in receivers]
    by_lineage: dict = {}
    by_replica: dict = {}
    for j, (n2, s2) in enumerate(receivers):
        shape = tuple(v.shape(n2["outputs"][0]))
        for i in {i for i, _ in slices(n2["outputs"][0])}:
            by_lineage.setdefault((shape, i), []).append(j)
        by_replica.setdefault(shape, {}).setdefault(s2["rank"] // per_replica, []).append(j)
    for index in (by_lineage, *by_replica.values()):
        for key, js in index.items():
            js.sort(key=spos.__getitem__)
            index[key] = (js, [spos[j] for j in js])

    def latest_first(js: list, keys: list, limit: int):
        return (js[k] for k in range(bisect.bisect_left(keys, limit) - 1, -1, -1))

    cands = []
    for n, sender in receivers:
        out = n["outputs"][0]
        shape, limit = tuple(v.shape(out)), v.pos[n["id"]]
        mine = slices(out)
        best = None  # (another rank, position, sender)
        seen: set = set()
        for j in heapq.merge(*(latest_first(*by_lineage[(shape, i)], limit)
                               for i in {i for i, _ in mine}), key=lambda j: -spos[j]):
            n2, s2 = receivers[j]
            if j in seen or n2 is n or slices(n2["outputs"][0]) & mine:
                continue
            seen.add(j)
            alt = (s2["rank"] != sender["rank"], spos[j], s2)
            if best is None or alt[:2] > best[:2]:
                best = alt
            if alt[0]:
                break
        if not mine and out in v.consumers:
            # no lineage to compare slices: another replica's message of the same shape
            for replica, (js, keys) in by_replica[shape].items():
                if replica == sender["rank"] // per_replica:
                    continue
                j = next((j for j in latest_first(js, keys, limit) if receivers[j][0] is not n),
                         None)
                if j is not None and (best is None or (True, spos[j]) > best[:2]):
                    best = (True, spos[j], receivers[j][1])
        if best is not None:
            cands.append((n, sender, best[2]))
    if where is None:  # a message with a lineage certainly differs from the one it replaces;
        # one without may be a constant all replicas share (a real plan's causal mask)
        cands = ([c for c in cands if slices(c[0]["outputs"][0])]
                 or [c for c in cands if not v.shape_only(c[0]["outputs"][0])] or cands)
    fw = [c for c in cands if v.role(c[0]["outputs"][0]) != "grad"]
    n, sender, s2 = _pick(fw or cands, rng, where, "pipeline receive that can be re-routed "
                          "(pp > 1)", node_of=lambda c: c[0])
    old = n["inputs"][0]
    n["inputs"] = [s2["outputs"][0]]
    n["attrs"] = dict(n["attrs"], src=s2["rank"])
    v.refresh()
    return _record(n, [n["id"]], n["outputs"], replaced=old, by=s2["outputs"][0],
                   wrong_src=s2["rank"], right_src=sender["rank"])


# ----------------------------------------------------------------------------- computation


def _const_nodes(v: PlanView) -> list[dict]:
    adds = [n for n in v.nodes if n["op"] == "add" and n["pass"] == "fw"
            and n["attrs"].get("consts") and len([t for t in n["inputs"] if t]) == 1]
    pows = [n for n in v.nodes if n["op"] == "pow" and n["pass"] == "fw"
            and n["attrs"].get("consts")]
    return adds or pows


def _bad_const(n: dict) -> list:
    consts = list(n["attrs"]["consts"])
    if n["op"] == "pow":
        consts[0] = consts[0] + 1
    else:
        consts[0] = consts[0] * 1000 if consts[0] else 1e-3
    return consts


def wrong_constant_one_rank(v: PlanView, rng, where):
    n = _pick(_const_nodes(v), rng, where, "forward node with a constant operand (RMSNorm eps "
              "or pow exponent)")
    old = n["attrs"]["consts"]
    n["attrs"] = dict(n["attrs"], consts=_bad_const(n))
    return _record(n, [n["id"]], n["outputs"], old=old, new=n["attrs"]["consts"])


def wrong_constant_group(v: PlanView, rng, where):
    n = _pick(_const_nodes(v), rng, where, "forward node with a constant operand")
    group = v.tp_group(n["rank"])
    siblings = {n["id"]}
    for lin in v.plan.get("lineages") or []:
        a = lin.get("aligned")
        if a and n["id"] in a.get("parallel", []):
            siblings |= {m for m in a["parallel"] if m in v.pos
                         and v.nodes[v.pos[m]]["rank"] in group}
    old = n["attrs"]["consts"]
    bad = _bad_const(n)
    changed = []
    for m in v.nodes:
        if m["id"] in siblings:
            m["attrs"] = dict(m["attrs"], consts=list(bad))
            changed.append(m)
    return _record(n, [m["id"] for m in changed], [o for m in changed for o in m["outputs"]],
                   old=old, new=bad, ranks=sorted(group))


def bw_wrong_input(v: PlanView, rng, where):
    """A backward node reads the forward node's output where it needs the forward input (a
    wrong tensor saved for backward)."""
    cands = []
    fw_index: dict[tuple, list[dict]] = {}
    for n in v.nodes:
        if n["pass"] == "fw":
            fw_index.setdefault((n["op"], n["rank"], n["mb"]), []).append(n)
    for bw in v.nodes:
        if bw["pass"] != "bw" or not get_op(bw["op"]).reads_mirrors:
            continue
        fw = None
        for n in fw_index.get((bw["op"], bw["rank"], bw["mb"]), []):
            k = len(n["inputs"])
            if k < len(bw["inputs"]) and bw["inputs"][-k:] == n["inputs"]:
                fw = n
                break
        if fw is None or not fw["outputs"] or fw["outputs"][0] is None:
            continue
        out = fw["outputs"][0]
        base = len(bw["inputs"]) - len(fw["inputs"])
        for j, t in enumerate(fw["inputs"]):
            if t is not None and v.shape(t) == v.shape(out) and v.role(t) != "param":
                cands.append((bw, base + j, out))
                break
    pref = [c for c in cands if c[0]["op"] == "silu"]
    bw, slot, out = _pick(pref or cands, rng, where, "backward node whose mirror input has "
                          "the shape of the forward output", node_of=lambda c: c[0])
    old = bw["inputs"][slot]
    bw["inputs"][slot] = out
    v.refresh()
    return _record(bw, [bw["id"]], bw["outputs"], slot=slot, replaced=old, by=out)


def swap_bw_outputs(v: PlanView, rng, where):
    def two_outputs(n):
        outs = [t for t in n["outputs"] if t is not None]
        return len(outs) >= 2 and v.shape(n["outputs"][0] or outs[0]) == v.shape(outs[1])

    cands = [n for n in v.nodes if n["pass"] == "bw" and n["op"] == "apply_rotary_emb"
             and n["outputs"][0] is not None and n["outputs"][1] is not None]
    if not cands:
        # (not add/sub: their two gradients are equal when alpha is 1)
        cands = [n for n in v.nodes if n["pass"] == "bw" and n["op"] not in ("add", "sub")
                 and len(n["outputs"]) >= 2 and n["outputs"][:2].count(None) == 0
                 and two_outputs(n)]
    n = _pick(cands, rng, where, "backward node with two same-shaped gradient outputs")
    n["outputs"][0], n["outputs"][1] = n["outputs"][1], n["outputs"][0]
    v.refresh()
    return _record(n, [n["id"]], n["outputs"][:2])


# ----------------------------------------------------------------------------- scaling


def _div_node(v: PlanView, base: str, rank: int, mb: int, src: str, dst: str, c: int) -> dict:
    return _node(v.fresh_node_id(_tagged(base, ":div")), "div", "fw", rank, mb, [src], [dst],
                 {"rounding_mode": None, "consts": [c]})


def grad_scale_wrong(v: PlanView, rng, where):
    """An extra division of one rank's weight gradient of one micro-batch by dp (or tp)."""
    cands = []
    for n in v.nodes:
        if n["pass"] != "bw" or n["op"] in ("multiref", "identity"):
            continue
        outs = n["outputs"]
        mirrors = n["inputs"][len(n["inputs"]) - len(outs):]
        for i, (o, m) in enumerate(zip(outs, mirrors)):
            if o is not None and m is not None and v.role(m) == "param":
                cands.append((n, i))
    n, slot = _pick(cands, rng, where, "weight gradient", node_of=lambda c: c[0])
    c = v.w("dp") if v.w("dp") > 1 else v.w("tp") if v.w("tp") > 1 else 2
    t = n["outputs"][slot]
    raw = v.fresh_tensor(t, v.shape(t), "grad")
    n["outputs"][slot] = raw
    div = _div_node(v, n["id"], n["rank"], n["mb"], raw, t, c)
    v.insert(v.pos[n["id"]] + 1, div)
    v.add_to_hints(n["id"], div["id"])
    return _record(n, [div["id"], n["id"]], [t], divisor=c, gradient=t)


def loss_scale_wrong(v: PlanView, rng, where):
    """The loss-gradient seed of one micro-batch is divided by the number of micro-batches (a
    mean-over-micro-batches scaling applied to a plan whose loss is a sum)."""
    cands = [t for t, info in v.plan["tensors"].items()
             if t not in v.producer and info.get("role") == "grad" and info["shape"] == [1]
             and t in v.consumers]
    if where is not None and where in v.pos:
        node = v.nodes[v.pos[where]]
        cands = [t for t in cands if t in node["inputs"]]
        where = None
    t = _pick([{"id": t, "inputs": [], "outputs": [t]} for t in cands], rng, where,
              "loss-gradient seed (graph input, role grad, shape [1])")["id"]
    c = v.w("mb") if v.w("mb") > 1 else v.w("dp") if v.w("dp") > 1 else 2
    readers = list(v.consumers[t])
    first = min(readers, key=lambda n: v.pos[n["id"]])
    scaled = v.fresh_tensor(t, v.shape(t), "grad")
    div = _div_node(v, first["id"], first["rank"], first["mb"], t, scaled, c)
    for n in readers:
        n["inputs"] = [scaled if x == t else x for x in n["inputs"]]
    v.insert(v.pos[first["id"]], div)
    for n in readers:
        v.add_to_hints(n["id"], div["id"])
    return _record(first, [div["id"]] + [n["id"] for n in readers],
                   [scaled] + [o for n in readers for o in n["outputs"]], seed=t, divisor=c)


# ----------------------------------------------------------------------------- scheduling


def reducer_before_last_accum(v: PlanView, rng, where):
    cands = []
    for n in v.nodes:
        if n["op"] != "reducer":
            continue
        for j, t in enumerate(n["inputs"]):
            p = v.producer.get(t)
            if p is not None and p["op"] == "grad_accum":
                cands.append((n, j, p))
                break
    n, j, acc = _pick(cands, rng, where, "reducer reading an accumulated gradient (dp > 1, "
                      "mb > 1)", node_of=lambda c: c[0])
    early = acc["inputs"][0]
    inst = v.instance(n)
    old = n["inputs"][j]
    for m in inst:
        m["inputs"][j] = early
    v.refresh()
    return _record(n, [m["id"] for m in inst], [o for m in inst for o in m["outputs"]],
                   replaced=old, by=early, skipped_accum=acc["id"])


# ----------------------------------------------------------------------------- mixture of experts


GMM = "nnscaler_moe_gmm"


def _gmm_nodes(v: PlanView, pass_: str) -> list[dict]:
    return [n for n in v.nodes if n["op"] == GMM and n["pass"] == pass_]


def _expert_parts(n: dict) -> int:
    """How many nodes share the experts: E / El (1 when this node holds them all)."""
    a = n["attrs"]
    total, el = a.get("n_routed_experts"), a.get("local_expert_end", 0) - a.get(
        "local_expert_start", 0)
    return int(total) // el if total and el > 0 else 1


def moe_expert_range_shifted(v: PlanView, rng, where):
    """Tokens dispatched to the wrong expert rank: one expert-parallel GEMM computes the
    tokens routed to another rank's experts with its own weights (its range moved by El)."""
    cands = [n for n in _gmm_nodes(v, "fw") if _expert_parts(n) > 1]
    n = _pick(cands, rng, where, "expert-parallel nnscaler_moe_gmm (E split over ranks)")
    a = n["attrs"]
    s, e, total = a["local_expert_start"], a["local_expert_end"], a["n_routed_experts"]
    new = (s + (e - s)) % total
    a["local_expert_start"], a["local_expert_end"] = new, new + (e - s)
    return _record(n, [n["id"]], n["outputs"], experts=[s, e], dispatched_as=[new, new + e - s])


def moe_dispatch_wrong_rank(v: PlanView, rng, where):
    """Tokens dispatched to the wrong expert rank: one rank's dispatch all_to_all takes each
    member's token block from the next member (its tokens go to the wrong expert rank, while
    their indices and router weights go to the right one)."""
    cands = []
    for n in v.nodes:
        if n["op"] != "all_to_all" or len(n["inputs"]) < 2 or n["pass"] is not None:
            continue
        if any(c["op"] == GMM and c["pass"] == "fw" and c["inputs"][0] in n["outputs"]
               for c in v.consumers.get(n["outputs"][0], [])):
            cands.append(n)
    n = _pick(cands, rng, where, "all_to_all dispatching tokens to an expert GEMM (ep > 1)")
    old = list(n["inputs"])
    n["inputs"] = old[1:] + old[:1]
    v.refresh()
    return _record(n, [n["id"]], n["outputs"], inputs=old, rotated_to=n["inputs"])


def moe_combine_other_microbatch(v: PlanView, rng, where):
    """The routed experts' outputs are combined with the router weights of another
    micro-batch (same rank, same producer, another micro-batch's tensor), read by the expert
    GEMM or, with expert parallelism, by the dispatch that sends them to the expert ranks."""
    cands = []
    for n in _gmm_nodes(v, "fw") + [m for m in v.nodes
                                    if m["op"] == "moe_dispatch" and m["pass"] == "fw"]:
        t = n["inputs"][2]
        p = v.producer.get(t)
        if p is None or p["op"] == "all_to_all":  # dispatched weights: bug the dispatch
            continue
        slot = p["outputs"].index(t)
        for q in v.nodes:
            if (q["op"] == p["op"] and q["rank"] == p["rank"] and q["mb"] != p["mb"]
                    and q["pass"] == p["pass"] and len(q["outputs"]) > slot
                    and q["outputs"][slot] is not None and v.before(q["outputs"][slot], n)
                    and v.shape(q["outputs"][slot]) == v.shape(t)):
                cands.append((n, q["outputs"][slot]))
                break
    n, other = _pick(cands, rng, where, "nnscaler_moe_gmm or moe_dispatch with another "
                     "micro-batch's router weights on its rank (mb > 1)",
                     node_of=lambda c: c[0])
    old = n["inputs"][2]
    n["inputs"][2] = other
    v.refresh()
    return _record(n, [n["id"]], n["outputs"], replaced=old, by=other)


def _expert_grad(v: PlanView, t: str, depth: int = 0) -> bool:
    """t is an expert weight gradient: a gmm backward's W11/W33/W22 output, possibly
    accumulated over micro-batches."""
    p = v.producer.get(t)
    if p is None or depth > 64:
        return False
    if p["op"] == GMM and p["pass"] == "bw":
        return p["outputs"].index(t) >= 3
    if p["op"] == "grad_accum":
        return any(_expert_grad(v, x, depth + 1) for x in p["inputs"] if x is not None)
    return False


def _tp_index(v: PlanView, t: str) -> int:
    return v.rank_of(t) % v.w("tp")


def moe_expert_grad_wrong_group(v: PlanView, rng, where):
    """Expert gradients reduced over the wrong group. Where the expert-data-parallel group
    is wider than the data-parallel one (ep < tp: every replica's ranks holding the same
    experts, dp * tp/ep of them), the reducer is split into data-parallel reducers (the
    other token groups' parts are lost); otherwise it is widened to the whole data-parallel
    group of the stage (every rank, whatever experts it holds): other experts' gradients are
    added in."""
    edp = [n for n in v.nodes if n["op"] == "reducer" and n["inputs"]
           and _expert_grad(v, n["inputs"][0])
           and len({_tp_index(v, t) for t in n["inputs"]}) > 1]
    if edp:
        n = _pick(edp, rng, where, "reducer of an expert gradient over the "
                  "expert-data-parallel group")
        inst, orig = v.instance(n), list(n["inputs"])
        for m in inst:
            mine = m["rank"] % v.w("tp")
            keep = [i for i, t in enumerate(orig) if _tp_index(v, t) == mine]
            ranks = m["attrs"].get("ranks")
            m["inputs"] = [orig[i] for i in keep]
            if isinstance(ranks, list) and len(ranks) == len(orig):
                m["attrs"]["ranks"] = [ranks[i] for i in keep]
        v.refresh()
        return _record(n, [m["id"] for m in inst], [o for m in inst for o in m["outputs"]],
                       split_into="data-parallel reducers")
    cands = []
    for n in v.nodes:
        if n["op"] != "reducer" or not n["inputs"] or not _expert_grad(v, n["inputs"][0]):
            continue
        t = n["inputs"][0]
        lins = {i for i, sl in v.parts_of.get(t, [])}
        slices = {sl for _, sl in v.parts_of.get(t, [])}
        group = v.tp_group(v.rank_of(t))
        first = min(v.instance(n), key=lambda m: v.pos[m["id"]])
        sibs = [u for u, parts in v.parts_of.items()
                if u not in n["inputs"] and v.rank_of(u) in group and v.role(u) == "grad"
                and v.shape(u) == v.shape(t) and any(i in lins and sl not in slices
                                                     for i, sl in parts)
                and v.before(u, first)]
        if sibs:
            cands.append((n, sorted(sibs)))
    n, sibs = _pick(cands, rng, where, "reducer of an expert-parallel expert gradient (dp > 1, "
                    "experts split)", node_of=lambda c: c[0])
    inst = v.instance(n)
    for m in inst:
        m["inputs"] = list(m["inputs"]) + sibs
        ranks = m["attrs"].get("ranks")
        if isinstance(ranks, list):
            m["attrs"]["ranks"] = list(ranks) + [v.rank_of(u) for u in sibs]
    v.refresh()
    return _record(n, [m["id"] for m in inst], [o for m in inst for o in m["outputs"]],
                   added=sibs)


def _scaled_output(v: PlanView, n: dict, slot: int, c: int, why: str) -> dict:
    t = n["outputs"][slot]
    raw = v.fresh_tensor(t, v.shape(t), "grad")
    n["outputs"][slot] = raw
    mul = _node(v.fresh_node_id(_tagged(n["id"], ":mul")), "mul", "fw", n["rank"], n["mb"],
                [raw], [t], {"consts": [c]})
    v.insert(v.pos[n["id"]] + 1, mul)
    v.add_to_hints(n["id"], mul["id"])
    return _record(n, [mul["id"], n["id"]], [t], factor=c, gradient=t, why=why)


def moe_expert_grad_not_divided(v: PlanView, rng, where):
    """One expert weight gradient is multiplied by the expert-parallel size (summed over the
    expert-parallel group as if it were replicated, not divided back: doubled at EP = 2)."""
    cands = [(n, i) for n in _gmm_nodes(v, "bw") for i in (3, 4, 5)
             if len(n["outputs"]) > i and n["outputs"][i] is not None]
    n, slot = _pick(cands, rng, where, "nnscaler_moe_gmm backward", node_of=lambda c: c[0])
    parts = _expert_parts(n)
    return _scaled_output(v, n, slot, parts if parts > 1 else 2, "expert-parallel size")


def moe_aux_grad_scaled_by_tp(v: PlanView, rng, where):
    """The auxiliary load-balancing loss's gradient (into the router weights) is multiplied
    by the tensor-parallel size on one rank (a loss computed redundantly on every tp rank and
    then treated as a tp partial sum)."""
    cands = [n for n in v.nodes if n["op"] == "moe_aux_loss" and n["pass"] == "bw"
             and n["outputs"] and n["outputs"][0] is not None]
    n = _pick(cands, rng, where, "moe_aux_loss backward (auxiliary load-balancing loss)")
    tp = v.w("tp")
    return _scaled_output(v, n, 0, tp if tp > 1 else 2, "tensor-parallel size")


# ----------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class Mutation:
    name: str
    category: str
    description: str
    apply: Callable[[PlanView, random.Random, str | None], dict]
    breaks_graph: bool = False


_ALL = [
    Mutation("drop-allreduce-keep-dataflow", "communication",
             "a forward tensor-parallel all_reduce becomes an identity: its consumers read the "
             "local partial sum", drop_allreduce_keep_dataflow),
    Mutation("drop-allreduce-break-dataflow", "communication",
             "a forward all_reduce node is deleted: its consumers read a tensor nothing writes "
             "(a broken plan: the verifier must refuse it)", drop_allreduce_break_dataflow,
             breaks_graph=True),
    Mutation("allreduce-to-allgather", "communication",
             "an all_reduce of partial sums becomes an all_gather of pieces of the partial "
             "sums (concatenation instead of reduction)", allreduce_to_allgather),
    Mutation("allgather-to-allreduce", "communication",
             "an all_gather of shards gathers their sum (all_reduce) instead of the shards",
             allgather_to_allreduce),
    Mutation("drop-bw-reduction", "communication",
             "the backward all_reduce of a column-parallel region's input gradient "
             "(IdentityAllreduce) becomes an identity: the gradient stays a partial sum",
             drop_bw_reduction),
    Mutation("wrong-group", "communication",
             "a collective reads one member's tensor from a rank outside its group (another "
             "data-parallel replica)", wrong_group),
    Mutation("pp-wrong-stage", "rank assignment",
             "a pipeline receive is routed from the wrong rank: the receiver gets another "
             "replica's (or micro-batch's) activation", pp_wrong_stage),
    Mutation("wrong-constant-one-rank", "computation",
             "a constant operand (RMSNorm eps, or a pow exponent) is wrong on one rank",
             wrong_constant_one_rank),
    Mutation("wrong-constant-group", "computation",
             "a constant operand is wrong on every rank of one tensor-parallel group (all "
             "micro-batches)", wrong_constant_group),
    Mutation("bw-wrong-input", "computation",
             "a backward node reads the forward output instead of the forward input as its "
             "mirror (a wrong tensor saved for backward)", bw_wrong_input),
    Mutation("swap-bw-outputs", "computation",
             "the two gradient outputs of a backward node (rotary embedding: dq, dk) are "
             "swapped", swap_bw_outputs),
    Mutation("grad-scale-wrong", "scaling",
             "one rank's weight gradient of one micro-batch is divided by dp (or tp)",
             grad_scale_wrong),
    Mutation("loss-scale-wrong", "scaling",
             "one micro-batch's loss-gradient seed is divided by the number of micro-batches",
             loss_scale_wrong),
    Mutation("reducer-before-last-accum", "scheduling",
             "the data-parallel reducer reads one rank's weight gradient before the last "
             "micro-batch has been accumulated", reducer_before_last_accum),
    Mutation("moe-expert-grad-wrong-group", "mixture of experts",
             "expert gradients are reduced over the data-parallel group of the stage instead "
             "of the expert-data-parallel group: other experts' gradients are added in",
             moe_expert_grad_wrong_group),
    Mutation("moe-expert-grad-not-divided", "mixture of experts",
             "one expert weight gradient is multiplied by the expert-parallel size (not "
             "divided back after an expert-parallel sum: doubled at EP = 2)",
             moe_expert_grad_not_divided),
    Mutation("moe-aux-grad-scaled-by-tp", "mixture of experts",
             "the auxiliary load-balancing loss's gradient is multiplied by the tensor-parallel "
             "size on one rank", moe_aux_grad_scaled_by_tp),
    Mutation("moe-dispatch-wrong-rank", "mixture of experts",
             "tokens are dispatched to the wrong expert rank: one dispatch all_to_all takes "
             "every member's token block from the next member", moe_dispatch_wrong_rank),
    Mutation("moe-expert-range-shifted", "mixture of experts",
             "tokens are dispatched to the wrong expert rank: one expert GEMM computes another "
             "rank's experts' tokens with its own expert weights", moe_expert_range_shifted),
    Mutation("moe-combine-other-microbatch", "mixture of experts",
             "the routed experts' outputs are combined with the router weights of another "
             "micro-batch", moe_combine_other_microbatch),
]

MUTATIONS: dict[str, Mutation] = {m.name: m for m in _ALL}


def apply(parallel: dict[str, Any], name: str, seed: int = 0, where: str | None = None
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inject bug `name` into a copy of the parallel plan dict: (mutated plan, record)."""
    if name not in MUTATIONS:
        raise ValueError(f"unknown bug {name!r} (choose from {', '.join(MUTATIONS)})")
    if parallel.get("kind") != "parallel":
        raise ValueError("mutations apply to a parallel plan")
    m = MUTATIONS[name]
    plan = _copy_of(parallel)
    info = m.apply(PlanView(plan), random.Random(seed), where)
    plan["name"] = f"{parallel.get('name', 'plan')}+{name}"
    record = {"bug": name, "category": m.category, "description": m.description,
              "breaks_graph": m.breaks_graph, "seed": seed, "where": where, **info}
    return plan, record
