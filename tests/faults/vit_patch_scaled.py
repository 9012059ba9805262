"""transformers' ViT (examples/families/vit.py) whose patch embedding computes 1% too much on rank 1 only,
where it is an FSDP unit: a fault whose gradients run through the Conv2d's 4-D weight (issue 39 class 0,
the gradients check compared such weights slice by slice with a matrix norm and raised). Only the model
shardlang shards carries it: the unsharded references are no FSDP units."""

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from examples.families.vit import build_model as build_vit
from examples.families.vit import example_input, loss  # noqa: F401


def build_model():
    model = build_vit()
    if dist.is_initialized() and dist.get_rank() == 1:
        model.vit.embeddings.register_forward_hook(
            lambda module, args, out: out * 1.01 if isinstance(module, FSDPModule) else out
        )
    return model
