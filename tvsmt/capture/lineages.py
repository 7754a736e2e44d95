"""Lineages of a captured pair: how each rank's tensors relate to the single device's.

* Inputs (parameters by qualified name, buffers, batch leaves) are assumptions. They come
  from what the code declares (PARAM_SHARDING, Megatron-style `tensor_model_parallel` /
  `partition_dim` attributes), else from values: the rank tensor must equal exactly one
  aligned block of the single tensor on every random draw (at least two). A tensor whose
  values are degenerate (constant) or that matches several blocks is refused, naming it.
* Claims: every parameter's gradient after the step, and every returned loss.
* Hypotheses: intermediate rank tensors that equal a block of a single tensor on the
  concrete run. They only cut stages (`"hypothesis": true`); tvsmt.capture.driver drops the
  ones that cannot be proven.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from fractions import Fraction

import torch

from tvsmt.capture.assemble import rid
from tvsmt.capture.dtensor import check_values
from tvsmt.capture.program import InputTensor, Program, state_id
from tvsmt.capture.script import user_code_failed
from tvsmt.errors import InputError, StructuralViolation

Slice = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Part:
    slice: Slice
    sum_of: tuple[str, ...]
    scale: tuple[int, int] | None = None


@dataclass
class CapLineage:
    single: str
    parts: list[Part]
    hypothesis: bool
    position: int  # where its last parallel tensor is produced (verification order)
    kind: str  # input | claim | hypothesis


@dataclass(frozen=True)
class Provenance:
    """How one rank's input got its lineage (shown in the report)."""

    tensor: str
    rank: int
    slice: Slice
    how: str


def full(shape) -> Slice:
    return tuple((0, n) for n in shape)


