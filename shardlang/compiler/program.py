"""The lowered program: an ordered list of plain torch calls (data), and its rendering as Python.

lower.py builds it, apply.py runs it step by step, and `compile --emit python` prints it with
`to_python`, so the code a user pastes and the code shardlang runs are the same program.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs
from attrs import frozen

from ..frontend import ir
from ..frontend.source import Span
from ..runtime import helpers as runtime
from .styles import Constructor, names_used, source, value_source


@frozen
class Matching:
    """The modules a target matches when the program runs: for a program lowered without a model.
    `target` is a pattern, `root` or `class NAME`; with `scope` it is relative to each scope match."""

    target: str
    scope: str | None = None


#: What a step acts on: a module FQN ("" the model), or the modules a target matches at run time.
Module = str | Matching


@frozen
class MakeMesh:
    name: str
    device: str  # cuda | cpu | auto
    shape: tuple[int | None, ...]  # None: `auto`, left to the world size at run time
    dims: tuple[str, ...]
    origin: Span | None = None


@frozen
class Parallelize:
    """`parallelize_module(module, mesh, {relative fqn: style})`; the key "" is the module itself."""

    module: Module
    mesh: ir.MeshRef
    plan: tuple[tuple[str, Constructor], ...]
    origin: Span | None = None


@frozen
class Distribute:
    """`distribute_module` with DTensor inputs of `input` and local (`output` None) or `output` outputs."""

    module: Module
    mesh: ir.MeshRef
    input: Any
    output: Any
    origin: Span | None = None


@frozen
class UserStyle:
    """A `use` style: a ParallelStyle subclass or a callable (module, mesh, **kwargs)."""

    module: Module
    mesh: ir.MeshRef
    alias: str
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class Retie:
    """Re-share tied parameters that parallelize_module replaced one by one (`groups` None: the ties
    the model had before the program started, found when it runs)."""

    groups: tuple[tuple[str, ...], ...] | None
    origin: Span | None = None


@frozen
class Checkpoint:
    module: Module
    origin: Span | None = None


@frozen
class FullyShard:
    module: Module
    mesh: ir.MeshRef
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class Replicate:
    """DDP-style composable replicate; a 2-D mesh is flattened to the 1-D mesh DDP needs."""

    module: Module
    mesh: ir.MeshRef
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class TakeRank0Values:
    """`init rank0`: rank 0 keeps its full model's values and shards a meta copy like every other rank."""

    origin: Span | None = None


@frozen
class InitOnMesh:
    """`init meta`: allocate the shards on the mesh device, then call `method` on every module that has it."""

    device: str
    method: str
    origin: Span | None = None


@frozen
class LoadFromRank0:
    device: str
    origin: Span | None = None


@frozen
class Sync:
    mesh: ir.MeshRef
    origin: Span | None = None


@frozen
class MoveToDevice:
    device: str
    origin: Span | None = None


Step = (
    MakeMesh
    | Parallelize
    | Distribute
    | UserStyle
    | Retie
    | Checkpoint
    | FullyShard
    | Replicate
    | TakeRank0Values
    | InitOnMesh
    | LoadFromRank0
    | Sync
    | MoveToDevice
)


@frozen
class Program:
    """A plan lowered for one model and world size (steps act on module FQNs), or for any model and
    world (`world_size` None; steps act on `Matching` targets)."""

    plan: ir.Plan
    world_size: int | None
    steps: tuple[Step, ...]

    @property
    def meshes(self) -> tuple[MakeMesh, ...]:
        return tuple(s for s in self.steps if isinstance(s, MakeMesh))


# --- rendering --------------------------------------------------------------------------------

