"""Runs a lowered program on a model inside an initialised process group: the only torch.distributed writer.

Everything that can be checked is checked before the first mutation (lint at the real world size,
imports of `use` styles, the model's devices against `init`). If a step still fails, the model is put
back exactly as it was (module classes, parameters, buffers, hooks and composable-API state: see
snapshot.py) and every rank raises PlanError(SL300) naming the plan line and the failing call. Each
step runs by its entry in the table of steps.py.
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
from ..compiler.devices import mesh_device
from ..compiler.lint import Linted, lint
from ..compiler.lower import lower
from ..compiler.predict import Placed
from ..compiler.trace import Order
from ..frontend import ir
from ..frontend.diagnostics import SL300, Diagnostic, PlanError, few
from . import helpers, pipeline
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
        return helpers.submesh(self.meshes[ref.mesh], ref.dims)


def simulated() -> bool:
    """Whether this is torch's fake process group: one process standing for a whole world, no data."""
    return dist.get_backend() == "fake"


def apply_plan(plan: ir.Plan, model: nn.Module, pp_rank: int | None = None, order: Order | None = None) -> Applied:
    """Lint, lower and run `plan` on `model` across the current process group. PlanError if anything fails.

    In a simulated world (the fake process group) the model stays on the meta device: the program
    places every tensor but skips the steps that allocate or move data. There `pp_rank` cuts the
    pipeline stages of that pp rank instead of this rank's own (explain stands one process for every
    pp rank; the ranks of one pp index differ from those of another only in the stages they hold).
    `order`: the order the model's modules run in (compiler.trace), for lint's SL210."""
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
    # In a simulated world (explain) nothing runs: what torch cannot run shows as explain's failed step.
    linted = lint_seeing_styles(plan, model, world_size, imported, runs=not simulated(), order=order, share=_on_rank0)
    if not linted.ok:
        raise PlanError(linted.diagnostics, sources)
    problems = [] if simulated() else _check_devices(plan, model)
    if problems:
        raise PlanError(problems, sources)
    program = lower(plan, linted.resolution, world_size)
    applied = Applied(model, {}, program, linted, imported)
    snapshot = Snapshot.take(model)
    failure, details = None, ""
    try:
        running = Running(model, applied.meshes, imported, pp_rank=pp_rank if simulated() else None)
        for step in program.steps:
            kind = STEPS[type(step)]
            if simulated() and kind.moves_data:
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
    share=lambda compute: compute(),
) -> Linted:
    """lint, where what `use` styles place is seen by running each of them in a simulated world (on a meta
    copy of its module), so that SL203/SL204 and the placements check see their tensors too instead of
    guessing. `share(compute)`: how the observation is made and handed out (apply: on rank 0, broadcast)."""
    linted = lint(plan, model, world_size, None, fsdp_strided_shard(), runs=runs, order=order)
    if linted.resolution is None or not any(rule.style.use for block in plan.parallelize for rule in block.rules):
        return linted
    try:
        program = lower(plan, linted.resolution, world_size)
    except Exception:  # noqa: BLE001 - a plan lint finds wrong may not lower: its diagnostics say why
        return linted
    observed = share(lambda: observe_user_styles(plan, program, model, imported, world_size))
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


def _on_rank0(compute):
    """`compute()` on rank 0, its result on every rank: one answer however each rank's run went. (A
    simulated world is one process: it computes it itself.)"""
    if simulated():
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    return helpers.build_for(plan.init.mode, plan.meshes[0].device if plan.meshes else "auto", build_model)
