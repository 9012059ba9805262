"""Context parallelism: a sequence split over the ranks of a mesh dim, attention computed on every rank's
queries against the whole sequence's keys and values.

The layout of the sequence. Split plainly, causal attention leaves the last rank with the most work (its
queries see every key) and the first with the least. Head-tail balancing (torch's `_HeadTailLoadBalancer`,
torchtitan's default) cuts the sequence into 2 x cp chunks and gives rank r chunks r and 2cp - 1 - r,
so every rank holds as many early tokens as late ones. `sequence_positions` says which global positions a
rank holds; `split_sequence` cuts a tensor's sequence dim so, `join_sequence` puts the shards back.

Attention. Inside a module the plan runs under context parallelism, every call of
`torch.nn.functional.scaled_dot_product_attention` (transformers' SDPA attention, torchtitan's) becomes
`context_attention`: the keys and values are gathered over the cp group (an all-gather whose backward is
a reduce-scatter, so every rank's queries send their gradients back to the keys' owners), put in
sequence order, and the rank's own queries attend to all of them, with the causal mask taken between
their global positions. This is torch's `allgather` rotate method of ring attention, on any device:
torch's own context parallelism (`torch.distributed.tensor.experimental.context_parallel`) handles only
CUDA's SDPA kernels (flash, efficient, cuDNN), not the CPU's, so the checks could not run it on gloo.
What differs from the ring: each rank holds the whole sequence's keys and values for the length of
one attention call (2 x batch x kv heads x sequence x head dim), where the ring holds one chunk at a
time and overlaps sending the next with computing; the arithmetic is the same.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def sequence_positions(length: int, ranks: int, rank: int, balanced: bool, device=None) -> torch.Tensor:
    """The global positions (in order) that `rank` of `ranks` holds of a sequence of `length`: head-tail
    chunks r and 2 x ranks - 1 - r when `balanced`, else the r-th contiguous block. The length must divide
    by 2 x ranks (balanced) or by ranks."""
    parts = 2 * ranks if balanced else ranks
    if length % parts:
        raise ValueError(f"a sequence of {length} does not split into {parts} equal chunks")
    chunk = length // parts
    chunks = (rank, parts - 1 - rank) if balanced else (rank,)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def split_sequence(tensor: torch.Tensor, dim: int, ranks: int, rank: int, balanced: bool) -> torch.Tensor:
    """This rank's shard of `tensor` along its sequence dim `dim` (see `sequence_positions`)."""
    index = sequence_positions(tensor.shape[dim], ranks, rank, balanced, tensor.device)
    return tensor.index_select(dim, index)


def join_sequence(shards: list[torch.Tensor], dim: int, balanced: bool) -> torch.Tensor:
    """Every rank's shard (in rank order) put back in sequence order."""
    ranks = len(shards)
    whole = torch.cat(shards, dim=dim)
    order = torch.cat([sequence_positions(whole.shape[dim], ranks, r, balanced, whole.device) for r in range(ranks)])
    return whole.index_select(dim, torch.argsort(order))


def _gathered(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim` in rank order; the gradient goes back to each rank's
    part summed over the ranks (reduce-scatter)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(tensor.contiguous(), dim, group))


def context_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, group, balanced
):
    """scaled_dot_product_attention for this rank's queries (its shard of the sequence, dim -2) against the
    whole sequence's keys and values, gathered over `group` (see the module's docstring)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    if attn_mask is not None:
        raise NotImplementedError(
            "context parallelism takes attention without an explicit mask (is_causal or none): the mask "
            "was built for this rank's shard of the sequence, not the whole"
        )
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    local = query.shape[-2]
    length = local * ranks
    keys, values = (_gathered(t, t.ndim - 2, group) for t in (key, value))
    mask = None
    if is_causal:
        mine = sequence_positions(length, ranks, rank, balanced, query.device)
        theirs = torch.cat([sequence_positions(length, ranks, r, balanced, query.device) for r in range(ranks)])
        mask = mine[:, None] >= theirs[None, :]  # the gathered keys stay in rank order: the mask follows them
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, **kwargs
    )


class ContextParallelAttention(TorchFunctionMode):
    """Every `scaled_dot_product_attention` called inside it runs as `context_attention` over `group`."""

    def __init__(self, group, balanced: bool):
        super().__init__()
        self.group, self.balanced = group, balanced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.nn.functional as F

        if func is F.scaled_dot_product_attention:
            return context_attention(*args, **(kwargs or {}), group=self.group, balanced=self.balanced)
        return func(*args, **(kwargs or {}))
