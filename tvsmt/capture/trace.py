"""Tracing one rank's training step into an ATen graph (make_fx) and converting it to SSA.

The step runs the user's `train_step` with the parameters and buffers swapped for traced
inputs (torch.nn.utils.stateless), then returns the loss and every parameter's `.grad`, as the
optimizer would read it after gradient synchronisation. The graph is not functionalized by
torch (functionalize does not know the c10d in-place collectives and would rename every view):
in-place ATen ops become their functional overload writing a new SSA version, collectives
become comm nodes, and a read of a tensor that an in-place op changed through an alias (a
stale view) is refused rather than guessed.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import re
import sys
import types
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tvsmt.capture import dtensor, foreach, fsdp, megatron_ddp, zero
from tvsmt.capture.markers import microbatch_of
from tvsmt.capture.program import (CapNode, Collective, InputTensor, Program, Ref, state_id,
                                   tensor_slots)
from tvsmt.capture.script import CaptureScript, user_code_failed
from tvsmt.capture.world import rank_world, reset_framework_singletons
from tvsmt.errors import InputError

# uninitialised memory: captured as zeros where nothing reads its values (`unread_empty`),
# through views that only select or reshape
EMPTY_OPS = {"aten.empty.memory_format"}
PURE_VIEW_OPS = {"aten.slice.Tensor", "aten.view.default", "aten._unsafe_view.default",
                 "aten.reshape.default", "aten.alias.default"}
IDENTITY_OPS = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh_copy.default",
                "_c10d_functional.wait_tensor.default"}
# marks for torch's profiler (optimizers wrap their step in one): no value, nothing computed
PROFILER_OPS = {"profiler._record_function_enter_new.default",
                "profiler._record_function_exit._RecordFunction"}
REDUCE_OPS = {0: "sum", 1: "avg", 4: "max"}  # c10d ReduceOp codes the registry has an op for
REDUCE_OP_NAMES = {2: "PRODUCT", 3: "MIN", 5: "BAND", 6: "BOR", 7: "BXOR", 8: "PREMUL_SUM"}
# the registry's op per (collective, reduction); a pair not listed is refused
REDUCED_COMM = {("all_reduce", "sum"): "all_reduce", ("all_reduce", "avg"): "all_reduce_avg",
                ("all_reduce", "max"): "all_reduce_max",
                ("reduce_scatter", "sum"): "reduce_scatter",
                ("reduce_scatter", "avg"): "reduce_scatter_avg"}
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in ')
SEED = 20261201


# ----------------------------------------------------------------------------- the step


def _split_built(built, what: str, path: str):
    if not (isinstance(built, tuple) and len(built) == 2):
        raise InputError(f"{what} must return (model, batch)", file=path)
    model, batch = built
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{what}: the model must be a torch.nn.Module", file=path)
    return model, batch


def _batch_leaves(batch, path: str) -> tuple[list[str], list[torch.Tensor], Any]:
    leaves, spec = pytree.tree_flatten(batch)
    names = [_leaf_name(p) for p, _ in pytree.tree_flatten_with_path(batch)[0]]
    for n, t in zip(names, leaves):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"the batch must be tensors (tuple/list/dict of tensors); "
                             f"{n} is a {type(t).__name__}", file=path)
    return names, leaves, spec


def _leaf_name(keypath) -> str:
    parts = []
    for k in keypath:
        key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(key))
    return ".".join(["batch"] + parts)


def build(script: CaptureScript, rank: int | None, draw: int, fake: bool = False):
    """(model, batch) of one rank (None: the single device) for random draw `draw`; with
    `fake`, every tensor is a FakeTensor (shapes only: a model of any width costs nothing)."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(SEED + 7919 * draw)
    reset_framework_singletons()  # a script may set up Megatron-Core's groups in every build
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
        what, make = (("build_single", script.build_single) if rank is None else
                      (f"build_rank({rank})", lambda: script.build_rank(rank)))
        try:
            built = make()
        except (Exception, SystemExit) as e:  # the user's code failed, not tvsmt
            raise user_code_failed(e, what, script.path) from None
        return _split_built(built, what, script.path)


class _EachOnItsOwn:
    """The handle `uncoalesced` gives for a coalesced group: its collectives ran one by one
    (traced, their works fake), so there is nothing left to wait for."""

    works: list = []

    def wait(self) -> None:
        return None


@contextmanager
def uncoalesced():
    """`torch.distributed._coalescing_manager` as a context in which each collective runs
    on its own, for the duration of the trace: a coalesced group of collectives is the same
    collectives batched into one launch (Megatron-Core's DDP all-reduces its buckets so),
    and torch has no fake kernel for the batched ops (c10d.allreduce_coalesced_). Patched
    wherever a module imported it by name."""
    import torch.distributed as tdist

    original = getattr(tdist, "_coalescing_manager", None)
    if original is None:
        yield
        return

    @contextmanager
    def each_on_its_own(group=None, device=None, async_ops=False):
        yield _EachOnItsOwn()

    holders = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "_coalescing_manager", None) is original]
    for m in holders:
        m._coalescing_manager = each_on_its_own
    try:
        yield
    finally:
        for m in holders:
            m._coalescing_manager = original


@contextmanager
def traced_data_assignment():
    """`t.data = v` followed by the tracer: afterwards `t` reads as `v`'s traced value.

    Assigning `.data` swaps a tensor's storage without any ATen operator, so make_fx keeps
    `t`'s old node (Megatron-Core's make_viewless_tensor: `torch.empty((1,))` whose `.data`
    becomes the real activation, with a micro-batch of one). Here `torch.Tensor.data`
    gets a setter, for the duration of the trace only, that also points the tracer's
    record of `t` at `v`'s (`v = x.data` is traced, as a detach of `x`). A value the tracer
    does not know leaves `t` as it was: a read of uninitialised memory is then refused.
    Private API of the pinned torch (get/set_proxy_slot), exercised by
    tests/test_capture_inplace.py."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, set_proxy_slot

    base = torch._C.TensorBase.data
    own = torch.Tensor.__dict__.get("data")

    def assign(tensor, value):
        base.__set__(tensor, value)
        mode = get_proxy_mode()
        proxy = None if mode is None else get_proxy_slot(value, mode.tracer, None)
        if proxy is not None:
            set_proxy_slot(tensor, mode.tracer, proxy)

    torch.Tensor.data = property(base.__get__, assign, doc=base.__doc__)
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.data
        else:
            torch.Tensor.data = own


def _swap_tensors(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange what two tensor objects are (class, attributes, and the C++ tensor under
    them), each Python object keeping its identity. torch.utils.swap_tensors refuses a traced
    tensor (the tracer holds weak references to it); private API of the pinned torch."""
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__
    torch._C._swap_tensor_impl(a, b)


