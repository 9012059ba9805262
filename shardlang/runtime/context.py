"""Context parallelism: a sequence split over the ranks of a mesh dim, attention computed on every rank's
queries against the whole sequence's keys and values.

The layout of the sequence. Split plainly, causal attention leaves the last rank with the most work (its
queries see every key) and the first with the least. Head-tail balancing (torch's `_HeadTailLoadBalancer`,
torchtitan's default) cuts the sequence into 2 x cp chunks and gives rank r chunks r and 2cp - 1 - r,
so every rank holds as many early tokens as late ones. `sequence_positions` says which global positions a
rank holds; `split_sequence` cuts a tensor's sequence dim so, `join_sequence` puts the shards back.

Attention. Inside a module the plan runs under context parallelism, every call of
`torch.nn.functional.scaled_dot_product_attention` (transformers' SDPA attention, torchtitan's) becomes
`ContextAttention`: the blocks of torch's ring attention (`attention_blocks`: the rank's queries against
its own keys, causal, and against every earlier chunk of the sequence), each through the fused kernel
SDPA would pick (`attention_kernel`: CUDA's cuDNN or flash kernel, the CPU's flash kernel, else plain
matrix products) with its log-sum-exp, the outputs merged by it as the ring merges them. What differs
from torch's ring (`torch.distributed.tensor.experimental.context_parallel`, CUDA's kernels only, so the
checks could not run it on gloo): the other ranks' keys and values arrive in one all-gather
(`GatheredKeys`, waited for after the rank's own block), not one rank's at a time, so for one attention
call each rank holds the whole sequence's keys and values (2 x batch x kv heads x sequence x head dim);
their gradients go back in one reduce-scatter (`ScatteredGradients`) in the keys' dtype, where the ring
sends float32. The arithmetic is the same.
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


def along_sequence(values, fn):
    """`fn` applied to every tensor of `values` whose dim 1 is the sequence (as long as dim 1 of the first
    tensor of 2 dims or more), the rest as they are; and that first tensor (None if there is none)."""
    first = next((x for x in values if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
    if first is None:
        return tuple(values), None
    length = first.shape[1]
    mapped = tuple(fn(x) if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == length else x for x in values)
    return mapped, first


def attention_kernel(query: torch.Tensor) -> str:
    """The fused kernel that computes attention blocks with their log-sum-exp for `query`'s device and dtype,
    as SDPA would choose it: CUDA's cuDNN kernel where enabled and able (Hopper's fastest), else CUDA's
    flash kernel, the CPU's flash kernel on CPUs, else `math` (any device and dtype: CUDA's float32, meta)."""
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        from torch.backends import cuda

        params = cuda.SDPAParams(query, query, query, None, 0.0, False, False)
        if cuda.cudnn_sdp_enabled() and cuda.can_use_cudnn_attention(params):
            return "cudnn"
        if cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(params):
            return "flash"
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return "cpu"
    return "math"


def attention_block(kernel: str, query, key, value, causal: bool, scale: float):
    """One block of attention (causal only for as many queries as keys): the output, the log-sum-exp of each
    query's scores (batch, heads, queries, 1; float32 or wider) and what the kernel's backward takes back."""
    aten = torch.ops.aten
    if kernel == "cudnn":
        out, lse, *rest = aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scale
        )
    elif kernel == "flash":
        out, lse, *rest = aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)
    elif kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
        rest = []
    else:
        scores = attention_scores(query, key, causal, scale)
        lse = scores.logsumexp(-1, keepdim=True)
        out, rest = (scores - lse).exp().to(value.dtype) @ value, []
    return out, (lse if lse.ndim == 4 else lse.unsqueeze(-1)), rest


def attention_scores(query, key, causal: bool, scale: float) -> torch.Tensor:
    """The math kernel's scaled scores, in float32 at least, the upper triangle -inf when `causal`."""
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(wide) @ key.to(wide).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def attention_block_backward(kernel: str, grad, query, key, value, out, lse, rest, causal: bool, scale: float):
    """The gradients of `attention_block`'s query, key and value, given the output and log-sum-exp of the
    whole attention (every block merged): the blocks' gradients then add up to the whole's."""
    aten = torch.ops.aten
    if kernel == "cudnn":
        cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, query, key, value, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale
        )
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
        return aten._scaled_dot_product_flash_attention_backward(
            grad,
            query,
            key,
            value,
            out,
            lse.squeeze(-1),
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse.squeeze(-1), 0.0, causal, scale=scale
        )
    wide = lse.dtype
    probs = (attention_scores(query, key, causal, scale) - lse).exp()
    grad, value, out = grad.to(wide), value.to(wide), out.to(wide)
    scores_grad = probs * (grad @ value.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True)) * scale
    return (
        (scores_grad @ key.to(wide)).to(query.dtype),
        (scores_grad.transpose(-2, -1) @ query.to(wide)).to(key.dtype),
        (probs.transpose(-2, -1) @ grad).to(value.dtype),
    )


