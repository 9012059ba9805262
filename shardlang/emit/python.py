"""`compile --emit python`: a lowered program printed as a Python module of plain torch calls.

Each step prints through its entry in runtime.steps (the same table apply runs it by), and the helpers
those lines call are pasted in from their source, so the printed program runs without shardlang and
does what `shardlang apply` does.
"""

from __future__ import annotations

import inspect
import re
import sys

import attrs
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..compiler import program as p
from ..compiler.devices import mesh_device
from ..compiler.lint import lint
from ..compiler.lower import lower
from ..frontend import ir, patterns
from ..frontend.diagnostics import SL216, Diagnostic, PlanError
from ..frontend.source import Span
from ..frontend.static_checks import check_world
from ..runtime.building import build_for, parameters_on_meta
from ..runtime.compiled import compiled_loss
from ..runtime.steps import STEPS, mesh_var, module_source
from ..runtime.ties import tied_parameter_groups
from ..runtime.units import wrap_children_first
from ..runtime.values import import_path

#: Import paths under this prefix are shardlang's own (runtime.tpstyles): pasted as source, not imported.
OURS = "shardlang."


def compile_python(plan: ir.Plan, model: nn.Module | None, world_size: int | None, command: str = "") -> str:
    """The program as Python: for `model` at `world_size` (default: what the meshes fix), or, without a
    model, for any model, matching the plan's targets when it runs. PlanError if the plan does not fit."""
    if model is None and plan.pipeline is not None:
        raise PlanError(
            [
                Diagnostic(
                    SL216,
                    "a pipelined plan compiles for a model: where its stages begin depends on the module tree",
                    plan.pipeline.span,
                    ("give the model: shardlang compile PLAN MODEL --world N --emit python",),
                )
            ],
            {plan.source.name: plan.source},
        )
    if model is None:
        if world_size is not None:
            problems = check_world(plan, world_size)
            if problems:
                raise PlanError(problems, {plan.source.name: plan.source})
        return to_python(lower(plan, None, world_size), command)
    world_size = world_size or plan.fixed_world_size()
    linted = lint(plan, model, world_size)
    if not linted.ok:
        raise PlanError(linted.diagnostics, {plan.source.name: plan.source})
    return to_python(lower(plan, linted.resolution, world_size), command)


def _loopable(a: p.Step, b: p.Step) -> bool:
    """Steps that differ only in the module they act on print as one `for` loop."""
    if type(a) is not type(b) or not isinstance(getattr(a, "module", None), str) or not isinstance(b.module, str):
        return False
    return attrs.evolve(a, module="", origin=None) == attrs.evolve(b, module="", origin=None)


def _matching(step: p.Step) -> bool:
    return isinstance(getattr(step, "module", None), p.Matching)


def _matching_loop(step: p.Step, program: p.Program) -> list[str]:
    """A step on the modules a target matches at run time, as a loop (two, inside a scope)."""
    where: p.Matching = step.module
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
    return lines + [pad + line for line in _write(step, program, module)]


def _groups(steps: tuple[p.Step, ...]) -> list[list[p.Step]]:
    """Consecutive steps that print as one loop: the same call on several modules, or (without a
    model) all the fully_shard and replicate units, wrapped children first at run time."""
    groups: list[list[p.Step]] = []
    for step in steps:
        last = groups[-1][-1] if groups else None
        units = last is not None and all(
            _matching(s) and isinstance(s, (p.FullyShard, p.Replicate)) for s in (last, step)
        )
        if last is not None and (units or _loopable(last, step) and last.origin == step.origin):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _names(program: p.Program) -> set[str]:
    """The import paths the printed steps name: torch's, and shardlang's own styles (pasted)."""
    names: set[str] = {"torch.distributed.device_mesh.init_device_mesh"}
    for step in program.steps:
        names |= STEPS[type(step)].names(step)
    if program.plan.loss_parallel is not None:
        names.add("torch.distributed.tensor.parallel.loss_parallel")
    return names


