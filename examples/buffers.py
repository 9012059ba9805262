"""A model with buffers next to its parameters: input statistics (persistent) and a step counter.

The statistics are measured on data in __init__, so ranks that see different data build different
buffers; `sync over` (plans/buffers_sync.sl) makes them agree.
"""

import torch
import torch.nn as nn


class Standardize(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        sample = torch.randn(64, dim) * 2 + 1
        self.register_buffer("mean", sample.mean(0))
        self.register_buffer("std", sample.std(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class BufferedMLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.standardize = Standardize(dim)
        self.net1 = nn.Linear(dim, hidden)
        self.net2 = nn.Linear(hidden, dim)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(self.standardize(x))))


def build_model() -> nn.Module:
    return BufferedMLP()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=generator)
