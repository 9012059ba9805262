"""One unit of the composite model (linear -> (relu, linear, relu) -> linear), on its own."""

import torch
import torch.nn as nn
from composite import Unit  # a model file may import its neighbours (its folder is importable)

DIM = 16


def build_model() -> nn.Module:
    return Unit()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)
