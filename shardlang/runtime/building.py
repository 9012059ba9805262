"""Where the model is built, as the plan's `init` says: meta (parameters only, buffers computed), the CPU,
rank 0's CPU, or the mesh device. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations

import contextlib

from ..compiler.devices import mesh_device


def build_for(init, device, build_model):
    """Build the model where `init` says: meta, cpu, rank 0's cpu (meta elsewhere), or the mesh device."""
    import torch
    import torch.distributed as dist

    if init == "rank0":
        init = "cpu" if dist.get_rank() == 0 else "meta"
    if init == "auto":
        init = mesh_device(device)
        if init == "cuda":
            init = torch.device("cuda", torch.cuda.current_device())
    if init == "meta":
        with parameters_on_meta():
            return build_model()
    with torch.device(init):
        return build_model()


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters created while this is active go to the meta device as they are registered (before the
    module's constructor initialises them, so that costs nothing); buffers stay real, on the CPU, with
    the values the constructor computed (rotary tables, causal masks, position ids)."""
    import torch.nn as nn

    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
