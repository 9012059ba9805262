"""A model file whose rank 1 aborts while its process exits, after its results were sent."""

import atexit
import os

import torch.distributed as dist

from examples.mlp import build_model as build_mlp
from examples.mlp import example_input  # noqa: F401


def build_model():
    if dist.is_initialized() and dist.get_rank() == 1:
        atexit.register(os._exit, 3)
    return build_mlp()
