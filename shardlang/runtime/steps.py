"""One table of the program's step types: for each, the function that runs it and the one that prints it.

runtime.apply runs a program with `STEPS[type(step)].run`; emit.python prints it with `.write`, pasting
the source of the helpers an entry names. Adding a step type is its data class in compiler.program and
one entry here; the check at the end of this module fails at import if a step type has none.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from attrs import define, field, frozen

from ..compiler import initialisers
from ..compiler import program as p
from ..compiler.devices import mesh_device
from ..frontend import ir
from . import broadcasts, context, gathering, materialise, meshes, moving, ownstyles, pipeline, rank0, ties, units
from .context_layout import LAYOUTS
from .torchcompat import composable_checkpoint, composable_replicate
from .values import build, names_used, source, to_torch, value_source


@define
class Running:
    """What the steps of one program share while it runs: the model, the meshes made so far, the
    objects `use` imported, and (for `init rank0`) rank 0's values kept before it shards."""

    model: nn.Module
    meshes: dict[str, Any]
    imported: dict[str, Any]
    full_state: dict = field(factory=dict)
    #: This rank's pipeline stages {stage: module}, once SplitStages has run; `model` is then the one a
    #: step is running on.
    parts: dict | None = None
    #: The pp rank whose stages to cut, where not this rank's own (explain's simulated world only).
    pp_rank: int | None = None

    def mesh(self, ref: ir.MeshRef):
        return meshes.mesh_of(self.meshes[ref.mesh], ref.dims, ref.flat)

    def module(self, fqn: str) -> nn.Module:
        return self.model.get_submodule(fqn)


@frozen
class StepType:
    """How one kind of step runs and prints. `write(step, program, module)` returns the Python lines,
    `module` being the expression of the module the step acts on."""

    run: Callable[[Any, Running], None]
    write: Callable[[Any, p.Program, str], list[str]]
    #: Helpers (runtime's functions) the printed lines call: the printed program pastes their source.
    helpers: tuple[Callable, ...] = ()
    #: Helpers only some steps of the kind call, by step.
    needs: Callable[[Any, Any], tuple[Callable, ...]] = lambda step, program: ()
    #: Public torch names (import paths) the printed lines need, from the step's values; shardlang's own
    #: (`shardlang.`...) are pasted with what their source names (emit.python).
    names: Callable[[Any], set[str]] = lambda step: set()
    #: An import line for a torch API with no public path.
    private_import: str | None = None
    #: Allocates or moves tensors: a simulated world (the fake process group) skips it.
    moves_data: bool = False
    #: Compiles the module's forward (torch.compile): a simulated world runs it eager.
    compiles: bool = False


# --- printing helpers ---------------------------------------------------------------------------


def mesh_expr(ref: ir.MeshRef, program: p.Program) -> str:
    mesh = next(m for m in program.meshes if m.name == ref.mesh)
    var = mesh_var(ref.mesh)
    if ref.flat:
        return f"{var}[{tuple(ref.dims)!r}]._flatten({ref.flat_name!r})"
    if ref.dims == mesh.dims:
        return var
    return f"{var}[{', '.join(repr(d) for d in ref.dims)}]"


def mesh_var(mesh: str) -> str:
    """A mesh's Python variable: its plan name, unless that would shadow a name the program uses."""
    return f"{mesh}_mesh" if mesh in {"model", "torch", "dist", "name", "full_state"} else mesh


def _kwargs(kwargs: tuple[tuple[str, Any], ...]) -> str:
    return "".join(f", {k}={value_source(v)}" for k, v in kwargs)


def _device_source(device: str) -> str:
    return f"mesh_device({device!r})"


def _shape(shape: tuple[int | None, ...]) -> str:
    """A mesh shape; an `auto` dim (None) takes what the world size leaves."""
    if None not in shape:
        return repr(shape)
    fixed = ir.fixed_size(shape)
    rest = "dist.get_world_size()" + (f" // {fixed}" if fixed > 1 else "")
    parts = [str(n) if n is not None else rest for n in shape]
    return f"({', '.join(parts)},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _value_names(step) -> set[str]:
    """The torch names a step's argument values print with (placements, dtypes, policies)."""
    values = [v for _, v in getattr(step, "kwargs", ())] + [getattr(step, "input", None), getattr(step, "output", None)]
    return set().union(*(names_used(v) for v in values))


