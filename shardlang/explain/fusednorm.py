"""RMSNorm as CUDA's fused kernel keeps memory, for explain's simulated step on the CPU.

On CUDA, `torch.nn.functional.rms_norm` runs one kernel (`_fused_rms_norm`) that saves its input and the
inverse RMS. On the CPU torch runs the composite, which saves a float32 copy of the input and three
intermediates: five times the input's bytes instead of one. `cuda_like_rms_norm()` makes the step keep
what CUDA keeps, and `REPLAYING` tells the tracker (explain.memory) that the forward replayed in the
backward is the fused backward kernel's work, not checkpointing's recomputation.
"""

from __future__ import annotations

import contextlib
from functools import wraps

import torch

#: Non-empty while _FusedRMSNorm replays its forward in its backward: not checkpointing's recomputation.
REPLAYING: list[bool] = []


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA runs it (`_fused_rms_norm`: one kernel that saves its input and the inverse
    RMS), where the fake step on CPU would run torch's composite, which saves a float32 copy of the
    input and three intermediates: 5 times the input's bytes instead of 1. Forward: the composite
    under no_grad (same values, same ops, nothing kept); backward: the composite again, differentiated
    (the same collectives as the composite's own backward, with transient memory only). The replayed
    forward's ops are costed as the backward kernel's work, not as checkpointing's recomputation."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, composite):
        ctx.normalized_shape, ctx.eps, ctx.composite = normalized_shape, eps, composite
        ctx.save_for_backward(x, weight)
        with torch.no_grad():
            return composite(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_()]
            if weight is not None:
                inputs.append(weight.detach().requires_grad_(weight.requires_grad))
            # the forward replayed here to be differentiated stands for part of the fused backward kernel's
            # work: costed, but not as checkpointing's recomputation (an op in backward with grad mode on)
            REPLAYING.append(True)
            try:
                y = ctx.composite(inputs[0], ctx.normalized_shape, inputs[1] if weight is not None else None, ctx.eps)
            finally:
                REPLAYING.pop()
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(y, wanted, grad))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        return grads[0], None, grads[1] if weight is not None else None, None, None


@contextlib.contextmanager
def cuda_like_rms_norm():
    """`torch.nn.functional.rms_norm` as CUDA's fused kernel keeps memory, for the length of the block."""
    import torch.nn.functional as F

    composite = F.rms_norm

    @wraps(composite)
    def fused(input, normalized_shape, weight=None, eps=None):
        if not input.requires_grad and (weight is None or not weight.requires_grad):
            return composite(input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps, composite)

    F.rms_norm = fused
    try:
        yield
    finally:
        F.rms_norm = composite
