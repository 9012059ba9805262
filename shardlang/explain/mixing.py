"""lint's SL223 beside its simulated step (rehearsal.py): compiler.rules.positions runs the model's forward
on the CPU, so it runs in a forked child as the step does, where a forward that hangs or crashes costs this
check, not the command."""

from __future__ import annotations

import attrs

from ..compiler.rules.positions import context_mixing
from ..runtime.simulated import in_fork


def with_context_mixing(rehearsal, plan, model, model_file, resolution, timeout_s: float):
    """`rehearsal` (what the simulated step found) with SL223 added where a context-parallel plan's model
    mixes positions outside the attention it splits."""
    if plan.context_parallel is None or model_file.example_input is None:
        return rehearsal
    status, found = in_fork(lambda: context_mixing(plan, resolution, model, model_file.example_input), timeout_s)
    if status != "ok":  # not checked is said, never left to read as clean
        note = f"whether modules outside the split attention mix positions (SL223) was not checked: {found}"
        return attrs.evolve(rehearsal, note="; ".join(filter(None, (rehearsal.note, note))))
    return attrs.evolve(rehearsal, diagnostics=(*rehearsal.diagnostics, *found)) if found else rehearsal
