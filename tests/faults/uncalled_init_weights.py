"""A model with a whole-model `init_weights()` that its build_model() never calls (as examples/titan_llama3.py
never calls torchtitan's init_states): `init meta with init_weights` initialises it unlike build_model(), the
init check fails, and `shardlang init` moves on to plain `init meta`."""

import torch
import torch.nn as nn

from tests.models import SeqMLP


class Model(SeqMLP):
    def init_weights(self):
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)
        for module in (self.mlp.w1, self.mlp.w2):
            nn.init.normal_(module.weight, std=1.0)
            nn.init.zeros_(module.bias)


def build_model():
    return Model()


def example_input(batch, generator):
    return torch.randn(batch, 4, 8, generator=generator)