def torch_device(kind: str) -> torch.device:
    """The torch device of a mesh of `kind` (cuda | cpu | auto) on this rank."""
    device = mesh_device(kind)
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


# --- the steps, each run then write -------------------------------------------------------------


def run_make_mesh(step: p.MakeMesh, ctx: Running) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ctx.meshes[step.name] = init_device_mesh(mesh_device(step.device), step.shape, mesh_dim_names=step.dims)


def write_make_mesh(step: p.MakeMesh, program: p.Program, module: str) -> list[str]:
    return [
        f"{mesh_var(step.name)} = init_device_mesh({_device_source(step.device)}, {_shape(step.shape)}, mesh_dim_names={step.dims!r})"
    ]


def run_split_stages(step: p.SplitStages, ctx: Running) -> None:
    rank = ctx.pp_rank if ctx.pp_rank is not None else ctx.mesh(step.mesh).get_local_rank()
    mine = [s for s, r in enumerate(step.ranks) if r == rank]
    ctx.parts = pipeline.split_stages(ctx.model, step.blocks, step.dropped, mine)


def write_split_stages(step: p.SplitStages, program: p.Program, module: str) -> list[str]:
    mesh = mesh_expr(step.mesh, program)
    return [
        f"stage_ranks = {step.ranks!r}  # the pp rank of each stage",
        f"blocks = {step.blocks!r}",
        f"dropped = {step.dropped!r}",
        f"mine = [s for s, r in enumerate(stage_ranks) if r == {mesh}.get_local_rank()]",
        "stages = split_stages(model, blocks, dropped, mine)",
    ]


def run_parallelize(step: p.Parallelize, ctx: Running) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    module, mesh = ctx.module(step.module), ctx.mesh(step.mesh)
    for fqn, ctor in step.plan:
        if fqn == "":
            parallelize_module(module, mesh, build(ctor))
    children = {fqn: build(ctor) for fqn, ctor in step.plan if fqn}
    if ctx.parts is not None:
        children = pipeline.held_plan(module, children)
    if children:
        parallelize_module(module, mesh, children)


def write_parallelize(step: p.Parallelize, program: p.Program, module: str) -> list[str]:
    mesh = mesh_expr(step.mesh, program)
    lines = []
    own = [c for fqn, c in step.plan if fqn == ""]
    children = [(fqn, c) for fqn, c in step.plan if fqn]
    for ctor in own:
        lines.append(f"parallelize_module({module}, {mesh}, {source(ctor)})")
    if children:
        held = program.plan.pipeline is not None  # a stage holds some of these modules
        lines.append(f"parallelize_module({module}, {mesh}, {'held_plan(' + module + ', ' if held else ''}{{")
        lines += [f"    {fqn!r}: {source(ctor)}," for fqn, ctor in children]
        lines.append("})" + (")" if held else ""))
    return lines


def _parallelize_names(step: p.Parallelize) -> set[str]:
    return {"torch.distributed.tensor.parallel.parallelize_module"}.union(*(names_used(c) for _, c in step.plan))


def module_source(fqn: str) -> str:
    """The printed program's expression for the module at `fqn` ("" the model)."""
    return "model" if not fqn else f"model.get_submodule({fqn!r})"


def run_distribute(step: p.Distribute, ctx: Running) -> None:
    ownstyles.distribute_with_layouts(
        ctx.module(step.module), ctx.mesh(step.mesh), to_torch(step.input), to_torch(step.output)
    )


def write_distribute(step: p.Distribute, program: p.Program, module: str) -> list[str]:
    return [
        f"distribute_with_layouts({module}, {mesh_expr(step.mesh, program)}, {value_source(step.input)}, {value_source(step.output)})"
    ]


