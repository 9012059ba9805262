"""The composite model with parameters of its own: a linear layer, two units, a parameter the output
is multiplied by, and a persistent buffer (PyTorch's CompositeParamModel)."""

import torch
import torch.nn as nn
from composite import Unit  # a model file may import its neighbours (its folder is importable)

DIM = 16


class CompositeParam(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.u1 = Unit(dim)
        self.u2 = Unit(dim)
        self.p = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.register_buffer("buffer", torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.u2(self.u1(self.l(x))), self.p)


def build_model() -> nn.Module:
    return CompositeParam()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)
