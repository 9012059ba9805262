"""An embedding and an output layer sharing one weight (PyTorch's weight-tying TP example)."""

import torch
import torch.nn as nn


class TiedModel(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, vocab)
        self.fc.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(tokens))


def build_model() -> nn.Module:
    return TiedModel()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 16, (batch_size, 5), generator=generator)