def run_user_style(step: p.UserStyle, ctx: Running) -> None:
    kwargs = {k: to_torch(v) for k, v in step.kwargs}
    ownstyles.apply_user_style(ctx.module(step.module), ctx.mesh(step.mesh), ctx.imported[step.alias], **kwargs)


def write_user_style(step: p.UserStyle, program: p.Program, module: str) -> list[str]:
    return [f"apply_user_style({module}, {mesh_expr(step.mesh, program)}, {step.alias}{_kwargs(step.kwargs)})"]


def run_retie(step: p.Retie, ctx: Running) -> None:
    groups = step.groups
    if ctx.parts is not None and groups is not None:  # SL214 keeps every tie within one stage
        groups = tuple(g for g in groups if all(pipeline.holds(ctx.model, n.rpartition(".")[0]) for n in g))
    ties.retie(ctx.model, groups)


def write_retie(step: p.Retie, program: p.Program, module: str) -> list[str]:
    if step.groups is None:
        return ["retie(model, ties)"]
    if program.plan.pipeline is not None:
        held = f"[g for g in {step.groups!r} if all(holds(model, n.rpartition('.')[0]) for n in g)]"
        return [f"retie(model, {held})"]
    return [f"retie(model, {step.groups!r})"]


def run_checkpoint(step: p.Checkpoint, ctx: Running) -> None:
    composable_checkpoint()(ctx.module(step.module))


def write_checkpoint(step: p.Checkpoint, program: p.Program, module: str) -> list[str]:
    return [f"checkpoint({module})"]


def run_compile(step: p.Compile, ctx: Running) -> None:
    ctx.module(step.module).compile(**dict(step.kwargs))


def write_compile(step: p.Compile, program: p.Program, module: str) -> list[str]:
    return [f"{module}.compile({', '.join(f'{k}={v!r}' for k, v in step.kwargs)})"]


def run_fully_shard(step: p.FullyShard, ctx: Running) -> None:
    from torch.distributed.fsdp import fully_shard

    modules = [ctx.module(fqn) for fqn in (step.module, *step.also)]
    kwargs = {k: to_torch(v) for k, v in step.kwargs}
    unit = fully_shard(modules if step.together else units.unit_of(modules[0]), mesh=ctx.mesh(step.mesh), **kwargs)
    if step.divide_by is not None:
        units.divide_gradients(unit, ctx.mesh(step.divide_by).size(), ctx.mesh(step.mesh))


def _may_be_container(step: p.FullyShard, program: p.Program) -> bool:
    """Whether a fully_shard unit's one module may be a ModuleList or ModuleDict of experts, split by
    expert_parallel, which the printed program hands to fully_shard through units.unit_of."""
    return not step.together and program.plan.has_style("expert_parallel")


def write_fully_shard(step: p.FullyShard, program: p.Program, module: str) -> list[str]:
    """`module` is the first module's expression, or (for targets matched at run time) the list of them all."""
    if step.also and all(isinstance(fqn, str) for fqn in step.also):
        module = f"[{', '.join([module, *map(module_source, step.also)])}]"
    mesh = mesh_expr(step.mesh, program)
    if _may_be_container(step, program):
        module = f"unit_of({module})"
    call = f"fully_shard({module}, mesh={mesh}{_kwargs(step.kwargs)})"
    note = [f"# {step.why}"] if step.why else []
    if step.divide_by is not None:
        return [*note, f"divide_gradients({call}, {mesh_expr(step.divide_by, program)}.size(), {mesh})"]
    return [*note, call]


def run_context_parallel(step: p.ContextParallel, ctx: Running) -> None:
    layout = LAYOUTS[step.load_balance]
    context.context_parallel(ctx.model, step.patterns, ctx.mesh(step.mesh), layout, step.whole_output)


def write_context_parallel(step: p.ContextParallel, program: p.Program, module: str) -> list[str]:
    mesh = mesh_expr(step.mesh, program)
    whole = "" if step.whole_output else ", whole_output=False"
    layout = LAYOUTS[step.load_balance].__name__
    return [f"context_parallel({module}, {step.patterns!r}, {mesh}, {layout}{whole})"]


