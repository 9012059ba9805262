"""An MLP whose first layer has 10 output features: 10 rows do not divide over 4 TP ranks."""

import torch
import torch.nn as nn


class UnevenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 10)

    def forward(self, x):
        return self.net1(x)


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 16, generator=generator)


def build_model():
    return UnevenMLP()
