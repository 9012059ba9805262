"""Jobs for tests/test_expert_dispatch.py (runtime.dispatch, the one dispatch and combine of every experts
form): run on every rank of a worker pool (gloo)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from shardlang.runtime.experts import ExpertParallel

from .expert_jobs import _experts, _routing, stepped_split_and_whole


def idle_ranks_in_a_shared_batch(implementation: str, tokens: int) -> dict:
    """transformers' Qwen3-MoE experts split over ep = the world, the ranks sharing `tokens` tokens and every
    token choosing the experts 0 and 1 (held by rank 0, or ranks 0 and 1 at world 4): the ranks holding
    the others receive no row. The output and the gradients of the tokens, the routing weights and this
    rank's experts against the whole experts', with how many rows this rank's experts were given (from
    the whole experts' gradients: zero where none came) and whether its split experts have a gradient."""
    world, rank = dist.get_world_size(), dist.get_rank()
    split, whole, errors = stepped_split_and_whole(implementation, tokens, True)
    errors = {**errors, "experts_grad": 0.0}
    per_rank = 4 // world
    used, has_grad = False, True
    for name in ("gate_up_proj", "down_proj"):
        block = getattr(whole, name).grad[rank * per_rank : (rank + 1) * per_rank]
        grad = getattr(split, name).grad
        has_grad = has_grad and grad is not None
        if grad is not None:
            errors["experts_grad"] = max(errors["experts_grad"], (grad.to_local() - block).abs().max().item())
        used = used or bool(block.abs().sum() > 0)
    return {"errors": errors, "received": used, "has_grad": has_grad}


def collectives_of_one_step(implementation: str) -> dict[str, int]:
    """The collectives of one forward and backward of Qwen3-MoE's experts split over ep = the world (each
    rank its own tokens), by op name: one module, one MoE layer."""
    from shardlang.verification.comms import Recorder

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    split = parallelize_module(_experts(implementation), mesh, ExpertParallel(shared_batch=False))
    hidden, index, weights, upstream = _routing(5 + rank, rank, False)
    recorder = Recorder()
    with recorder:
        (split(hidden, index, weights) * upstream).sum().backward()
    return dict(recorder.counts())