def _context_names(step: p.ContextParallel) -> set[str]:
    """The roots of what a printed context_parallel line runs, as shardlang import paths (emit.python pastes
    them and every function and class of shardlang their source names), and the import their source needs."""
    roots = (context.context_parallel, context.context_shard, LAYOUTS[step.load_balance])
    return {"dataclasses.dataclass"} | {f"{root.__module__}.{root.__qualname__}" for root in roots}


def run_replicate(step: p.Replicate, ctx: Running) -> None:
    mesh = meshes.flat_mesh(ctx.meshes[step.mesh.mesh], step.mesh.dims)
    composable_replicate()(ctx.module(step.module), device_mesh=mesh, **{k: to_torch(v) for k, v in step.kwargs})


def write_replicate(step: p.Replicate, program: p.Program, module: str) -> list[str]:
    mesh = f"flat_mesh({mesh_var(step.mesh.mesh)}, {step.mesh.dims!r})"
    return [f"replicate({module}, device_mesh={mesh}{_kwargs(step.kwargs)})"]


def run_take_rank0_values(step: p.TakeRank0Values, ctx: Running) -> None:
    if dist.get_rank() == 0:
        ctx.full_state = rank0.rank0_values(ctx.model)


def write_take_rank0_values(step: p.TakeRank0Values, program: p.Program, module: str) -> list[str]:
    return [
        "full_state = {}",
        "if dist.get_rank() == 0:  # rank 0 built the full model: keep its values, shard it as a meta model",
        "    full_state = rank0_values(model)",
    ]


def run_init_on_mesh(step: p.InitOnMesh, ctx: Running) -> None:
    materialise.init_on_mesh(ctx.model, torch_device(step.device), step.method, seed=broadcasts.common_seed())


def write_init_on_mesh(step: p.InitOnMesh, program: p.Program, module: str) -> list[str]:
    return [f"init_on_mesh(model, {_device_source(step.device)}, {step.method!r}, seed=common_seed())"]


def run_load_from_rank0(step: p.LoadFromRank0, ctx: Running) -> None:
    rank0.load_from_rank0(ctx.model, torch_device(step.device), ctx.full_state)


def write_load_from_rank0(step: p.LoadFromRank0, program: p.Program, module: str) -> list[str]:
    return [f"load_from_rank0(model, {_device_source(step.device)}, full_state)"]


def run_offload_to_cpu(step: p.OffloadToCpu, ctx: Running) -> None:
    moving.offload_to_cpu(ctx.module(step.module))


def write_offload_to_cpu(step: p.OffloadToCpu, program: p.Program, module: str) -> list[str]:
    return [f"offload_to_cpu({module})"]


def run_sync(step: p.Sync, ctx: Running) -> None:
    broadcasts.sync_module_states(ctx.model, ctx.meshes[step.mesh.mesh], step.mesh.dims)


def write_sync(step: p.Sync, program: p.Program, module: str) -> list[str]:
    return [f"sync_module_states(model, {mesh_var(step.mesh.mesh)}, {step.mesh.dims!r})"]


def run_move_to_device(step: p.MoveToDevice, ctx: Running) -> None:
    moving.move_to_device(ctx.model, torch_device(step.device))


def write_move_to_device(step: p.MoveToDevice, program: p.Program, module: str) -> list[str]:
    return [f"move_to_device(model, {_device_source(step.device)})"]


# --- the table ----------------------------------------------------------------------------------

