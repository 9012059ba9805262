"""A parameter and a buffer drawn from each rank's own seed, as in PyTorch's module-state sync test:
they start different on every rank, and only `sync` makes replicas agree."""

import torch
import torch.distributed as dist
import torch.nn as nn


class PerRank(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        generator = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        self.param = nn.Parameter(torch.randn(dim, dim, generator=generator))
        self.register_buffer("buf", torch.randn(dim, dim, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.param + self.buf


def build_model() -> nn.Module:
    return PerRank()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=generator)
