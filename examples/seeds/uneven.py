"""Even (8) and uneven (3) dimensions: FSDP splits a dim of 3 over 2 ranks as 2 + 1 and over 4 as
1 + 1 + 1 + 0 (an empty shard)."""

import torch
import torch.nn as nn


class Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        self.even = nn.Linear(8, 8)
        self.odd = nn.Linear(8, 3)
        self.head = nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.odd(torch.relu(self.even(x)))))


def build_model() -> nn.Module:
    return Uneven()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=generator)