def blocks(single_shape, part_shape, dims=None) -> list[Slice]:
    """Every aligned block of `part_shape` inside `single_shape` (dims: axes allowed to be
    split; the others must be equal)."""
    if len(single_shape) != len(part_shape):
        return []
    ranges = []
    for d, (n, m) in enumerate(zip(single_shape, part_shape)):
        if m == n:
            ranges.append([(0, n)])
        elif m and n % m == 0 and (dims is None or d in dims):
            ranges.append([(k * m, (k + 1) * m) for k in range(n // m)])
        else:
            return []
    return [tuple(c) for c in itertools.product(*ranges)]


def _view(t: torch.Tensor, sl: Slice) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in sl)]


def megatron_block(single_shape, part_shape, declared: dict) -> Slice | None:
    """The block Megatron-Core's attributes give a rank's parameter: piece k of n along
    `partition_dim` for the rank k of a tensor-parallel group of n (stride 1 only: a strided
    partition is not one block); None when they do not say or do not fit the shapes."""
    place, stride = declared.get("megatron_tp"), declared.get("megatron_stride", 1)
    d = declared["megatron_partition_dim"]
    if place is None or stride != 1 or len(single_shape) != len(part_shape) \
            or not 0 <= d < len(single_shape):
        return None
    k, n = place
    if not 0 <= k < n or single_shape[d] != part_shape[d] * n or any(
            a != b for i, (a, b) in enumerate(zip(single_shape, part_shape)) if i != d):
        return None
    m = part_shape[d]
    return tuple((k * m, (k + 1) * m) if i == d else (0, x) for i, x in enumerate(single_shape))


def held(block: torch.Tensor, mine: torch.Tensor) -> bool:
    """Does a rank's input hold this block of the single tensor: the same values (as
    `torch.equal` compares them, across dtypes too), or the block cast to the rank's
    narrower floating dtype (DeepSpeed's `bf16` and `fp16` modes cast the module when the
    engine is built, before any step). Over the reals a cast is the value itself, as for a
    cast inside the step; the concrete run is fed the block (`cast_inputs`)."""
    if torch.equal(block, mine):
        return True
    if not (block.is_floating_point() and mine.is_floating_point()) or \
            torch.finfo(mine.dtype).bits >= torch.finfo(block.dtype).bits:
        return False
    return torch.equal(block.to(mine.dtype), mine)


def cast_inputs(single: Program, lineages: list, rank_values: dict) -> dict:
    """{rank input id: its single block, at the single's precision} for the rank inputs
    (`rank_values`: id -> the concrete run's value) that hold their block cast to a
    narrower dtype (`held`): the concrete run computes over those values, as the proof
    does."""
    s_draw = {i.id: i.draws[0] for i in single.inputs}
    out = {}
    for lin in lineages:
        if lin.kind != "input":
            continue
        for part in lin.parts:
            for t in part.sum_of:
                mine = rank_values.get(t)
                if mine is not None and mine.dtype != s_draw[lin.single].dtype:
                    out[t] = _view(s_draw[lin.single], part.slice)
    return out


def _degenerate(t: torch.Tensor) -> bool:
    return t.numel() > 1 and bool((t == t.reshape(-1)[0]).all())


def _declared_slices(script_sharding: dict, name: str, rank: int, shape,
                     path: str) -> Slice | None:
    spec = script_sharding.get(name)
    if spec is None:
        return None
    if isinstance(spec, str) and spec == "replicate":
        return full(shape)
    if callable(spec):
        try:
            got = spec(rank)
        except (Exception, SystemExit) as e:  # the user's function failed, not tvsmt
            raise user_code_failed(e, f"PARAM_SHARDING[{name!r}]({rank})", path) from None
        if got is None:
            return full(shape)
        try:
            return tuple((_bound(a), _bound(b)) for a, b in got)
        except (TypeError, ValueError):
            raise InputError(f"PARAM_SHARDING[{name!r}]({rank}) returned {str(got)[:60]}, not "
                             f"((start, end), ...) per dimension", file=path,
                             tensor=name) from None
    raise InputError(f"PARAM_SHARDING[{name!r}] must be 'replicate' or a function of the rank "
                     f"returning ((start, end), ...) per dimension", file=path, tensor=name)


def _bound(x) -> int:
    """A slice bound a sharding function returned: an int (numpy's and torch's integers
    included), never a float or a bool that int() would take."""
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(x)
    return operator.index(x)


def input_lineage(single: InputTensor, rank: int, mine: InputTensor, sharding: dict,
                  path: str) -> Provenance:
    """The slice of `single` that rank `rank`'s input `mine` holds, and how it was found."""
    name = single.name if single.kind != "batch" else single.id
    declared = (_declared_slices(sharding, name, rank, single.shape, path)
                if single.kind != "batch" else None)
    if declared is not None:
        shape = tuple(b - a for a, b in declared)
        if shape != mine.shape:
            raise InputError(f"PARAM_SHARDING gives rank {rank} a {list(shape)} slice but the "
                             f"rank holds {list(mine.shape)}", file=path, tensor=name)
        dt = mine.declared.get("dtensor") if isinstance(mine.declared, dict) else None
        if dt is not None and dt.slice != declared:
            raise InputError(f"PARAM_SHARDING gives rank {rank} the block {list(declared)} but "
                             f"its DTensor placement says {list(dt.slice)}", file=path,
                             tensor=name)
        return Provenance(single.id, rank, declared, "declared (PARAM_SHARDING)")
    if isinstance(mine.declared, dict) and "dtensor" in mine.declared:
        layout = mine.declared["dtensor"]
        check_values(single.draws, mine.draws, layout, rank, name, path, _degenerate)
        return Provenance(single.id, rank, layout.slice,
                          f"from DTensor placement {layout.described}")
    if isinstance(mine.declared, dict) and "zero3" in mine.declared:
        block = mine.declared["zero3"]
        if any(not held(_view(s, block), r) for s, r in zip(single.draws, mine.draws)):
            raise InputError(f"rank {rank}'s ZeRO-3 partition is not the block {list(block)} "
                             f"of the single tensor on the random draws", file=path,
                             tensor=name)
        return Provenance(single.id, rank, block, "DeepSpeed ZeRO-3 partition")
    dims, place = None, None
    how = f"inferred from values ({len(mine.draws)} random draws)"
    if isinstance(mine.declared, dict) and "megatron_partition_dim" in mine.declared:
        dims = {mine.declared["megatron_partition_dim"]}
        how = (f"Megatron attributes (partition_dim={next(iter(dims))}), block found from "
               f"values ({len(mine.draws)} draws)")
        place = megatron_block(single.shape, mine.shape, mine.declared)
    candidates = blocks(single.shape, mine.shape, dims)
    if not candidates:
        raise InputError(f"rank {rank} holds a {list(mine.shape)} tensor that is no block of "
                         f"the single {list(single.shape)} tensor; declare it in "
                         f"PARAM_SHARDING", file=path, tensor=name)
    if len(mine.draws) < 2 or len(single.draws) < 2:
        raise InputError("inference by value needs two random draws", file=path, tensor=name)
    if any(_degenerate(r) or _degenerate(s) for s, r in zip(single.draws, mine.draws)):
        return _constant_input(single, rank, mine, place, candidates, name, path)
    if all(torch.equal(a, b) for a, b in zip(single.draws, single.draws[1:])) and \
            single.draws[0].numel() > 1 and single.kind != "buffer":
        raise InputError("both random draws gave the same values (does the script seed the "
                         "generator itself?); inference by value needs independent draws",
                         file=path, tensor=name)
    hits = [sl for sl in candidates
            if all(held(_view(s, sl), r) for s, r in zip(single.draws, mine.draws))]
    if not hits:
        raise InputError(f"rank {rank}'s tensor equals no block of the single tensor on the "
                         f"random draws; declare it in PARAM_SHARDING", file=path, tensor=name)
    if len(hits) > 1:
        raise InputError(f"rank {rank}'s tensor matches {len(hits)} blocks of the single "
                         f"tensor (ambiguous); declare it in PARAM_SHARDING", file=path,
                         tensor=name)
    if mine.draws[0].dtype != single.draws[0].dtype:
        how += f", held as {str(mine.draws[0].dtype).replace('torch.', '')}"
    return Provenance(single.id, rank, hits[0], how)


def _constant_input(single: InputTensor, rank: int, mine: InputTensor, place: Slice | None,
                    candidates: list[Slice], name: str, path: str) -> Provenance:
    """A rank input whose values are constant equals every block of its shape, so values
    cannot say which it holds: taken only where one block is possible (a replicated bias
    starting at zero) or Megatron-Core's attributes name it (a sharded one), and where the
    values agree with that block on every draw."""
    if place is not None:
        d, (k, n) = mine.declared["megatron_partition_dim"], mine.declared["megatron_tp"]
        block, how = place, (f"Megatron attributes (partition_dim={d}, tensor-parallel rank "
                             f"{k} of {n}; its values are constant)")
    elif len(candidates) == 1:
        block, how = candidates[0], "the only block of its shape (its values are constant)"
    else:
        raise InputError(f"rank {rank}'s values are degenerate (constant), so its slice "
                         f"cannot be inferred; declare it in PARAM_SHARDING", file=path,
                         tensor=name)
    if not all(held(_view(s, block), r) for s, r in zip(single.draws, mine.draws)):
        raise InputError(f"rank {rank}'s tensor equals no block of the single tensor on the "
                         f"random draws; declare it in PARAM_SHARDING", file=path, tensor=name)
    return Provenance(single.id, rank, block, how)


def input_and_claim_lineages(single: Program, ranks: dict[int, Program], sharding: dict,
                             path: str) -> tuple[list[CapLineage], list[Provenance]]:
    """Assumptions for every input of every rank, claims for gradients and losses."""
    s_inputs = {i.id: i for i in single.inputs}
    provenance: list[Provenance] = []
    assumptions: dict[str, list[Part]] = {}
    claims: dict[str, list[Part]] = {}
    for r, prog in sorted(ranks.items()):
        for inp in prog.inputs:
            if isinstance(inp.declared, dict) and inp.declared.get("zero3_released"):
                continue  # a parameter ZeRO-3 released: its partition's blocks are inputs
            s = s_inputs.get(inp.single_id or inp.id)
            if s is None:
                raise InputError(f"rank {r} has input {inp.name} ({inp.kind}) that the single "
                                 f"model does not have", file=path, tensor=inp.name)
            prov = input_lineage(s, r, inp, sharding, path)
            provenance.append(prov)
            if not _empty(prov.slice):  # a rank holding none of a tensor holds no part
                assumptions.setdefault(s.id, []).append(Part(prov.slice, (rid(r, inp.id),)))
        by_input = {p.tensor: p.slice for p in provenance if p.rank == r}
        partitioned = {i.single_id for i in prog.inputs  # ZeRO-3's: blocks of the single's
                       if isinstance(i.declared, dict) and "zero3" in i.declared}
        names = set(single.grads) | set(single.aliases)
        for name in sorted(names):
            own = prog.aliases.get(name, name)
            _claim_update(single, prog, r, name, own, by_input, claims)
            _claim_states(single, prog, r, name, own, by_input, claims, path)
            s_name = single.aliases.get(name, name)
            s_grad = single.grads.get(s_name)
            if s_grad is None and s_name not in single.updated and (
                    prog.grads.get(own) is not None or prog.grad_pieces.get(own)):
                raise StructuralViolation(f"only the step of rank {r} leaves a gradient of "
                                          f"{name} (the single step leaves none and does not "
                                          f"update it)", tensor=name)
            if s_grad is None:
                continue
            # DeepSpeed ZeRO's partition, Megatron's distributed optimizer's shards: blocks of
            # the rank's parameter, which is its block of the single one where it is held
            base = None if f"param.{own}" in partitioned else by_input.get(f"param.{own}")
            for t, block in prog.grad_pieces.get(own, ()):
                _add_claim(claims, s_grad, Part(_within(block, base), (rid(r, t),)))
            if own not in prog.grads:  # another stage's parameter (pipeline parallelism)
                continue
            r_grad = prog.grads[own]
            if r_grad is None and own in prog.updated:
                continue  # the optimizer's update is claimed (gradients zeroed after it)
            if r_grad is None:
                raise StructuralViolation(f"rank {r} computes no gradient for {name} (its "
                                          f".grad is None after train_step)", tensor=name)
            sl = prog.grad_slices.get(own, by_input[f"param.{own}"])
            _add_claim(claims, s_grad, Part(sl, (rid(r, r_grad),)))
        if single.loss is not None and prog.loss is not None:
            claims.setdefault(single.loss, []).append(
                Part(full(single.shapes[single.loss]), (rid(r, prog.loss),)))
    _every_parameter_is_held(single, claims, path)
    out = [CapLineage(t, parts, False, -1, "input") for t, parts in assumptions.items()]
    out += [CapLineage(t, parts, False, 0, "claim") for t, parts in claims.items()]
    return out, provenance


def _claim_update(single: Program, prog: Program, r: int, name: str, own: str,
                  by_input: dict, claims: dict[str, list[Part]]) -> None:
    """The claim that the rank's parameter after its optimizer step is its block of the
    single parameter after the single step; a step that updates a parameter on one side
    only is a violation."""
    s_new = single.updated.get(single.aliases.get(name, name))
    held = f"param.{own}" in by_input
    if not held or (s_new is None and own not in prog.updated):
        return
    if s_new is None or own not in prog.updated:
        side = "single step" if s_new is not None else f"step of rank {r}"
        raise StructuralViolation(f"only the {side} updates parameter {name} (an "
                                  f"optimizer step on one side only)", tensor=name)
    _add_claim(claims, s_new, Part(by_input[f"param.{own}"], (rid(r, prog.updated[own]),)))


def _claim_states(single: Program, prog: Program, r: int, name: str, own: str,
                  by_input: dict, claims: dict[str, list[Part]], path: str) -> None:
    """The claims that the optimizer state the rank's step leaves for the next step (its
    momentum buffers, Adam's moments, a factored second moment's rows and columns) is its
    block of the single step's: the block its state held before the step, else the one its
    parameter's block gives (`_state_block`). State that one side leaves and the other does
    not is a violation; state whose block cannot be told is refused, never left unchecked."""
    mine = prog.states_left.get(own, {})
    theirs = single.states_left.get(single.aliases.get(name, name), {})
    p_block = by_input.get(f"param.{own}")
    if p_block is None or not (mine or theirs):
        return
    for k in sorted(set(mine) | set(theirs)):
        if k not in mine or k not in theirs:
            side = "single step" if k in theirs else f"step of rank {r}"
            raise StructuralViolation(f"only the {side} leaves optimizer state {k!r} of "
                                      f"{name} for the next step", tensor=name)
        s_t, r_t = theirs[k], mine[k]
        s_shape, r_shape = tuple(single.shapes[s_t]), tuple(prog.shapes[r_t])
        s_param = tuple(single.shapes.get(f"param.{own}", ()))
        block = by_input.get(state_id(own, k))
        if block is None:
            block = _state_block(s_shape, s_param, p_block)
        if block is None or tuple(b - a for a, b in block) != r_shape:
            raise InputError(f"rank {r}'s optimizer state {k!r} of {name} (shape "
                             f"{list(r_shape)}; the single step's {list(s_shape)}, the "
                             f"parameter's {list(s_param)}, rank {r} holding its block "
                             f"{[list(d) for d in p_block]}) is no block of the single "
                             f"step's state that tvsmt can tell: it cannot be checked",
                             file=path, tensor=name)
        _add_claim(claims, s_t, Part(block, (rid(r, r_t),)))


def _state_block(s_shape: tuple, s_param: tuple, p_block: Slice) -> Slice | None:
    """The block of an optimizer state that a rank holding `p_block` of its parameter holds:
    the parameter's block where the state has the parameter's shape (elementwise state);
    where the state reduces the parameter over some dimensions, keeping them as 1 (Adafactor's
    (R, 1) rows and (1, C) columns of an (R, C) weight), the parameter's block along the
    dimensions it keeps and the one entry along those it reduces (a rank holding some rows
    must hold the columns' statistics over all of them: reduced over its group); the whole
    state where the rank holds the whole parameter; else None."""
    if len(s_shape) == len(s_param) and all(s in (p, 1) for s, p in zip(s_shape, s_param)):
        return tuple(pb if s == p else (0, 1) for s, p, pb in zip(s_shape, s_param, p_block))
    if p_block == full(s_param):
        return full(s_shape)
    return None


def _within(block: Slice, base: Slice | None) -> Slice:
    """A block of a rank's parameter as a block of the single one, the rank's parameter being
    the block `base` of it (None: ZeRO-3's partitions are blocks of the single's already)."""
    if base is None:
        return block
    return tuple((a + s, b + s) for (a, b), (s, _) in zip(block, base))


def _empty(sl: Slice) -> bool:
    """Is the block empty (FSDP2's last ranks' share of a few uneven rows)?"""
    return any(a >= b for a, b in sl)


def _add_claim(claims: dict[str, list[Part]], single: str, part: Part) -> None:
    """A part of a single tensor's claim, once (tied parameters reach it by several names);
    an empty block claims nothing."""
    if _empty(part.slice):
        return
    if part not in claims.setdefault(single, []):
        claims[single].append(part)


def _every_parameter_is_held(single: Program, claims: dict[str, list[Part]], path: str) -> None:
    """Every element of every single-device gradient (and updated parameter) is claimed by
    some rank: a rank may lack a parameter (a pipeline stage holds its own layers only), but
    a parameter, or a block of one, that no rank holds would leave its gradient unchecked."""
    names = {g: n for n, g in single.grads.items() if g is not None
             and not (n in single.updated and g not in claims)}  # zeroed after the step
    names |= {u: n for n, u in single.updated.items()}
    names |= {t: f"{n} (optimizer state {k!r})" for n, left in single.states_left.items()
              for k, t in left.items() if t in claims}  # claimed where it is elementwise
    for g, name in names.items():
        slices = [p.slice for p in claims.get(g, [])]
        if not covers(tuple(single.shapes[g]), slices):
            raise InputError(f"no rank holds {'all of' if slices else 'parameter'} "
                             f"{name} (of shape {list(single.shapes[g])})", file=path,
                             tensor=name)


def _normalised(t: torch.Tensor) -> tuple[bytes, float]:
    """A scale-free fingerprint of a block: values divided by the largest-magnitude one,
    rounded (a lookup key only; every hit is checked with allclose)."""
    flat = t.reshape(-1).double()
    if not flat.numel() or not bool(torch.isfinite(flat).all()):
        return b"", 0.0  # empty (a rank's share of uneven rows), a NaN or an infinity
    pivot = float(flat[int(flat.abs().argmax())])
    if pivot == 0:
        return b"", 0.0
    return torch.round(flat / pivot * 1000).to(torch.int32).numpy().tobytes(), pivot


def _nice(c: float) -> Fraction | None:
    """c as a small exact ratio (a loss scale such as the number of replicas), if it is one."""
    if not math.isfinite(c):
        return None
    f = Fraction(c).limit_denominator(64)
    if f == 0 or abs(float(f) - c) > 1e-4 * abs(c) or max(f.numerator, f.denominator) > 64:
        return None
    return f


def hypotheses(single: Program, s_values: dict, order_ids: list[str], p_values: dict,
               p_shapes: dict[str, tuple[int, ...]], exclude: set[str],
               s_order: list[str], s_ops: dict[str, str] | None = None,
               p_ops: dict[str, str] | None = None) -> list[CapLineage]:
    """Intermediate rank tensors that equal (up to a small exact factor, such as the loss
    scale of data-parallel averaging) a block of a single tensor on the concrete run.

    order_ids: the parallel tensors in production order; s_order: the single's; s_ops/p_ops:
    the op producing each tensor. Only a single tensor made by the same ATen op is taken (a
    value match across different ops, such as x and 1*x, cuts stages where the two graphs
    do not correspond). A tensor with constant or non-float values is never hypothesised.
    """
    s_ops, p_ops = s_ops or {}, p_ops or {}
    wanted = []
    for t in order_ids:
        v = p_values.get(t)
        if t not in exclude and isinstance(v, torch.Tensor) and v.is_floating_point() \
                and not _degenerate(v):
            wanted.append((t, v))
    rank_shapes = {tuple(v.shape) for _, v in wanted}
    index: dict[tuple, list[tuple[str, Slice, float]]] = {}
    for s in s_order:
        sv = s_values.get(s)
        if not (isinstance(sv, torch.Tensor) and sv.is_floating_point()) or _degenerate(sv):
            continue
        for shape in rank_shapes:
            for sl in blocks(tuple(sv.shape), shape):
                key, pivot = _normalised(_view(sv, sl))
                if pivot:
                    index.setdefault((s_ops.get(s), shape, key), []).append((s, sl, pivot))
    grouped: dict[str, list[tuple[Part, int]]] = {}
    position = {t: i for i, t in enumerate(order_ids)}
    for t, v in wanted:
        key, pivot = _normalised(v)
        hits = []
        for s, sl, s_pivot in index.get((p_ops.get(t), tuple(v.shape), key), []):
            factor = _nice(pivot / s_pivot)
            # a single number is a small ratio of another by coincidence too often: only
            # an exact match of one-element tensors is taken
            if factor is None or (factor != 1 and v.numel() == 1):
                continue
            block = _view(s_values[s], sl)
            if not torch.allclose(block * float(factor), v, rtol=1e-3,
                                  atol=1e-5 * (1 + float(v.abs().max()))):
                continue
            hits.append((factor != 1, s, sl, factor))
        # Every equal single tensor made by the same op (the three views of one input of
        # q, k and v are equal): a parallel tensor may serve several lineages, so a stage
        # finds the one its single side reaches instead of a sibling it cannot use.
        exact = [h for h in hits if not h[0]] or hits
        for _, s, sl, factor in exact:
            scale = None if factor == 1 else (
                (1 / factor).numerator, (1 / factor).denominator)
            grouped.setdefault(s, []).append((Part(sl, (t,), scale), position[t]))
    # Only single tensors that every rank holds a piece of: a lineage naming some ranks only
    # would cut the single graph where the other ranks' graphs are not cut.
    # One scale per lineage: the forward tensors of every unit equal the single ones, the
    # backward ones of every unit are scaled alike; a part with another factor (a backward
    # tensor that happens to be proportional to a forward one) is a coincidence
    for s, items in grouped.items():
        counts: dict = {}
        for p, _ in items:
            counts[p.scale] = counts.get(p.scale, 0) + 1
        common = max(counts, key=lambda k: (counts[k], k is None))
        grouped[s] = [(p, pos) for p, pos in items if p.scale == common]
    # And only lineages that cover every element of their single tensor: a stage cut at a
    # partly covered tensor leaves the rest of it free (a spurious counterexample).
    world = {t.split(":", 1)[0] for t in order_ids}
    return [CapLineage(s, [p for p, _ in items], True, max(pos for _, pos in items),
                       "hypothesis") for s, items in grouped.items()
            if {p.sum_of[0].split(":", 1)[0] for p, _ in items} == world
            and covers(tuple(s_values[s].shape), [p.slice for p, _ in items])]


def covers(shape: tuple[int, ...], slices: list[Slice]) -> bool:
    """Whether the slices together hold every element of a tensor of this shape."""
    seen = torch.zeros(shape, dtype=torch.bool)
    for sl in slices:
        seen[tuple(slice(a, b) for a, b in sl)] = True
    return bool(seen.all())
