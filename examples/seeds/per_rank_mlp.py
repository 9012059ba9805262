"""An MLP whose weights come from each rank's own seed (a rank that loaded another checkpoint, say)."""

import torch
import torch.distributed as dist
import torch.nn as nn


def build_model() -> nn.Module:
    torch.manual_seed(100 + (dist.get_rank() if dist.is_initialized() else 0))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=generator)
