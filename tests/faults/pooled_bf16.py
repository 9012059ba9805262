"""A bf16 model whose small error early grows large later: a feed-forward block (proj colwise, out
rowwise) over 64 positions, then a mean over the positions, then a head. A wrong bias in `out` (counted
on every TP rank) is only a little over `out`'s tolerance, because its bias is small; the mean keeps
that error whole while it averages the rounding of the positions away, so `pool` is far over its own.
The module to blame is `out` (tests/test_faults.py)."""

import os

import torch
import torch.nn as nn

#: `out`'s bias: small, so that counting it twice is only a little over out's tolerance.
BIAS = float(os.environ.get("SHARDLANG_TEST_BIAS", "0.02"))


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


class Pooled(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, dim)
        self.pool = Pool()
        self.head = nn.Linear(dim, classes)
        with torch.no_grad():
            self.out.bias.fill_(BIAS)

    def forward(self, x):
        return self.head(self.pool(self.out(self.act(self.proj(x)))))


def build_model():
    return Pooled().to(torch.bfloat16)


def example_input(batch, generator):
    return torch.randn(batch, 64, 16, generator=generator).to(torch.bfloat16)
