"""An MLP whose activation's gradient is not finite in float64 alone (as LED's and Longformer's attention
masks overflow there); tests/faults/nan_everywhere.py adds a parameter whose gradient is not finite in every precision: the
gradients check falls back to a float32 truth for the first, and leaves the second out, saying so."""

import torch
import torch.nn as nn

from tests.models import SeqMLP


class Float64Overflow(torch.autograd.Function):
    """The identity, whose backward gives NaN in float64 only."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan") if grad.dtype == torch.float64 else grad


class NanGradient(torch.autograd.Function):
    """x + 0 * scale, whose gradient of `scale` is NaN in every precision."""

    @staticmethod
    def forward(ctx, x, scale):
        return x + 0 * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((1,), float("nan"), dtype=grad.dtype)


class Act(nn.Module):
    def __init__(self, nan_everywhere: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(1)) if nan_everywhere else None

    def forward(self, x):
        x = Float64Overflow.apply(torch.relu(x))
        return x if self.scale is None else NanGradient.apply(x, self.scale)


def build_model(nan_everywhere: bool = False):
    model = SeqMLP()
    model.mlp.act = Act(nan_everywhere)
    return model


def example_input(batch, generator):
    return torch.randn(batch, 4, 8, generator=generator)
