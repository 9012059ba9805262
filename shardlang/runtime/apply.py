"""Runs a lowered program on a model inside an initialised process group: the only torch.distributed writer.

Everything that can be checked is checked before the first mutation (lint at the real world size,
imports of `use` styles, the model's devices against `init`). If a step still fails, the model is put
back exactly as it was (module classes, parameters, buffers, hooks and composable-API state: see
snapshot.py) and every rank raises PlanError(SL300) naming the plan line and the failing call. Each
step runs by its entry in the table of steps.py. The caller says how it runs (ApplyMode): for real, or
in a simulated world (explain), where nothing is moved and nobody else is asked; and a caller that
applies one plan to one model tree more than once hands on the plan it linted instead of linting again.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from attrs import define, evolve, field, frozen

from ..compiler import program as p
from ..compiler.devices import mesh_device
from ..compiler.lint import Linted, lint
from ..compiler.lower import lower
from ..compiler.predict import Placed
from ..compiler.trace import Order
from ..frontend import ir
from ..frontend.diagnostics import SL300, Diagnostic, PlanError, few
from . import building, meshes, pipeline
from .simulated import observe_user_styles
from .snapshot import Snapshot
from .steps import STEPS, Running, torch_device
from .torchcompat import fsdp_strided_shard
from .values import import_path


@define
class Applied:
    """The result of applying a plan: the model (changed in place), its meshes and the compiler's view."""

    model: nn.Module
    meshes: dict[str, Any]
    program: p.Program
    linted: Linted
    imported: dict[str, Any] = field(factory=dict)
    #: This rank's pipeline stages {stage: module} (None without a pipeline); `model` is then a view of
    #: them under the model's own names (the stage itself when the rank holds one).
    parts: dict[int, nn.Module] | None = None

    @property
    def predictions(self) -> dict[str, Placed]:
        return self.linted.predictions

    def mesh(self, ref: ir.MeshRef):
        return meshes.mesh_of(self.meshes[ref.mesh], ref.dims, ref.flat)


@frozen
class ApplyMode:
    """How `apply_plan` runs a program, told by its caller: for real, one process a rank of an initialised
    process group (`REAL`, the default), or in a simulated world (`SIMULATED`: torch's fake process group,
    one process standing for every rank, the model left on the meta device; explain and lint's step)."""

    #: Whether lint's SL301 (what the installed torch cannot run) stops the run. A simulated world runs
    #: nothing: what torch cannot run shows as explain's failed step instead.
    check_torch: bool = True
    #: Whether the model's devices are checked against the plan's `init` (a simulated world's model is on
    #: the meta device whatever `init` says).
    check_devices: bool = True
    #: Whether the steps that allocate or move data run (steps.py's `moves_data`); without them the
    #: program only places tensors.
    move_data: bool = True
    #: Whether `compile` steps compile: a simulated world runs the modules eager (fake tensors through
    #: torch.compile cost minutes and change no layout).
    compile: bool = True
    #: Whose pipeline stages a split cuts: None, this rank's own (its place on the pp dim); else that pp
    #: rank's (explain stands one process for every pp rank).
    pp_rank: int | None = None
    #: Whether every rank is a process of its own, to be asked: what `use` styles place is observed on rank
    #: 0 and broadcast, and whether any rank failed is agreed by all. A simulated world asks nobody.
    ranks_apart: bool = True

    def at_pp_rank(self, pp_rank: int) -> ApplyMode:
        """This mode, cutting the pipeline stages of `pp_rank`."""
        return evolve(self, pp_rank=pp_rank)


#: A real run: every check, every step, this rank's own stages, the ranks agreeing.
REAL = ApplyMode()
#: A simulated world (explain, lint's step): tensors placed on the meta model, nothing moved, nobody asked.
SIMULATED = ApplyMode(check_torch=False, check_devices=False, move_data=False, compile=False, ranks_apart=False)


