"""A model file whose rank 1 dies (SIGKILL) or raises while building, once workers are running."""

import os
import signal

import torch.distributed as dist

from examples.mlp import build_model as build_mlp
from examples.mlp import example_input  # noqa: F401 (the model file convention looks it up here)

HOW = os.environ.get("SHARDLANG_TEST_FAULT", "kill")


def build_model():
    if dist.is_initialized() and dist.get_rank() == 1:
        if HOW == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("planted failure while building on rank 1")
    return build_mlp()
