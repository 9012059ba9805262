"""A DTensor's whole value and its shard: gathered (by hand where torch cannot plan it), a shard filled
from the whole, and where a shard is held. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def whole(tensor):
    """A DTensor's whole value, on its mesh's device: `full_tensor()`, for a shard kept off that device too (a
    unit's `offload = cpu` on GPUs), and gathered by hand where torch cannot plan the redistribution (torch
    2.11: FSDP's Shard(1) over the _StridedShard(0) of a packed weight)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local().detach()
    if local.device.type != tensor.device_mesh.device_type:  # from_local puts the shard on the mesh's device
        tensor = DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    try:
        return tensor.full_tensor()
    except ValueError:  # torch could not plan it (a failing collective raises RuntimeError, and stays raised)
        return gather_by_hand(tensor)


def gather_by_hand(tensor):
    """`tensor.full_tensor()` for any placements but Partial: every rank learns where its shard's elements sit
    in the whole tensor (the placements applied to their positions, without communication), then shards and
    positions are gathered along each mesh dim in turn."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    mesh, local = tensor.device_mesh, tensor.to_local().detach()
    positions = torch.arange(tensor.numel(), device=local.device).view(tensor.shape)
    where = distribute_tensor(positions, mesh, tensor.placements, src_data_rank=None).to_local()
    pieces = [(where.reshape(-1).cpu(), local.reshape(-1).cpu())]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, pieces, group=group)
        pieces = [piece for theirs in everyone for piece in theirs]
    result = torch.empty(tensor.numel(), dtype=tensor.dtype)
    for at, values in pieces:
        result[at] = values
    return result.view(tensor.shape).to(local.device)


def fill_shard(tensor, full):
    """Copy this rank's slice of `full` (DTensor `tensor`'s whole value, the same on every rank) into its shard,
    wherever the shard is."""
    from torch.distributed.tensor import distribute_tensor

    shard = distribute_tensor(full.detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.to_local().copy_(shard.to_local())


def shards_on_cpu(modules) -> bool:
    """Whether any of `modules`' own DTensors holds its shard on the CPU."""
    return any(
        shard_on_cpu(tensor)
        for module in modules
        for store in (module._parameters, module._buffers)
        for tensor in store.values()
    )


def shard_on_cpu(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) and tensor.to_local().device.type == "cpu"
