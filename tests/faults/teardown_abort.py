"""A model file whose rank 1 aborts while its process group is torn down, after its results were sent
(as gloo's teardown can abort a process)."""

import os

import torch.distributed as dist

from examples.mlp import build_model as build_mlp
from examples.mlp import example_input  # noqa: F401


def build_model():
    if dist.is_initialized() and dist.get_rank() == 1:
        dist.destroy_process_group = lambda *args, **kwargs: os._exit(3)
    return build_mlp()
