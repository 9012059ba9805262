"""A simulated world in one CPU process (torch's fake process group standing for rank R of N), and the
tensor-parallel steps of a program run there on meta copies of their modules, to see what they place.

explain lays a whole plan out in such a world (explain.simulate). apply uses it to predict what `use`
styles place: it has no table for them, so it runs each one, on a meta copy of its module, and reads the
layout it leaves on every tensor (predict.Observed). apply runs inside a real process group, which a
second `init_process_group` would clash with and whose collectives must not see meta tensors, so the
styles run in a forked child that sets the real world aside (kept alive, never destroyed, never called)
and starts a fake one of the same size: the parent's process group, its communicators and DTensor's
caches are not touched, and a style that hangs or crashes costs its prediction, not the run. This lives
in runtime, not explain, because apply needs it and no stage imports a later one.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import select
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn

from ..compiler import program as p
from ..compiler.predict import PLAIN, Observed, Placed, unknown
from ..frontend import ir
from .lifetime import die_with, kill_and_reap
from .steps import STEPS, Running
from .torchcompat import clear_sharding_caches, strided_shard_class

#: How long the forked child may take to run every `use` style of a plan before its predictions are given up.
TIMEOUT_S = 120.0


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int) -> Iterator[None]:
    """Torch's fake process group as rank `rank` of `world_size`, for the length of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a simulated world needs a process without a process group (see observe_steps)")
    # DTensor caches how ops shard by their meshes' values, and hands back the meshes it cached: one of an
    # earlier world (an explain run before in this process, or in the parent of a forked child) names a
    # process group this world has not ("Could not resolve the process group registered under the name 3").
    clear_sharding_caches()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        if not _forked:
            dist.destroy_process_group()


#: Whether this process is in_fork's child. It ends by os._exit and never destroys its fake world: that
#: clears c10d's tables, shared with the parent's world it set aside, and the last reference to a real gloo
#: group of the parent then runs its destructor, which waits for threads that were not forked (a child
#: hung there for its whole time limit in one run of the suite).
_forked = False


def placed_as(tensor, mesh: str = "?") -> Placed:
    """What a tensor is: plain, or a DTensor's mesh dims and placements as plan values (on the plan's
    mesh `mesh`, which a DTensor does not name)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return PLAIN
    names = tuple(tensor.device_mesh.mesh_dim_names or ())
    return Placed(mesh, names, tuple(_placement(p, tensor.ndim) for p in tensor.placements))


def _placement(p, ndim: int):
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, strided_shard_class()):
        return ir.StridedShard(p.dim % ndim if ndim else p.dim, p.split_factor)
    if isinstance(p, Shard):
        return ir.Shard(p.dim % ndim if ndim else p.dim)
    if isinstance(p, Replicate):
        return ir.Replicate()
    if isinstance(p, Partial):
        return ir.Partial()
    return p


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers (and tensors kept as plain attributes) are on the
    meta device: nothing is allocated or read, tied tensors stay tied."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        tensors = [*sub._parameters.values(), *sub._buffers.values()]
        tensors += [v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and id(t) not in memo:
                empty = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def observe_user_styles(
    plan: ir.Plan, program: p.Program, model: nn.Module, imported: Mapping[str, Any], world_size: int
) -> dict[str, Observed]:
    """What each `use` style of `program` places, by the FQN of its module: each run on a meta copy of
    that module in a simulated world of `world_size` with the program's meshes (predict.predict's
    `observed`). A style that fails there, or a child that cannot be run, is an Observed with a failure."""
    steps = [s for s in program.steps if isinstance(s, p.UserStyle) and isinstance(s.module, str)]
    observed: dict[str, Observed] = {}
    for step, seen in zip(steps, observe_steps(plan, program, model, imported, world_size, steps)):
        observed.setdefault(step.module, seen)
    return observed


def observe_steps(
    plan: ir.Plan,
    program: p.Program,
    model: nn.Module,
    imported: Mapping[str, Any],
    world_size: int,
    steps: Sequence[p.Parallelize | p.Distribute | p.UserStyle],
    timeout_s: float = TIMEOUT_S,
) -> list[Observed]:
    """Run each of `steps` (tensor-parallel steps of `program`, acting on a module by FQN) on its own meta
    copy of that module, in a forked child holding a simulated world of `world_size` (rank 0) with the
    program's meshes on the CPU, through the same runtime.steps entries apply runs; the layout each step
    left on every tensor below its module, in the order of `steps`."""
    names = [_style_name(s) for s in steps]
    copies: list[nn.Module | Observed] = []  # a meta copy to run, or why there is none; then what it showed
    for step, name in zip(steps, names):
        try:
            copies.append(meta_copy(model.get_submodule(step.module)))
        except Exception as e:  # noqa: BLE001 - a module that cannot be copied to meta is not predicted
            copies.append(Observed(name, failure=f"its module cannot be copied to the meta device: {_why(e)}"))
    runnable = [i for i, c in enumerate(copies) if isinstance(c, nn.Module)]
    if not runnable:
        return copies
    meshes = {m.name: m.dim_names for m in plan.meshes}
    chosen = [(steps[i], names[i], copies[i]) for i in runnable]
    status, payload = in_fork(lambda: _run_steps(program, chosen, imported, world_size, meshes), timeout_s)
    ran = payload if status == "ok" else [Observed(names[i], failure=payload) for i in runnable]
    for i, seen in zip(runnable, ran):
        copies[i] = seen
    return copies


def _why(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _style_name(step) -> str:
    if isinstance(step, p.UserStyle):
        return step.alias
    if isinstance(step, p.Parallelize):
        return ", ".join(ctor.name for _, ctor in step.plan)
    return "distribute"


def _run_steps(program, chosen, imported, world_size, meshes) -> list[Observed]:
    """In the child: leave the real world, start a fake one, make the meshes, run every step."""
    from torch.distributed.device_mesh import init_device_mesh

    _set_real_world_aside()
    observed = []
    with simulated_world(world_size, 0), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = {}
        for step in program.steps:
            if isinstance(step, p.MakeMesh):
                shape = step.shape
                if None in shape:
                    shape = tuple(n if n is not None else world_size // ir.fixed_size(shape) for n in shape)
                made[step.name] = init_device_mesh("cpu", shape, mesh_dim_names=step.dims)
        for step, name, module in chosen:
            try:
                STEPS[type(step)].run(attrs.evolve(step, module=""), Running(module, made, dict(imported)))
            except Exception as e:  # noqa: BLE001 - a style that cannot run on meta is not predicted
                observed.append(Observed(name, failure=_why(e)))
                continue
            observed.append(Observed(name, _layouts(module, step.mesh, name, meshes[step.mesh.mesh])))
    return observed


def _layouts(module: nn.Module, mesh: ir.MeshRef, name: str, dims: tuple[str, ...]) -> tuple:
    """(name relative to the module, layout) of every parameter and buffer below it, shared ones under
    each of their names."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for local, tensor in (*sub._parameters.items(), *sub._buffers.items()):
            if tensor is None:
                continue
            placed = placed_as(tensor, mesh.mesh)
            if placed.mesh is not None and not set(placed.dims) <= set(dims):
                placed = unknown(f"the style '{name}' left it on a mesh the plan does not name")
            elif placed.mesh is not None:
                placed = attrs.evolve(placed, note=f"what the style '{name}' did in a simulated world")
            found.append((f"{prefix}.{local}" if prefix else local, placed))
    return tuple(found)