@contextmanager
def parameters_kept(originals: list[torch.Tensor], standins: list[torch.Tensor]):
    """The model's own parameter objects become the traced stand-ins for the duration of
    the step: code that holds them (an optimizer's parameter lists, DeepSpeed's partitions
    of them) or registered hooks on them (its gradient reduction after each gradient is
    accumulated) sees the traced tensors, as it sees the real ones in training. What the
    code set on a parameter (Megatron's `sequence_parallel`, DeepSpeed's ids) stays on it;
    its post-accumulate-grad hooks move to the traced tensor. Each object is itself again
    afterwards, without a gradient (tests/test_capture_deepspeed.py)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, set_proxy_slot

    tracer = get_proxy_mode().tracer
    done = []
    try:
        for orig, standin in zip(originals, standins):
            proxy = get_proxy_slot(standin, tracer)
            # the hooks' table is the Python object's, their registration the C++ tensor's:
            # registered again, on the traced tensor
            hooks = list((orig._post_accumulate_grad_hooks or {}).values())
            own = dict(vars(orig))
            _swap_tensors(orig, standin)
            done.append((orig, standin))
            orig.__dict__.update(own)
            set_proxy_slot(orig, tracer, proxy)
            if hooks:
                orig._post_accumulate_grad_hooks = None
                for hook in hooks:
                    orig.register_post_accumulate_grad_hook(hook)
        yield
    finally:
        for orig, standin in reversed(done):
            orig.grad = None
            _swap_tensors(orig, standin)


STEP_KEY = "step"  # torch's optimizers count their steps under this key, a scalar tensor


def held_optimizers(model, params: dict, script: CaptureScript) -> list:
    """The torch optimizers whose state lasts from one step to the next: attributes of the
    model's modules, and the script's own globals whose parameters are all this model's (a
    global names the optimizer of the latest build), in that order, each once."""
    mine = {id(p) for p in params.values()}
    found: dict[int, torch.optim.Optimizer] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.optim.Optimizer):
                found.setdefault(id(value), value)
    for value in vars(script.module).values() if script.module is not None else ():
        if isinstance(value, torch.optim.Optimizer) and all(
                id(p) in mine for group in value.param_groups for p in group["params"]):
            found.setdefault(id(value), value)
    return list(found.values())


def _held_states(model, params: dict, script: CaptureScript):
    """(one parameter's state dict, the parameter's name, a key, its tensor) for every
    tensor in the state of the optimizers the step carries on (`held_optimizers`), in the
    optimizers' order. Refused in one line: state of a tensor that is no parameter of the
    model."""
    names = {id(p): n for n, p in params.items()}
    for optimizer in held_optimizers(model, params, script):
        for p, st in optimizer.state.items():
            name = names.get(id(p))
            if name is None:
                raise InputError(f"{type(optimizer).__name__} holds state of a tensor that is "
                                 f"no parameter of the model", file=script.path)
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    yield st, name, k, v


def optimizer_states(model, params: dict, script: CaptureScript
                     ) -> list[tuple[dict, str, str]]:
    """(one parameter's state dict, the parameter's name, a key) for every tensor in the
    state of the optimizers the step carries on (`held_optimizers`): the state of steps
    taken when they were built (or loaded from a checkpoint), which the traced step reads
    (momentum buffers, Adam's moments and step counter)."""
    return [(st, name, k) for st, name, k, _ in _held_states(model, params, script)]


def states_left(model, params: dict, script: CaptureScript
                ) -> tuple[list[tuple[str, str]], list]:
    """What the step leaves in the state of the optimizers it carries on, for the next
    step: ((parameter, key) pairs, their tensors), step counters aside (constants of the
    trace); a DTensor's local tensor."""
    keys, tensors = [], []
    for _, name, k, v in _held_states(model, params, script):
        if k != STEP_KEY:
            keys.append((name, k))
            tensors.append(v._local_tensor if dtensor.is_dtensor(v) else v)
    return keys, tensors


@contextmanager
def states_kept(states: list[tuple[dict, str, str]], standins: list[torch.Tensor],
                layouts: dict[tuple[str, str], dtensor.Layout]):
    """The optimizers' state entries become the traced stand-ins for the duration of the
    step (the optimizer reads them from its dicts; a DTensor entry, of `layouts`, the
    stand-in wrapped as that DTensor's local tensor), each step counter a tensor made
    inside the trace, so a constant of it (Adam reads it with `.item()`); the entries are
    the original tensors again afterwards."""
    saved = [(st, k, st[k]) for st, _, k in states]
    given = iter(standins)
    try:
        for st, name, k in states:
            if k == STEP_KEY:
                st[k] = torch.tensor(st[k].item(), dtype=st[k].dtype)
                continue
            standin, layout = next(given), layouts.get((name, k))
            st[k] = standin if layout is None else dtensor.wrapped(standin, layout)
        yield
    finally:
        for st, k, v in saved:
            st[k] = v


def untraced_tensor(e: BaseException) -> str | None:
    """What it means when the step computed with a tensor made before it that is none of its
    traced inputs (the model's parameters and buffers, the batch, its optimizers' state): a
    tensor of the script's own, made at import or when the model was built. The trace
    cannot take it as a value of every input, so it is refused, naming the op
    (FakeTensorMode's assertion, of the pinned torch); None for any other failure."""
    text = str(e)
    if not isinstance(e, AssertionError) or "convert all Tensors to FakeTensors" not in text:
        return None
    op = re.search(r"Found in (aten\.[\w.]+)", text)
    return (f"the step computes with a tensor made before it that is none of its inputs "
            f"(parameters, buffers, the batch, the optimizers' state)"
            f"{f' in {op.group(1)}' if op else ''}: make it in train_step, or register it "
            f"as a buffer of the model")


# Where torch's tracing machinery lives: frames there are never where a step reads a value.
_TRACING_INTERNALS = ("torch/fx/", "torch/_subclasses/", "torch/_prims", "torch/_refs/",
                      "torch/_decomp/", "torch/utils/", "torch/_ops.py", "torch/_tensor.py",
                      "torch/__init__.py", "torch/_guards.py", "torch/_dynamo/",
                      "torch/_logging/", "torch/_library/", "/sympy/", "/tvsmt/")


def value_read(e: BaseException) -> str | None:
    """What it means when the trace stopped at a guard on a traced value (torch's
    GuardOnDataDependentSymNode): the step turned a value into a Python number (`.item()`,
    `float()`) and computed or branched with it, which one trace cannot do for every input
    (torch's Adafactor's step size reads the parameter's norm so); names the innermost
    frame outside torch's tracing machinery. None for any other failure."""
    import traceback

    if "DataDependent" not in type(e).__name__:
        return None
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not any(part in f.filename.replace(os.sep, "/") for part in _TRACING_INTERNALS)]
    at = ""
    if frames:
        f = frames[-1]
        parts = f.filename.replace(os.sep, "/").split("/site-packages/")
        at = f" at {parts[-1]}:{f.lineno}"
    return (f"the step reads a traced value as a Python number (.item(), float(), or a "
            f"branch on a tensor){at}: one trace cannot follow that for every input, so "
            f"the step cannot be verified as written")


def anchor_stack_traces(path: str) -> None:
    """Make make_fx record stack traces of every function of the user's file, not only of
    `forward` methods (fx keeps frames named forward or registered as anchors: private API
    of the pinned torch, exercised by tests/test_capture.py)."""
    from torch.fx.proxy import _register_stack_trace_anchor

    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
    except (OSError, SyntaxError, ValueError):
        return
    todo = [code]
    while todo:
        c = todo.pop()
        _register_stack_trace_anchor(types.SimpleNamespace(__code__=c))
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def trace_program(script: CaptureScript, rank: int | None, draws: int = 2,
                  fake: bool = False) -> Program:
    """Build and trace one rank (rank None: the single device in a world of one rank);
    `fake`: built with fake tensors, one draw of no values (tvsmt.capture.scale)."""
    anchor_stack_traces(script.path)
    world = 1 if rank is None else script.world_size
    with rank_world(0 if rank is None else rank, world, script.path):
        model, batch = build(script, rank, 0, fake)
        step = script.single_step if rank is None else script.train_step
        try:
            traced = _Tracer(script, rank, model, batch, step)
            program = traced.run()
        finally:
            zero.release(model)
        for k in range(1, 1 if fake else draws):
            m, b = build(script, rank, k)
            try:
                values = traced.input_values(m, b)
            finally:
                zero.release(m)
            for inp in program.inputs:
                inp.draws.append(values[inp.id])
    return program


