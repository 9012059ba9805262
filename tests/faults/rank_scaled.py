"""The MLP of examples/mlp.py whose net2 computes 1% too much on rank 1 only: a forward that is wrong on
one data-parallel replica (for the HSDP and activation-checkpointing localisation fault). Only the first
model each process builds (the one shardlang shards) carries the fault; the unsharded references the
checks build later do not."""

import torch.distributed as dist

from examples.mlp import MLP, example_input  # noqa: F401

_built = []


def build_model():
    model = MLP()
    if not _built and dist.is_initialized() and dist.get_rank() == 1:
        model.net2.register_forward_hook(lambda module, args, out: out * 1.01)
    _built.append(model)
    return model