def _ours(program: p.Program) -> list:
    """shardlang's own objects the steps name (runtime.tpstyles' styles, context parallelism), each after the
    functions and classes of shardlang its source calls: what the printed program pastes."""
    order: list = []
    visiting: list = []  # source may name what names it (context parallelism's does): each is visited once

    def visit(obj) -> None:
        if obj in order or obj in visiting:
            return
        visiting.append(obj)
        module = sys.modules[obj.__module__]
        source = inspect.getsource(obj)
        for name, dep in vars(module).items():
            if dep is obj or not (inspect.isroutine(dep) or inspect.isclass(dep)):
                continue
            if getattr(dep, "__module__", "").startswith(OURS) and re.search(rf"\b{name}\b", source):
                visit(dep)
        order.append(obj)

    for path in sorted(n for n in _names(program) if n.startswith(OURS)):
        visit(import_path(path))
    return order


def _imports(program: p.Program) -> list[str]:
    kinds = [kind for step_type, kind in STEPS.items() if any(type(s) is step_type for s in program.steps)]
    names = {n for n in _names(program) if not n.startswith(OURS)}
    if any(inspect.isclass(obj) and issubclass(obj, ParallelStyle) for obj in _ours(program)):
        names.add("torch.distributed.tensor.parallel.ParallelStyle")  # the base of the pasted styles
    by_module: dict[str, set[str]] = {}
    for path in names:
        module, _, name = path.rpartition(".")
        by_module.setdefault(module, set()).add(name)
    # Pasted source keeps the annotations of its module, where they are never evaluated (`nn.Module` in a
    # module that pastes no `nn`): the program's are not either.
    lines = [
        "from __future__ import annotations",
        "",
        "import contextlib",
        "",
        "import torch",
        "import torch.distributed as dist",
    ]
    lines += [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(by_module.items())]
    lines += [kind.private_import for kind in kinds if kind.private_import is not None]
    for use in program.plan.uses:
        module, sep, attr = use.path.partition(":")
        if not sep:
            module, _, attr = use.path.rpartition(".")
        lines.append(f"from {module} import {attr}" + (f" as {use.alias}" if attr != use.alias else ""))
    return lines


def _helpers(program: p.Program) -> list[str]:
    """The source of the helpers the program's steps call, each once, in the table's order."""
    present = {type(s) for s in program.steps}
    seen, blocks = set(), []
    for step_type, kind in STEPS.items():
        if step_type not in present:
            continue
        needed = [h for s in program.steps if type(s) is step_type for h in kind.needs(s, program)]
        for helper in (*kind.helpers, *needed):
            if helper not in seen:
                seen.add(helper)
                blocks.append(inspect.getsource(helper).rstrip())
    return blocks


def _write(step: p.Step, program: p.Program, module: str) -> list[str]:
    """The Python lines of one step, with `module` the expression of the module it acts on."""
    return STEPS[type(step)].write(step, program, module)