def attention_blocks(ranks: int, rank: int, local: int, causal: bool, balanced: bool) -> list[tuple]:
    """The blocks of this rank's attention: (first query, end of the queries, the keys: "local" (its own
    shard) or "whole" (the whole sequence, gathered, in order), first key, end, causal). Causal, each query
    sees its own shard's keys causally (one square block: a shard's chunks are in sequence order) and every
    earlier chunk of the sequence whole: under head-tail (chunk c = `local` / 2 tokens), rank r's chunks r
    and 2cp-1-r see chunks 0..r-1, and chunk 2cp-1-r also sees r+1..2cp-2-r; unbalanced, rank r's chunk sees
    the r before it. Torch's ring computes the same blocks, a rank's keys at a time."""
    if not causal:
        return [(0, local, "whole", 0, local * ranks, False)]
    blocks = [(0, local, "local", 0, local, True)]
    chunk = local // 2 if balanced else local
    if rank:
        blocks.append((0, local, "whole", 0, rank * chunk, False))
    if balanced and rank < ranks - 1:
        blocks.append((chunk, local, "whole", (rank + 1) * chunk, (2 * ranks - 1 - rank) * chunk, False))
    return blocks


def chunk_home(chunk: int, ranks: int, balanced: bool) -> tuple[int, int]:
    """The rank that holds a chunk of the sequence (`attention_blocks`' chunks) and its place among the
    rank's chunks."""
    if balanced and chunk >= ranks:
        return 2 * ranks - 1 - chunk, 1
    return chunk, 0


