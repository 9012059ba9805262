"""Small models for the distributed tests (importable by the worker processes)."""

import torch
import torch.nn as nn


class Embed(nn.Module):
    """An embedding and a linear head, untied (embedding colwise/rowwise tests)."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.fc(self.embedding(tokens))


class Uneven(nn.Module):
    """Even (8) and uneven (3) dimensions, for meta-device init."""

    def __init__(self):
        super().__init__()
        self.even = nn.Linear(8, 8)
        self.odd = nn.Linear(8, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.odd(torch.relu(self.even(x))))


class Units(nn.Module):
    """Two units of two layers each, for fully_shard / replicate / checkpoint composition."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.u1 = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.u2 = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        return self.head(self.u2(self.u1(x)))


class SeqMLP(nn.Module):
    """norm -> MLP over (batch, seq, dim): the sequence-parallel MLP block."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.add_module("w1", nn.Linear(dim, hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("w2", nn.Linear(hidden, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class LossHead(nn.Module):
    """A body and an output layer for loss_parallel."""

    def __init__(self, dim: int = 8, classes: int = 16):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, classes, bias=False)

    def forward(self, x):
        return self.output(torch.relu(self.body(x)))


def embed():
    return Embed()


def uneven():
    return Uneven()


def units():
    return Units()


def seq_mlp():
    return SeqMLP()


def loss_head():
    return LossHead()


class FailingLinear(nn.Linear):
    def reset_parameters(self):
        if self.weight.device.type != "meta" and getattr(self, "armed", False):
            raise RuntimeError("planted init failure")
        super().reset_parameters()
        self.armed = True


class FailingMLP(nn.Module):
    """net2's reset_parameters fails once the model is materialised (the `init meta` case)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(8, 16)
        self.net2 = FailingLinear(16, 8)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


def failing_mlp():
    return FailingMLP()
