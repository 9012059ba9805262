"""Shared parameters and a module used twice (PyTorch's managed-states tests): three MLP blocks whose
input projections share one weight, two of which also share a buffer, and one block called twice."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.register_buffer("buffer", torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x))) + self.buffer


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.blocks[0].in_proj.weight = self.blocks[1].in_proj.weight
        self.blocks[2].in_proj.weight = self.blocks[1].in_proj.weight
        self.blocks[1].buffer = self.blocks[2].buffer
        self.twice = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.twice(self.twice(x))


def build_model() -> nn.Module:
    return Shared()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=generator)
