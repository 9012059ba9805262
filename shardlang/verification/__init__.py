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

from .. import plan as ir
from ..apply import Applied
from ..modelfile import ModelFile

if TYPE_CHECKING:
    from ..checkpoints import Checkpoint

#: The order checks run in: the ones that only look first (init before anything trains), the ones that
#: train last.
ORDER = ("init", "init_device", "placements", "module_states", "comms", "gradients")

#: How a check ends. `skipped`: it compared nothing (the message says why); `reported`: it measured and
#: shows something but was given nothing to compare it with (comms without expected counts). Neither is
#: a pass.
PASS, FAIL, SKIPPED, REPORTED = "pass", "fail", "skipped", "reported"
STATUSES = (PASS, FAIL, SKIPPED, REPORTED)


@frozen
class Outcome:
    """One check on one rank. `worst`: the largest error measured, as a fraction of what was allowed (1.0
    is the limit), where the check has one."""

    status: str = field(validator=lambda _, __, value: _known(value))
    message: str
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None


def _known(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown check status {status!r}; expected one of {STATUSES}")


@frozen
class CheckResult:
    check: str
    status: str
    message: str
    seconds: float
    data: dict[str, Any] = field(factory=dict)
    worst: float | None = None

    @property
    def ok(self) -> bool | None:
        """True passed, False failed, None neither (skipped or reported)."""
        return True if self.status == PASS else False if self.status == FAIL else None

    def to_json(self) -> dict[str, Any]:
        data = dict(self.data)
        if self.worst is not None:
            data.setdefault("worst_error", self.worst)
        return {
            "check": self.check,
            "status": self.status,
            "ok": self.ok,
            "message": self.message,
            "seconds": round(self.seconds, 4),
            "data": data,
        }


def summary(results: Sequence[CheckResult]) -> str:
    """What happened, in counts: `4 passed, 1 skipped`, `1 failed, 3 passed`, or `no checks ran`."""
    words = {FAIL: "failed", PASS: "passed", SKIPPED: "skipped", REPORTED: "reported"}
    counts = [(sum(r.status == s for r in results), words[s]) for s in (FAIL, PASS, SKIPPED, REPORTED)]
    return ", ".join(f"{n} {word}" for n, word in counts if n) or "no checks ran"


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
    seed: int = 0  # the seed the model was built with (the init check builds an unsharded one with it)

    @property
    def model(self) -> torch.nn.Module:
        return self.applied.model

    @property
    def device(self) -> torch.device:
        """The device the model's tensors should be on: cuda:<local rank> or cpu."""
        from ..runtime import mesh_device

        kinds = {mesh_device(m.device) for m in self.plan.meshes} or {"cpu"}
        if "cuda" in kinds:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def modules() -> dict[str, Any]:
    from . import comms, gradients, init, init_device, module_states, placements

    return {
        "init": init,
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
            name, outcome.status, outcome.message, time.perf_counter() - start, outcome.data, outcome.worst
        )
    return [results[c.name] for c in checks]


def combine(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """One result per check from every rank's: failed anywhere is failed; otherwise skipped anywhere is
    skipped (a rank compared nothing), then reported, then passed; the slowest rank's time."""
    merged = []
    for results in zip(*per_rank):
        status = next(s for s in (FAIL, SKIPPED, REPORTED, PASS) if any(r.status == s for r in results))
        rank, first = next((r, res) for r, res in enumerate(results) if res.status == status)
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
