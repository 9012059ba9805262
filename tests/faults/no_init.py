"""An MLP with a learned output scale held by a module that has no reset_parameters: under `init meta`
nothing would initialise it (SL209)."""

import torch
import torch.nn as nn

from examples.mlp import MLP


class Scale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class ScaledMLP(MLP):
    def __init__(self):
        super().__init__()
        self.out_scale = Scale(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_scale(super().forward(x))


def build_model():
    return ScaledMLP()
