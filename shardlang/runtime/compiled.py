"""`compile loss`: the loss function compiled once per function and options, the same every step.
Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def compiled_loss(loss, **options):
    """`loss` compiled as the plan's `compile loss (OPTIONS)` says (torch.compile's own keywords), once per
    function and options: the same compiled function every step."""
    import torch

    key = (loss, tuple(sorted(options.items())))
    cache = compiled_loss.__dict__.setdefault("cache", {})
    if key not in cache:
        cache[key] = torch.compile(loss, **options)
    return cache[key]