class _Tracer:
    def __init__(self, script: CaptureScript, rank, model, batch, step):
        self.script, self.rank, self.model, self.batch, self.step = script, rank, model, batch, step
        self.where = "single" if rank is None else f"rank {rank}"
        self.params = dict(model.named_parameters())  # unique tensors, first name
        self.buffers = dict(model.named_buffers())
        self.aliases = {}
        first = {id(p): n for n, p in self.params.items()}
        for n, p in model.named_parameters(remove_duplicate=False):
            if n not in self.params:
                self.aliases[n] = first[id(p)]
        self.batch_names, leaves, self.batch_spec = _batch_leaves(batch, script.path)
        self.fsdp = fsdp.managed(model, self.params, script.path)  # FSDP2's parameters
        if rank is None and zero.zero_stage(model) == 3:
            # its engine's ZeRO-3 state outlives it in the process and breaks the ranks'
            # traces that follow (they fail on a tensor of it): said here, in one line
            raise InputError("single: DeepSpeed ZeRO-3 is not supported on the single "
                             "device (its engine's state breaks the ranks' traces): build "
                             "the single model without ZeRO-3 (stages 0 to 2 work there)",
                             file=script.path)
        self.zero3 = zero.stage3_partitions(model, self.params, script.path)  # ZeRO-3's
        self.grad_buffers = megatron_ddp.grad_buffers(model)  # Megatron DDP's
        # optimizers' state from steps taken when they were built: inputs (their counters
        # constants of the trace)
        self.states = optimizer_states(model, self.params, script)
        self.state_inputs = [x for x in self.states if x[2] != STEP_KEY]
        self.state_ids = [state_id(n, k) for _, n, k in self.state_inputs]
        # DTensor state (FSDP2's, parallelize_module's): its placements are its lineage
        self.state_layouts = {(n, k): dtensor.layout_of(st[k], f"{n}:{k}", script.path,
                                                        what="optimizer state",
                                                        uneven=n in self.fsdp)
                              for st, n, k in self.state_inputs if dtensor.is_dtensor(st[k])}

    def input_values(self, model, batch) -> dict[str, torch.Tensor]:
        values = {f"param.{n}": dtensor.local_value(p) for n, p in model.named_parameters()}
        for n, part in zero.stage3_partitions(model, dict(model.named_parameters()),
                                              self.script.path).items():
            # ZeRO-3: the released parameter (no elements) and its partition's blocks
            values[f"param.{n}"] = values[f"param.{n}"].new_empty(0)
            values.update(zip(part.input_ids(n), (v for _, v in part.blocks)))
        for n, b in model.named_buffers():
            dtensor.refuse_dtensor(b, n, self.script.path)
        values.update({f"buffer.{n}": b.detach().clone() for n, b in model.named_buffers()})
        names, leaves, _ = _batch_leaves(batch, self.script.path)
        for n, t in zip(names, leaves):
            dtensor.refuse_dtensor(t, n, self.script.path)
        if names != self.batch_names:
            raise InputError(f"{self.where}: the batch has a different structure on the "
                             f"second random draw", file=self.script.path)
        values.update({n: t.detach().clone() for n, t in zip(names, leaves)})
        values.update({state_id(n, k): dtensor.local_value(st[k]) for st, n, k in
                       optimizer_states(model, dict(model.named_parameters()), self.script)
                       if k != STEP_KEY})
        return values

    def run(self) -> Program:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.nn.utils.stateless import _reparametrize_module

        pnames, bnames = list(self.params), list(self.buffers)
        model, step, aliases = self.model, self.step, self.aliases
        layouts = {n: dtensor.layout_of(p, n, self.script.path, uneven=n in self.fsdp)
                   for n, p in self.params.items() if dtensor.is_dtensor(p)}
        grad_slices: dict[str, Any] = {}
        piece_blocks: list[tuple[str, Any]] = []  # (parameter, block) of each ZeRO piece
        partitioned = False  # are the gradients partitions (ZeRO's, Megatron's)?
        state_keys: list[tuple[str, str]] = []  # (parameter, key) of each state left

        zero3_ids = [(n, i) for n, part in self.zero3.items() for i in part.input_ids(n)]

        def traced(params, buffers, leaves, zero3_blocks, states):
            nonlocal partitioned
            shards = {n: p for n, p in zip(pnames, params) if n in self.fsdp}
            # each requiring grad as the model's own does (a frozen parameter has no
            # gradient and no optimizer updates it)
            frozen = {n for n in pnames if not self.params[n].requires_grad}
            params = [p if n in self.fsdp else
                      dtensor.leaf_parameter(p, layouts[n], n not in frozen) if n in layouts
                      else p.requires_grad_(n not in frozen) if p.is_floating_point() else p
                      for n, p in zip(pnames, params)]
            # plain parameters: the model's own objects become the traced tensors
            # (`parameters_kept`); DTensor ones are swapped on the module for leaf DTensors;
            # FSDP2's stay, FSDP2's shard storage becomes the traced tensors (fsdp.py)
            plain = [n for n in pnames if n not in layouts]
            mapping = {n: p for n, p in zip(pnames, params)
                       if n in layouts and n not in self.fsdp}
            mapping |= dict(zip(bnames, buffers))
            mapping |= {a: mapping[n] for a, n in aliases.items() if n in mapping}
            at = {n: self.params[n] if n not in layouts or n in self.fsdp else p
                  for n, p in zip(pnames, params)}
            batch = pytree.tree_unflatten(list(leaves), self.batch_spec)
            with parameters_kept([self.params[n] for n in plain],
                                 [p for n, p in zip(pnames, params) if n not in layouts]), \
                    fsdp.traced_shards(self.fsdp, shards), \
                    zero.traced_partitions(model, self.zero3, _grouped(zero3_ids, zero3_blocks)), \
                    states_kept(self.states, states, self.state_layouts), \
                    megatron_ddp.traced_buffers(self.grad_buffers):
                versions = {n: at[n]._version for n in layouts}
                with _reparametrize_module(model, mapping, tie_weights=True):
                    loss = step(model, batch)
                if loss is not None and not isinstance(loss, torch.Tensor):
                    raise InputError(f"train_step must return the loss tensor or None, not "
                                     f"{type(loss).__name__}", file=self.script.path)
                names = {id(self.params[n]): n for n in plain}
                held = zero.gradient_pieces(model, names, self.script.path)
                if held is None:  # Megatron's distributed optimizer: its shards
                    held = megatron_ddp.gradient_pieces(self.grad_buffers, names,
                                                        self.script.path)
                grads, pieces = [], []
                partitioned = held is not None
                for n in pnames:
                    g, grad_slices[n] = dtensor.grad_result(
                        megatron_ddp.gradient_of(at[n], self.grad_buffers), layouts.get(n))
                    grads.append(None if held is not None else g)
                for n, got in (held or {}).items():  # ZeRO: the partitions, not .grad
                    for tensor, block in got:
                        piece_blocks.append((n, block))
                        pieces.append(tensor)
                # each parameter's value after the step (an optimizer updates it in place);
                # a DTensor's local tensor where the step wrote the DTensor (its version
                # counter moved: DTensor writes its local tensor below autograd, which
                # counts nothing there; FSDP2's is a view of its padded shard anyway)
                after = [None if n in self.zero3 else  # its partition: engine.step() refused
                         self.params[n] if n not in layouts else
                         at[n]._local_tensor if at[n]._version != versions[n] else None
                         for n in pnames]
                # the optimizers' state the next step reads (before states_kept restores it)
                keys, left = states_left(model, self.params, self.script)
                state_keys[:] = keys
            return dtensor.loss_result(loss, self.script.path), grads, pieces, after, left

        values = self.input_values(self.model, self.batch)
        ins = ([values[f"param.{n}"] for n in pnames], [values[f"buffer.{n}"] for n in bnames],
               [values[n] for n in self.batch_names], [values[i] for _, i in zero3_ids],
               [values[i] for i in self.state_ids])
        # torch logs a failing meta kernel with its traceback before raising: the error
        # below says it in one line
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            import torch.fx.traceback as fx_traceback

            with fx_traceback.preserve_node_meta(), traced_data_assignment(), \
                    foreach.as_loops(), uncoalesced():
                # preserve_node_meta keeps tvsmt.capture.microbatch marks
                table = {**_decompositions(), **foreach.loop_decompositions()}
                if self.fsdp:
                    table = {**table, **fsdp.decompositions()}
                gm = make_fx(traced, tracing_mode="fake", record_stack_traces=True,
                             decomposition_table=table)(*ins)
        except InputError:
            raise
        except (Exception, SystemExit) as e:  # the user's code failed under tracing
            raise user_code_failed(e, "tracing the training step", self.script.path,
                                   self.where, why=zero.step_not_traced(self.model, e)
                                   or untraced_tensor(e) or value_read(e)) from None
        finally:
            quiet.setLevel(level)
        inputs = []
        for n in pnames:
            p = self.params[n]
            declared = {"dtensor": layouts[n]} if n in layouts else \
                {"zero3_released": True} if n in self.zero3 else _declared(p)
            inputs.append(InputTensor(f"param.{n}", "param", n,
                                      tuple(values[f"param.{n}"].shape),
                                      [values[f"param.{n}"]], declared))
        for n in bnames:
            inputs.append(InputTensor(f"buffer.{n}", "buffer", n, tuple(self.buffers[n].shape),
                                      [values[f"buffer.{n}"]]))
        for n in self.batch_names:
            inputs.append(InputTensor(n, "batch", n, tuple(values[n].shape), [values[n]]))
        for (n, i), (block, _) in zip(zero3_ids, (b for part in self.zero3.values()
                                                  for b in part.blocks)):
            inputs.append(InputTensor(i, "param", n, tuple(values[i].shape), [values[i]],
                                      {"zero3": block}, single_id=f"param.{n}"))
        for i, (_, n, k) in zip(self.state_ids, self.state_inputs):
            layout = self.state_layouts.get((n, k))
            inputs.append(InputTensor(i, "state", f"{n}:{k}", tuple(values[i].shape),
                                      [values[i]], None if layout is None else
                                      {"dtensor": layout}))
        program = _Converter(gm, self.script.path, self.where, self.rank or 0).convert(
            inputs, pnames, piece_blocks, state_keys)
        program.rank = self.rank
        program.aliases = dict(aliases)
        program.grad_slices = {n: dtensor.grad_slice(sp, n, self.script.path,
                                                     uneven=n in self.fsdp)
                               for n, sp in grad_slices.items() if sp is not None}
        if (piece_blocks or partitioned) and self.rank is None:
            program.grads = _whole_partitions(program, self.params, self.script.path)
            program.grad_pieces = {}
        elif piece_blocks or partitioned:
            program.grads = {}  # ZeRO's, Megatron's distributed optimizer's: only their
            # partitions are the rank's gradients
        return _readable(program)


# composite ATen ops of optimizers and gradient clipping, traced as torch's own
# decompositions into ops the registry has (the pinned torch's tables)
DECOMPOSED = ("linalg_vector_norm.default", "lerp.Scalar", "lerp.Tensor", "lerp_.Scalar",
              "lerp_.Tensor", "addcmul.default", "addcmul_.default", "addcdiv.default",
              "addcdiv_.default")


@functools.cache
def _decompositions() -> dict:
    """Built once per process (every rank and draw traces with the same table)."""
    from torch._decomp import get_decompositions

    return get_decompositions([operator.attrgetter(n)(torch.ops.aten) for n in DECOMPOSED])


def _grouped(pairs: list[tuple[str, str]], values: list) -> dict[str, list]:
    """name -> its values, in order, from (name, id) pairs and their values."""
    out: dict[str, list] = {}
    for (name, _), v in zip(pairs, values):
        out.setdefault(name, []).append(v)
    return out