def to_python(program: p.Program, command: str = "") -> str:
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
        if any(isinstance(s, p.Retie) and s.groups is None for s in program.steps)
        else []
    )
    outer, staged = body, False
    for group in _groups(program.steps):
        step = group[0]
        units = _matching(step) and isinstance(step, (p.FullyShard, p.Replicate))
        if step.origin is not None and not units:
            body.append(f"# {plan.source.name}:{step.origin.line}: {_origin_text(plan, step.origin)}")
        if staged and isinstance(getattr(step, "module", None), str) and step.module:
            # A stage holds some of the modules: each call runs where its module is held.
            if len(group) > 1:
                names = ", ".join(repr(s.module) for s in group)
                body.append(f"for name in ({names}):")
                body.append("    if holds(model, name):")
                body += ["        " + line for line in _write(step, program, "model.get_submodule(name)")]
            else:
                body.append(f"if holds(model, {step.module!r}):")
                body += ["    " + line for line in _write(step, program, module_source(step.module))]
            continue
        if units:
            body.append("# fully_shard and replicate units, children before parents")
            body.append("wrap_children_first(model, [")
            for unit in group:
                kind = "fully_shard" if isinstance(unit, p.FullyShard) else "replicate"
                target = unit.module.target
                if getattr(unit, "together", False):  # one unit over every module its targets match
                    target = (target, *(t.target for t in unit.also))
                arg = "modules" if isinstance(target, tuple) else "module"
                (line,) = _write(unit, program, arg)
                body.append(f"    ({target!r}, {kind!r}, lambda {arg}: {line}),  # line {unit.origin.line}")
            body.append("])")
        elif _matching(step):
            body += _matching_loop(step, program)
        elif len(group) > 1:
            names = ", ".join(repr(s.module) for s in group)
            body.append(f"for name in ({names}):")
            body += ["    " + line for line in _write(step, program, "model.get_submodule(name)")]
        else:
            body += _write(step, program, module_source(getattr(step, "module", "")))
        if isinstance(step, p.SplitStages):
            # Every later step runs on each stage this rank holds, as `shardlang apply` runs them.
            staged, body = True, []
    if staged:
        outer.append("for stage, model in stages.items():")
        outer += ["    " + line for line in body]
        outer.append(_make_pipeline(program))
        body = outer
    pasted = [inspect.getsource(h).rstrip() for h in (build_for, parameters_on_meta, mesh_device)]
    pasted += _helpers(program)
    pasted += [inspect.getsource(obj).rstrip() for obj in _ours(program)]
    if any(_matching(s) for s in program.steps) or "tied_parameter_groups" in "\n".join(body):
        matching = (
            patterns.split_pattern,
            patterns.pattern_regex,
            patterns.class_matches,
            patterns.modules_matching,
            patterns.depth,
            patterns.named_units_win,
            wrap_children_first,
            tied_parameter_groups,
        )
        pasted += [inspect.getsource(h).rstrip() for h in matching]
    parts = ["\n".join(header), "\n".join(_imports(program)), *pasted, _build_function(plan)]
    if staged:
        signature = "def apply_plan(model, loss):\n"
        doc = (
            '    """This rank\'s pipeline stages of `model`, sharded, and the schedule that trains them with\n'
            '    loss(output, inputs): pipeline.step(*inputs) runs one step and returns the loss on the last stage."""\n'
        )
        parts.append(signature + doc + "\n".join("    " + line for line in body) + "\n    return pipeline")
    else:
        parts.append("def apply_plan(model):\n" + "\n".join("    " + line for line in body) + "\n    return model")
    parts.append(_loss_context(plan))
    if plan.compile_loss is not None:
        options = ", ".join(f"{k}={v!r}" for k, v in plan.compile_loss.options)
        parts.append(inspect.getsource(compiled_loss).rstrip())
        parts.append(
            "def loss_function(loss):\n"
            f'    """The plan says `compile loss` (line {plan.compile_loss.span.line}): train with\n'
            '    loss_function(loss)(output, inputs), compiled once."""\n'
            f"    return compiled_loss(loss{', ' + options if options else ''})"
        )
    return "\n\n\n".join(parts) + "\n"


def _make_pipeline(program: p.Program) -> str:
    plan = program.plan
    spec = plan.pipeline
    mesh = next(m for m in program.meshes if m.name == spec.mesh.mesh)
    pp = dict(zip(mesh.dims, mesh.shape))[spec.mesh.dims[0]]
    split = next(s for s in program.steps if isinstance(s, p.SplitStages))
    device = f"torch.device('cuda', torch.cuda.current_device()) if mesh_device({mesh.device!r}) == 'cuda' else torch.device('cpu')"
    return (
        f"pipeline = Pipeline(stages, {len(split.blocks)}, {ir.SCHEDULES[spec.schedule][0]!r}, {spec.n_microbatches(pp)}, "
        f"{mesh_var(spec.mesh.mesh)}[{spec.mesh.dims[0]!r}].get_group(), {device}, "
        f"{'loss_function(loss)' if plan.compile_loss is not None else 'loss'})"
    )


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
