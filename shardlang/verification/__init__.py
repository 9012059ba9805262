"""The verification checks (docs/checks.md), each a real measurement on every rank after apply.

One module per check; each exposes `run(ctx, check) -> Outcome` and is called on every rank in the
same order (most of them talk to the other ranks). `run_checks` runs the requested ones, and
`combine` merges every rank's outcomes into one result per check: it passes only if it passed on
every rank, and its message and data come from the first rank that failed (else rank 0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from attrs import define

from ..frontend import ir
from ..frontend.schema import CHECKS as SCHEMA
from ..runtime.apply import Applied
from ..runtime.modelfile import ModelFile
from . import comms, gradients, init, init_device, module_states, placements
from .outcome import FAIL, PASS, REPORTED, SKIPPED, STATUSES, CheckResult, Outcome, summary

#: Every check: its name (as plans and --verify write it) and the function that runs it on a rank, in
#: the order they run: the ones that only look first (init before anything trains), the ones that train
#: last. The frontend's schema (names and arguments) is the other half; both must name the same checks.
CHECKS = {
    "init": init.run,
    "init_device": init_device.run,
    "placements": placements.run,
    "module_states": module_states.run,
    "comms": comms.run,
    "gradients": gradients.run,
}
if set(CHECKS) != set(SCHEMA):
    raise ImportError(f"checks without a schema or a runner: {sorted(set(CHECKS) ^ set(SCHEMA))}")

__all__ = [
    "CHECKS",
    "FAIL",
    "PASS",
    "REPORTED",
    "SKIPPED",
    "STATUSES",
    "CheckResult",
    "Context",
    "Outcome",
    "combine",
    "gather",
    "run_checks",
    "summary",
]

if TYPE_CHECKING:
    from ..checkpoints.hf import HFWeights
    from ..checkpoints.records import Checkpoint


@define
class Context:
    """What the checks need on each rank: the applied plan and the model file's functions; the checkpoint
    the model was loaded from, whose optimizer state the gradients check resumes from; and the optimizer
    that check trained with, which `--save` writes."""

    plan: ir.Plan
    applied: Applied
    model_file: ModelFile
    checkpoint: Checkpoint | HFWeights | None = None  # what --load loaded: DCP or Hugging Face weights
    optimizer: torch.optim.Optimizer | None = None
    seed: int = 0  # the seed the model was built with (the init check builds an unsharded one with it)
    #: The training step (step.Step) whose pipeline schedule runs now: its last stage's loss is that step's.
    stepping: Any = None
    _pipeline: Any = None

    @property
    def pipeline(self):
        """The schedule that trains a pipelined plan's stages with the model file's loss (None without a
        pipeline); one per run, shared by the checks."""
        if self.applied.parts is None:
            return None
        if self._pipeline is None:
            from ..runtime.apply import build_pipeline
            from .step import Step

            last = self.applied.parts[max(self.applied.parts)]  # the loss runs on the last stage only

            def stage_loss(output, inputs):  # the loss phases of the step whose schedule runs
                step = self.stepping if self.stepping is not None else Step.of(self)
                return step.stage_loss(last, output, _tuple(inputs))

            self._pipeline = build_pipeline(self.applied, stage_loss)
        return self._pipeline

    @property
    def model(self) -> torch.nn.Module:
        return self.applied.model

    def sequence_split(self):
        """Under context parallelism, how this rank's sequences split (runtime.context_layout's layout) and
        this rank's place in it; None without."""
        from ..runtime.context_layout import sequence_layout

        cp = self.plan.context_parallel
        if cp is None:
            return None
        mesh = self.applied.mesh(cp.mesh)
        return sequence_layout(cp.load_balance, mesh.size()), mesh.get_local_rank()

    @property
    def device(self) -> torch.device:
        """The device the model's tensors should be on: cuda:<local rank> or cpu."""
        from ..compiler.devices import mesh_device

        kinds = {mesh_device(m.device) for m in self.plan.meshes} or {"cpu"}
        if "cuda" in kinds:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _tuple(inputs) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def run_checks(
    ctx: Context, checks: Sequence[ir.Check], progress: Callable[[str], None] | None = None
) -> list[CheckResult]:
    """Run `checks` on this rank (every rank must call this with the same checks), in CHECKS' order."""
    by_name = {c.name: c for c in checks}
    results = {}
    for name in (n for n in CHECKS if n in by_name):
        if progress is not None:
            progress(name)
        start = time.perf_counter()
        outcome = CHECKS[name](ctx, by_name[name])
        seconds = time.perf_counter() - start
        results[name] = CheckResult(
            name, outcome.status, outcome.message, seconds, outcome.data, outcome.worst, outcome.moot
        )
    return [results[c.name] for c in checks]


def combine(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """One result per check from every rank's: failed anywhere is failed; otherwise skipped anywhere is
    skipped (a rank compared nothing), then reported, then passed; the slowest rank's time. The message is
    the first such rank's, or of a failure the worst failing rank's, so that it tells of the error the
    table shows (the largest over the ranks). A skip is moot only if it is moot on every rank that skipped."""
    merged = []
    for results in zip(*per_rank):
        status = next(s for s in (FAIL, SKIPPED, REPORTED, PASS) if any(r.status == s for r in results))
        ranked = [(r, res) for r, res in enumerate(results) if res.status == status]
        if status == FAIL:  # max keeps the lowest rank among equals
            ranked = [max(ranked, key=lambda pair: -math.inf if pair[1].worst is None else pair[1].worst)]
        rank, first = ranked[0]
        message = f"rank {rank}: {first.message}" if status == FAIL and len(results) > 1 else first.message
        worsts = [res.worst for res in results if res.worst is not None]
        merged.append(
            CheckResult(
                first.check,
                status,
                message,
                max(res.seconds for res in results),
                first.data,
                max(worsts) if worsts else None,
                status == SKIPPED and all(res.moot for res in results if res.status == SKIPPED),
            )
        )
    return merged


def gather(results: list[CheckResult]) -> list[list[CheckResult]]:
    """Every rank's results, on every rank (a simulated or single-process world is just this one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [results]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    return everyone
