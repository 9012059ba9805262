"""A model whose buffer depends on the rank that builds it (as data read per rank would)."""

import torch.distributed as dist

from examples.buffers import BufferedMLP, example_input  # noqa: F401


def build_model():
    model = BufferedMLP()
    model.steps.fill_(dist.get_rank() if dist.is_initialized() else 0)
    return model
