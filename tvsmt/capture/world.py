"""One rank's torch.distributed world, in this process: the "fake" backend over a FakeStore.

Collectives on the fake backend compute nothing; they only let the user's code run and be
traced. Between ranks the process group is destroyed and made again, so groups the script
creates (dist.new_group, device meshes) are made afresh for every rank.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch.distributed as dist

from tvsmt.capture.dtensor import local_distribution, reset_caches
from tvsmt.errors import InputError


def _fake_store():
    # Private test utility of torch (pinned 2.13.0): tests/test_capture.py exercises it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def reset_framework_singletons() -> None:
    """Framework state that outlives a process group and would leak between ranks, or
    between the two builds (random draws) of one rank.

    Reset here: torch's own group registry (by destroy_process_group), Megatron-Core's
    parallel state when it is imported, DeepSpeed's communication backend at the end of a
    world (`_end_deepspeed_world`), and DTensor's caches (`reset_caches`, called around
    every world). Anything else a script keeps globally, it must reset itself in build_rank.
    """
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and hasattr(ps, "destroy_model_parallel"):
        ps.destroy_model_parallel()


def _end_deepspeed_world() -> None:
    """DeepSpeed wraps the world in its own backend (`deepspeed.comm`) and keeps groups of
    it: its own destroy_process_group ends the world and drops them, and the next world is
    wrapped afresh by the next deepspeed.initialize. Within a world (the builds of two random
    draws) its backend stays: it wraps the same world."""
    ds = sys.modules.get("deepspeed.comm.comm")
    if ds is not None and getattr(ds, "cdb", None) is not None and dist.is_initialized():
        ds.destroy_process_group()
        ds.cdb = None


# what a launcher (torchrun, the deepspeed launcher) tells each rank's process
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")


def launcher_environment(rank: int, world_size: int):
    """The environment variables a launcher sets for one rank of a one-node job, as code
    such as DeepSpeed's reads them (without them it looks for MPI); the environment is as it
    was afterwards. Nothing connects to the address: the world is already made (the fake
    backend)."""
    import os
    from unittest import mock

    return mock.patch.dict(os.environ, zip(LAUNCHER_ENV, map(str, (
        rank, rank, world_size, world_size, "127.0.0.1", 29500))))


_DEEPSPEED_BACKEND = "deepspeed.comm.torch"


@contextmanager
def deepspeed_without_shared_memory():
    """DeepSpeed's communication backend compiles a C++ shared-memory all-reduce the first
    time it is made on a CPU machine (about 30 s and a compiler), for the ranks of one node
    as processes. Here every rank is this one process on the fake backend and the capture's
    collectives never run that kernel: while a world lasts the backend is made without it,
    as on a machine where it cannot be built. DeepSpeed's module is patched when it is
    imported, also by a build within the world, and given back as it was afterwards."""
    import importlib.abc
    import importlib.machinery

    patched = []

    def patch(module):
        if hasattr(module, "build_shm_op"):
            patched.append((module, module.build_shm_op))
            module.build_shm_op = lambda: None

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != _DEEPSPEED_BACKEND:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    finder = None
    if _DEEPSPEED_BACKEND in sys.modules:
        patch(sys.modules[_DEEPSPEED_BACKEND])
    else:
        finder = PatchOnImport()
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for module, original in patched:
            module.build_shm_op = original


@contextmanager
def rank_world(rank: int, world_size: int, script: str = "<script>"):
    """torch.distributed initialised as rank `rank` of `world_size`, torn down afterwards."""
    if dist.is_initialized():
        raise InputError("torch.distributed is already initialised in this process; "
                         "tvsmt makes one world per rank itself", file=script)
    # init_process_group wraps sys.excepthook with a "[rank<r>]:" prefix, once per call;
    # the process is not a rank once the capture is done
    hook = sys.excepthook
    dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=world_size)
    try:
        reset_caches()
        with local_distribution(), launcher_environment(rank, world_size), \
                deepspeed_without_shared_memory():
            yield
    finally:
        reset_framework_singletons()
        _end_deepspeed_world()
        reset_caches()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = hook
