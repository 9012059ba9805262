"""The MLP of examples/mlp.py whose net2 computes 1% too much on rank 1 only: a forward that is wrong on
one data-parallel replica (for the HSDP and activation-checkpointing localisation faults). Only the model
shardlang shards carries the fault: the hook acts where net2 is an FSDP unit, which the unsharded
references the checks build are not (a mark on the first model built would hold for one job only, since a
worker keeps its imported model files from job to job)."""

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from examples.mlp import MLP, example_input  # noqa: F401


def build_model():
    model = MLP()
    if dist.is_initialized() and dist.get_rank() == 1:
        model.net2.register_forward_hook(
            lambda module, args, out: out * 1.01 if isinstance(module, FSDPModule) else out
        )
    return model
