"""`init rank0`: rank 0's values kept before sharding, and the sharded meta model loaded from them on every
rank. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations

from .gathering import fill_shard, shard_on_cpu


def rank0_values(model):
    """Rank 0's side of `init rank0`, before sharding: every parameter's and buffer's value by name (each
    name of a tied tensor), kept on the CPU; the model then moves to the meta device like the other ranks'.
    Keyed by `named_parameters()`/`named_buffers()`, not `state_dict()`: a model's state-dict hooks may
    rename or split its tensors (a fused QKV saved as wq/wk/wv), and the shards are filled by name.
    `model.to` would untie tensors shared by several modules (each module's copy moved on its own): the
    other ranks built theirs tied, and FSDP would then shard another list of parameters on rank 0."""
    import torch

    values = {}
    shared = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    full = f"{module_name}.{name}" if module_name else name
                    values[full] = tensor.detach()
                    shared.setdefault(id(tensor), []).append(full)
    model.to("meta")
    for names in shared.values():
        first, *others = names
        owner, _, leaf = first.rpartition(".")
        module = model.get_submodule(owner)
        tensor = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
        for other in others:
            owner, _, leaf = other.rpartition(".")
            store = model.get_submodule(owner)
            (store._parameters if leaf in store._parameters else store._buffers)[leaf] = tensor
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in values.items()}


def load_from_rank0(model, device, full_state):
    """Materialise a sharded meta model from rank 0's values (`rank0_values`; empty elsewhere): allocate the
    shards on `device`, then broadcast each parameter and buffer whole from rank 0 and copy its shard."""
    import torch

    on_gpus = torch.device(device).type != "cpu"
    # model.to_empty(device=device), except that the shards of an offloading unit that rank 0 built stay in
    # pinned CPU memory, where FSDP put them: torch refuses to move a DTensor's storage to another device in place.
    model._apply(lambda t: t if on_gpus and shard_on_cpu(t) else torch.empty_like(t, device=device))
    scatter_from_rank0(model, device, full_state)


def scatter_from_rank0(model, device, full_state):
    """Load rank 0's `full_state` ({name: whole tensor} for every parameter and buffer name; empty elsewhere)
    into the model's tensors, sharded or not, wherever their shards are (FSDP pins an offloading unit's in CPU
    memory): each tensor is broadcast whole on `device` (in the model's dtype), then every rank copies its
    shard. Every name and shape is checked on rank 0 first, and every rank raises the same ValueError before
    anything is copied if one does not fit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    seen, tensors = set(), []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    problems = []
    if dist.get_rank() == 0:
        for name, tensor in tensors:
            have = full_state.get(name)
            if not isinstance(have, torch.Tensor):
                problems.append(f"{name}: not among rank 0's tensors")
            elif tuple(have.shape) != tuple(tensor.shape):
                problems.append(f"{name}: {tuple(have.shape)} on rank 0, {tuple(tensor.shape)} sharded")
    verdict = [problems]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError("rank 0's model does not fit the sharded one: " + "; ".join(verdict[0][:5]))
    with torch.no_grad():
        for name, tensor in tensors:
            if dist.get_rank() == 0:
                full = full_state[name].detach().to(device=device, dtype=tensor.dtype)
            else:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                fill_shard(tensor, full)
            else:
                tensor.copy_(full)
