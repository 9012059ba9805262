"""A user style for DeepSeek's multi-head latent attention (plans/field/deepseek_v2.sl): transformers'
`mla_kv_a_proj`, which shardlang has no built-in for.

`kv_a_proj_with_mqa` outputs [latent | rotary key]. Under tensor parallelism over heads the latent goes
to a colwise `kv_b_proj`, whose backward already sums its input gradient over tp; the rotary key is
broadcast to this rank's heads only, so its gradient holds only their share. This style sums that slice
of the output gradient over the tp group, leaving the parameters whole on every rank.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


class _SumTail(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last `[latent:]` features over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, latent: int, group) -> torch.Tensor:
        ctx.latent, ctx.group = latent, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tail = grad[..., ctx.latent :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., : ctx.latent], tail], dim=-1), None, None


def mla_kv_a_proj(module: nn.Module, mesh: DeviceMesh, latent: int) -> None:
    group = mesh.get_group()
    module.register_forward_hook(lambda mod, args, out: _SumTail.apply(out, latent, group))
