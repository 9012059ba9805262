"""Runs a lowered program on a model inside an initialised process group: the only torch.distributed writer.

Everything that can be checked is checked before the first mutation (lint at the real world size,
imports of `use` styles, the model's devices against `init`). If a step still fails, the model is put
back exactly as it was (module classes, parameters, buffers, hooks and composable-API state) and every
rank raises PlanError(SL300) naming the plan line and the failing call.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from attrs import define, field

from ..compiler import program as p
from ..compiler.lint import Linted, lint
from ..compiler.lower import lower
from ..compiler.predict import Placed
from ..compiler.styles import build, import_path, to_torch
from ..frontend import ir
from ..frontend.diagnostics import Diagnostic, PlanError
from . import helpers as runtime
from .torchcompat import composable_checkpoint, composable_replicate, composable_state_mapping


@define
class Applied:
    """The result of applying a plan: the model (changed in place), its meshes and the compiler's view."""

    model: nn.Module
    meshes: dict[str, Any]
    program: p.Program
    linted: Linted
    imported: dict[str, Any] = field(factory=dict)

    @property
    def predictions(self) -> dict[str, Placed]:
        return self.linted.predictions

    def mesh(self, ref: ir.MeshRef):
        return runtime.submesh(self.meshes[ref.mesh], ref.dims)


#: Steps that allocate or move data; a simulated world (the fake process group) skips them.
MATERIALISING = (p.TakeRank0Values, p.InitOnMesh, p.LoadFromRank0, p.Sync, p.MoveToDevice)


def simulated() -> bool:
    """Whether this is torch's fake process group: one process standing for a whole world, no data."""
    return dist.get_backend() == "fake"


def apply_plan(plan: ir.Plan, model: nn.Module) -> Applied:
    """Lint, lower and run `plan` on `model` across the current process group. PlanError if anything fails.

    In a simulated world (the fake process group) the model stays on the meta device: the program
    places every tensor but skips the steps that allocate or move data."""
    sources = {plan.source.name: plan.source}
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(
            [
                Diagnostic(
                    "SL300",
                    "apply needs an initialised process group",
                    help=("call torch.distributed.init_process_group() first, or use `shardlang apply`",),
                )
            ],
            sources,
        )
    world_size = dist.get_world_size()
    imported = _import_uses(plan, sources)
    user_classes = {alias: obj for alias, obj in imported.items() if isinstance(obj, type)}
    linted = lint(plan, model, world_size, user_classes)
    if not linted.ok:
        raise PlanError(linted.diagnostics, sources)
    problems = [] if simulated() else _check_devices(plan, model)
    if problems:
        raise PlanError(problems, sources)
    program = lower(plan, linted.resolution, world_size)
    applied = Applied(model, {}, program, linted, imported)
    snapshot = Snapshot.take(model)
    failure = None
    try:
        ctx = _Context(model, applied.meshes, imported)
        for step in program.steps:
            if simulated() and isinstance(step, MATERIALISING):
                continue
            try:
                run_step(step, ctx)
            except Exception as e:  # noqa: BLE001 - any failure of a torch call is reported as SL300
                failure = _failure(plan, step, e)
                break
    finally:
        failure = _agree(failure)
        if failure is not None:
            snapshot.restore()
    if failure is not None:
        raise PlanError([failure], sources)
    return applied


def _agree(failure: Diagnostic | None) -> Diagnostic | None:
    """Every rank learns whether any rank failed, so that all of them roll back together. (A simulated
    world, the fake process group, is one process: there is nobody to ask.)"""
    if simulated():
        return failure
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, None if failure is None else (dist.get_rank(), failure))
    failed = [f for f in flags if f is not None]
    if not failed:
        return None
    rank, first = failed[0]
    if failure is None:
        return Diagnostic("SL300", f"apply failed on rank {rank}: {first.message}", first.span, first.help)
    return failure