def apply_plan(
    plan: ir.Plan,
    model: nn.Module,
    order: Order | None = None,
    *,
    mode: ApplyMode = REAL,
    linted: Linted | None = None,
) -> Applied:
    """Lint, lower and run `plan` on `model` across the current process group. PlanError if anything fails.

    `mode` says how (ApplyMode): for real (the default), or in a simulated world, where the model stays on
    the meta device and the program places every tensor but skips the steps that allocate or move data.
    `order`: the order the model's modules run in (compiler.trace), for lint's SL210. `linted`: the plan
    already linted against this model's module tree at this world size (lint_seeing_styles, by a caller
    that applies it more than once: explain, once per pp rank), not linted again."""
    sources = {plan.source.name: plan.source}
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(
            [
                Diagnostic(
                    SL300,
                    "apply needs an initialised process group",
                    help=("call torch.distributed.init_process_group() first, or use `shardlang apply`",),
                )
            ],
            sources,
        )
    world_size = dist.get_world_size()
    imported = _import_uses(plan, sources)
    if linted is None:
        share = _on_rank0 if mode.ranks_apart else _here
        linted = lint_seeing_styles(plan, model, world_size, imported, mode.check_torch, order, share)
    if not linted.ok:
        raise PlanError(linted.diagnostics, sources)
    problems = _check_devices(plan, model) if mode.check_devices else []
    if problems:
        raise PlanError(problems, sources)
    program = lower(plan, linted.resolution, world_size)
    applied = Applied(model, {}, program, linted, imported)
    snapshot = Snapshot.take(model)
    failure, details = None, ""
    try:
        running = Running(model, applied.meshes, imported, pp_rank=mode.pp_rank)
        for step in program.steps:
            kind = STEPS[type(step)]
            if (kind.moves_data and not mode.move_data) or (kind.compiles and not mode.compile):
                continue
            try:
                # After a pipeline's split, each step runs on every stage this rank holds that holds its module.
                for part in running.parts.values() if running.parts is not None else (model,):
                    running.model = part
                    where = getattr(step, "module", "")
                    if running.parts is None or not isinstance(where, str) or pipeline.holds(part, where):
                        kind.run(step, running)
            except Exception as e:  # noqa: BLE001 - any failure of a torch call is reported as SL300
                failure = _failure(plan, step, e)
                details = "".join(traceback.format_exception(e))
                break
        applied.parts = running.parts
    finally:
        if mode.ranks_apart:
            failure = _agree(failure)
        if failure is not None:
            snapshot.restore()
    if failure is not None:
        raise PlanError([failure], sources, details)  # details: the local traceback, for `--debug`
    if applied.parts is not None:
        stages = linted.resolution.stages
        applied.model = pipeline.stages_view(applied.parts, {s: stages.held(s) for s in applied.parts})
    return applied


def lint_seeing_styles(
    plan: ir.Plan,
    model: nn.Module,
    world_size: int,
    imported: dict[str, Any],
    runs: bool = True,
    order: Order | None = None,
    share=None,
) -> Linted:
    """lint, where what `use` styles place is seen by running each of them in a simulated world (on a meta
    copy of its module), so that SL203/SL204 and the placements check see their tensors too instead of
    guessing. `share(compute)`: how the observation is made and handed out (apply: on rank 0, broadcast)."""
    linted = lint(plan, model, world_size, None, fsdp_strided_shard(), runs=runs, order=order)
    return seeing_styles(plan, model, world_size, imported, linted, runs, order, share)


def seeing_styles(
    plan: ir.Plan,
    model: nn.Module,
    world_size: int,
    imported: dict[str, Any],
    linted: Linted,
    runs: bool = True,
    order: Order | None = None,
    share=None,
) -> Linted:
    """`linted` (lint's, without observations, with these `runs` and `order`) linted again with what the
    plan's `use` styles place, seen by running them (lint_seeing_styles); `linted` itself for a plan
    without `use` styles, or one that does not resolve or lower."""
    if linted.resolution is None or not any(rule.style.use for block in plan.parallelize for rule in block.rules):
        return linted
    try:
        program = lower(plan, linted.resolution, world_size)
    except Exception:  # noqa: BLE001 - a plan lint finds wrong may not lower: its diagnostics say why
        return linted
    observed = (share or _here)(lambda: observe_user_styles(plan, program, model, imported, world_size))
    return lint(plan, model, world_size, observed, fsdp_strided_shard(), runs=runs, order=order)


def import_uses(plan: ir.Plan) -> dict[str, Any]:
    """Every `use` style of `plan` imported; PlanError (SL300 at the `use` line) for one that fails."""
    return _import_uses(plan, {plan.source.name: plan.source})


