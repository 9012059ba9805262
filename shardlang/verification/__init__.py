"""The verification checks (SPEC §7), each a real measurement on every rank after apply.

One module per check; each exposes `run(ctx, check) -> Outcome` and is called on every rank in the
same order (most of them talk to the other ranks). `run_checks` runs the requested ones, and
`combine` merges every rank's outcomes into one result per check: it passes only if it passed on
every rank, and its message and data come from the first rank that failed (else rank 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from attrs import define, field, frozen

from ..frontend import ir
from ..runtime.apply import Applied
from ..runtime.modelfile import ModelFile

if TYPE_CHECKING:
    from ..checkpoints.dcp import Checkpoint

#: The order checks run in: the ones that only look first, the ones that train last.
ORDER = ("init_device", "placements", "module_states", "comms", "gradients")


@frozen
class Outcome:
    """One check on one rank. `ok` None: the check could not run here (it says why, and is not a pass)."""

    ok: bool | None
    message: str
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None


@frozen
class CheckResult:
    check: str
    ok: bool | None
    message: str
    seconds: float
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = dict(self.data)
        if self.worst is not None:
            data.setdefault("worst_error", self.worst)
        return {
            "check": self.check,
            "ok": self.ok,
            "message": self.message,
            "seconds": round(self.seconds, 4),
            "data": data,
        }


@define
class Context:
    """What the checks need on each rank: the applied plan and the model file's functions; the checkpoint
    the model was loaded from, whose optimizer state the gradients check resumes from; and the optimizer
    that check trained with, which `--save` writes."""

    plan: ir.Plan
    applied: Applied
    model_file: ModelFile
    checkpoint: Checkpoint | None = None
    optimizer: torch.optim.Optimizer | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.applied.model

    @property
    def device(self) -> torch.device:
        """The device the model's tensors should be on: cuda:<local rank> or cpu."""
        from ..compiler.devices import mesh_device

        kinds = {mesh_device(m.device) for m in self.plan.meshes} or {"cpu"}
        if "cuda" in kinds:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def modules() -> dict[str, Any]:
    from . import comms, gradients, init_device, module_states, placements

    return {
        "init_device": init_device,
        "placements": placements,
        "module_states": module_states,
        "comms": comms,
        "gradients": gradients,
    }


def run_checks(
    ctx: Context, checks: Sequence[ir.Check], progress: Callable[[str], None] | None = None
) -> list[CheckResult]:
    """Run `checks` on this rank (every rank must call this with the same checks), in ORDER."""
    by_name = {c.name: c for c in checks}
    results = {}
    for name in (n for n in ORDER if n in by_name):
        if progress is not None:
            progress(name)
        start = time.perf_counter()
        outcome = modules()[name].run(ctx, by_name[name])
        results[name] = CheckResult(
            name, outcome.ok, outcome.message, time.perf_counter() - start, outcome.data, outcome.worst
        )
    return [results[c.name] for c in checks]


def combine(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """One result per check from every rank's: failed anywhere is failed, the slowest rank's time."""
    merged = []
    for results in zip(*per_rank):
        failed = [(r, res) for r, res in enumerate(results) if res.ok is False]
        skipped = [res for res in results if res.ok is None]
        rank, first = failed[0] if failed else (0, results[0])
        ok = False if failed else (None if skipped else True)
        message = f"rank {rank}: {first.message}" if failed and len(results) > 1 else first.message
        worsts = [res.worst for res in results if res.worst is not None]
        merged.append(
            CheckResult(
                first.check,
                ok,
                message,
                max(res.seconds for res in results),
                first.data,
                max(worsts) if worsts else None,
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
