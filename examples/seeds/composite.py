"""The composite model of PyTorch's composability tests: a linear layer, two units, a linear layer.
A unit is linear -> (relu, linear, relu) -> linear."""

import torch
import torch.nn as nn

DIM = 16


class Unit(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.seq(self.l1(x)))


class Composite(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.u1 = Unit(dim)
        self.u2 = Unit(dim)
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.u2(self.u1(self.l1(x))))


def build_model() -> nn.Module:
    return Composite()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)
