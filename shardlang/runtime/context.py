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
a reduce-scatter, so every rank's queries send their gradients back to the keys' owners) and put in
sequence order; each chunk of the rank's own queries attends to the keys up to its own last position,
causal aligned to the lower right (torch's `causal_lower_right`, which CUDA's flash kernel runs without
a mask in memory; elsewhere the mask is made). This is torch's `allgather` rotate method of ring attention, on any device:
torch's own context parallelism (`torch.distributed.tensor.experimental.context_parallel`) handles only
CUDA's SDPA kernels (flash, efficient, cuDNN), not the CPU's, so the checks could not run it on gloo.
What differs from the ring: each rank holds the whole sequence's keys and values for the length of
one attention call (2 x batch x kv heads x sequence x head dim), where the ring holds one chunk at a
time and overlaps sending the next with computing; the arithmetic is the same.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..frontend.patterns import modules_matching


def sequence_positions(length: int, ranks: int, rank: int, balanced: bool, device=None) -> torch.Tensor:
    """The global positions (in order) that `rank` of `ranks` holds of a sequence of `length`: head-tail
    chunks r and 2 x ranks - 1 - r when `balanced`, else the r-th contiguous block. The length must divide
    by 2 x ranks (balanced) or by ranks."""
    parts = 2 * ranks if balanced else ranks
    if length % parts:
        how = f"2 x {ranks} ranks, head-tail" if balanced else f"{ranks} ranks"
        raise ValueError(f"a sequence of {length} does not split into {parts} equal chunks ({how})")
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


def gathered(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim` in rank order; the gradient goes back to each rank's
    part summed over the ranks (reduce-scatter)."""
    from torch.distributed import _functional_collectives as funcol

    # torch 2.13 renames it (the old name warns); torch 2.11 has only the old one
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return funcol.wait_tensor(gather(tensor.contiguous(), dim, group))


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
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    local = query.shape[-2]
    length = local * ranks
    keys, values = (gathered(t, t.ndim - 2, group) for t in (key, value))
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    if not is_causal:
        return F.scaled_dot_product_attention(query, keys, values, dropout_p=dropout_p, scale=scale, **kwargs)
    # The gathered keys in sequence order; then each chunk of this rank's queries attends to the keys up to
    # its own last position, causal aligned to the lower right (torch's CausalBias: CUDA's flash kernel,
    # no mask held), the chunk's first query seeing every earlier chunk whole.
    order = torch.cat([sequence_positions(length, ranks, r, balanced, query.device) for r in range(ranks)])
    keys, values = (t.index_select(-2, torch.argsort(order)) for t in (keys, values))
    parts = 2 * ranks if balanced else ranks
    chunk = length // parts
    outputs = []
    for n, c in enumerate((rank, parts - 1 - rank) if balanced else (rank,)):
        end = (c + 1) * chunk
        with _disable_current_modes():  # a tensor subclass: made outside any dispatch mode (the comms check's)
            bias = causal_lower_right(chunk, end)
        outputs.append(
            F.scaled_dot_product_attention(
                query[..., n * chunk : (n + 1) * chunk, :],
                keys[..., :end, :],
                values[..., :end, :],
                attn_mask=bias,
                dropout_p=dropout_p,
                scale=scale,
                **kwargs,
            )
        )
    return torch.cat(outputs, dim=-2)


class ContextParallelAttention(TorchFunctionMode):
    """Every `scaled_dot_product_attention` called inside it runs as `context_attention` over `group`."""

    def __init__(self, group, balanced: bool):
        super().__init__()
        self.group, self.balanced = group, balanced
        self.calls = 0  # how many attention calls it took over

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.nn.functional as F

        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return context_attention(*args, **(kwargs or {}), group=self.group, balanced=self.balanced)
        return func(*args, **(kwargs or {}))


class GatherSequence(torch.autograd.Function):
    """Every cp rank's shard of a sequence (dim 1), whole and in order on every rank. Every rank computes
    the same loss from it, so the gradient arrives whole: each rank takes its own positions' rows, times
    the number of ranks, since the gradient reduction averages the cp ranks' gradients (each of which
    holds only its own tokens' part)."""

    @staticmethod
    def forward(ctx, tensor, group, balanced):
        import torch.distributed as dist

        ctx.group, ctx.balanced = group, balanced
        shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return join_sequence(shards, 1, balanced)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        ranks, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return split_sequence(grad, 1, ranks, rank, ctx.balanced) * ranks, None, None


def whole_sequences(output, local: int, group, balanced: bool):
    """Every sequence-shaped tensor of a model's output (dim 1 `local` long: a tensor, a tuple, or a
    transformers ModelOutput, in place) gathered whole over `group` (GatherSequence)."""

    def whole(x):
        if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == local:
            return GatherSequence.apply(x, group, balanced)
        return x

    if isinstance(output, torch.Tensor):
        return whole(output)
    if isinstance(output, dict):
        for key in list(output.keys()):
            output[key] = whole(output[key])
        return output
    if isinstance(output, tuple):
        return type(output)(whole(x) for x in output)
    return output


def context_shard(model, tensor, dim: int = 1):
    """This rank's shard of `tensor` along its sequence dim, as the model context_parallel set up splits
    its inputs: the labels a training loop takes the loss against under `output = local`."""
    ranks, rank, balanced = model._shardlang_context[1:]
    return split_sequence(tensor, dim, ranks, rank, balanced)


def context_parallel(model, patterns, mesh, balanced, whole_output=True):
    """Context parallelism over the 1-D `mesh`: the modules `patterns` match run their SDPA over the whole
    sequence (ContextParallelAttention); the model takes whole sequences as before: a hook on it cuts every
    sequence-shaped input (dim 1 as long as the first tensor's) to this rank's shard and gives transformers'
    models the shard's global `position_ids`; with `whole_output` another gathers every sequence-shaped
    output back (whole_sequences), else the outputs stay this rank's shard (`context_shard` cuts the
    labels alike)."""
    import functools
    import inspect

    group, ranks, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    for pattern in patterns:
        for name in modules_matching(model, pattern):
            module = model.get_submodule(name)
            forward = module.forward

            def attending(*args, forward=forward, name=name, **kwargs):
                with ContextParallelAttention(group, balanced) as mode:
                    out = forward(*args, **kwargs)
                if not mode.calls:
                    raise RuntimeError(
                        f"context_parallel: '{name}' called no scaled_dot_product_attention, which is what runs "
                        "over the whole sequence: match the attention modules that call it (transformers' with "
                        "attn_implementation='sdpa')"
                    )
                return out

            module.forward = functools.wraps(forward)(attending)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def split(module, args, kwargs):
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
        if first is None:
            return args, kwargs
        length = first.shape[1]

        def cut(x):
            if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == length:
                return split_sequence(x, 1, ranks, rank, balanced)
            return x

        args, kwargs = tuple(cut(x) for x in args), {k: cut(v) for k, v in kwargs.items()}
        if takes_positions and kwargs.get("position_ids") is None:
            positions = sequence_positions(length, ranks, rank, balanced, first.device)
            kwargs["position_ids"] = positions.expand(first.shape[0], -1)
        module._context_length = length // ranks
        return args, kwargs

    def gather(module, args, output):
        return whole_sequences(output, module._context_length, group, balanced)

    model._shardlang_context = (group, ranks, rank, balanced)
    model.register_forward_pre_hook(split, with_kwargs=True)
    if whole_output:
        model.register_forward_hook(gather)
    return model
