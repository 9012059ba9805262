"""The tensor-parallel styles shardlang adds to torch's, for layouts that transformers' models use and
torch's ParallelStyles cannot express: packed (fused) projections, per-head norms whose gradients are
partial, and transformers' Conv1D (weight stored [in, out]).

They are ParallelStyle subclasses, so `parallelize_module` applies them like torch's own, and
`compile --emit python` pastes their source (and that of the functions here they call) into the program
it prints. Like the other pasted helpers (runtime.steps names them), each method imports what it needs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from .torchcompat import strided_shard_class


class SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group. For a replicated parameter whose
    forward on each rank sees only that rank's part of the activations (its heads, its slice of packed
    outputs): each rank's gradient is partial and the true one is their sum."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def distribute_params(module, mesh, placements, src_data_rank=0):
    """Replace the module's own parameters by DTensors: `placements` maps a parameter name (or "*", any)
    to its placement on the 1-D `mesh` (the full tensor is cut there; `src_data_rank` as torch's styles
    take it). Parameters it does not name are left as they are."""
    import torch.nn as nn
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, placements.get("*"))
        if placement is None:
            continue
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad,
            ),
        )


def forward_on_local_params(module, local):
    """Run the module's forward on plain tensors in place of its DTensor parameters: `local(name, dtensor)`
    gives each one's local view (autograd flows back through it into the DTensor). The DTensors are put
    back after the forward, before FSDP reshards (torch runs FSDP's pre-forward hook first and its
    post-forward hook after this one's)."""
    from torch.distributed.tensor import DTensor

    kept = {}

    def swap_in(mod, args):
        for name, param in mod._parameters.items():
            if isinstance(param, DTensor):
                kept[name] = param
        for name, param in kept.items():
            mod._parameters[name] = local(name, param)

    def swap_back(mod, args, output):
        mod._parameters.update(kept)
        kept.clear()

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


def layout_input(layout, desired, local_grad_partial=False):
    """A distribute_module input_fn: the first input, a local tensor laid out as `layout` (or a DTensor),
    redistributed to `desired`; a local tensor again when `local_grad_partial` (its gradient then
    arrives partial, as after a colwise matmul on a replicated input, and is summed over the mesh)."""

    def prepare(mod, inputs, mesh):
        from torch.distributed.tensor import DTensor, Partial

        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [layout], run_check=False)
        if x.placements != (desired,):
            x = x.redistribute(placements=[desired])
        if local_grad_partial:
            x = x.to_local(grad_placements=[Partial()])
        return (x, *inputs[1:])

    return prepare


def layout_output(layout, use_local_output):
    """A distribute_module output_fn: the DTensor output redistributed to `layout`, local if asked."""

    def prepare(mod, output, mesh):
        if output.placements != (layout,):
            output = output.redistribute(placements=[layout])
        return output.to_local() if use_local_output else output

    return prepare


