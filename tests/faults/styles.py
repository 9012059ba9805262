"""User styles with planted faults, and their fixed twins (tests/test_faults.py)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module


def colwise_off_on_rank1(module, mesh):
    """Column-wise, but rank 1's output is 1% too large: a forward that is wrong on one rank."""
    parallelize_module(module, mesh, ColwiseParallel())
    if dist.get_rank() == 1:
        module.register_forward_hook(lambda mod, args, out: out * 1.01)


def colwise(module, mesh):
    """The fixed twin of colwise_off_on_rank1."""
    parallelize_module(module, mesh, ColwiseParallel())


def colwise_bias_on_meta(module, mesh):
    """Column-wise, then a bias re-created on the meta device: a parameter left unmaterialised."""
    parallelize_module(module, mesh, ColwiseParallel())
    module.bias = nn.Parameter(torch.empty(module.bias.shape, device="meta"))


class ShardingSequenceParallel(SequenceParallel):
    """Claims to be sequence parallel (parameters replicated) but shards them on dim 0."""

    def _replicate_module_fn(self, name, module, device_mesh):
        for p_name, param in module.named_parameters():
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))


class PlainSequenceParallel(SequenceParallel):
    """The fixed twin: a subclass that keeps SequenceParallel's replication."""
