"""examples/llama.py with eight attention heads (head_dim 4), so one head is 1/8 of wq, wk and wv."""

from examples.llama import Transformer, example_input, loss  # noqa: F401


def build_model():
    return Transformer(heads=8)
