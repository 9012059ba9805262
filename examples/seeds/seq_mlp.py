"""A LayerNorm and an MLP over (batch, sequence, dim) with a residual: the block of PyTorch's
sequence-parallel MLP example. Under sequence parallelism each TP rank holds its slice of the sequence."""

import torch
import torch.nn as nn

DIM, SEQ = 16, 8


class SeqMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.net1 = nn.Linear(DIM, 4 * DIM)
        self.net2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net2(torch.relu(self.net1(self.norm(x))))


def build_model() -> nn.Module:
    return SeqMLP()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, SEQ, DIM, generator=generator)