_PRIVATE_IMPORTS = {
    Checkpoint: "from torch.distributed._composable import checkpoint  # composable, non-reentrant, keeps FQNs",
    Replicate: "from torch.distributed._composable import replicate  # composable DDP",
}
_HELPERS = {
    Distribute: [runtime.distribute_with_layouts],
    UserStyle: [runtime.apply_user_style],
    Retie: [runtime.retie],
    Replicate: [runtime.flat_mesh, runtime.submesh],
    TakeRank0Values: [],
    InitOnMesh: [runtime.common_seed, runtime.init_on_mesh],
    LoadFromRank0: [runtime.load_from_rank0],
    Sync: [runtime.sync_module_states],
    MoveToDevice: [runtime.move_to_device],
}


def mesh_expr(ref: ir.MeshRef, program: Program) -> str:
    mesh = next(m for m in program.meshes if m.name == ref.mesh)
    var = _var(ref.mesh)
    if ref.dims == mesh.dims:
        return var
    return f"{var}[{', '.join(repr(d) for d in ref.dims)}]"


def _var(mesh: str) -> str:
    """A mesh's Python variable: its plan name, unless that would shadow a name the program uses."""
    return f"{mesh}_mesh" if mesh in {"model", "torch", "dist", "name", "full_state", "all_buffers"} else mesh


def _module(fqn: str) -> str:
    return "model" if not fqn else f"model.get_submodule({fqn!r})"


def _kwargs(kwargs: tuple[tuple[str, Any], ...]) -> str:
    return "".join(f", {k}={value_source(v)}" for k, v in kwargs)


def _device(device: str) -> str:
    return f"mesh_device({device!r})"


def _call(step: Step, program: Program, module: str) -> list[str]:
    """The Python lines of one step, with `module` the expression of the module it acts on."""
    if isinstance(step, MakeMesh):
        return [
            f"{_var(step.name)} = init_device_mesh({_device(step.device)}, {_shape(step.shape)}, mesh_dim_names={step.dims!r})"
        ]
    if isinstance(step, Parallelize):
        mesh = mesh_expr(step.mesh, program)
        lines = []
        own = [c for fqn, c in step.plan if fqn == ""]
        children = [(fqn, c) for fqn, c in step.plan if fqn]
        for ctor in own:
            lines.append(f"parallelize_module({module}, {mesh}, {source(ctor)})")
        if children:
            lines.append(f"parallelize_module({module}, {mesh}, {{")
            lines += [f"    {fqn!r}: {source(ctor)}," for fqn, ctor in children]
            lines.append("})")
        return lines
    if isinstance(step, Distribute):
        return [
            f"distribute_with_layouts({module}, {mesh_expr(step.mesh, program)}, {value_source(step.input)}, {value_source(step.output)})"
        ]
    if isinstance(step, UserStyle):
        return [f"apply_user_style({module}, {mesh_expr(step.mesh, program)}, {step.alias}{_kwargs(step.kwargs)})"]
    if isinstance(step, Retie):
        return [f"retie(model, {step.groups!r})" if step.groups is not None else "retie(model, ties)"]
    if isinstance(step, Checkpoint):
        return [f"checkpoint({module})"]
    if isinstance(step, FullyShard):
        return [f"fully_shard({module}, mesh={mesh_expr(step.mesh, program)}{_kwargs(step.kwargs)})"]
    if isinstance(step, Replicate):
        mesh = f"flat_mesh({_var(step.mesh.mesh)}, {step.mesh.dims!r})"
        return [f"replicate({module}, device_mesh={mesh}{_kwargs(step.kwargs)})"]
    if isinstance(step, TakeRank0Values):
        return [
            "full_state, all_buffers = {}, {}",
            "if dist.get_rank() == 0:  # rank 0 built the full model: keep its values, shard it as a meta model",
            "    full_state, all_buffers = model.state_dict(), dict(model.named_buffers())",
            '    model.to("meta")',
        ]
    if isinstance(step, InitOnMesh):
        return [f"init_on_mesh(model, {_device(step.device)}, {step.method!r}, seed=common_seed())"]
    if isinstance(step, LoadFromRank0):
        return [f"load_from_rank0(model, {_device(step.device)}, full_state, all_buffers)"]
    if isinstance(step, Sync):
        return [f"sync_module_states(model, {_var(step.mesh.mesh)}, {step.mesh.dims!r})"]
    if isinstance(step, MoveToDevice):
        return [f"move_to_device(model, {_device(step.device)})"]
    raise TypeError(step)