def chunk_places(first: int, end: int, chunk: int, ranks: int, balanced: bool):
    """For each chunk of positions first..end (whole chunks of `chunk`), in order: the rank holding it and
    the slice of that rank's shard it is."""
    for n in range(first // chunk, end // chunk):
        rank, place = chunk_home(n, ranks, balanced)
        yield rank, slice(place * chunk, (place + 1) * chunk)


class GatheredKeys:
    """Every rank's keys and values, gathered over `group` in one all-gather that is started here and waited
    for at the first `range` (the attention's first block, the rank's own, runs meanwhile), kept as it
    arrives: rank by rank, each rank's chunks in its own order."""

    def __init__(self, key, value, group, balanced: bool):
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol

        self.ranks, self.balanced, self.parts = dist.get_world_size(group), balanced, 2 if balanced else 1
        self.chunk = key.shape[-2] // self.parts
        # torch 2.13 renames it (the old name warns); torch 2.11 has only the old one
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        self.pending, self.gathered = gather(torch.stack([key, value]), 0, group), None

    def range(self, first: int, end: int):
        """The keys and values of the sequence's positions first..end (whole chunks), in sequence order."""
        from torch.distributed import _functional_collectives as funcol

        if self.gathered is None:
            self.gathered = funcol.wait_tensor(self.pending).unflatten(0, (self.ranks, 2))
            self.pending = None
        places = chunk_places(first, end, self.chunk, self.ranks, self.balanced)
        both = torch.cat([self.gathered[rank, :, ..., rows, :] for rank, rows in places], dim=-2)
        return both[0], both[1]


class ScatteredGradients:
    """The gradients of the gathered keys and values, written block by block into one buffer laid out as
    GatheredKeys receives them (rank by rank), then summed onto their owners by one reduce-scatter."""

    def __init__(self, like, ranks: int, balanced: bool):
        self.ranks, self.balanced, self.chunk = ranks, balanced, like.shape[-2] // (2 if balanced else 1)
        self.buffer = like.new_zeros(ranks, 2, *like.shape)

    def add(self, first: int, end: int, key_grad, value_grad) -> None:
        for n, (rank, into) in enumerate(chunk_places(first, end, self.chunk, self.ranks, self.balanced)):
            rows = slice(n * self.chunk, (n + 1) * self.chunk)
            self.buffer[rank, 0, ..., into, :] += key_grad[..., rows, :]
            self.buffer[rank, 1, ..., into, :] += value_grad[..., rows, :]

    def scattered(self, group):
        """This rank's share: the gradients of its own keys and values summed over every rank's queries."""
        from torch.distributed import _functional_collectives as funcol

        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        mine = scatter(self.buffer.flatten(0, 1), "sum", 0, group)
        return funcol.wait_tensor(mine).unbind(0)


def grouped(keys: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention's keys or values with each head repeated for the `groups` query heads it
    serves (the fused kernels take as many of each)."""
    return keys.repeat_interleave(groups, -3) if groups > 1 else keys


def attend(kernel: str, query, keys: dict, blocks: list, scale: float):
    """This rank's attention: every block of `blocks` (see `attention_blocks`) through `kernel`, with the
    keys and values `keys[source](first, end)` gives, the outputs merged by their log-sum-exps. Returns the
    output (query's dtype), the log-sum-exp of every query and what each block's backward takes back."""
    out = lse = None
    rests = []
    for first, end, which, k_first, k_end, causal in blocks:
        k, v = keys[which](k_first, k_end)
        groups = query.shape[-3] // k.shape[-3]  # grouped-query attention
        block, block_lse, rest = attention_block(
            kernel, query[..., first:end, :], grouped(k, groups), grouped(v, groups), causal, scale
        )
        rests.append(rest)
        if out is None:  # the first block has every query
            out, lse = block.to(block_lse.dtype), block_lse
            continue
        # merged stably, as torch's ring merges: out - sigmoid(lse_b - lse) (out - out_b)
        mine, mine_lse = out[..., first:end, :], lse[..., first:end, :]
        mine -= torch.sigmoid(block_lse - mine_lse) * (mine - block)
        mine_lse -= torch.nn.functional.logsigmoid(mine_lse - block_lse)
    return out.to(query.dtype), lse, rests


def attend_backward(kernel: str, grad, query, keys: dict, sinks: dict, blocks: list, rests: list, out, lse, scale):
    """`attend`'s gradients: the query's is returned (float32 or wider); the keys' and values' of each
    block go to `sinks[source](first, end, key_grad, value_grad)`. Each block's backward runs against the
    merged output and log-sum-exp, and the blocks' gradients add up to the whole's."""
    query_grad = torch.zeros_like(query, dtype=lse.dtype)
    for (first, end, which, k_first, k_end, causal), rest in zip(blocks, rests, strict=True):
        k, v = keys[which](k_first, k_end)
        groups = query.shape[-3] // k.shape[-3]
        rows = slice(first, end)
        dq, dk, dv = attention_block_backward(
            kernel,
            grad[..., rows, :],
            query[..., rows, :],
            grouped(k, groups),
            grouped(v, groups),
            out[..., rows, :],
            lse[..., rows, :].contiguous(),
            rest,
            causal,
            scale,
        )
        query_grad[..., rows, :] += dq
        sinks[which](k_first, k_end, *(t.unflatten(-3, (k.shape[-3], groups)).sum(-3) for t in (dk, dv)))
    return query_grad


class ContextAttention(torch.autograd.Function):
    """SDPA of this rank's shard of the queries against the whole sequence (see the module's docstring),
    by `attend`. The keys and values of the other ranks arrive while the rank's own block computes; only
    the rank's own are kept for the backward, which gathers the others again (while the own block's
    backward computes) and reduce-scatters their gradients back to their owners (in the keys' dtype)."""

    @staticmethod
    def forward(ctx, query, key, value, causal, scale, group, balanced):
        import torch.distributed as dist

        ctx.kernel, ctx.scale, ctx.group, ctx.balanced = attention_kernel(query), scale, group, balanced
        ctx.blocks = attention_blocks(
            dist.get_world_size(group), dist.get_rank(group), query.shape[-2], causal, balanced
        )
        keys = {"local": local_keys(key, value), "whole": GatheredKeys(key, value, group, balanced).range}
        out, lse, ctx.rests = attend(ctx.kernel, query, keys, ctx.blocks, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        query, key, value, out, lse = ctx.saved_tensors
        keys = {"local": local_keys(key, value), "whole": GatheredKeys(key, value, ctx.group, ctx.balanced).range}
        own = [torch.zeros_like(key, dtype=lse.dtype), torch.zeros_like(value, dtype=lse.dtype)]
        theirs = ScatteredGradients(key, dist.get_world_size(ctx.group), ctx.balanced)

        def local(first, end, key_grad, value_grad):
            own[0][..., first:end, :] += key_grad
            own[1][..., first:end, :] += value_grad

        sinks = {"local": local, "whole": theirs.add}
        query_grad = attend_backward(ctx.kernel, grad, query, keys, sinks, ctx.blocks, ctx.rests, out, lse, ctx.scale)
        key_grad, value_grad = (mine + summed for mine, summed in zip(own, theirs.scattered(ctx.group)))
        return query_grad.to(query.dtype), key_grad.to(key.dtype), value_grad.to(value.dtype), None, None, None, None


def local_keys(key, value):
    """`attend`'s keys of one source: positions first..end of `key` and `value` (dim -2)."""
    return lambda first, end: (key[..., first:end, :], value[..., first:end, :])


def context_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, group, balanced
):
    """scaled_dot_product_attention for this rank's queries (its shard of the sequence, dim -2) against the
    whole sequence's keys and values over `group` (ContextAttention; see the module's docstring)."""
    if attn_mask is not None:
        raise NotImplementedError(
            "context parallelism takes attention without an explicit mask (is_causal or none): the mask "
            "was built for this rank's shard of the sequence, not the whole"
        )
    if dropout_p:
        raise NotImplementedError(
            "context parallelism takes attention without dropout (dropout_p=0, as transformers' decoders train)"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return ContextAttention.apply(query, key, value, is_causal, scale, group, balanced)


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
        cut, first = along_sequence((*args, *kwargs.values()), lambda x: split_sequence(x, 1, ranks, rank, balanced))
        if first is None:
            return args, kwargs
        length = first.shape[1]
        args, kwargs = cut[: len(args)], dict(zip(kwargs, cut[len(args) :]))
        if takes_positions and kwargs.get("position_ids") is None:
            positions = sequence_positions(length, ranks, rank, balanced, first.device)
            kwargs["position_ids"] = positions.expand(first.shape[0], -1)
        module._context_length = length // ranks
        return args, kwargs

    def gather(module, args, output):
        if getattr(module, "shardlang_sends", False):  # a pipeline stage's activation for the next stage
            return output
        return whole_sequences(output, module._context_length, group, balanced)

    model._shardlang_context = (group, ranks, rank, balanced)
    model.register_forward_pre_hook(split, with_kwargs=True)
    if whole_output:
        model.register_forward_hook(gather)
    return model
