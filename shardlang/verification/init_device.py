"""init_device: every parameter, buffer and DTensor local tensor is on the mesh device (cuda:<local
rank> or cpu), except parameters a unit offloads to the CPU; nothing is left on meta."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..compiler.predict import enclosing, units_by_module
from .outcome import FAIL, PASS, Outcome

LISTED = 8


def run(ctx, check) -> Outcome:
    expected = ctx.device
    offloaded = _offloaded(ctx)
    wrong, seen, on_cpu = [], set(), 0
    tensors = [(n, t, True) for n, t in ctx.model.named_parameters()] + [
        (n, t, False) for n, t in ctx.model.named_buffers()
    ]
    for name, tensor, is_param in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        want = torch.device("cpu") if is_param and _owner(name) in offloaded else expected
        on_cpu += want != expected
        if not _same(local.device, want):
            wrong.append((name, str(local.device), str(want)))
        elif not _same(tensor.device, want):  # a DTensor saying it is elsewhere (FSDP believes what it says)
            wrong.append((name, f"{local.device}, the DTensor saying {tensor.device}", str(want)))
    wrong.sort(key=lambda w: w[1] != "meta")  # what is still on meta first
    data = {
        "device": str(expected),
        "tensors": len(seen),
        "offloaded": on_cpu,
        "wrong": [{"name": n, "device": d, "expected": e} for n, d, e in wrong],
    }
    if not wrong:
        if on_cpu:
            where = f"{len(seen) - on_cpu} on {expected}, the {on_cpu} parameters of units with `offload = cpu` on cpu"
            return Outcome(PASS, f"all {len(seen)} parameters and buffers placed: {where}", data)
        return Outcome(PASS, f"all {len(seen)} parameters and buffers on {expected}", data)
    on_meta = [n for n, d, _ in wrong if d == "meta"]
    listed = ", ".join(f"{n} ({d})" for n, d, _ in wrong[:LISTED]) + (
        f" and {len(wrong) - LISTED} more" if len(wrong) > LISTED else ""
    )
    lead = f"{len(on_meta)} still on meta; " if on_meta else ""
    return Outcome(FAIL, f"{lead}{len(wrong)} of {len(seen)} tensors not on {expected}: {listed}", data)


def _same(actual: torch.device, want: torch.device) -> bool:
    if actual.type != want.type:
        return False
    return actual.type != "cuda" or (actual.index or 0) == (want.index or 0)


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _offloaded(ctx) -> set[str]:
    """Modules whose parameters a unit with `offload = cpu` keeps on the CPU."""
    resolution = ctx.applied.linted.resolution
    units = units_by_module(resolution)
    found = set()
    for fqn in resolution.modules:
        unit = enclosing(fqn, units)
        if (
            unit is not None
            and unit.kind(ctx.plan.units[unit.block]) == "fully_shard"
            and unit.option(ctx.plan.units[unit.block], "offload") == "cpu"
        ):
            found.add(fqn)
    return found
