"""User styles for `use` (plans/llama_custom_styles.sl, plans/hf/gpt2_use.sl): a style is a ParallelStyle
subclass or a callable (module, mesh, **kwargs)."""

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def rowwise_scaled(module: nn.Module, mesh: DeviceMesh, scale: float = 1.0) -> None:
    """Row-wise tensor parallelism with the weight scaled by `scale` (a residual-branch init trick)."""
    parallelize_module(module, mesh, RowwiseParallel())
    with torch.no_grad():
        module.weight.mul_(scale)


class ColwiseConv1D(ColwiseParallel):
    """torch's ColwiseParallel for transformers' Conv1D (GPT-2's projections), which stores its weight
    [in, out] and computes `x @ weight + bias`: the output columns it splits are the weight's dim 1 and
    the bias's dim 0 (nn.Linear's weight would be Shard(0)). plans/hf/gpt2_use.sl."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        for param_name, param in module.named_parameters():
            placement = Shard(1) if param_name == "weight" else Shard(0)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RowwiseConv1D(RowwiseParallel):
    """torch's RowwiseParallel for transformers' Conv1D: the input features it splits are the weight's
    dim 0 (nn.Linear's would be dim 1); the bias stays whole."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        if module.bias is not None:
            bias = distribute_tensor(module.bias, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter("bias", nn.Parameter(bias, requires_grad=module.bias.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