class ColwiseConv1DParallel(ParallelStyle):
    """colwise for a layer that stores its weight [in, out] and computes `x @ weight + bias` (transformers'
    Conv1D, as in GPT-2): weight Shard(1), bias Shard(0); input replicated, output sharded on the last dim."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        from torch.distributed.tensor.parallel import ColwiseParallel

        super().__init__()
        torchs = ColwiseParallel(input_layouts=input_layouts, output_layouts=output_layouts)  # torch's defaults
        self.input_layouts, self.output_layouts = torchs.input_layouts[0], torchs.output_layouts[0]
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Replicate, Shard, distribute_module

        distribute_params(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)
        return distribute_module(
            module,
            device_mesh,
            None,
            layout_input(self.input_layouts, Replicate()),
            layout_output(self.output_layouts, self.use_local_output),
        )


class RowwiseConv1DParallel(ParallelStyle):
    """rowwise for a layer that stores its weight [in, out] (transformers' Conv1D): weight Shard(0), bias
    Replicate; input sharded on the last dim, the partial sums reduced to the output layout (replicated)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        from torch.distributed.tensor.parallel import RowwiseParallel

        super().__init__()
        torchs = RowwiseParallel(input_layouts=input_layouts, output_layouts=output_layouts)  # torch's defaults
        self.input_layouts, self.output_layouts = torchs.input_layouts[0], torchs.output_layouts[0]
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Replicate, Shard, distribute_module

        distribute_params(module, device_mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)
        return distribute_module(
            module,
            device_mesh,
            None,
            layout_input(self.input_layouts, Shard(-1)),
            layout_output(self.output_layouts, self.use_local_output),
        )


class PackedColwiseParallel(ParallelStyle):
    """colwise for an nn.Linear whose output packs `parts` projections of equal width ([gate; up], or
    [q; k; v] with as many key/value heads as query heads): each rank gets the k-th slice of every part,
    so its local output is [gate_k, up_k] and the model's own `chunk(parts, -1)` splits it right.

    The weight is `_StridedShard(0, split_factor=parts)` over the mesh (torch's Shard(0) would give rank
    0 all of gate). The forward runs on the local weight with the input replicated; its output is a
    local tensor. A bias, a vector, stays whole on every rank (Replicate) and each rank adds its parts'
    slices of it; its gradient is summed over the mesh.
    """

    def __init__(self, *, parts=2, input_layouts=None):
        from torch.distributed.tensor.parallel import ColwiseParallel

        super().__init__()
        self.parts = parts
        self.input_layouts = ColwiseParallel(input_layouts=input_layouts).input_layouts[0]  # torch's default

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Replicate, distribute_module

        packed = strided_shard_class()(0, split_factor=self.parts)
        distribute_params(module, device_mesh, {"weight": packed, "bias": Replicate()}, self.src_data_rank)
        parts, rank, size = self.parts, device_mesh.get_local_rank(), device_mesh.size()

        def local(name, param):
            if name != "bias":
                return param.to_local()
            whole = SumGradOver.apply(param.to_local(), device_mesh.get_group())
            return torch.cat([part.chunk(size)[rank] for part in whole.chunk(parts)])

        forward_on_local_params(module, local)
        return distribute_module(
            module, device_mesh, None, layout_input(self.input_layouts, Replicate(), local_grad_partial=True), None
        )


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module (a per-head q/k norm) that runs on each rank's own part of the activations (its heads)
    with its parameters replicated: they become Replicate DTensors, the forward runs on their local
    values with the inputs and outputs left alone, and each parameter's gradient, partial on every rank,
    is summed over the mesh. transformers' `replicated_with_grad_allreduce`."""

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Replicate

        distribute_params(module, device_mesh, {"*": Replicate()}, self.src_data_rank)
        forward_on_local_params(
            module, lambda name, param: SumGradOver.apply(param.to_local(), device_mesh.get_group())
        )
        return module


class MlaKvAProjParallel(ParallelStyle):
    """DeepSeek's multi-head latent attention under tensor parallelism over heads: `kv_a_proj_with_mqa`
    stays whole on every rank (its parameters plain) and outputs [latent | rotary key]. The latent goes on
    to a colwise `kv_b_proj`, whose backward sums its input gradient over tp; the `rope` rotary features
    are shared by every head, and each rank uses them for its own heads only, so the gradient of that slice
    of the output is summed over the mesh here. transformers' `mla_kv_a_proj`."""

    def __init__(self, rope: int):
        super().__init__()
        self.rope = rope

    def _apply(self, module, device_mesh):
        import torch

        group, rope = device_mesh.get_group(), self.rope

        def summed_rope(module, args, output):
            latent, key = output.split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, SumGradOver.apply(key, group)], dim=-1)

        module.register_forward_hook(summed_rope)
        return module


def fsdp_shard_placement(param):
    """FSDP2's shard placement for `param` (its `shard_placement_fn`): Shard(1) for a weight that
    packed_colwise split part by part over TP (strided on dim 0), whose rows FSDP's Shard(0) would cut in a way DTensor
    cannot describe (its full tensor would come out scrambled); None (FSDP's Shard(0)) for the rest."""
    from torch.distributed.tensor import DTensor, Shard

    strided = strided_shard_class()
    if (
        isinstance(param, DTensor)
        and param.ndim > 1
        and any(isinstance(p, strided) and p.dim == 0 for p in param.placements)
    ):
        return Shard(1)
    return None