def _declared(p) -> Any:
    """Sharding the code declares on a parameter (Megatron-style attributes): the split
    dimension, and, when Megatron-Core's parallel state is set up, the partition stride and
    this rank's place in its tensor-parallel group (which block a constant tensor holds,
    e.g. a sharded bias that starts at zero)."""
    if not (getattr(p, "tensor_model_parallel", False) and hasattr(p, "partition_dim")):
        return None
    out = {"megatron_partition_dim": int(p.partition_dim)}
    place = _megatron_tp_place()
    # an expert's weight (allreduce False) is split over the expert-parallel groups instead
    if place is not None and getattr(p, "allreduce", True):
        out["megatron_tp"] = place
        out["megatron_stride"] = int(getattr(p, "partition_stride", 1))
    return out


def _megatron_tp_place() -> tuple[int, int] | None:
    """(this rank's index in its tensor-parallel group, the group's size) from Megatron-Core's
    parallel state, when the code set it up; else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        return int(ps.get_tensor_model_parallel_rank()), \
            int(ps.get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - another version's API: the block is then found by value
        return None


# ----------------------------------------------------------------------------- conversion


def source_of(node, script_path: str) -> str | None:
    """file:line of the innermost frame of the user's script in the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(trace)]
    mine = [f for f in frames if os.path.abspath(f[0]) == script_path]
    if not mine:
        return None
    file, line = mine[-1]
    try:
        shown = os.path.relpath(file)
        if shown.startswith(".."):
            shown = file
    except ValueError:
        shown = file
    return f"{shown}:{line}"


def _storage(v) -> int | None:
    if isinstance(v, torch.Tensor):
        try:
            return v.untyped_storage()._cdata
        except Exception:  # noqa: BLE001 - tensors without storage (never aliased)
            return None
    return None


def _region(val) -> tuple[int, int] | None:
    """The elements [start, end) of its storage that a contiguous tensor covers, in order;
    None for a tensor that is not contiguous (or has no storage)."""
    try:
        if isinstance(val, torch.Tensor) and val.is_contiguous():
            start = val.storage_offset()
            return start, start + val.numel()
    except Exception:  # noqa: BLE001 - no storage to speak of
        pass
    return None


def _functional_name(target) -> str:
    """An in-place ATen overload's functional form's name (aten.copy_.default ->
    aten.copy.default), as the conversion writes it."""
    name = str(target)
    op, _, overload = name.rpartition(".")
    return f"{op[:-1]}.{overload}" if op.endswith("_") else name


def _whole(val) -> bool:
    """Does the tensor `val` view all of its storage, contiguously, from its start?"""
    try:
        return (isinstance(val, torch.Tensor) and val.storage_offset() == 0
                and val.is_contiguous()
                and val.numel() * val.element_size() == val.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - no storage to speak of: never taken for a whole view
        return False


def _without_out(target):
    """The overload of an out= ATen op that takes the same arguments but `out` and writes
    nothing (exp.out -> exp.default), or None."""
    schema = target._schema
    want = [(a.name, str(a.type)) for a in schema.arguments
            if not (a.alias_info is not None and a.alias_info.is_write)]
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1], None)
    for overload in packet.overloads() if packet is not None else ():
        op = getattr(packet, overload)
        theirs = op._schema.arguments
        if not any(a.alias_info is not None and a.alias_info.is_write for a in theirs) and \
                [(a.name, str(a.type)) for a in theirs] == want:
            return op
    return None


OUTPUT_BUFFER_COLLECTIVES = {"c10d._allgather_base_.default",
                             "c10d._reduce_scatter_base_.default",
                             "c10d.alltoall_base_.default"}  # their first argument: the output


def _values_ignored(value) -> bool:
    """Are the values of fx node `value` never read: through views only (slice, view,
    reshape), are its users `baddbmm` with beta 0 taking it as the term to add, which torch
    ignores (Megatron's buffer for the attention scores), or collectives that take it as their
    output buffer (the same buffer of Megatron's, reused by sequence parallelism's
    all-gathers)?"""
    if not value.users:
        return False
    for user in value.users:
        target = str(user.target)
        if target in PURE_VIEW_OPS and user.args[0] is value:
            if not _values_ignored(user):
                return False
            continue
        first_only = user.args[0] is value and not any(a is value for a in user.args[1:])
        if not first_only or not (target in OUTPUT_BUFFER_COLLECTIVES or (
                target == "aten.baddbmm.default" and _beta(user) == 0)):
            return False
    return True


OVERWRITING_OPS = {"aten.copy.default", "aten.fill.Scalar", "aten.fill.Tensor",
                   "aten.zero.default"}  # functional forms of copy_, fill_, zero_


def _is_view(target) -> bool:
    """Does the ATen op only view its input (its schema: every result an alias of an
    argument, none written), as t, transpose, expand, split and as_strided do?"""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) and \
        not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _first_values_unread(fx_node, name: str) -> bool:
    """Does the op leave its first argument's values unread: it overwrites all of them
    (copy_, fill_, zero_, in their functional form) or adds them with weight 0 (baddbmm
    with beta 0)?"""
    return name in OVERWRITING_OPS or (name == "aten.baddbmm.default" and _beta(fx_node) == 0)


def _beta(fx_node):
    """baddbmm's beta (the weight of the term it adds), 1 when not given."""
    beta = fx_node.kwargs.get("beta", fx_node.args[3] if len(fx_node.args) > 3 else 1)
    return beta if isinstance(beta, (int, float)) else None


def _dtype_of(fx_node) -> str | None:
    """The dtype of a non-floating tensor ("torch.int64", "torch.bool"): ATen entries such as
    index and index_put read it (a bool mask and 0/1 indices mean different things)."""
    val = fx_node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_floating_point():
        return str(val.dtype)
    return None


def computes_in_float32(fx_node) -> bool:
    """Whether PyTorch computes this op in float32: its floating tensors (inputs and outputs)
    are float32 or narrower. Its kernels then take a Python float argument as the nearest
    float32 (a wrapped scalar cast to the common dtype, `opmath_t` float for float32, half and
    bfloat16), so `x * 0.05` multiplies by 0.0500000007..., exactly what a float32 tensor
    holding 0.05 gives; with a float64 tensor among them the scalar stays a double."""
    dtypes = set()
    values = [fx_node.meta.get("val")] + [a.meta.get("val") for a in fx_node.all_input_nodes]
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            dtypes.add(leaf.dtype)
    return bool(dtypes) and torch.float64 not in dtypes


def _as_float32(v: float) -> float:
    """The float32 nearest to `v`, as the double that holds it exactly (inf past the range,
    as torch's cast gives)."""
    return float(torch.tensor(v, dtype=torch.float32).item())


