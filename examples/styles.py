"""User styles for `use` (plans/llama_custom_styles.sl): a style is a ParallelStyle subclass or a
callable (module, mesh, **kwargs)."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module


def rowwise_scaled(module: nn.Module, mesh: DeviceMesh, scale: float = 1.0) -> None:
    """Row-wise tensor parallelism with the weight scaled by `scale` (a residual-branch init trick)."""
    parallelize_module(module, mesh, RowwiseParallel())
    with torch.no_grad():
        module.weight.mul_(scale)
