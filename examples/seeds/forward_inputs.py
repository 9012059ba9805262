"""Two blocks that record the dtype of every input they see (PyTorch's SaveForwardInputsModel), for
mixed precision's `cast_forward_inputs`: `seen` maps each module's name to the dtypes it received."""

import torch
import torch.nn as nn

DIM = 16


class Recorder(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.l(x)


class TwoRecorders(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = Recorder()
        self.c2 = Recorder()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.c2(self.c1(x))


def build_model() -> nn.Module:
    return TwoRecorders()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)
