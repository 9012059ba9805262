"""The styles that are not one of torch's ParallelStyles on parallelize_module: `distribute` with its
input and output layouts, and a style of the user's own. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def distribute_with_layouts(module, mesh, input_placement, output_placement):
    """distribute_module (parameters and buffers replicated over `mesh`) where each tensor input becomes
    `DTensor.from_local(x, mesh, [input_placement])` and the output goes back to a local tensor
    (`output_placement` None) or is redistributed to `output_placement`."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_module

    def input_fn(mod, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [input_placement], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def output_fn(mod, outputs, device_mesh):
        if output_placement is None:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs
        return outputs.redistribute(device_mesh, [output_placement])

    return distribute_module(module, mesh, input_fn=input_fn, output_fn=output_fn)


def apply_user_style(module, mesh, style, **kwargs):
    """A user style: a ParallelStyle subclass (instantiated with kwargs) or a callable (module, mesh, **kwargs)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    if isinstance(style, type) and issubclass(style, ParallelStyle):
        return parallelize_module(module, mesh, style(**kwargs))
    return style(module, mesh, **kwargs)
