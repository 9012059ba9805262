"""The Llama-style transformer of examples/llama.py with 4 blocks, for pipelined plans: two stages of two
blocks, or four stages of one for an interleaved schedule over two ranks."""

import torch.nn as nn

from examples.llama import Transformer, example_input, loss

__all__ = ["build_model", "example_input", "loss"]


def build_model() -> nn.Module:
    return Transformer(layers=4)
