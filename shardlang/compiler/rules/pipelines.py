"""Pipelines at a world size (SL213, SL215): the stage count against the pp dim, and microbatches against
the batch the gradients check splits. The split itself is checked where it is resolved (stages.py)."""

from __future__ import annotations

from ...frontend.diagnostics import SL213, SL215, Diagnostic
from .common import dim_sizes


def stage_count(plan, resolution, predictions, shapes) -> list[Diagnostic]:
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
