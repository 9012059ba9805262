"""SL223: context parallelism over a model that mixes positions outside the attention it splits.

`context_parallel` cuts every sequence into one shard per cp rank, and only the attention modules it names
see the whole sequence (their SDPA runs across the ranks). Every other module runs on its rank's shard
alone: right for what acts on each position by itself (embeddings, norms, MLPs, a rotary embedding taken
from each token's own position id), wrong for what mixes positions: a convolution along the sequence, a
scan (Mamba's), attention that context_parallel does not name. Such a model trains on wrong values, and
the gradients check can only say that it does.

Which modules mix positions is found by running them, not guessed from names or ops: one forward of the
model on its example input, in eval mode and without gradients, with a hook on every module that may run
on a shard (neither a split attention module, nor inside one, nor holding one). Each call whose input is
sequence-shaped (dim 1 as long as the model input's sequence) and whose output is too is called again on
the tail of its sequence-shaped inputs (positions from the middle on, as a cp rank holds a later part of
the sequence without the earlier), and the tail of its whole output is compared with what it returns. A
module acting on each position by itself returns the same, up to rounding; one whose output at a position
reads earlier positions (causal) or any (bidirectional) does not. A call that cannot run on the tail (a
dim 1 that is not the sequence after all) is taken to act per position: no false alarm from a guess.
Named are the innermost such modules, those with no mixing module inside them (Mamba's mixer, not the
decoder layer holding it).

What this does not see: a module that holds a split attention and also mixes positions in its own code
(such modules are not run on the tail, since their attention rightly mixes), and positions mixed in the
model's own code outside every module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ...frontend import ir
from ...frontend.diagnostics import SL223, Diagnostic
from ..resolve import Resolution

#: How far (relative 2-norm) the tail of a module's output may be from its output on the tail alone and
#: still count as the same: float32 rounding of the same arithmetic in other shapes is about 1e-7, mixing
#: positions changes the result at the percent level.
SAME = 1e-4
#: The batch lint runs the model on.
BATCH = 2
#: The most parameter and buffer elements a model may hold for lint to run it on the CPU (1 GiB in float32).
CPU_LIMIT = 2**28


def position_mixers(model: nn.Module, inputs: tuple, split: Collection[str]) -> list[str]:
    """The innermost modules of `model` (FQNs, in the order they first ran) whose output at a position
    depends on other positions, of those that may run on a shard of the sequence: not a module of `split`
    (the attention modules context parallelism splits), inside one or holding one. One forward on
    `inputs` (the model's own, whose first tensor of two dims or more holds the sequence on dim 1)."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
    if first is None or first.shape[1] < 2:
        return []
    length = first.shape[1]
    mixing: dict[str, None] = {}
    rerunning = [False]
    handles = [
        module.register_forward_hook(_tail_hook(name, length, mixing, rerunning), with_kwargs=True)
        for name, module in model.named_modules()
        if _may_run_on_a_shard(name, split)
    ]
    training = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.training = mode
    return [name for name in mixing if not any(other.startswith(name + ".") for other in mixing)]


def _may_run_on_a_shard(name: str, split: Collection[str]) -> bool:
    """Neither the root (whose hooks split and gather), nor a split attention module, nor inside one, nor
    one holding one."""
    return bool(name) and all(not (name == s or name.startswith(s + ".") or s.startswith(name + ".")) for s in split)


def _tail_hook(name: str, length: int, mixing: dict[str, None], rerunning: list[bool]) -> Callable:
    """The forward hook that calls its module again on the tail of its sequence-shaped inputs (see the
    module's docstring); the calls it makes are not hooked again (`rerunning`)."""

    def hook(module, args, kwargs, output):
        if rerunning[0] or name in mixing:
            return None
        whole = _sequence_tensor(output, length)
        values = [*args, *kwargs.values()]
        if whole is None or not any(_is_sequence(v, length) for v in values):
            return None
        start = length // 2
        rerunning[0] = True
        try:
            tail = module(
                *(_tail(a, length, start) for a in args), **{k: _tail(v, length, start) for k, v in kwargs.items()}
            )
        except Exception:  # noqa: BLE001 - dim 1 was not the sequence for this module: not judged
            return None
        finally:
            rerunning[0] = False
        part = _sequence_tensor(tail, length - start)
        if part is not None and part.shape == whole[:, start:].shape and _differs(whole[:, start:], part):
            mixing[name] = None
        return None

    return hook


def _is_sequence(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length


def _tail(value: Any, length: int, start: int) -> Any:
    """A sequence-shaped tensor's positions from `start` on, also inside a tuple or list (a pair of rotary
    tables); anything else as it is."""
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_tail(v, length, start) for v in value)
    return value[:, start:] if _is_sequence(value, length) else value


def _sequence_tensor(value: Any, length: int) -> torch.Tensor | None:
    """The first floating-point tensor of a module's output (a tensor, a tuple, a dict or a ModelOutput)
    whose dim 1 is `length` long."""
    found = (t for t in tree_leaves(value) if _is_sequence(t, length) and t.is_floating_point())
    return next(found, None)


def _differs(expected: torch.Tensor, got: torch.Tensor) -> bool:
    expected, got = expected.detach().double(), got.detach().double()
    if not (expected.isfinite().all() and got.isfinite().all()):
        return not torch.equal(expected, got)
    return float((expected - got).norm()) > SAME * float(expected.norm()) + 1e-30


def context_mixing(plan: ir.Plan, resolution: Resolution, model: nn.Module, example_input) -> list[Diagnostic]:
    """SL223 at the `context_parallel` statement for each module that mixes positions outside the attention
    it splits, found on a CPU copy of `model` (which may be on meta) with random values; nothing without
    context parallelism, an example input, or for a model too large to run here."""
    cp = plan.context_parallel
    if cp is None or example_input is None or not resolution.context:
        return []
    if sum(t.numel() for t in [*model.parameters(), *model.buffers()]) > CPU_LIMIT:
        return []
    from ..trace import random_copy

    inputs = example_input(BATCH, torch.Generator().manual_seed(0))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    try:
        mixers = position_mixers(random_copy(model, "cpu"), inputs, resolution.context)
    except Exception:  # noqa: BLE001 - a forward that fails here is the step's to report (SL220)
        return []
    if not mixers:
        return []
    first = mixers[0]
    split = ", ".join(resolution.context[:3]) + (", ..." if len(resolution.context) > 3 else "")
    others = (
        (f"{len(mixers) - 1} more mix positions so: {', '.join(mixers[1:4])}{', ...' if len(mixers) > 4 else ''}",)
        if len(mixers) > 1
        else ()
    )
    message = (
        f"context_parallel splits the sequence, but '{first}' ({type(model.get_submodule(first)).__name__}) mixes "
        "positions outside the attention it splits: its output at a position depends on other positions, which "
        "other cp ranks hold"
    )
    why = (
        f"only the modules context_parallel names see the whole sequence ({split}); every other module runs on "
        "its rank's shard alone, so a convolution or a scan along the sequence, or attention it does not name, "
        "computes from part of it"
    )
    return [Diagnostic(SL223, message, cp.span, (why, *others))]
