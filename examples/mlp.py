"""A two-layer MLP, the model of PyTorch's tensor-parallel examples (net1 -> relu -> net2)."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.net1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def build_model() -> nn.Module:
    return MLP()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 16, generator=generator)