def _shape(shape: tuple[int | None, ...]) -> str:
    """A mesh shape; an `auto` dim (None) takes what the world size leaves."""
    if None not in shape:
        return repr(shape)
    fixed = 1
    for n in shape:
        fixed *= n or 1
    rest = "dist.get_world_size()" + (f" // {fixed}" if fixed > 1 else "")
    parts = [str(n) if n is not None else rest for n in shape]
    return f"({', '.join(parts)},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _loopable(a: Step, b: Step) -> bool:
    """Steps that differ only in the module they act on print as one `for` loop."""
    if type(a) is not type(b) or not isinstance(getattr(a, "module", None), str) or not isinstance(b.module, str):
        return False
    return attrs.evolve(a, module="", origin=None) == attrs.evolve(b, module="", origin=None)


def _matching(step: Step) -> bool:
    return isinstance(getattr(step, "module", None), Matching)


def _matching_loop(step: Step, program: Program) -> list[str]:
    """A step on the modules a target matches at run time, as a loop (two, inside a scope)."""
    where: Matching = step.module
    if where.scope is None:
        lines = [f"for name in modules_matching(model, {where.target!r}):"]
        module = "model.get_submodule(name)"
    else:
        lines = [
            f"for scope in modules_matching(model, {where.scope!r}):",
            f"    for name in modules_matching(model.get_submodule(scope), {where.target!r}):",
        ]
        module = "model.get_submodule(scope).get_submodule(name)"
    pad = "    " * len(lines)
    return lines + [pad + line for line in _call(step, program, module)]


def _groups(steps: tuple[Step, ...]) -> list[list[Step]]:
    """Consecutive steps that print as one loop: the same call on several modules, or (without a
    model) all the fully_shard and replicate units, wrapped children first at run time."""
    groups: list[list[Step]] = []
    for step in steps:
        last = groups[-1][-1] if groups else None
        units = last is not None and all(_matching(s) and isinstance(s, (FullyShard, Replicate)) for s in (last, step))
        if last is not None and (units or _loopable(last, step) and last.origin == step.origin):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _imports(program: Program) -> list[str]:
    kinds = {type(s) for s in program.steps}
    names: set[str] = {"torch.distributed.device_mesh.init_device_mesh"}
    for step in program.steps:
        if isinstance(step, Parallelize):
            names.add("torch.distributed.tensor.parallel.parallelize_module")
            for _, ctor in step.plan:
                names |= names_used(ctor)
        elif isinstance(step, (FullyShard, Replicate, Distribute, UserStyle)):
            values = [v for _, v in getattr(step, "kwargs", ())] + [
                getattr(step, "input", None),
                getattr(step, "output", None),
            ]
            names |= set().union(*(names_used(v) for v in values))
        if isinstance(step, FullyShard):
            names.add("torch.distributed.fsdp.fully_shard")
    if program.plan.loss_parallel is not None:
        names.add("torch.distributed.tensor.parallel.loss_parallel")
    by_module: dict[str, set[str]] = {}
    for path in names:
        module, _, name = path.rpartition(".")
        by_module.setdefault(module, set()).add(name)
    lines = ["import contextlib", "", "import torch", "import torch.distributed as dist"]
    lines += [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(by_module.items())]
    lines += [line for kind, line in _PRIVATE_IMPORTS.items() if kind in kinds]
    for use in program.plan.uses:
        module, sep, attr = use.path.partition(":")
        if not sep:
            module, _, attr = use.path.rpartition(".")
        lines.append(f"from {module} import {attr}" + (f" as {use.alias}" if attr != use.alias else ""))
    return lines


