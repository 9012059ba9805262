"""The loss_parallel classifier with a planted fault in its loss: under TP each rank computes the
cross-entropy of its own slice of the classes and the ranks' losses are averaged, as if the TP group
were data parallel. Its fixed twin is examples/seeds/classifier.py."""

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from examples.seeds.classifier import build_model, example_input, labels  # noqa: F401


def loss(logits, x):
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits, labels(x))
    local = logits.to_local()
    mine = F.cross_entropy(local, labels(x) % local.shape[-1])
    return DTensor.from_local(mine, logits.device_mesh, [Partial("avg")]).full_tensor()
