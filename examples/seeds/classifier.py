"""A classifier whose loss is cross-entropy, for loss parallelism: the output layer's logits can stay
sharded over the 16 classes. The labels are a fixed function of the inputs."""

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, CLASSES = 8, 16


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(DIM, 32)
        self.output = nn.Linear(32, CLASSES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.body(x)))


def build_model() -> nn.Module:
    return Classifier()


def example_input(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch_size, DIM, generator=generator)


def labels(x: torch.Tensor) -> torch.Tensor:
    return (x.abs().sum(-1) * 1000).long() % CLASSES


def loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels(x))