def _helpers(program: Program) -> list[str]:
    kinds = {type(s) for s in program.steps}
    seen, blocks = set(), []
    for kind, helpers in _HELPERS.items():
        if kind not in kinds:
            continue
        for helper in helpers:
            if helper not in seen:
                seen.add(helper)
                blocks.append(inspect.getsource(helper).rstrip())
    return blocks


def to_python(program: Program, command: str = "") -> str:
    """The program as a Python module with `build(build_model)` and `apply_plan(model)`."""
    plan = program.plan
    world = f"a world of {program.world_size}" if program.world_size else "any model and world size"
    header = [
        f"# Generated by shardlang from {plan.source.name} for {world}" + (f" (`{command}`)." if command else "."),
        "# Call apply_plan(model) on every rank inside an initialised process group; build(build_model)",
        "# builds the model the way the plan's `init` says; compute the loss inside `with loss_context():`.",
    ]
    body = (
        ["ties = tied_parameter_groups(model)"]
        if any(isinstance(s, Retie) and s.groups is None for s in program.steps)
        else []
    )
    for group in _groups(program.steps):
        step = group[0]
        units = _matching(step) and isinstance(step, (FullyShard, Replicate))
        if step.origin is not None and not units:
            body.append(f"# {plan.source.name}:{step.origin.line}: {_origin_text(plan, step.origin)}")
        if units:
            body.append("# fully_shard and replicate units, children before parents")
            body.append("wrap_children_first(model, [")
            for unit in group:
                (line,) = _call(unit, program, "module")
                kind = "fully_shard" if isinstance(unit, FullyShard) else "replicate"
                body.append(
                    f"    ({unit.module.target!r}, {kind!r}, lambda module: {line}),  # line {unit.origin.line}"
                )
            body.append("])")
        elif _matching(step):
            body += _matching_loop(step, program)
        elif len(group) > 1:
            names = ", ".join(repr(s.module) for s in group)
            body.append(f"for name in ({names}):")
            body += ["    " + line for line in _call(step, program, "model.get_submodule(name)")]
        else:
            body += _call(step, program, _module(getattr(step, "module", "")))
    helpers = [inspect.getsource(h).rstrip() for h in (runtime.build_for, runtime.mesh_device)] + _helpers(program)
    if any(_matching(s) for s in program.steps) or "tied_parameter_groups" in "\n".join(body):
        matching = (
            runtime.split_pattern,
            runtime.pattern_regex,
            runtime.class_matches,
            runtime.modules_matching,
            runtime.depth,
            runtime.named_units_win,
            runtime.wrap_children_first,
            runtime.tied_parameter_groups,
        )
        helpers += [inspect.getsource(h).rstrip() for h in matching]
    parts = ["\n".join(header), "\n".join(_imports(program)), *helpers, _build_function(plan)]
    parts.append("def apply_plan(model):\n" + "\n".join("    " + line for line in body) + "\n    return model")
    parts.append(_loss_context(plan))
    return "\n\n\n".join(parts) + "\n"


def _loss_context(plan: ir.Plan) -> str:
    if plan.loss_parallel is None:
        return 'def loss_context():\n    """Where to compute the loss: the plan has no loss_parallel."""\n    return contextlib.nullcontext()'
    return (
        "def loss_context():\n"
        '    """The plan says loss_parallel: compute the loss inside `with loss_context():` (the output\n'
        '    layer leaves its logits sharded over the classes)."""\n'
        "    return loss_parallel()"
    )


def _origin_text(plan: ir.Plan, span: Span) -> str:
    """The plan line a step comes from, without its comment."""
    return plan.source.line_text(span.line).split("#", 1)[0].strip()


def _build_function(plan: ir.Plan) -> str:
    device = plan.meshes[0].device if plan.meshes else "auto"
    return (
        "def build(build_model):\n"
        f'    """Build the model for `init {plan.init.mode}`."""\n'
        f"    return build_for({plan.init.mode!r}, {device!r}, build_model)"
    )
