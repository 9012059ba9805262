"""An MLP with user init methods for `init meta with METHOD`, called on the root, which reach the
parameters of every layer; build_model() initialises with `init_weights`. `init_weights` seeds every rank
alike and fills each tensor it is given: where it is given shards (on CUDA, where `init meta` runs a call
on the DTensors) every shard holds the same values, the planted fault; on a CPU mesh it is given whole
tensors and each rank keeps its slice. `init_weights_per_rank` is its fixed twin: each rank draws its
own values from the same distribution."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples.mlp import MLP, example_input  # noqa: F401


class InitMLP(MLP):
    def init_weights(self, per_rank: bool = False) -> None:
        rank = dist.get_rank() if dist.is_initialized() and per_rank else 0
        generator = torch.Generator().manual_seed(1000 + rank)
        with torch.no_grad():
            for p in self.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(torch.empty(local.shape).uniform_(-0.2, 0.2, generator=generator))

    def init_weights_per_rank(self) -> None:
        self.init_weights(per_rank=True)


def build_model():
    model = InitMLP()
    model.init_weights()
    return model
