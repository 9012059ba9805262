"""The peak of each moment of a training step, for extrapolating a stack of blocks (explain.stepping).

A step's memory peaks at one of a few moments, and each grows by its own amount per block: the end of the
forward and the loss by each block's activations, the end of the backward and the optimizer's step by each
block's gradients. Which moment is highest can change with the number of blocks. With two to four blocks
of an 8B Llama, checkpointing every block, the loss's logits make the forward's end the highest. With all
32 blocks, it is the end of the backward, 19 GiB higher, by the gradients of 28 more blocks. So
extrapolating the highest moment of a few blocks is wrong, and explain extrapolates each moment's own.

The moments (`PHASES`): the forward with the loss; the backward before the stack's blocks; the backward
of the stack's last block (which the backward reaches first), of its middle blocks, and of its first; the
backward after the blocks; the optimizer's step and what follows it (`zero_grad`). The memory over the
stack's backward moves linearly from block to block, so in each of those phases it peaks at one of its
ends. Each phase's peak grows linearly with the blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy

#: The phases in the order the step passes them.
PHASES = (
    "forward and loss",
    "backward before the blocks",
    "backward of the last block",
    "backward of the middle blocks",
    "backward of the first block",
    "backward after the blocks",
    "optimizer step",
)


class Phases:
    """Per phase of one step, the most device bytes live at once, a copy of the tracker's snapshot at that
    moment and the activations by module then (`activations`, the tracker's running count). `blocks`: the
    repeated stack's path and its blocks' keys in the model stepped, as explain.stepping cuts it (None:
    the phases of the backward are not split)."""

    def __init__(self, blocks: tuple[str, list[str]] | None, activations: dict[str, int]):
        self._activations = activations
        self._heads = []
        if blocks is not None:
            path, keys = blocks
            self._heads = [f"{path}.{key}" if path else key for key in keys]
        self._reached = False  # whether the backward has reached the stack's blocks yet
        self._stepped = False  # whether the optimizer has stepped (zero_grad after it is its phase too)
        self.peaks: dict[str, tuple[int, dict, dict]] = {}

    def phase(self, in_optimizer: bool, in_backward: bool, innermost: Callable[[], str]) -> str:
        """The phase now, from the tracker's state and the innermost module running (asked in backward)."""
        self._stepped |= in_optimizer
        if self._stepped:
            return PHASES[6]
        if not in_backward:
            return PHASES[0]
        innermost = innermost()
        block = next(
            (i for i, head in enumerate(self._heads) if innermost == head or innermost.startswith(head + ".")), None
        )
        if block is None:
            return PHASES[5] if self._reached else PHASES[1]
        self._reached = True
        last = len(self._heads) - 1
        return PHASES[2] if block == last else PHASES[4] if block == 0 else PHASES[3]

    def note(self, in_optimizer: bool, in_backward: bool, innermost: Callable[[], str], total: int, snapshot) -> None:
        """Note `total` device bytes live now, with the tracker's snapshot, if the most of the phase yet."""
        phase = self.phase(in_optimizer, in_backward, innermost)
        if total > self.peaks.get(phase, (-1,))[0]:
            self.peaks[phase] = (total, deepcopy(snapshot), {k: v for k, v in self._activations.items() if v})
