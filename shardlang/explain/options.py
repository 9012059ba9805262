"""What one explain is asked: the world, the rank it is seen from, and how much of the step to simulate.

Built once, by the command (`shardlang explain`) or the library (`Plan.explain`), and handed down whole:
to a fresh process when this one is inside a process group, and on to the layouts, the step and the
pipeline's report.
"""

from __future__ import annotations

import attrs
from attrs import frozen

from .timing import Hardware, hardware


def _rank_in_world(options: ExplainOptions, attribute, rank: int) -> None:
    if not 0 <= rank < options.world_size:
        raise ValueError(f"rank {rank} is not in a world of {options.world_size}")


@frozen
class ExplainOptions:
    """One explain's options; ValueError for a rank outside the world."""

    world_size: int
    #: The rank the layouts, the step and the time are seen from (every rank's bytes are reported).
    rank: int = attrs.field(default=0, validator=_rank_in_world)
    #: A parameter pattern: for the tensors it picks, every block and the ranks holding it.
    blocks_for: str | None = None
    #: Whether one training step is simulated (with a model file's example_input): collectives, peak, time.
    step: bool = True
    #: Whether the step runs on every block of a repeated stack, never extrapolated from a few.
    full_step: bool = False
    #: Examples per data-parallel replica (default: twice the TP size; per microbatch count for a pipeline).
    batch: int | None = None
    #: The accelerator the time is estimated on (default: an H100).
    hardware: Hardware = attrs.field(factory=hardware)
    #: Bytes: the largest batch whose peak fits is searched for.
    fit: int | None = None
