"""A norm in front of an MLP over (batch, seq, dim): sequence-parallel styles (tests/test_predict.py, SL210)."""

import torch

from tests.models import SeqMLP


def build_model():
    return SeqMLP()


def example_input(batch, generator):
    return torch.randn(batch, 4, 8, generator=generator)