#: The real world the child set aside, kept referenced so that its process groups are never destroyed there.
_set_aside: list = []


def _set_real_world_aside() -> None:
    """In the forked child: forget the parent's process groups without destroying them (their
    communicators belong to the parent), so that a fake world can start."""
    from torch.distributed import distributed_c10d as c10d

    _set_aside.append(c10d._world)
    c10d._world = c10d._World()
    unregister = getattr(torch._C._distributed_c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()


def in_fork(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """`fn()` in a forked child: ("ok", its result) or ("failed", why). The child shares nothing back but
    the pickled result, writes nothing to the terminal and never returns into the caller's code (it
    leaves by os._exit), and runs CPU ops on one thread; one that is still running after `timeout_s` is
    killed. A child killed by a signal before its result is forked once more. (The deaths seen in test runs,
    a SIGSEGV or a SIGABRT, were a double free in lint's step, fixed at its cause: fakestep.copy_model.)"""
    outcome, value = _in_fork(fn, timeout_s)
    if outcome == "died":
        outcome, value = _in_fork(fn, timeout_s)
    return ("failed", value) if outcome == "died" else (outcome, value)


def _in_fork(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """in_fork's one attempt: ("died", why) where the child died of a signal before its result."""
    if not hasattr(os, "fork"):
        return "failed", "no fork on this platform to run it apart from the real process group"
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - imported before the fork, not in the child

    read, write = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(read)
        os.close(write)
        return "failed", f"cannot fork: {_why(e)}"
    if pid == 0:  # the child
        global _forked
        _forked = True
        try:
            die_with(parent)  # killed with the command (SIGTERM, SIGKILL), never left running on its own
            # One intra-op thread: the parent's OpenMP pool (started by any CPU op it ran) is not fork-safe,
            # and a child entering it waits forever (a matmul hung a whole time limit after the parent had
            # run a forward of its own); one thread never enters it.
            torch.set_num_threads(1)
            os.close(read)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            try:
                result = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                result = ("failed", _why(e))
            data = pickle.dumps(result)
            view = memoryview(data)
            while view:
                view = view[os.write(write, view) :]
        finally:
            os._exit(0)
    os.close(write)
    chunks, deadline, ended = [], time.monotonic() + timeout_s, False
    waiting = select.poll()  # not select.select, which takes no descriptor above 1023
    waiting.register(read, select.POLLIN)
    try:
        while True:
            if not waiting.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return "failed", f"no result within {timeout_s:.0f} s"
            chunk = os.read(read, 1 << 16)
            if not chunk:
                ended = True
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        status = 0
        if ended:  # it wrote its result and is leaving
            status = os.waitpid(pid, 0)[1]
        else:  # its time ran out, or this process is being stopped (a time limit, Ctrl-C): killed, not waited for
            kill_and_reap(pid)
    if not chunks and os.WIFSIGNALED(status):
        return "died", f"the simulated run died of {signal.Signals(os.WTERMSIG(status)).name} without a result"
    if not chunks:
        return "failed", "the simulated run ended without a result"
    return pickle.loads(b"".join(chunks))
