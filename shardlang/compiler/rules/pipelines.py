"""Pipelines at a world size (SL213, SL215, SL301): the stage count against the pp dim, microbatches against
the batch the gradients check splits, and schedules the installed torch gets wrong with data parallelism.
The split itself is checked where it is resolved (stages.py)."""

from __future__ import annotations

from ...frontend import ir
from ...frontend.diagnostics import SL213, SL215, SL301, Diagnostic
from ...frontend.ir import V_SCHEDULES
from ..devices import mesh_device
from ..resolve import Resolution
from ..torchlimits import V_SCHEDULE_GLOO, ZERO_BUBBLE_DATA_PARALLEL, cannot
from .common import Predictions, Shapes, dim_sizes

#: The schedules that split the backward into an input pass and a weight pass.
ZERO_BUBBLE = ("zero_bubble", "zbv", "dualpipe_v")


def stage_count(plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes) -> list[Diagnostic]:
    pipeline, stages = plan.pipeline, resolution.stages
    if pipeline is None or stages is None:
        return []
    (dim,) = pipeline.mesh.dims
    pp = dim_sizes(plan, shapes)[(pipeline.mesh.mesh, dim)]
    found = []
    want = pp * pipeline.stages_per_rank
    if stages.count != want:
        per = f" x {pipeline.stages_per_rank} stages per rank" if pipeline.stages_per_rank > 1 else ""
        found.append(
            Diagnostic(
                SL213,
                f"the split makes {stages.count} stages, but {dim}={pp}{per} runs {want}",
                pipeline.split_span,
                (f"split {stages.stack} into {want}, or size {dim} to {stages.count // pipeline.stages_per_rank}",)
                if stages.count % pipeline.stages_per_rank == 0
                else (f"split {stages.stack} into {want}",),
            )
        )
    gradients = next((c for c in plan.checks if c.name == "gradients"), None)
    batch = gradients.get("batch") if gradients is not None else None
    n = pipeline.n_microbatches(pp)
    if batch is not None and batch < n and pipeline.microbatches is None:
        found.append(
            Diagnostic(
                SL215,
                f"gradients(batch={batch}) cannot be split into {n} microbatches (the default: one per stage)",
                gradients.span,
                (f"give a batch of at least {n}, or set microbatches",),
            )
        )
    return found


def zero_bubble_with_data_parallelism(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL301: a zero-bubble schedule with fully_shard or replicate units over more than one rank, which the
    installed torch trains with wrong gradients (torchlimits.py)."""
    pipeline = plan.pipeline
    if pipeline is None or pipeline.schedule not in ZERO_BUBBLE or not cannot(ZERO_BUBBLE_DATA_PARALLEL):
        return []
    sizes = dim_sizes(plan, shapes)
    wide = [b for b in plan.units if any(sizes[(b.mesh.mesh, d)] > 1 for d in b.mesh.dims)]
    if not wide:
        return []
    import torch

    return [
        Diagnostic(
            SL301,
            f"schedule {pipeline.schedule} with {wide[0].kind} over {wide[0].mesh}: torch {torch.__version__} "
            "reduces the gradients before its weight pass adds to them, and trains with wrong gradients",
            pipeline.span,
            (
                "use interleaved_1f1b (or 1f1b, gpipe) with data parallelism; zero-bubble schedules are right without it",
            ),
        )
    ]


def v_schedule_over_gloo(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL301: a V-shaped schedule on a CPU mesh (gloo), whose sends to the rank itself the installed torch
    cannot make (torchlimits.py)."""
    pipeline = plan.pipeline
    if pipeline is None or pipeline.schedule not in V_SCHEDULES or not cannot(V_SCHEDULE_GLOO):
        return []
    if mesh_device(plan.mesh(pipeline.mesh.mesh).device) != "cpu":
        return []
    import torch

    return [
        Diagnostic(
            SL301,
            f"schedule {pipeline.schedule} over gloo: torch {torch.__version__}'s V-shaped schedules send to the "
            "rank itself, which gloo cannot",
            pipeline.span,
            ("use interleaved_1f1b on the CPU, or run on GPUs (NCCL), or torch 2.13 or newer",),
        )
    ]
