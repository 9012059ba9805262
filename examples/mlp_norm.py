"""PyTorch's TP + FSDP integration model: a Python RMSNorm in front of an MLP (test_fsdp_tp_integration).

The plan (plans/mlp_norm_2d.sl) runs it sequence-parallel over the batch: each TP rank normalises its
own rows, net1 gathers them, net2 scatters its output back to rows.
"""

import torch
import torch.nn as nn


class RMSNormPython(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, dim: int = 10, hidden: int = 16):
        super().__init__()
        self.net1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.mlp_norm = RMSNormPython(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mlp_norm(x))


def build_model() -> nn.Module:
    return NormMLP()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(batch_size, 10, generator=generator)
