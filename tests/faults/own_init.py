"""A model whose build_model() initialises it with its own function, `init_weights` (truncated normal of
std 0.02 for weights, zero biases, ones for the norm), as torchtitan's and many hand-written models do.
Under `init meta` without METHOD shardlang initialises each module its own way (`reset_parameters`:
kaiming-uniform weights of std 1/sqrt(3 fan_in), 3 to 7 times as wide, random biases): the planted
fault. `init meta with init_weights` calls it on the root, which initialises the whole model."""

import torch
import torch.nn as nn


class OwnInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 64)
        self.net2 = nn.Linear(64, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net2(torch.relu(self.net1(x))))

    def init_weights(self) -> None:
        for module in (self.net1, self.net2):
            nn.init.trunc_normal_(module.weight, std=0.02, a=-0.04, b=0.04)
            nn.init.zeros_(module.bias)
        self.norm.reset_parameters()


def build_model() -> nn.Module:
    model = OwnInit()
    model.init_weights()
    return model


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, 16, generator=generator)