def _failure(plan: ir.Plan, step: p.Step, error: Exception) -> Diagnostic:
    where = getattr(step, "module", None)
    what = f" on '{where or 'root'}'" if where is not None else ""
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    help = [f"the failing call: {type(step).__name__}{what}"]
    if last is not None:
        help.append(f"raised at {Path(last.filename).name}:{last.lineno}")
    help.append("the model is left exactly as it was")
    message = f"apply failed{what}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return Diagnostic("SL300", message.rstrip(": "), step.origin, tuple(help))


def _import_uses(plan: ir.Plan, sources) -> dict[str, Any]:
    """Import every `use` before touching the model; a failed import is SL300 at the `use` line."""
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` would, so `use examples.styles.x` finds ./examples
    imported, found = {}, []
    for use in plan.uses:
        try:
            imported[use.alias] = import_path(use.path)
        except (ImportError, AttributeError, ValueError) as e:
            found.append(
                Diagnostic(
                    "SL300",
                    f"cannot import '{use.path}': {type(e).__name__}: {e}",
                    use.span,
                    ("the path is imported from the current directory and sys.path",),
                )
            )
    if found:
        raise PlanError(found, sources)
    return imported


def _check_devices(plan: ir.Plan, model: nn.Module) -> list[Diagnostic]:
    """The model must be built the way `init` says: on meta for `init meta` (rank 0 excepted for rank0),
    materialised otherwise: a meta model under another `init` would never be materialised."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    devices = {t.device.type for _, t in tensors}
    mode = plan.init.mode
    expect_meta = mode == "meta" or (mode == "rank0" and dist.get_rank() != 0)
    if expect_meta and devices - {"meta"}:
        where = "rank 0's model on cpu and the others' " if mode == "rank0" else "the model "
        return [
            Diagnostic(
                "SL300",
                f"init {mode} needs {where}on the meta device, but it has tensors on {', '.join(sorted(devices - {'meta'}))}",
                plan.init.span,
                ("build it with plan.build(build_model), or under `with torch.device('meta')`",),
            )
        ]
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if not expect_meta and on_meta:
        shown = ", ".join(on_meta[:8]) + (f" and {len(on_meta) - 8} more" if len(on_meta) > 8 else "")
        return [
            Diagnostic(
                "SL300",
                f"init {mode} needs a materialised model, but {len(on_meta)} tensors are on the meta device: {shown}",
                plan.init.span,
                ("nothing would materialise them: say `init meta` to materialise after sharding",),
            )
        ]
    cuda = any(runtime.mesh_device(m.device) == "cuda" for m in plan.meshes)
    if cuda and not torch.cuda.is_available():
        return [
            Diagnostic(
                "SL300",
                "the plan has a cuda mesh but no GPU is available",
                plan.meshes[0].span,
                ("use `cpu` or `auto` as the mesh device",),
            )
        ]
    return []


# --- running steps ---------------------------------------------------------------------------


@define
class _Context:
    model: nn.Module
    meshes: dict[str, Any]
    imported: dict[str, Any]
    full_state: dict = field(factory=dict)
    all_buffers: dict = field(factory=dict)

    def mesh(self, ref: ir.MeshRef):
        return runtime.submesh(self.meshes[ref.mesh], ref.dims)

    def module(self, fqn: str) -> nn.Module:
        return self.model.get_submodule(fqn) if fqn else self.model


def run_step(step: p.Step, ctx: _Context) -> None:
    """Do what `program.to_python` prints for this step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(step, p.MakeMesh):
        ctx.meshes[step.name] = init_device_mesh(runtime.mesh_device(step.device), step.shape, mesh_dim_names=step.dims)
    elif isinstance(step, p.Parallelize):
        module, mesh = ctx.module(step.module), ctx.mesh(step.mesh)
        for fqn, ctor in step.plan:
            if fqn == "":
                parallelize_module(module, mesh, build(ctor))
        children = {fqn: build(ctor) for fqn, ctor in step.plan if fqn}
        if children:
            parallelize_module(module, mesh, children)
    elif isinstance(step, p.Distribute):
        runtime.distribute_with_layouts(
            ctx.module(step.module), ctx.mesh(step.mesh), to_torch(step.input), to_torch(step.output)
        )
    elif isinstance(step, p.UserStyle):
        kwargs = {k: to_torch(v) for k, v in step.kwargs}
        runtime.apply_user_style(ctx.module(step.module), ctx.mesh(step.mesh), ctx.imported[step.alias], **kwargs)
    elif isinstance(step, p.Retie):
        runtime.retie(ctx.model, step.groups)
    elif isinstance(step, p.Checkpoint):
        composable_checkpoint()(ctx.module(step.module))
    elif isinstance(step, p.FullyShard):
        fully_shard(ctx.module(step.module), mesh=ctx.mesh(step.mesh), **{k: to_torch(v) for k, v in step.kwargs})
    elif isinstance(step, p.Replicate):
        mesh = runtime.flat_mesh(ctx.meshes[step.mesh.mesh], step.mesh.dims)
        composable_replicate()(ctx.module(step.module), device_mesh=mesh, **{k: to_torch(v) for k, v in step.kwargs})
    elif isinstance(step, p.TakeRank0Values):
        if dist.get_rank() == 0:
            ctx.full_state, ctx.all_buffers = ctx.model.state_dict(), dict(ctx.model.named_buffers())
            ctx.model.to("meta")
    elif isinstance(step, p.InitOnMesh):
        runtime.init_on_mesh(ctx.model, _device(step.device), step.method, seed=runtime.common_seed())
    elif isinstance(step, p.LoadFromRank0):
        runtime.load_from_rank0(ctx.model, _device(step.device), ctx.full_state, ctx.all_buffers)
    elif isinstance(step, p.Sync):
        runtime.sync_module_states(ctx.model, ctx.meshes[step.mesh.mesh], step.mesh.dims)
    elif isinstance(step, p.MoveToDevice):
        runtime.move_to_device(ctx.model, _device(step.device))
    else:
        raise TypeError(f"no way to run {type(step).__name__}")


def _device(kind: str) -> torch.device:
    device = runtime.mesh_device(kind)
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


# --- rollback ------------------------------------------------------------------------------------


class Snapshot:
    """Enough of a model's state to put it back after a failed apply: each module's class and attribute
    dict (one level of its dicts, sets and lists copied: parameters, buffers, submodules, hooks), each
    tensor's data, and the composable-API state torch keeps outside the modules."""

    def __init__(self, modules, tensors, composable):
        self.modules = modules
        self.tensors = tensors
        self.composable = composable

    @classmethod
    def take(cls, model: nn.Module) -> Snapshot:
        modules = []
        tensors = []
        for module in model.modules():
            saved = {k: _shallow(v) for k, v in module.__dict__.items()}
            modules.append((module, module.__class__, saved))
            for store in (module._parameters, module._buffers):
                tensors += [(t, t.data) for t in store.values() if t is not None]
        mapping = composable_state_mapping()
        composable = {m: mapping[m] for m, _, _ in modules if m in mapping} if mapping is not None else None
        return cls(modules, tensors, composable)

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, data in self.tensors:
                if tensor.data is not data:
                    tensor.data = data
        for module, cls, saved in self.modules:
            module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update({k: _shallow(v) for k, v in saved.items()})
        mapping = composable_state_mapping()
        if mapping is not None and self.composable is not None:
            for module, _, _ in self.modules:
                mapping.pop(module, None)
            mapping.update(self.composable)


def _shallow(value: Any) -> Any:
    """A copy of a dict, set or list (one level), so later in-place edits do not reach the snapshot."""
    return type(value)(value) if isinstance(value, (dict, set, list)) else value