def build_pipeline(applied: Applied, loss, scale_grads: bool = True) -> pipeline.Pipeline:
    """The schedule that trains this rank's stages of a pipelined plan, with `loss(output, inputs)` (the
    model file's) on the last stage's microbatches."""
    spec = applied.program.plan.pipeline
    stages = applied.linted.resolution.stages
    mesh = applied.mesh(spec.mesh)
    device = torch_device(applied.program.plan.mesh(spec.mesh.mesh).device)
    schedule, _ = ir.SCHEDULES[spec.schedule]
    n = spec.n_microbatches(mesh.size())
    return pipeline.Pipeline(applied.parts, stages.count, schedule, n, mesh.get_group(), device, loss, scale_grads)


def _here(compute):
    """`compute()` in this process: a simulated world is one process, with nobody to share it with."""
    return compute()


def _on_rank0(compute):
    """`compute()` on rank 0, its result on every rank: one answer however each rank's run went."""
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(failure: Diagnostic | None) -> Diagnostic | None:
    """Every rank learns whether any rank failed, so that all of them roll back together."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, None if failure is None else (dist.get_rank(), failure))
    failed = [f for f in flags if f is not None]
    if not failed:
        return None
    rank, first = failed[0]
    if failure is None:
        return Diagnostic(SL300, f"apply failed on rank {rank}: {first.message}", first.span, first.help)
    return failure


def _failure(plan: ir.Plan, step: p.Step, error: Exception) -> Diagnostic:
    where = getattr(step, "module", None)
    what = f" on '{where or 'root'}'" if where is not None else ""
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    help = [f"the failing call: {type(step).__name__}{what}"]
    if last is not None:
        help.append(f"raised at {Path(last.filename).name}:{last.lineno}")
    if (
        plan.has_style("expert_parallel")
        and isinstance(error, (KeyError, IndexError, AttributeError))
        and plan.init.mode == "meta"
    ):
        help.append(
            "expert_parallel on experts held as modules (a ModuleList or ModuleDict) leaves each rank only its "
            "own members, and the model's init code may reach for the others (SwitchTransformers' does): "
            "`init cpu` builds the model whole and then splits it"
        )
    help.append("the model is left exactly as it was")
    message = f"apply failed{what}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return Diagnostic(SL300, message.rstrip(": "), step.origin, tuple(help))


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
                    SL300,
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
    # Parameters on meta; buffers may be real (plan.build keeps what the constructor computed in them).
    devices = {t.device.type for _, t in model.named_parameters()}
    mode = plan.init.mode
    expect_meta = mode == "meta" or (mode == "rank0" and dist.get_rank() != 0)
    if expect_meta and devices - {"meta"}:
        where = "rank 0's model on cpu and the others' " if mode == "rank0" else "the model "
        return [
            Diagnostic(
                SL300,
                f"init {mode} needs {where}parameters on the meta device, but it has some on "
                f"{', '.join(sorted(devices - {'meta'}))}",
                plan.init.span,
                ("build it with plan.build(build_model), or under `with torch.device('meta')`",),
            )
        ]
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if not expect_meta and on_meta:
        return [
            Diagnostic(
                SL300,
                f"init {mode} needs a materialised model, but {len(on_meta)} tensors are on the meta device: {few(on_meta)}",
                plan.init.span,
                ("nothing would materialise them: say `init meta` to materialise after sharding",),
            )
        ]
    cuda = any(mesh_device(m.device) == "cuda" for m in plan.meshes)
    if cuda and not torch.cuda.is_available():
        return [
            Diagnostic(
                SL300,
                "the plan has a cuda mesh but no GPU is available",
                plan.meshes[0].span,
                ("use `cpu` or `auto` as the mesh device",),
            )
        ]
    return []


def build_for_plan(plan: ir.Plan, build_model) -> nn.Module:
    """Call `build_model()` where the plan's `init` says: on meta (`meta`; `rank0` except on rank 0), on
    the CPU (`cpu`, rank 0 of `rank0`) or on the mesh device (`auto`)."""
    return building.build_for(plan.init.mode, plan.meshes[0].device if plan.meshes else "auto", build_model)
