"""Tracing one model description into a single or a parallel execution plan.

A model is written once, as forward code over `Tracer` calls (`op`, `multiref`, `all_reduce`,
`tp_enter`, `all_gather`, `goto`, ...). The tracer runs that code once per (data-parallel
replica d, micro-batch m), "SPMD" over the tensor-parallel group: a `Val` holds the tp group's
tensors (one per tp rank) and every call emits one node per tp rank, so collectives always find
their group's inputs already written. Each call also records a tape entry; `backward` walks the
tape in reverse and emits the backward nodes (plan convention: grads of the outputs, then the
forward inputs as mirrors; grads of the inputs out, null where none), the backward halves of
the communication (all_reduce for `tp_enter`, chunk for `all_gather`, moves back), the
micro-batch gradient accumulation (`grad_accum`) and, at the end, the data-parallel `reducer`s.

The single plan is the same description traced on a 1x1x1x1 world, so both plans always agree
on the model; tensor ids of the single plan are the *keys* of the description.

Lineages come from the layouts. Every parallel tensor the tracer creates is an *instance* of
(key, version) with a `Layout` saying which slice of the single tensor `key` it holds; versions
separate the representations of one single tensor before/after a collective or a move. At the
end, every (key, version) becomes one lineage (graph inputs first, then first-creation order,
which is a dependency order), with an `aligned` hint for compute nodes and reducers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from tvsmt.frontends.builder import PlanBuilder

_INHERIT = object()


@dataclass(frozen=True)
class World:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    mb: int = 1
    ep: int | None = None  # expert-parallel size, a divisor of tp (None: ep = tp)

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def ep_size(self) -> int:
        return self.tp if self.ep is None else self.ep

    def rank(self, d: int, stage: int, t: int) -> int:
        """rank = dp_index*(pp*tp) + pp_stage*tp + tp_index (as the reference fixtures)."""
        return d * self.pp * self.tp + stage * self.tp + t


@dataclass(frozen=True)
class Layout:
    """How one parallel instance relates to its single tensor.

    batch: axis 0 holds this (replica, micro-batch)'s rows of the global batch;
    split: the axis cut in `tp` equal pieces, piece t on tp rank t;
    partial: the tp group's tensors add up to the value (before an all_reduce);
    reduce: "dm" = the value is the sum over every (replica, micro-batch) instance (a loss, a
    weight gradient of one micro-batch), "d" = the sum over replicas (accumulated gradients).
    pieces: the split axis is cut in `pieces` pieces (0: tp), piece t % pieces on tp rank t
    (expert weights, split over the expert-parallel group only); with `partial`, the ranks
    holding one piece add up to it (an expert gradient of one token group).
    """

    batch: bool = True
    split: int | None = None
    partial: bool = False
    reduce: str = ""
    pieces: int = 0


REPLICATED = Layout(batch=False)


@dataclass(eq=False)
class Val:
    key: str  # single-plan tensor id
    ver: int
    ids: list[str]  # one parallel tensor per tp rank
    stage: int
    layout: Layout
    shape: tuple[int, ...]  # local shape (equal on every tp rank)
    role: str
    grad: bool  # requires a gradient
    param: bool = False
    hidden: bool = False  # has no single-plan counterpart (no lineage): e.g. a dispatch buffer

    @property
    def kv(self) -> tuple[str, int]:
        return (self.key, self.ver)


@dataclass
class _Inst:
    d: int
    m: int
    t: int
    tid: str
    layout: Layout
    shape: tuple[int, ...]


@dataclass
class _Hint:
    single: list[str]
    parallel: list[str] = field(default_factory=list)
    inputs: list[tuple[str, int]] = field(default_factory=list)


class Tracer:
    def __init__(self, builder: PlanBuilder, world: World):
        self.b = builder
        self.w = world
        self.single = builder.kind == "single"
        self.tp = world.tp
        # lineage bookkeeping (kept for both kinds; only the parallel plan writes lineages)
        self.input_order: list[tuple[str, int]] = []
        self.order: list[tuple[str, int]] = []
        self.instances: dict[tuple[str, int], list[_Inst]] = defaultdict(list)
        self.hints: dict[tuple[str, int], _Hint] = {}
        self._node_hints: dict[str, _Hint] = {}
        # graph inputs held per rank (weights, constants)
        self._per_rank: dict[tuple[str, int], str] = {}
        # gradient accumulation: (grad key, rank) -> every micro-batch's gradient so far
        self._acc: dict[tuple[str, int], list[str]] = {}
        self._final_vals: dict[tuple[str, int], Val] = {}  # (grad key, d) -> final Val
        self.weight_grads: list[str] = []  # single keys of the weight gradients, in order
        self.d = self.m = self.stage = 0
        self._tape: list[tuple] = []
        self._ver: dict[str, int] = defaultdict(int)
        self._rank_attrs: dict[str, Any] = {}  # op sid -> attrs_of(tp index), see op_per_rank
        self._partial_grads: set[str] = set()  # op sids whose input gradients are tp partial

    # ------------------------------------------------------------------ runs

    def start_run(self, d: int, m: int) -> None:
        self.d, self.m, self.stage = d, m, 0
        self._tape = []
        self._ver = defaultdict(int)

    def group(self, stage: int | None = None) -> list[int]:
        s = self.stage if stage is None else stage
        return [self.w.rank(self.d, s, t) for t in range(self.tp)]

    def _new_ver(self, key: str) -> int:
        v = self._ver[key]
        self._ver[key] += 1
        return v

    # ------------------------------------------------------------------ ids

    def _tid(self, key: str, ver: int, rank: int, per_mb: bool = True) -> str:
        if self.single:
            if ver:
                raise AssertionError(f"single plan tensor {key} has a version {ver}")
            return key
        base = key if ver == 0 else f"{key}~{ver}"
        return f"{base}@r{rank}m{self.m}" if per_mb else f"{base}@r{rank}"

    def _nid(self, base: str, rank: int, m: int | None = None) -> str:
        if self.single:
            return base
        return f"{base}@r{rank}m{self.m if m is None else m}"

    # ------------------------------------------------------------------ registration

    def _register(self, v: Val, is_input: bool = False) -> None:
        if v.hidden:
            return
        kv = v.kv
        if kv not in self.instances:
            (self.input_order if is_input else self.order).append(kv)
        for t, tid in enumerate(v.ids):
            self.instances[kv].append(_Inst(self.d, self.m, t, tid, v.layout, v.shape))

    def _declare(self, v: Val) -> None:
        for tid in v.ids:
            self.b.add_tensor(tid, v.shape, v.role)

    def _norm_layout(self, layout: Layout, ndim: int) -> Layout:
        if layout.split is not None and layout.split < 0:
            return replace(layout, split=layout.split + ndim)
        return layout

    # ------------------------------------------------------------------ graph inputs

    def data(self, key: str, shape: Sequence[int], role: str = "input") -> Val:
        """A graph input of this (replica, micro-batch), replicated over the tp group."""
        v = Val(key, self._new_ver(key), [], self.stage, Layout(batch=True), tuple(shape),
                role, grad=False)
        v.ids = [self._tid(key, v.ver, r) for r in self.group()]
        self._declare(v)
        self._register(v, is_input=True)
        return v

    def _held(self, key: str, full: Sequence[int], split: int | None, role: str,
              grad: bool, pieces: int = 0) -> Val:
        """A graph input held by each rank of the current stage (weight, constant), read by
        every micro-batch: one lineage instance per (replica, micro-batch, tp rank)."""
        full = tuple(full)
        pieces = 0 if pieces == self.tp else pieces
        layout = self._norm_layout(Layout(batch=False, split=split, pieces=pieces), len(full))
        shape = list(full)
        if layout.split is not None:
            n = pieces or self.tp
            if full[layout.split] % n:
                raise ValueError(f"{key}: axis {layout.split} of {list(full)} is not divisible "
                                 f"into {n} pieces")
            shape[layout.split] //= n
        ids = []
        for r in self.group():
            tid = self._per_rank.get((key, r))
            if tid is None:
                tid = self._tid(key, 0, r, per_mb=False)
                self.b.add_tensor(tid, shape, role)
                self._per_rank[(key, r)] = tid
            ids.append(tid)
        v = Val(key, 0, ids, self.stage, layout, tuple(shape), role, grad=grad, param=grad)
        self._register(v, is_input=True)
        return v

    def param(self, key: str, full: Sequence[int], split: int | None = None,
              pieces: int = 0) -> Val:
        """A weight; `pieces` (a divisor of tp): split in that many pieces, piece t % pieces
        on tp rank t (expert weights over the expert-parallel group)."""
        return self._held(key, full, split, "param", grad=True, pieces=pieces)

    def const(self, key: str, full: Sequence[int]) -> Val:
        return self._held(key, full, None, "const", grad=False)

    def seed(self, key: str, shape: Sequence[int]) -> Val:
        """The loss-gradient seed dL/dL of this micro-batch (a graph input, role grad)."""
        v = Val(key, self._new_ver(key), [], self.stage, REPLICATED, tuple(shape), "grad",
                grad=False)
        v.ids = [self._tid(key, v.ver, r) for r in self.group()]
        self._declare(v)
        self._register(v, is_input=True)
        return v

    # ------------------------------------------------------------------ compute

    def op(self, op: str, inputs: Sequence[Val], outs: str | Sequence[str],
           shapes: Sequence[int] | Sequence[Sequence[int]], attrs: dict | None = None, *,
           split: Any = _INHERIT, partial: bool = False, batch: bool | None = None,
           reduce: str = "", role: str = "activation", differentiable: bool = True,
           hidden: bool = False, partial_grads: bool = False):
        """One forward operator on every rank of the tp group. Returns a Val (one output) or a
        list of Vals. The outputs' layout is the first split input's layout unless given.
        hidden: the outputs have no single-plan counterpart (no lineage); partial_grads: the
        gradients of its inputs are tp partial sums (each rank differentiates its own rows)."""
        single_out = isinstance(outs, str)
        names = [outs] if single_out else list(outs)
        shape_list = [tuple(shapes)] if single_out else [tuple(s) for s in shapes]
        attrs = dict(attrs or {})
        for v in inputs:
            if v.stage != self.stage:
                raise AssertionError(f"{op} -> {names}: input {v.key} is on stage {v.stage}, "
                                     f"the op on stage {self.stage}")
        if split is _INHERIT:
            split = next((v.layout.split for v in inputs if v.layout.split is not None), None)
        if batch is None:
            batch = any(v.layout.batch for v in inputs)
        partial = partial and self.tp > 1
        grad = differentiable and any(v.grad for v in inputs)
        sid = f"{names[0]}:{op}"
        out_vals = []
        for name, shape in zip(names, shape_list):
            layout = self._norm_layout(Layout(batch, split, partial, reduce), len(shape))
            v = Val(name, self._new_ver(name), [], self.stage, layout, shape, role, grad,
                    hidden=hidden)
            v.ids = [self._tid(name, v.ver, r) for r in self.group()]
            self._declare(v)
            out_vals.append(v)
        if partial_grads:
            self._partial_grads.add(sid)
        hint = self._hint_for(sid, [v.kv for v in inputs if not v.hidden])
        for t, r in enumerate(self.group()):
            nid = self._nid(sid, r)
            self.b.add_node(nid, op, "fw", r, self.m, [v.ids[t] for v in inputs],
                            [v.ids[t] for v in out_vals], attrs)
            hint.parallel.append(nid)
        for v in out_vals:
            self._register(v)
            if not v.hidden:
                self.hints.setdefault(v.kv, hint)
        self._tape.append(("op", op, sid, list(inputs), out_vals, attrs))
        return out_vals[0] if single_out else out_vals

    def op_per_rank(self, op: str, inputs: Sequence[Val], outs, shapes, attrs_of, **kw):
        """`op` whose attributes depend on the tp index t (`attrs_of(t)`), e.g. the expert range
        of an expert-parallel GEMM; its backward nodes get the same per-rank attributes."""
        first = len(self.b.nodes)
        out = self.op(op, inputs, outs, shapes, attrs_of(0), **kw)
        for t, node in enumerate(self.b.nodes[first:]):
            node["attrs"] = dict(attrs_of(t))
        self._rank_attrs[self._tape[-1][2]] = attrs_of
        return out

    def _hint_for(self, sid: str, inputs: list[tuple[str, int]]) -> _Hint:
        hint = self._node_hints.get(sid)
        if hint is None:
            hint = self._node_hints[sid] = _Hint([sid], [], inputs)
        return hint

    def multiref(self, x: Val, n: int) -> list[Val]:
        """n copies of x (the plan convention for a tensor read twice)."""
        names = [f"{x.key}#{i}" for i in range(n)]
        copies = []
        for name in names:
            v = Val(name, self._new_ver(name), [], self.stage, x.layout, x.shape, x.role, x.grad)
            v.ids = [self._tid(name, v.ver, r) for r in self.group()]
            self._declare(v)
            copies.append(v)
        sid = f"{x.key}:multiref"
        for t, r in enumerate(self.group()):
            self.b.add_node(self._nid(sid, r), "multiref", "fw", r, self.m, [x.ids[t]],
                            [c.ids[t] for c in copies], {"times": n})
        for c in copies:
            self._register(c)
        self._tape.append(("multiref", sid, x, copies))
        return copies

    # ------------------------------------------------------------------ communication

    def _comm_val(self, x: Val, layout: Layout, stage: int | None = None,
                  shape: Sequence[int] | None = None) -> Val:
        stage = self.stage if stage is None else stage
        v = Val(x.key, self._new_ver(x.key), [], stage, layout,
                tuple(shape) if shape is not None else x.shape, x.role, x.grad, x.param,
                hidden=x.hidden)
        v.ids = [self._tid(x.key, v.ver, r) for r in self.group(stage)]
        self._declare(v)
        return v

    def _all_reduce(self, x: Val) -> Val:
        y = self._comm_val(x, replace(x.layout, partial=False))
        ranks = self.group()
        for t, r in enumerate(ranks):
            self.b.add_node(self._nid(f"{y.key}~{y.ver}:all_reduce", r), "all_reduce", None, r,
                            self.m, list(x.ids), [y.ids[t]], {"ranks": ranks})
        self._register(y)
        return y

    def all_reduce(self, x: Val) -> Val:
        """Forward all_reduce of tp partial sums (Megatron's AllReduceIdentity: the backward
        is the identity)."""
        if self.tp == 1:
            return x
        if not x.layout.partial:
            raise AssertionError(f"all_reduce of {x.key}, which is not a partial sum")
        y = self._all_reduce(x)
        self._tape.append(("all_reduce", x, y))
        return y

    def tp_enter(self, x: Val) -> Val:
        """Start of a column-parallel region (Megatron's IdentityAllreduce): identity forward,
        all_reduce of the input gradient backward."""
        if self.tp > 1 and x.grad:
            self._tape.append(("tp_enter", x))
        return x

    def all_gather(self, x: Val, dim: int) -> Val:
        """Concatenate the tp shards along `dim` (AllGatherSplit: chunk backward)."""
        if self.tp == 1:
            return x
        dim %= len(x.shape)
        if x.layout.split != dim:
            raise AssertionError(f"all_gather of {x.key} along {dim}: split is {x.layout.split}")
        shape = list(x.shape)
        shape[dim] *= self.tp
        y = self._comm_val(x, replace(x.layout, split=None), shape=shape)
        ranks = self.group()
        for t, r in enumerate(ranks):
            self.b.add_node(self._nid(f"{y.key}~{y.ver}:all_gather", r), "all_gather", None, r,
                            self.m, list(x.ids), [y.ids[t]], {"dim": dim, "ranks": ranks})
        self._register(y)
        self._tape.append(("all_gather", x, y, dim))
        return y

    def _all_to_all(self, x: Val, ep: int) -> Val:
        y = self._comm_val(x, x.layout)
        ranks = self.group()
        for t, r in enumerate(ranks):
            members = ranks[t - t % ep:t - t % ep + ep]
            self.b.add_node(self._nid(f"{y.key}~{y.ver}:all_to_all", r), "all_to_all", None, r,
                            self.m, [x.ids[ranks.index(q)] for q in members], [y.ids[t]],
                            {"dim": 0, "split_dim": 0, "ranks": members, "idx": t % ep})
        self._register(y)
        return y

    def all_to_all(self, x: Val, ep: int) -> Val:
        """Exchange row pieces inside each expert-parallel group (ep consecutive tp ranks):
        rank q of a group receives piece q of every member's rows, in member order (the
        dispatch / combine of routed tokens). Its own inverse, so also its backward."""
        if ep == 1:
            return x
        if self.tp % ep:
            raise AssertionError(f"expert-parallel size {ep} does not divide tp={self.tp}")
        y = self._all_to_all(x, ep)
        self._tape.append(("all_to_all", x, y, ep))
        return y

    def _chunk(self, x: Val, dim: int) -> Val:
        shape = list(x.shape)
        shape[dim] //= self.tp
        y = self._comm_val(x, replace(x.layout, split=dim), shape=shape)
        ranks = self.group()
        for t, r in enumerate(ranks):
            self.b.add_node(self._nid(f"{y.key}~{y.ver}:chunk", r), "chunk", None, r, self.m,
                            [x.ids[t]], [y.ids[t]], {"dim": dim, "ranks": ranks, "idx": t})
        self._register(y)
        return y

    def _move(self, x: Val, dst_stage: int) -> Val:
        y = self._comm_val(x, x.layout, stage=dst_stage)
        src_ranks, dst_ranks = self.group(x.stage), self.group(dst_stage)
        for t in range(self.tp):
            src, dst = src_ranks[t], dst_ranks[t]
            flight = f"{x.key}~{y.ver}@r{src}>r{dst}m{self.m}"
            self.b.add_tensor(flight, x.shape, x.role)
            attrs = {"src": src, "dst": dst, "shape": list(x.shape), "dtype": "torch.float32"}
            base = f"{y.key}~{y.ver}"
            self.b.add_node(self._nid(f"{base}:send", src), "move", None, src, self.m,
                            [x.ids[t]], [flight], attrs)
            self.b.add_node(self._nid(f"{base}:recv", dst), "move", None, dst, self.m,
                            [flight], [y.ids[t]], attrs)
        self._register(y)
        return y

    def goto(self, stage: int, *vals: Val) -> list[Val]:
        """Continue on pipeline stage `stage`, moving `vals` there stage by stage."""
        out = []
        for v in vals:
            while v.stage != stage:
                nxt = v.stage + (1 if stage > v.stage else -1)
                y = self._move(v, nxt)
                self._tape.append(("move", v, y))
                v = y
            out.append(v)
        self.stage = stage
        return out

    # ------------------------------------------------------------------ backward

    def backward(self, loss: Val, seed_key: str) -> None:
        """Emit the backward pass of the current run, seeded with dL/dL (a graph input)."""
        grads: dict[int, Val] = {}
        seed = self.seed(seed_key, loss.shape)
        grads[id(loss)] = seed

        def set_grad(v: Val, g: Val, replace_ok: bool = False) -> None:
            if id(v) in grads and not replace_ok:
                raise AssertionError(f"{v.key} receives two gradients: use multiref")
            grads[id(v)] = g

        for entry in reversed(self._tape):
            kind = entry[0]
            if kind == "op":
                _, op, sid, ins, outs, attrs = entry
                gouts = [grads.get(id(o)) for o in outs]
                if all(g is None for g in gouts) or not any(v.grad for v in ins):
                    continue
                self.stage = outs[0].stage
                for v, g in zip(ins, self._bw_op(op, sid, ins, outs, gouts, attrs)):
                    if g is not None:
                        set_grad(v, g)
            elif kind == "multiref":
                _, sid, x, copies = entry
                gs = [grads[id(c)] for c in copies if id(c) in grads]
                if not gs or not x.grad:
                    continue
                self.stage = x.stage
                set_grad(x, self._bw_multiref(sid, x, gs))
            elif kind == "all_reduce":
                _, x, y = entry
                if id(y) in grads:
                    set_grad(x, grads[id(y)])
            elif kind == "tp_enter":
                _, x = entry
                g = grads.get(id(x))
                if g is not None:
                    if not g.layout.partial:
                        raise AssertionError(f"gradient of {x.key} is not a tp partial sum")
                    self.stage = g.stage
                    set_grad(x, self._all_reduce(g), replace_ok=True)
            elif kind == "all_to_all":
                _, x, y, ep = entry
                if id(y) in grads:
                    self.stage = y.stage
                    set_grad(x, self._all_to_all(grads[id(y)], ep))
            elif kind == "all_gather":
                _, x, y, dim = entry
                if id(y) in grads:
                    self.stage = y.stage
                    set_grad(x, self._chunk(grads[id(y)], dim))
            elif kind == "move":
                _, x, y = entry
                if id(y) in grads:
                    self.stage = y.stage
                    set_grad(x, self._move(grads[id(y)], x.stage))

    def _grad_layout(self, v: Val, ins: Sequence[Val]) -> Layout:
        """A gradient has its tensor's layout, except that the gradient of a replicated input
        of an op whose other operands are tp-split is a tp partial sum (column-parallel
        linear), and a weight's gradient of one micro-batch is a (replica, micro-batch)
        partial sum."""
        lay = v.layout
        if lay.partial:
            raise AssertionError(f"gradient of the tp partial sum {v.key}")
        partial = (self.tp > 1 and lay.split is None
                   and any(o.layout.split is not None for o in ins if o is not v))
        if lay.pieces and self.tp > lay.pieces:  # an expert weight: one token group's part
            partial = True
        return Layout(batch=lay.batch, split=lay.split, partial=partial,
                      reduce="dm" if v.param else "", pieces=lay.pieces)

    def _bw_op(self, op, sid, ins, outs, gouts, attrs) -> list[Val | None]:
        bsid = sid.replace(f":{op}", f":BW.{op}", 1)
        gins: list[Val | None] = []
        for v in ins:
            if not v.grad:
                gins.append(None)
                continue
            key = f"{v.key}.grad"
            if v.param and key not in self.weight_grads:
                self.weight_grads.append(key)
            layout = self._grad_layout(v, ins)
            if sid in self._partial_grads and self.tp > 1:
                layout = replace(layout, partial=True)
            g = Val(key, self._new_ver(key), [], self.stage, layout, v.shape,
                    "grad", grad=False, param=v.param, hidden=v.hidden)
            g.ids = [self._tid(key, g.ver, r) for r in self.group()]
            self._declare(g)
            gins.append(g)
        inputs = [g.kv for g in gouts if g is not None and not g.hidden]
        hint = self._hint_for(bsid, inputs + [v.kv for v in ins if not v.hidden])
        for t, r in enumerate(self.group()):
            nid = self._nid(bsid, r)
            self.b.add_node(nid, op, "bw", r, self.m,
                            [g.ids[t] if g is not None else None for g in gouts]
                            + [v.ids[t] for v in ins],
                            [g.ids[t] if g is not None else None for g in gins],
                            self._rank_attrs[sid](t) if sid in self._rank_attrs else attrs)
            hint.parallel.append(nid)
        for g in gins:
            if g is not None:
                self._register(g)
                if not g.hidden:
                    self.hints.setdefault(g.kv, hint)
                if g.param:
                    self._accumulate(g)
        return gins

    def _bw_multiref(self, sid: str, x: Val, gs: list[Val]) -> Val:
        partial = {g.layout.partial for g in gs}
        if len(partial) != 1:
            raise AssertionError(f"{x.key}: copies with full and partial gradients")
        key = f"{x.key}.grad"
        g = Val(key, self._new_ver(key), [], self.stage, gs[0].layout, x.shape, "grad", False)
        g.ids = [self._tid(key, g.ver, r) for r in self.group()]
        self._declare(g)
        bsid = sid.replace(":multiref", ":BW.multiref", 1)
        for t, r in enumerate(self.group()):
            self.b.add_node(self._nid(bsid, r), "multiref", "bw", r, self.m,
                            [c.ids[t] for c in gs], [g.ids[t]], {})
        self._register(g)
        return g

    # ------------------------------------------------------------------ gradient finalization

    def _accumulate(self, g: Val) -> None:
        """grad_accum of a weight gradient over this rank's micro-batches: one n-ary node at
        the last micro-batch, which sums every micro-batch's gradient (an n-ary sum keeps the
        plan the same for every micro-batch, which is what replica folding needs)."""
        mb = self.w.mb
        for t, r in enumerate(self.group()):
            self._acc.setdefault((g.key, r), []).append(g.ids[t])
        if self.m < mb - 1:
            return
        final = g
        if mb > 1:
            final = Val(g.key, self._new_ver(g.key), [], self.stage,
                        replace(g.layout, reduce="d"), g.shape, "grad", False, True)
            final.ids = [self._tid(g.key, final.ver, r, per_mb=False) for r in self.group()]
            for t, r in enumerate(self.group()):
                self.b.add_tensor(final.ids[t], g.shape, "grad")
                self.b.add_node(self._nid(f"{g.key}:grad_accum", r), "grad_accum", None, r,
                                self.m, self._acc[(g.key, r)], [final.ids[t]], {})
            self._register(final)
        self._final_vals[(g.key, self.d)] = final

    def finalize_gradients(self) -> dict[str, list[str]]:
        """Reducers over the data-parallel replicas; returns, per weight-gradient key, the
        final parallel tensors (every one must equal the single gradient, or its tp shard)."""
        finals: dict[str, list[str]] = {}
        for key in self.weight_grads:
            per_d = [self._final_vals[(key, d)] for d in range(self.w.dp)]
            src = per_d[0]
            # an expert gradient of one token group is reduced over the expert-data-parallel
            # group: every replica's ranks holding the same experts (t % pieces)
            pieces = src.layout.pieces if src.layout.partial else 0
            if self.w.dp == 1 and not pieces:
                finals[key] = list(per_d[0].ids)
                continue
            ver = src.ver + 1
            hint = _Hint([], [], [src.kv])
            layout = replace(src.layout, reduce="", partial=False)
            out = []
            for d in range(self.w.dp):
                self.d, self.m = d, 0
                v = Val(key, ver, [], src.stage, layout, src.shape, "grad", False, True)
                for t in range(self.tp):
                    r = self.w.rank(d, src.stage, t)
                    tid = self._tid(key, ver, r, per_mb=False)
                    self.b.add_tensor(tid, src.shape, "grad")
                    ts = [u for u in range(self.tp) if u % pieces == t % pieces] if pieces \
                        else [t]
                    inputs = [per_d[dd].ids[u] for dd in range(self.w.dp) for u in ts]
                    nid = f"{key}:reducer@r{r}"
                    self.b.add_node(nid, "reducer", None, r, 0, inputs, [tid],
                                    {"ranks": [self.w.rank(dd, src.stage, u)
                                               for dd in range(self.w.dp) for u in ts]})
                    hint.parallel.append(nid)
                    v.ids.append(tid)
                self._register(v)
                out.extend(v.ids)
            self.hints[(key, ver)] = hint
            finals[key] = out
        return finals

    def finalize_loss(self, losses: dict[tuple[int, int], Val]) -> None:
        """Make the whole loss appear on every last-stage rank (it is an output of the single
        plan, and outputs need whole-tensor lineages): each rank adds up its micro-batches'
        partial losses (one n-ary `grad_accum`), then an all_reduce sums the replicas' (as Megatron's
        loss reporting does, without its averaging)."""
        if self.single:
            return
        w, first = self.w, losses[(0, 0)]
        acc: dict[tuple[int, int], str] = {}
        if w.mb > 1:
            ver = first.ver + 1
            for d in range(w.dp):
                self.d, self.m = d, w.mb - 1
                v = Val(first.key, ver, [], first.stage, replace(first.layout, reduce="d"),
                        first.shape, "loss", False)
                for t in range(self.tp):
                    r = w.rank(d, first.stage, t)
                    out = self._tid(first.key, ver, r, per_mb=False)
                    self.b.add_tensor(out, first.shape, "loss")
                    self.b.add_node(f"{first.key}:grad_accum@r{r}m{w.mb - 1}", "grad_accum",
                                    None, r, w.mb - 1,
                                    [losses[(d, m)].ids[t] for m in range(w.mb)], [out], {})
                    acc[(d, t)] = out
                    v.ids.append(out)
                self._register(v)
        else:
            ver = first.ver
            acc = {(d, t): losses[(d, 0)].ids[t] for d in range(w.dp) for t in range(self.tp)}
        if w.dp == 1:
            return
        ver += 1
        for d in range(w.dp):
            self.d, self.m = d, 0
            v = Val(first.key, ver, [], first.stage, REPLICATED, first.shape, "loss", False)
            for t in range(self.tp):
                r = w.rank(d, first.stage, t)
                ranks = [w.rank(dd, first.stage, t) for dd in range(w.dp)]
                out = self._tid(first.key, ver, r, per_mb=False)
                self.b.add_tensor(out, first.shape, "loss")
                self.b.add_node(f"{first.key}~{ver}:all_reduce@r{r}", "all_reduce", None, r, 0,
                                [acc[(dd, t)] for dd in range(w.dp)], [out], {"ranks": ranks})
                v.ids.append(out)
            self._register(v)

    # ------------------------------------------------------------------ lineages

    def _slice(self, inst: _Inst, full: tuple[int, ...]) -> list[list[int]]:
        lay = inst.layout
        sl = []
        for i, n in enumerate(full):
            if i == 0 and lay.batch:
                k = inst.d * self.w.mb + inst.m
                size = inst.shape[0]
                sl.append([k * size, (k + 1) * size])
            elif i == lay.split:
                pieces = lay.pieces or self.tp
                size, piece = n // pieces, inst.t % pieces
                sl.append([piece * size, (piece + 1) * size])
            else:
                sl.append([0, n])
        if tuple(e - s for s, e in sl) != tuple(inst.shape):
            raise AssertionError(f"{inst.tid}: shape {list(inst.shape)} does not match slice "
                                 f"{sl} of {list(full)}")
        return sl

    def _parts(self, kv: tuple[str, int], full: tuple[int, ...]) -> list[dict]:
        insts = self.instances[kv]
        lay = insts[0].layout
        groups: dict[Any, tuple[list, list]] = {}
        for n, inst in enumerate(insts):
            sl = self._slice(inst, full)
            if lay.reduce:
                gk = ("all", inst.t % lay.pieces if lay.pieces else 0) if lay.partial \
                    else (inst.t,)
            elif lay.partial:
                gk = (inst.d, inst.m)
            else:
                gk = (n,)
            entry = groups.setdefault(gk, (sl, []))
            if entry[0] != sl:
                raise AssertionError(f"lineage of {kv}: summed tensors hold different slices")
            entry[1].append(inst.tid)
        return [{"slice": sl, "sum_of": tids} for sl, tids in groups.values()]

    def emit_lineages(self, single_shapes: dict[str, tuple[int, ...]]) -> None:
        index: dict[tuple[str, int], int] = {}
        for kv in self.input_order + self.order:
            key = kv[0]
            if key not in single_shapes:
                raise AssertionError(f"{key} has no single-plan counterpart")
            parts = self._parts(kv, tuple(single_shapes[key]))
            hint = self.hints.get(kv)
            aligned = None
            if hint is not None:
                aligned = {"single": list(hint.single), "parallel": list(hint.parallel),
                           "inputs": [index[i] for i in hint.inputs if i in index]}
            index[kv] = self.b.add_lineage(key, parts, aligned)
