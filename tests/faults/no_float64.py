"""A norm in front of an MLP whose activation is a kernel without float64 (as fused GPU kernels often are):
the gradients check's truth must fall back to float32 and measure its own error."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import SeqMLP


class FusedGelu(torch.autograd.Function):
    """GELU as a kernel that refuses float64, forward and backward."""

    @staticmethod
    def forward(ctx, x):
        _refuse(x)
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _refuse(grad)
        return _gelu_grad(x) * grad


def _gelu_grad(x):
    cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
    return cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5


def _refuse(x):
    if x.dtype == torch.float64:
        raise RuntimeError("fused_gelu: expected a Float, BFloat16 or Half tensor, got Double")


class Gelu(nn.Module):
    def forward(self, x):
        return FusedGelu.apply(x)


def build_model():
    model = SeqMLP()
    model.mlp.act = Gelu()
    return model


def example_input(batch, generator):
    return torch.randn(batch, 4, 8, generator=generator)