def _to_json(v: Any, float32: bool = False) -> Any:
    """A call's argument template as JSON; with `float32`, each Python float as the float32
    the op computes with (see `computes_in_float32`)."""
    if isinstance(v, Ref):
        return {"tensor": v.k} if v.dtype is None else {"tensor": v.k, "dtype": v.dtype}
    if isinstance(v, (list, tuple)):
        return [_to_json(x, float32) for x in v]
    if isinstance(v, dict):
        return {str(k): _to_json(x, float32) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if float32 and math.isfinite(v):
            v = _as_float32(v)
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    return str(v)


class _Converter:
    """fx graph of one rank -> Program (SSA ids, comm nodes resolved, getitem folded)."""

    def __init__(self, gm, script_path: str, where: str, rank: int):
        self.gm, self.path, self.where, self.rank = gm, script_path, where, rank
        self.env: dict[Any, Any] = {}
        self.version: dict[int, int] = {}  # storage -> current version
        self.seen_version: dict[Any, tuple[int, int]] = {}  # fx node -> (storage, version)
        # storage -> (SSA id, shape, version) of its whole new value, after an in-place or
        # out= op wrote all of it: a stale read of another whole view of it is that value
        # viewed in its own shape (`read`)
        self.whole: dict[int, tuple[str, tuple[int, ...], int]] = {}
        # storage -> what it holds where, as [(start, end, SSA id, start of that id)] in
        # element offsets, sorted: its first value and what in-place or out= ops wrote into
        # contiguous parts of it since (`wrote`); None once a write the capture cannot place
        # (a non-contiguous view, an in-place collective) or a view of another dtype. A
        # stale contiguous view is rederived from it (`rederive`): DeepSpeed's gradient
        # bucket, a `torch.empty` filled gradient by gradient through narrow views and read
        # through another one
        self.held: dict[int, list | None] = {}
        self.held_dtype: dict[int, Any] = {}
        # fx view node -> the stale (storage, version) it viewed: the view is stale too
        self.stale_views: dict[Any, tuple[int, int]] = {}
        self.nodes: list[CapNode] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        # SSA id -> fx node of the torch.empty whose uninitialised memory it is (itself or a
        # view of it): an operator that reads one is refused (`refuse_uninitialised_reads`)
        self.uninitialised: dict[str, Any] = {}

    def fail(self, node, message: str):
        src = source_of(node, self.path)
        at = f" at {src}" if src else ""
        raise InputError(f"{self.where}{at}: {message}", file=self.path, node=node.name)

    # values ---------------------------------------------------------------------------
    def define(self, fx_node, value) -> None:
        self.env[fx_node] = value
        val = fx_node.meta.get("val")
        s = _storage(val)
        if s is None:
            return
        stale = self.stale_views.pop(fx_node, None)
        self.seen_version[fx_node] = stale or (s, self.version.get(s, 0))
        if s not in self.held and isinstance(value, str) and _whole(val) and \
                str(fx_node.target) not in EMPTY_OPS:  # a storage's first value
            self.held[s], self.held_dtype[s] = [(0, val.numel(), value, 0)], val.dtype

    def mutate(self, fx_tensor_node) -> None:
        s = _storage(fx_tensor_node.meta.get("val"))
        if s is not None:
            self.version[s] = self.version.get(s, 0) + 1
            self.held[s] = None  # unless `wrote` says what was written where

    def read(self, fx_node, user):
        if fx_node not in self.env:
            self.fail(user, f"uses {fx_node.name}, which the capture could not convert")
        seen = self.seen_version.get(fx_node)
        if seen is not None and self.version.get(seen[0], 0) != seen[1]:
            if str(user.target) in PURE_VIEW_OPS and _values_ignored(user):
                # a buffer reused after a write (Megatron's global buffer, written by an
                # all-gather, then viewed as the next one's output or as baddbmm's ignored
                # term): whatever it holds now, nothing reads it
                return self.env[fx_node]
            if str(user.target) in PURE_VIEW_OPS and user.args[0] is fx_node:
                # a view of a stale tensor is as stale: rederived where it is read
                self.stale_views[user] = seen
                return self.env[fx_node]
            if user.args and user.args[0] is fx_node and fx_node not in user.args[1:] and \
                    _first_values_unread(user, _functional_name(user.target)):
                # overwritten whole (copy_, fill_, zero_): its values are not read
                shape = tuple(fx_node.meta["val"].shape)
                return self.aten_node(user, "overwritten", torch.ops.aten.zeros.default,
                                      (list(shape),), [], shape)
            if not self.rederive_through_views(fx_node, user, seen[0]):
                self.fail(user, f"reads {fx_node.name} after an in-place operation changed "
                                f"it through an alias (a view written in place): not "
                                f"supported")
        return self.env[fx_node]

    def new_version_id(self, fx_node, version: int, shape: tuple[int, ...]) -> str:
        """A fresh SSA id for `fx_node`'s value at storage version `version` (never another
        tensor's name), with its shape recorded."""
        new = f"{fx_node.name}_v{version}"
        while new in self.shapes:
            new += "_"
        self.shapes[new] = shape
        return new

    def rederive_through_views(self, fx_node, user, storage: int) -> bool:
        """A stale `fx_node` that is a chain of views (t, as_strided, detach, ...) of a
        tensor `rederive` can give its storage's current value: the same views of that
        value, as eager torch reads the memory now. FSDP2's unsharded parameters are such:
        the forward saves `t(as_strided(buffer))`, the buffer is all-gathered again before
        the backward reads it. False where no tensor of the chain can be rederived."""
        chain, node = [], fx_node
        while True:
            seen = self.seen_version.get(node)
            if node is not fx_node and seen is not None and \
                    self.version.get(seen[0], 0) == seen[1]:
                break  # viewed after the write: current
            if self.rederive(node, user, storage):
                break
            base = node.args[0] if node.op == "call_function" and node.args else None
            if not (isinstance(base, torch.fx.Node) and base in self.env
                    and isinstance(node.meta.get("val"), torch.Tensor)
                    and _storage(base.meta.get("val")) == storage
                    and (str(node.target) in IDENTITY_OPS or _is_view(node.target))):
                return False
            chain.append(node)
            node = base
        version = self.version.get(storage, 0)
        for node in reversed(chain):
            if str(node.target) in IDENTITY_OPS:
                self.env[node] = self.env[node.args[0]]
            else:
                inputs: list[str] = []
                args = self.template(node, node.args, inputs)
                kwargs = self.template(node, dict(node.kwargs), inputs)
                new = self.new_version_id(node, version, tuple(node.meta["val"].shape))
                self.nodes.append(CapNode(new, str(node.target), inputs, [new],
                                          {"args": _to_json(args), "kwargs": _to_json(kwargs)},
                                          source_of(user, self.path),
                                          call=(node.target, args, kwargs),
                                          mb=microbatch_of(user)))
                self.env[node] = new
            self.seen_version[node] = (storage, version)
        return True

    def rederive(self, fx_node, user, storage: int) -> bool:
        """A stale `fx_node` that views all of its storage, whose whole new value an
        in-place or out= op wrote (`whole`): that value in `fx_node`'s shape (a view node),
        e.g. Megatron's attention scores masked in place through a view of the batched
        matmul's result. False for anything else (a partial view: refused by the caller)."""
        latest = self.whole.get(storage)
        val = fx_node.meta.get("val")
        if latest is None or latest[2] != self.version.get(storage, 0) or not _whole(val):
            return self.rederive_part(fx_node, user, storage)
        vid, shape, version = latest
        if tuple(val.shape) != shape:
            target = torch.ops.aten.view.default
            args = (Ref(0, _dtype_of(fx_node)), list(val.shape))
            new = self.new_version_id(fx_node, version, tuple(val.shape))
            self.nodes.append(CapNode(new, str(target), [vid], [new],
                                      {"args": _to_json(args), "kwargs": {}},
                                      source_of(user, self.path), call=(target, args, {}),
                                      mb=microbatch_of(user)))
            vid = new
        self.env[fx_node] = vid
        self.seen_version[fx_node] = (storage, version)
        return True

    def rederive_part(self, fx_node, user, storage: int) -> bool:
        """A stale contiguous `fx_node` whose elements the storage's `held` parts cover: the
        slices of those parts' values, concatenated, in `fx_node`'s shape. False where a
        part is unknown or uninitialised (refused by the caller)."""
        val = fx_node.meta.get("val")
        held, region = self.held.get(storage), _region(val)
        if held is None or region is None or self.held_dtype.get(storage) != val.dtype:
            return False
        start, end = region
        pieces, at, version = [], start, self.version.get(storage, 0)
        name = f"{fx_node.name}_v{version}"
        for a, b, vid, first in held:
            if b <= at:
                continue
            if a > at or vid not in self.shapes:
                return False  # a gap (never written, or uninitialised), or not a tensor
            stop = min(b, end)
            flat = vid
            if len(self.shapes[vid]) != 1:
                flat = self.aten_node(user, f"{name}_{len(pieces)}_flat",
                                      torch.ops.aten.view.default, (Ref(0), [-1]), [vid],
                                      (math.prod(self.shapes[vid]),))
            if (at - first, stop - first) != (0, self.shapes[flat][0]):
                flat = self.aten_node(user, f"{name}_{len(pieces)}", torch.ops.aten.slice.Tensor,
                                      (Ref(0), 0, at - first, stop - first), [flat],
                                      (stop - at,))
            pieces.append(flat)
            at = stop
            if at >= end:
                break
        if at < end:
            return False
        vid = pieces[0] if len(pieces) == 1 else self.aten_node(
            user, f"{name}_cat", torch.ops.aten.cat.default,
            ([Ref(k) for k in range(len(pieces))], 0), pieces, (end - start,))
        if tuple(val.shape) != (end - start,):
            vid = self.aten_node(user, f"{name}_view", torch.ops.aten.view.default,
                                 (Ref(0, _dtype_of(fx_node)), list(val.shape)), [vid],
                                 tuple(val.shape))
        self.env[fx_node] = vid
        self.seen_version[fx_node] = (storage, version)
        return True

    def wrote(self, fx_tensor, value) -> None:
        """`fx_tensor` was written in place with `value` (an SSA id): a new version of its
        storage, whole when it covers all of the storage; where it is contiguous, the
        storage's `held` parts say so."""
        val = fx_tensor.meta.get("val")
        s = _storage(val)
        before = self.held.get(s, []) if s is not None else None
        self.mutate(fx_tensor)
        if s is None or not isinstance(value, str):
            return
        if _whole(val):
            self.whole[s] = (value, tuple(val.shape), self.version[s])
        region = _region(val)
        if region is None or before is None or (before and self.held_dtype.get(s) != val.dtype):
            return
        a, b = region
        kept = [(x, min(y, a), v, f) for x, y, v, f in before if x < a] + \
               [(max(x, b), y, v, f) for x, y, v, f in before if y > b]
        self.held[s] = sorted(kept + [(a, b, value, a)], key=lambda p: p[0])
        self.held_dtype[s] = val.dtype

    # main -----------------------------------------------------------------------------
    def convert(self, inputs: list[InputTensor], pnames: list[str],
                piece_blocks: list[tuple[str, Any]] = (),
                state_keys: list[tuple[str, str]] = ()) -> Program:
        """The traced graph as a Program; `piece_blocks`: (parameter, block) of each piece of
        a ZeRO gradient partition the step returned (zero.py), in order; `state_keys`:
        (parameter, key) of each optimizer state tensor the step left (`states_left`)."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise InputError(f"{self.where}: traced graph has {len(placeholders)} inputs, "
                             f"expected {len(inputs)}", file=self.path)
        for ph, inp in zip(placeholders, inputs):
            self.define(ph, inp.id)
            self.shapes[inp.id] = inp.shape
        out_node = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out_node = node
                break
            if node.op == "get_attr":
                self.get_attr(node)
            elif node.op == "call_function":
                self.call(node)
            else:
                self.fail(node, f"unsupported fx node kind {node.op}")
        flat = [self.read(x, out_node) if isinstance(x, torch.fx.Node) else x
                for x in (out_node.args[0] if out_node is not None else [])]
        loss, grads, pieces, after, left = pytree.tree_unflatten(flat, self.gm._out_spec)
        if loss is not None and not isinstance(loss, str):
            raise InputError(f"{self.where}: the loss is not a tensor of the graph",
                             file=self.path)
        if loss is not None and self.shapes.get(loss) is None:
            raise InputError(f"{self.where}: the loss is not a tensor", file=self.path)
        grad_ids = dict(zip(pnames, grads))
        for nm, g in grad_ids.items():
            if g is not None and not isinstance(g, str):
                raise InputError(f"{self.where}: the gradient of {nm} is not a tensor",
                                 file=self.path, tensor=nm)
        for t in pieces:
            if not isinstance(t, str):
                raise InputError(f"{self.where}: a piece of DeepSpeed ZeRO's gradient "
                                 f"partition is not a tensor of the graph", file=self.path)
        program = Program(None, inputs, self.nodes, self.shapes, loss, grad_ids)
        for nm, inp, now in zip(pnames, inputs, after):
            if isinstance(now, str) and now != inp.id:  # written in place by the step
                program.updated[nm] = now
        for (n, block), t in zip(piece_blocks, pieces):
            program.grad_pieces.setdefault(n, []).append((t, block))
        taken = {i.id for i in inputs}
        for (nm, k), now in zip(state_keys, left):
            if not isinstance(now, str):
                raise InputError(f"{self.where}: the optimizer's state {k!r} of {nm} after "
                                 f"the step is not a tensor of the graph", file=self.path,
                                 tensor=nm)
            if now not in taken:  # written by the step (a state left as it was: not)
                program.states_left.setdefault(nm, {})[k] = now
        return program

    def get_attr(self, node) -> None:
        obj = getattr(self.gm, node.target)
        if isinstance(obj, torch.ScriptObject):
            self.define(node, ("object", obj))
            return
        if isinstance(obj, torch.Tensor) and obj.numel() >= 1 and not obj.is_complex() and \
                bool((obj == obj.reshape(-1)[0]).all()):
            return self.constant(node, obj)
        self.fail(node, "the step uses a tensor created outside the traced inputs (a "
                        "constant or a module attribute that is not a parameter or buffer)")

    def constant(self, node, obj: torch.Tensor) -> None:
        """A constant tensor of one repeated value that tracing lifted out of the code (the
        0-d value of `x[mask] = 0`): the `full` of that value, so nothing is hidden."""
        value = obj.reshape(-1)[0].item()
        shape = list(obj.shape)
        kwargs = {"dtype": obj.dtype}
        self.shapes[node.name] = tuple(shape)
        target = torch.ops.aten.full.default
        self.nodes.append(CapNode(node.name, str(target), [], [node.name],
                                  {"args": _to_json([shape, value]),
                                   "kwargs": _to_json(kwargs)},
                                  source_of(node, self.path),
                                  call=(target, (shape, value), kwargs)))
        self.define(node, node.name)

    def template(self, node, value, inputs: list):
        """Replace tensor ids in a (nested) argument value by Ref markers."""
        if isinstance(value, torch.fx.Node):
            v = self.read(value, node)
            if isinstance(v, str):
                inputs.append(v)
                return Ref(len(inputs) - 1, _dtype_of(value))
            if isinstance(v, tuple) and v and v[0] == "object":
                self.fail(node, f"passes a torch.distributed object to {node.target}")
            return v
        if isinstance(value, (list, tuple)):
            return type(value)(self.template(node, x, inputs) for x in value)
        if isinstance(value, dict):
            return {k: self.template(node, x, inputs) for k, x in value.items()}
        return value

    def call(self, node) -> None:
        target = node.target
        if target is operator.getitem:
            base, idx = node.args
            value = self.read(base, node)
            try:
                self.define(node, value[idx])
            except (TypeError, IndexError, KeyError):
                self.fail(node, f"cannot index the result of {base.name}")
            return
        name = str(target)
        if name.startswith("c10d.") or name.startswith("_c10d_functional."):
            return self.collective(node, name)
        if name in PROFILER_OPS:  # torch.profiler.record_function around optimizer steps
            self.define(node, None)
            return
        if not isinstance(target, torch._ops.OpOverload) or not name.startswith("aten."):
            self.fail(node, f"unsupported call {name} (only ATen operators and collectives "
                            f"are captured)")
        if name in IDENTITY_OPS:
            value = self.read(node.args[0], node)
            self.define(node, value)
            return
        if name == "aten.as_strided.default" and self.as_strided_range(node):
            return
        zeroed = name in EMPTY_OPS and self.unread_empty(node)
        if zeroed:  # values nobody reads: zeros (any other torch.empty stays as it is:
            # dead where a collective overwrites it, else refused later as unknown)
            target, name = torch.ops.aten.zeros.default, "aten.zeros.default"
        schema = target._schema
        written = [i for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        call_kwargs = dict(node.kwargs)
        if zeroed:
            call_kwargs.pop("memory_format", None)  # zeros takes no layout in memory
        written_fx = []
        if written:
            target, name, written_fx = self.functional(node, target, written)
            call_kwargs.pop("out", None)
        inputs: list[str] = []
        args = self.template(node, node.args, inputs)
        kwargs = self.template(node, call_kwargs, inputs)
        if inputs and inputs[0] in self.uninitialised and inputs[0] not in inputs[1:] \
                and _first_values_unread(node, name):
            # the values the op overwrites or ignores: zeros, never uninitialised memory
            shape = tuple(node.args[0].meta["val"].shape)
            inputs[0] = self.aten_node(node, "ignored", torch.ops.aten.zeros.default,
                                       (list(shape),), [], shape)
        val = node.meta.get("val")
        outs = self.outputs_of(node, val)
        self.refuse_uninitialised_reads(node, name, inputs, outs)
        for w in written_fx:
            self.wrote(w, outs)
        float32 = computes_in_float32(node)
        cap = CapNode(node.name, name, inputs, tensor_slots(outs),
                      {"args": _to_json(args, float32), "kwargs": _to_json(kwargs, float32)},
                      source_of(node, self.path), call=(target, args, kwargs),
                      mb=microbatch_of(node))
        self.nodes.append(cap)
        self.define(node, outs)

    def as_strided_range(self, node) -> bool:
        """`as_strided` that takes a contiguous range of a contiguous tensor's elements in a
        new shape (FSDP2 views each parameter's gradient so in the reduce-scatter's flat
        output): the range sliced from the flattened tensor, viewed in that shape. Any
        other as_strided stays one (modelled only as a reshape of the whole tensor)."""
        base, val = node.args[0], node.meta.get("val")
        bval = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        region = _region(bval)
        if not isinstance(val, torch.Tensor) or region is None or _region(val) is None or \
                val.dtype != bval.dtype:
            return False
        (a, b), (start, end) = region, _region(val)
        if not (a <= start and end <= b) or (start, end) == (a, b):
            return False
        x = self.read(base, node)
        if not isinstance(x, str):
            return False
        view = torch.ops.aten.view.default
        flat = x if bval.dim() == 1 else self.aten_node(node, "flat", view, (Ref(0), [-1]),
                                                       [x], (bval.numel(),))
        piece = self.aten_node(node, "range", torch.ops.aten.slice.Tensor,
                               (Ref(0), 0, start - a, end - a), [flat], (end - start,))
        out = self.aten_node(node, "view", view, (Ref(0), list(val.shape)), [piece],
                             tuple(val.shape))
        self.refuse_uninitialised_reads(node, "aten.view.default", [x], out)
        self.define(node, out)
        return True

    def outputs_of(self, node, val):
        """SSA ids of a node's tensor outputs (the node's name, or name.i for several)."""
        if isinstance(val, torch.Tensor):
            self.shapes[node.name] = tuple(val.shape)
            return node.name
        if isinstance(val, (list, tuple)):
            out = []
            for i, v in enumerate(val):
                if isinstance(v, torch.Tensor):
                    tid = f"{node.name}.{i}"
                    self.shapes[tid] = tuple(v.shape)
                    out.append(tid)
                else:
                    out.append(v)
            return type(val)(out) if isinstance(val, tuple) else out
        if val is None:
            self.fail(node, f"{node.target}: no traced value (a data-dependent result?)")
        return val

    def unread_empty(self, node) -> bool:
        """Is `torch.empty` (uninitialised memory) unread (`_values_ignored`)? It is then
        captured as zeros, which no result depends on. Uninitialised memory that is read is
        never given values it does not have: it stays `aten.empty`, which no rule models."""
        return _values_ignored(node)

    def refuse_uninitialised_reads(self, node, name: str, inputs: list[str], outs) -> None:
        """Uninitialised memory (`torch.empty` that is not `unread_empty`) may only be viewed
        or handed to a collective as its output buffer. An operator that reads it computes on
        values the traced graph does not have: eager torch gave that tensor its values
        outside the traced operators (`tensor.data = ...`, as Megatron-Core's
        make_viewless_tensor does), so the captured program is not the code's. Refused here,
        naming the line, before any value is computed from it."""
        if name in EMPTY_OPS:
            self.uninitialised[outs] = node
            return
        read = [t for t in inputs if t in self.uninitialised]
        if not read:
            return
        if name in PURE_VIEW_OPS or _is_view(node.target):  # views of it are it
            for t in outs if isinstance(outs, (list, tuple)) else [outs]:
                if isinstance(t, str):
                    self.uninitialised[t] = self.uninitialised[read[0]]
            return
        empty = self.uninitialised[read[0]]
        src = source_of(empty, self.path)
        frames = _FRAME.findall(empty.meta.get("stack_trace") or "")
        made = f" at {src}" if src else ""
        if frames and os.path.abspath(frames[-1][0]) != self.path:  # inside a library
            made += f", in {frames[-1][0]}:{frames[-1][1]}"
        made = f" (torch.empty{made})"
        self.fail(node, f"{name} reads uninitialised memory{made}: its values were given "
                        f"outside the traced operators (e.g. by assigning `.data`), which "
                        f"tracing does not see; not supported")

    def functional(self, node, target, written):
        """The functional overload of an in-place ATen op (add_ -> add) or of an out= form
        (exp.out -> exp.default: the overload with the same arguments but `out`), and the fx
        tensor written: the functional output is its new version."""
        args = target._schema.arguments
        if written == [0] and not target._schema.name.endswith("_out") \
                and "out" not in node.kwargs and node.args:
            packet = target._schema.name.split("::")[-1]
            base = packet[:-1] if packet.endswith("_") else packet
            try:
                functional = getattr(getattr(torch.ops.aten, base), target._overloadname)
            except AttributeError:
                self.fail(node, f"{target}: no functional form aten.{base}")
            return functional, str(functional), [node.args[0]]
        out = node.kwargs.get("out")
        if len(written) == 1 and args[written[0]].name == "out" and \
                args[written[0]].kwarg_only and isinstance(out, torch.fx.Node):
            functional = _without_out(target)
            if functional is not None:
                return functional, str(functional), [out]
        self.fail(node, f"{target}: in-place or out= form not supported")

    # collectives ----------------------------------------------------------------------
    def group_ranks(self, node, arg) -> tuple[int, ...]:
        try:
            if isinstance(arg, str):  # functional collectives name the group
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(arg)
            else:
                kind, obj = self.read(arg, node)
                pg = dist.ProcessGroup.unbox(obj)
            return tuple(dist.get_process_group_ranks(pg))
        except InputError:
            raise
        except Exception:  # noqa: BLE001 - a group that cannot be resolved is never guessed
            self.fail(node, f"{node.target}: cannot resolve the process group")

    def reduce_op(self, node, arg) -> str:
        if isinstance(arg, str):
            op = arg.lower()
        else:
            _, obj = self.read(arg, node)
            code = int(obj.op())
            op = REDUCE_OPS.get(code) or REDUCE_OP_NAMES.get(code, f"ReduceOp {code}")
        if op not in ("sum", "avg", "max"):
            self.fail(node, f"{node.target}: reduction {op} is not supported (sum, avg, max)")
        return op

    def comm_node(self, node, kind: str, src_fx, ranks, *, reduce=None, src=None,
                  out_id: str) -> str:
        inp = src_fx if isinstance(src_fx, str) else self.read(src_fx, node)
        if not isinstance(inp, str):
            self.fail(node, f"{node.target}: the input is not a tensor")
        if not (kind == "broadcast" and src != self.rank):  # a receiver's buffer is not read
            self.refuse_uninitialised_reads(node, kind, [inp], out_id)
        out = out_id
        op = kind
        if kind in ("all_reduce", "reduce_scatter"):
            op = REDUCED_COMM.get((kind, reduce))
            if op is None:
                self.fail(node, f"{node.target}: {kind} with reduction {reduce} is not "
                                f"supported")
        attrs: dict[str, Any] = {"ranks": list(ranks)}
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            attrs["dim"] = 0
        if kind == "all_to_all":
            attrs["split_dim"] = 0
        if kind in ("reduce_scatter", "all_to_all"):
            attrs["idx"] = list(ranks).index(self.rank)
        if kind == "broadcast":
            attrs["src"] = src
        self.nodes.append(CapNode(out, op, [inp], [out], attrs, source_of(node, self.path),
                                  comm=Collective(kind, tuple(ranks), reduce, src),
                                  mb=microbatch_of(node)))
        return out

    def aten_node(self, node, suffix: str, target, args: tuple, inputs: list[str],
                  shape: tuple[int, ...]) -> str:
        """A plain ATen node the conversion writes itself (the cat before a list-form
        reduce-scatter, the slices after a list-form all-to-all), with the real call."""
        oid = f"{node.name}.{suffix}"
        self.shapes[oid] = tuple(shape)
        self.nodes.append(CapNode(oid, str(target), list(inputs), [oid],
                                  {"args": _to_json(list(args)), "kwargs": {}},
                                  source_of(node, self.path), call=(target, args, {}),
                                  mb=microbatch_of(node)))
        return oid

    def tensor_ids(self, node, fx_nodes) -> list[str]:
        ids = [self.read(t, node) for t in fx_nodes]
        if not all(isinstance(t, str) for t in ids):
            self.fail(node, f"{node.target}: an input is not a tensor")
        return ids

    def equal_pieces(self, node, pieces, n: int, shape) -> None:
        """List-form collectives: one equal piece per group member (other splits are
        refused, never guessed)."""
        if len(pieces) != n or any(tuple(p.meta["val"].shape) != tuple(shape) for p in pieces):
            self.fail(node, f"{node.target}: only {n} equal pieces (one per member of the "
                            f"group) are supported")

    def list_collective(self, node, name: str) -> None:
        """all_gather / reduce_scatter / all_to_all with tensor lists, written with the
        registry's tensor forms: an all-gather into a list is one broadcast from each
        member; a reduce-scatter of a list is a reduce-scatter of its concatenation; an
        all-to-all of lists is an all-to-all of the concatenations, sliced again."""
        a = node.args
        if name == "c10d.allgather_.default":
            outs, ins, ranks = a[0], a[1], self.group_ranks(node, a[2])
            if len(outs) != 1 or len(ins) != 1:
                self.fail(node, f"{node.target}: only one tensor per rank is supported")
            self.equal_pieces(node, outs[0], len(ranks), ins[0].meta["val"].shape)
            ids = []
            for j, t in enumerate(outs[0]):
                oid = f"{node.name}.{j}"
                self._shape_for(oid, t.meta["val"])
                ids.append(self.comm_node(node, "broadcast", ins[0], ranks, src=ranks[j],
                                          out_id=oid))
                self.mutate(t)
            self.define(node, ([ids], None))
            return
        if name == "c10d.reduce_scatter_.default":
            outs, ins = a[0], a[1]
            ranks, op = self.group_ranks(node, a[2]), self.reduce_op(node, a[3])
            if len(outs) != 1 or len(ins) != 1:
                self.fail(node, f"{node.target}: only one tensor per rank is supported")
            shape = tuple(outs[0].meta["val"].shape)
            self.equal_pieces(node, ins[0], len(ranks), shape)
            cat = self.aten_node(node, "cat", torch.ops.aten.cat.default,
                                 ([Ref(k) for k in range(len(ranks))], 0),
                                 self.tensor_ids(node, ins[0]),
                                 (shape[0] * len(ranks),) + shape[1:])
            oid = f"{node.name}.0"
            self.shapes[oid] = shape
            self.comm_node(node, "reduce_scatter", cat, ranks, reduce=op, out_id=oid)
            self.mutate(outs[0])
            self.define(node, ([oid], None))
            return
        # c10d.alltoall_: out[j] on this rank = member j's in[this rank]
        outs, ins, ranks = a[0], a[1], self.group_ranks(node, a[2])
        shape = tuple(ins[0].meta["val"].shape) if ins else ()
        self.equal_pieces(node, ins, len(ranks), shape)
        self.equal_pieces(node, outs, len(ranks), shape)
        n = len(ranks)
        full = (shape[0] * n,) + shape[1:]
        cat = self.aten_node(node, "cat", torch.ops.aten.cat.default,
                             ([Ref(k) for k in range(n)], 0), self.tensor_ids(node, ins), full)
        mixed = f"{node.name}.all"
        self.shapes[mixed] = full
        self.comm_node(node, "all_to_all", cat, ranks, out_id=mixed)
        ids = []
        for j, t in enumerate(outs):
            ids.append(self.aten_node(node, str(j), torch.ops.aten.slice.Tensor,
                                      (Ref(0), 0, j * shape[0], (j + 1) * shape[0]), [mixed],
                                      shape))
            self.mutate(t)
        self.define(node, (ids, None))

    def all_to_all_single(self, node, out_fx, in_fx, ranks, splits) -> str:
        """all_to_all_single with equal splits along dim 0 (the registry's all_to_all);
        uneven splits are refused."""
        n = len(ranks)
        size = in_fx.meta["val"].shape[0]
        for sp in splits:
            if sp and (len(sp) != n or any(int(k) * n != size for k in sp)):
                self.fail(node, f"{node.target}: split sizes {list(sp)} are not {n} equal "
                                f"pieces (only even splits are supported)")
        oid = node.name if out_fx is None else f"{node.name}.0"
        self._shape_for(oid, (out_fx if out_fx is not None else node).meta["val"])
        return self.comm_node(node, "all_to_all", in_fx, ranks, out_id=oid)

    def point_to_point(self, node, send: bool) -> None:
        """send / recv_ (also what isend / irecv trace to; `wait()` leaves no node). A send
        is a marker that assemble.py pairs with the destination's receive, in program order
        per (source, destination, tag); the receive becomes a `move` from the sender's
        tensor, and the receive buffer's later reads see the moved value."""
        tensors, group, peer, tag = node.args[:4]
        ranks = self.group_ranks(node, group)
        try:
            peer = ranks[int(peer)]  # c10d takes the peer's rank within the group
        except (IndexError, TypeError, ValueError):
            self.fail(node, f"{node.target}: peer {peer!r} is not a rank of group "
                            f"{list(ranks)}")
        if peer == self.rank:
            self.fail(node, f"{node.target}: a rank sending to or receiving from itself")
        src, dst = (self.rank, peer) if send else (peer, self.rank)
        where = source_of(node, self.path)
        for i, t in enumerate(tensors):
            oid = f"{node.name}.{i}"
            if send:
                tid = self.read(t, node)
                if not isinstance(tid, str):
                    self.fail(node, f"{node.target}: the sent value is not a tensor")
                self.nodes.append(CapNode(oid, "send", [tid], [], {"src": src, "dst": dst},
                                          where, comm=Collective("send", (src, dst),
                                                                 tag=int(tag)),
                                          mb=microbatch_of(node)))
                continue
            self._shape_for(oid, t.meta["val"])
            self.nodes.append(CapNode(oid, "move", [None], [oid], {"src": src, "dst": dst},
                                      where, comm=Collective("recv", (src, dst),
                                                             tag=int(tag)),
                                      mb=microbatch_of(node)))
            self.mutate(t)
            self.define(t, oid)  # the buffer now holds the received value
        self.define(node, None)

    def _shape_for(self, name: str, val) -> None:
        self.shapes[name] = tuple(val.shape)

    def in_place_each(self, node, kind: str, tensors, ranks, **kw) -> None:
        """An in-place c10d collective over a list of tensors: one communication node per
        tensor, whose buffer then holds the result."""
        outs = []
        for i, t in enumerate(tensors):
            oid = f"{node.name}.{i}"
            self._shape_for(oid, t.meta["val"])
            outs.append(self.comm_node(node, kind, t, ranks, out_id=oid, **kw))
            self.wrote(t, oid)  # the buffer holds the result, also for its other views
        self.define(node, (outs, None))

    def collective(self, node, name: str) -> None:
        a = node.args
        val = node.meta.get("val")
        if name == "c10d.allreduce_.default":
            ranks, op = self.group_ranks(node, a[1]), self.reduce_op(node, a[2])
            self.in_place_each(node, "all_reduce", a[0], ranks, reduce=op)
        elif name in ("c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"):
            out_fx, in_fx = a[0], a[1]
            ranks = self.group_ranks(node, a[2])
            kind = "all_gather" if "allgather" in name else "reduce_scatter"
            op = self.reduce_op(node, a[3]) if kind == "reduce_scatter" else None
            oid = node.name
            self._shape_for(oid, out_fx.meta["val"])
            self.comm_node(node, kind, in_fx, ranks, reduce=op, out_id=oid)
            self.wrote(out_fx, oid)
            self.define(node, (oid, None))
        elif name in ("c10d.allgather_.default", "c10d.reduce_scatter_.default",
                      "c10d.alltoall_.default"):
            self.list_collective(node, name)
        elif name == "c10d.alltoall_base_.default":
            out_fx, in_fx, group = a[0], a[1], a[2]
            oid = self.all_to_all_single(node, out_fx, in_fx, self.group_ranks(node, group),
                                         [a[3], a[4]])
            self.mutate(out_fx)
            self.define(out_fx, oid)  # the output buffer now holds the result
            self.define(node, None)
        elif name == "_c10d_functional.all_to_all_single.default":
            self.define(node, self.all_to_all_single(node, None, a[0],
                                                     self.group_ranks(node, a[3]),
                                                     [a[1], a[2]]))
        elif name in ("c10d.send.default", "c10d.recv_.default"):
            self.point_to_point(node, name == "c10d.send.default")
        elif name == "c10d.broadcast_.default":
            ranks = self.group_ranks(node, a[1])
            self.in_place_each(node, "broadcast", a[0], ranks, src=ranks[int(a[2])])
        elif name == "_c10d_functional.all_reduce.default":
            ranks, op = self.group_ranks(node, a[2]), self.reduce_op(node, a[1])
            self._shape_for(node.name, val)
            self.define(node, self.comm_node(node, "all_reduce", a[0], ranks, reduce=op,
                                             out_id=node.name))
        elif name in ("_c10d_functional.all_gather_into_tensor.default",
                      "_c10d_functional.reduce_scatter_tensor.default"):
            gather = "all_gather" in name
            ranks = self.group_ranks(node, a[2] if gather else a[3])
            op = None if gather else self.reduce_op(node, a[1])
            self._shape_for(node.name, val)
            self.define(node, self.comm_node(node, "all_gather" if gather else "reduce_scatter",
                                             a[0], ranks, reduce=op, out_id=node.name))
        elif name == "_c10d_functional.broadcast.default":
            ranks = self.group_ranks(node, a[2])
            self._shape_for(node.name, val)
            self.define(node, self.comm_node(node, "broadcast", a[0], ranks,
                                             src=ranks[int(a[1])],  # a rank of the group
                                             out_id=node.name))
        elif name in IDENTITY_OPS:
            self.define(node, self.read(a[0], node))
        else:
            self.fail(node, f"collective {name} is not supported yet")


def _whole_partitions(program: Program, params: dict, path: str) -> dict[str, str | None]:
    """The single device's gradients when its code partitions them (DeepSpeed ZeRO, Megatron's
    distributed optimizer, in a world of one rank): each parameter's one partition, which is
    the whole gradient; anything else is refused (its gradients would go unclaimed)."""
    grads: dict[str, str | None] = {n: None for n in params}
    for n, pieces in program.grad_pieces.items():
        shape = tuple(getattr(params[n], "ds_shape", None) or params[n].shape)
        if len(pieces) != 1 or tuple(pieces[0][1]) != tuple((0, d) for d in shape):
            raise InputError(f"single: the gradient of {n} is partitioned on the single "
                             f"device ({len(pieces)} pieces that are not the whole): build "
                             f"the single model without the partitioning", file=path,
                             tensor=n)
        grads[n] = pieces[0][0]
    return grads


def _readable(program: Program) -> Program:
    """Name the results after what they are: `loss`, `grad.<parameter>`,
    `updated.<parameter>`, `updated.state.<parameter>.<key>` (reports show them)."""
    names = {}
    if program.loss is not None:
        names[program.loss] = "loss"
    for n, g in program.grads.items():
        if g is not None and g not in names:
            names[g] = f"grad.{n}"
    for n, pieces in program.grad_pieces.items():
        for k, (g, _) in enumerate(pieces):
            names.setdefault(g, f"grad.{n}.{k}" if len(pieces) > 1 else f"grad.{n}")
    for n, u in program.updated.items():
        names.setdefault(u, f"updated.{n}")
    for n, left in program.states_left.items():
        for k, t in left.items():
            names.setdefault(t, f"updated.{state_id(n, k)}")
    taken = {i.id for i in program.inputs}
    names = {k: v for k, v in names.items() if k not in taken}
    if not names:
        return program

    def r(t):
        return names.get(t, t) if isinstance(t, str) else t

    for node in program.nodes:
        node.inputs = [r(t) for t in node.inputs]
        node.outputs = [r(t) for t in node.outputs]
    program.shapes = {r(t): s for t, s in program.shapes.items()}
    program.loss = r(program.loss)
    program.grads = {n: r(g) for n, g in program.grads.items()}
    program.grad_pieces = {n: [(r(g), block) for g, block in pieces]
                           for n, pieces in program.grad_pieces.items()}
    program.updated = {n: r(u) for n, u in program.updated.items()}
    program.states_left = {n: {k: r(t) for k, t in left.items()}
                           for n, left in program.states_left.items()}
    return program
