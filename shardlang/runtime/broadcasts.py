"""Values every rank must agree on, broadcast: one random seed, and the module states along the dims
`sync` names. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def common_seed():
    """One random seed, the same on every rank: rank 0's, broadcast."""
    import torch
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_initialized():
        backend = str(dist.get_backend())
        seed = seed.to("cuda" if "nccl" in backend and "gloo" not in backend else "cpu")
        dist.broadcast(seed, src=0)
    return int(seed.item())


def sync_module_states(model, mesh, dims):
    """Broadcast every parameter and buffer from the first rank of its group along each of `dims`,
    skipping a dim along which the tensor is sharded (each rank rightly holds its own piece)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    with torch.no_grad():
        for dim in dims:
            group = mesh.get_group(dim)
            src = dist.get_global_rank(group, 0)
            for tensor in tensors:
                if isinstance(tensor, DTensor):
                    names = tensor.device_mesh.mesh_dim_names or ()
                    if dim in names and not isinstance(tensor.placements[names.index(dim)], Replicate):
                        continue
                    tensor = tensor.to_local()
                dist.broadcast(tensor, src=src, group=group)
