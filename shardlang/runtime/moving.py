"""Tensors moved between devices after sharding: a unit's parameters to the CPU where it offloads, and
what no sharding moved to the mesh device. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def offload_to_cpu(unit):
    """Move the parameters fully_shard unit `unit` manages (its subtree's, less those of units nested in it)
    to the CPU, where its `offload = cpu` policy wants them before the first forward (FSDP pins them there
    where its policy says so). Tied parameters stay tied."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def managed(module):
        yield module
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from managed(child)

    moved = {}
    for module in managed(unit):
        for param in module._parameters.values():
            if param is None or id(param) in moved:
                continue
            # FSDP may already have moved a pinned unit's shards to the CPU (when the model was materialised), its
            # DTensors still saying they are on the GPU: FSDP checks what they say.
            local = param.to_local() if isinstance(param, DTensor) else param
            if param.device.type == "cpu" and local.device.type == "cpu":
                continue
            if isinstance(param, DTensor):
                # Made as fully_shard makes its sharded parameters, around the shard where it is (DTensor.from_local
                # would put it back on the mesh's device).
                copy = DTensor(local.detach().cpu(), param._spec, requires_grad=param.requires_grad)
            else:
                copy = param.detach().cpu()
            moved[id(param)] = torch.nn.Parameter(copy, requires_grad=param.requires_grad)
    for module in unit.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in moved:
                module._parameters[name] = moved[id(param)]


def move_to_device(model, device):
    """Move parameters and buffers that no sharding moved (plain tensors) to `device`."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and not isinstance(param, DTensor) and param.device != torch.device(device):
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and not isinstance(buffer, DTensor) and buffer.device != torch.device(device):
                    module._buffers[name] = buffer.to(device)