#: Every step type, in the order lowering emits them (the printed program's helpers and imports follow it).
STEPS: dict[type, StepType] = {
    p.MakeMesh: StepType(run_make_mesh, write_make_mesh),
    p.SplitStages: StepType(
        run_split_stages,
        write_split_stages,
        helpers=(
            pipeline.PassThrough,
            pipeline.meta_twin,
            pipeline.blocks_begin,
            pipeline.wrapping,
            pipeline.split_stages,
            pipeline.stage_inputs,
            pipeline.take_received,
            pipeline.keep_sent,
            pipeline.stage_output,
            pipeline.model_output,
            pipeline.holds,
            pipeline.held_plan,
            pipeline.Pipeline,
        ),
    ),
    p.Parallelize: StepType(run_parallelize, write_parallelize, names=_parallelize_names),
    p.Distribute: StepType(
        run_distribute, write_distribute, helpers=(ownstyles.distribute_with_layouts,), names=_value_names
    ),
    p.UserStyle: StepType(run_user_style, write_user_style, helpers=(ownstyles.apply_user_style,), names=_value_names),
    p.Retie: StepType(run_retie, write_retie, helpers=(ties.retie,)),
    p.Checkpoint: StepType(
        run_checkpoint,
        write_checkpoint,
        private_import="from torch.distributed._composable import checkpoint  # composable, non-reentrant, keeps FQNs",
    ),
    p.Compile: StepType(run_compile, write_compile, compiles=True),
    p.ContextParallel: StepType(
        run_context_parallel,
        write_context_parallel,
        names=_context_names,
        private_import="from torch.overrides import TorchFunctionMode",
    ),
    p.FullyShard: StepType(
        run_fully_shard,
        write_fully_shard,
        needs=lambda step, program: (
            *((units.divide_gradients,) if step.divide_by is not None else ()),
            *((units.unit_of,) if _may_be_container(step, program) else ()),
        ),
        names=lambda step: {"torch.distributed.fsdp.fully_shard"} | _value_names(step),
    ),
    p.Replicate: StepType(
        run_replicate,
        write_replicate,
        helpers=(meshes.flat_mesh, meshes.submesh),
        names=_value_names,
        private_import="from torch.distributed._composable import replicate  # composable DDP",
    ),
    p.TakeRank0Values: StepType(
        run_take_rank0_values, write_take_rank0_values, helpers=(rank0.rank0_values,), moves_data=True
    ),
    p.InitOnMesh: StepType(
        run_init_on_mesh,
        write_init_on_mesh,
        helpers=(
            broadcasts.common_seed,
            initialisers.forget_initialised,
            initialisers.as_built,
            initialisers.is_hugging_face,
            initialisers.initialiser,
            initialisers.owners,
            initialisers.children_first,
            initialisers.initialisation_calls,
            initialisers.calls_below,
            gathering.gather_by_hand,
            gathering.whole,
            gathering.fill_shard,
            gathering.shard_on_cpu,
            gathering.shards_on_cpu,
            materialise.whole_for_call,
            materialise.dtensors_of,
            materialise.made_whole,
            materialise.put_back,
            materialise.versions,
            materialise.parameter_versions,
            materialise.written_since,
            materialise.on_shards,
            materialise.on_whole_tensors,
            materialise.run_initialiser,
            materialise.initialise_below,
            materialise.allocate_on,
            materialise.untied_for_init,
            materialise.init_on_mesh,
        ),
        moves_data=True,
    ),
    p.LoadFromRank0: StepType(
        run_load_from_rank0,
        write_load_from_rank0,
        helpers=(
            gathering.fill_shard,
            gathering.shard_on_cpu,
            gathering.shards_on_cpu,
            rank0.scatter_from_rank0,
            rank0.load_from_rank0,
        ),
        moves_data=True,
    ),
    p.OffloadToCpu: StepType(
        run_offload_to_cpu, write_offload_to_cpu, helpers=(moving.offload_to_cpu,), moves_data=True
    ),
    p.Sync: StepType(run_sync, write_sync, helpers=(broadcasts.sync_module_states,), moves_data=True),
    p.MoveToDevice: StepType(
        run_move_to_device, write_move_to_device, helpers=(moving.move_to_device,), moves_data=True
    ),
}

_missing = set(typing.get_args(p.Step)) ^ set(STEPS)
if _missing:
    raise TypeError(f"step types without (or not in) the table: {sorted(t.__name__ for t in _missing)}")
