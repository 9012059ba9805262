"""Context parallelism's attention: SDPA of a rank's shard of the queries against the whole sequence's keys
and values, as the blocks of torch's ring attention.

Inside a module the plan runs under context parallelism, every call of
`torch.nn.functional.scaled_dot_product_attention` (transformers' SDPA attention, torchtitan's) becomes
`ContextAttention`: the blocks the sequence layout gives (`SequenceLayout.blocks`: the rank's queries
against its own keys, causal, and against every earlier chunk of the sequence), each through the fused
kernel SDPA would pick (`attention_kernel`: CUDA's cuDNN or flash kernel, the CPU's flash kernel, else plain
matrix products) with its log-sum-exp, the outputs merged by it as the ring merges them. A block reads its
keys and values from a key source (`KeySource`): `LocalKeys`, the rank's own, or `GatheredKeys`, the whole
sequence; the backward hands each source its keys' gradients. What differs from torch's ring
(`torch.distributed.tensor.experimental.context_parallel`, CUDA's kernels only, so the checks could not run
it on gloo): the other ranks' keys and values arrive in one all-gather (`GatheredKeys`, waited for after the
rank's own block), not one rank's at a time (torch's `_RingRotater`: here, another key source), so for one
attention call each rank holds the whole sequence's keys and values (2 x batch x kv heads x sequence x head
dim); their gradients go back in one reduce-scatter (`ScatteredGradients`) in the keys' dtype, where the
ring sends float32. The arithmetic is the same.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


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


class KeySource:
    """Where a block's keys and values come from (`range`), and where their gradients go (`add`, then
    `gradients`: the source's own keys' and values' gradients, once every block has added)."""

    def range(self, first: int, end: int):
        """The keys and values of positions first..end."""
        raise NotImplementedError

    def add(self, first: int, end: int, key_grad, value_grad) -> None:
        raise NotImplementedError

    def gradients(self):
        raise NotImplementedError


class LocalKeys(KeySource):
    """Keys and values held here (a rank's own shard), their gradients summed in `grad_dtype` (the
    log-sum-exp's: float32 or wider)."""

    def __init__(self, key, value, grad_dtype=None):
        self.key, self.value, self.grad_dtype = key, value, grad_dtype
        self.grads = None

    def range(self, first: int, end: int):
        return self.key[..., first:end, :], self.value[..., first:end, :]

    def add(self, first: int, end: int, key_grad, value_grad) -> None:
        own = self.gradients()
        own[0][..., first:end, :] += key_grad
        own[1][..., first:end, :] += value_grad

    def gradients(self):
        if self.grads is None:
            self.grads = [torch.zeros_like(t, dtype=self.grad_dtype) for t in (self.key, self.value)]
        return self.grads


class GatheredKeys(KeySource):
    """Every rank's keys and values, gathered over `group` in one all-gather that is started here and waited
    for at the first `range` (the attention's first block, the rank's own, runs meanwhile), kept as it
    arrives: rank by rank, each rank's chunks in its own order (`layout`). Their gradients go back to their
    owners in one reduce-scatter (`ScatteredGradients`), which every rank joins."""

    def __init__(self, key, value, group, layout):
        from torch.distributed import _functional_collectives as funcol

        self.key, self.group, self.layout = key, group, layout
        self.chunk = key.shape[-2] // layout.per_rank
        # torch 2.13 renames it (the old name warns); torch 2.11 has only the old one
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        self.pending, self.gathered = gather(torch.stack([key, value]), 0, group), None
        self.scattered = None

    def range(self, first: int, end: int):
        """The keys and values of the sequence's positions first..end (whole chunks), in sequence order."""
        from torch.distributed import _functional_collectives as funcol

        if self.gathered is None:
            self.gathered = funcol.wait_tensor(self.pending).unflatten(0, (self.layout.ranks, 2))
            self.pending = None
        places = self.layout.places(first, end, self.chunk)
        both = torch.cat([self.gathered[rank, :, ..., rows, :] for rank, rows in places], dim=-2)
        return both[0], both[1]

    def add(self, first: int, end: int, key_grad, value_grad) -> None:
        if self.scattered is None:
            self.scattered = ScatteredGradients(self.key, self.layout)
        self.scattered.add(first, end, key_grad, value_grad)

    def gradients(self):
        """This rank's share: the gradients of its own keys and values summed over every rank's queries."""
        if self.scattered is None:  # no block of this rank's read another's keys; the others' may have
            self.scattered = ScatteredGradients(self.key, self.layout)
        return self.scattered.scattered(self.group)


class ScatteredGradients:
    """The gradients of the gathered keys and values, written block by block into one buffer laid out as
    GatheredKeys receives them (rank by rank), then summed onto their owners by one reduce-scatter."""

    def __init__(self, like, layout):
        self.layout, self.chunk = layout, like.shape[-2] // layout.per_rank
        self.buffer = like.new_zeros(layout.ranks, 2, *like.shape)

    def add(self, first: int, end: int, key_grad, value_grad) -> None:
        for n, (rank, into) in enumerate(self.layout.places(first, end, self.chunk)):
            rows = slice(n * self.chunk, (n + 1) * self.chunk)
            self.buffer[rank, 0, ..., into, :] += key_grad[..., rows, :]
            self.buffer[rank, 1, ..., into, :] += value_grad[..., rows, :]

    def scattered(self, group):
        from torch.distributed import _functional_collectives as funcol

        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        mine = scatter(self.buffer.flatten(0, 1), "sum", 0, group)
        return funcol.wait_tensor(mine).unbind(0)


def grouped(keys: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention's keys or values with each head repeated for the `groups` query heads it
    serves (the fused kernels take as many of each)."""
    return keys.repeat_interleave(groups, -3) if groups > 1 else keys


def attend(kernel: str, query, sources: dict, blocks: list, scale: float):
    """This rank's attention: every block of `blocks` (`SequenceLayout.blocks`) through `kernel`, with the
    keys and values its source (`sources[block.keys]`, a KeySource) gives, the outputs merged by their
    log-sum-exps. Returns the output (query's dtype), the log-sum-exp of every query and what each block's
    backward takes back."""
    out = lse = None
    rests = []
    for block in blocks:
        k, v = sources[block.keys].range(block.key_first, block.key_end)
        groups = query.shape[-3] // k.shape[-3]  # grouped-query attention
        part, part_lse, rest = attention_block(
            kernel, query[..., block.queries, :], grouped(k, groups), grouped(v, groups), block.causal, scale
        )
        rests.append(rest)
        if out is None:  # the first block has every query
            out, lse = part.to(part_lse.dtype), part_lse
            continue
        # merged stably, as torch's ring merges: out - sigmoid(lse_b - lse) (out - out_b)
        mine, mine_lse = out[..., block.queries, :], lse[..., block.queries, :]
        mine -= torch.sigmoid(part_lse - mine_lse) * (mine - part)
        mine_lse -= torch.nn.functional.logsigmoid(mine_lse - part_lse)
    return out.to(query.dtype), lse, rests


def attend_backward(kernel: str, grad, query, sources: dict, blocks: list, rests: list, out, lse, scale):
    """`attend`'s gradients: the query's is returned (float32 or wider); the keys' and values' of each
    block go to its source (`KeySource.add`). Each block's backward runs against the merged output and
    log-sum-exp, and the blocks' gradients add up to the whole's."""
    query_grad = torch.zeros_like(query, dtype=lse.dtype)
    for block, rest in zip(blocks, rests, strict=True):
        source = sources[block.keys]
        k, v = source.range(block.key_first, block.key_end)
        groups = query.shape[-3] // k.shape[-3]
        rows = block.queries
        dq, dk, dv = attention_block_backward(
            kernel,
            grad[..., rows, :],
            query[..., rows, :],
            grouped(k, groups),
            grouped(v, groups),
            out[..., rows, :],
            lse[..., rows, :].contiguous(),
            rest,
            block.causal,
            scale,
        )
        query_grad[..., rows, :] += dq
        source.add(block.key_first, block.key_end, *(t.unflatten(-3, (k.shape[-3], groups)).sum(-3) for t in (dk, dv)))
    return query_grad


class ContextAttention(torch.autograd.Function):
    """SDPA of this rank's shard of the queries against the whole sequence (see the module's docstring),
    by `attend`. The keys and values of the other ranks arrive while the rank's own block computes; only
    the rank's own are kept for the backward, which gathers the others again (while the own block's
    backward computes) and reduce-scatters their gradients back to their owners (in the keys' dtype)."""

    @staticmethod
    def forward(ctx, query, key, value, causal, scale, group, layout):
        import torch.distributed as dist

        ctx.kernel, ctx.scale, ctx.group, ctx.layout = attention_kernel(query), scale, group, layout
        ctx.blocks = layout.blocks(dist.get_rank(group), query.shape[-2], causal)
        sources = {"local": LocalKeys(key, value), "whole": GatheredKeys(key, value, group, layout)}
        out, lse, ctx.rests = attend(ctx.kernel, query, sources, ctx.blocks, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        local, whole = LocalKeys(key, value, lse.dtype), GatheredKeys(key, value, ctx.group, ctx.layout)
        sources = {"local": local, "whole": whole}
        query_grad = attend_backward(ctx.kernel, grad, query, sources, ctx.blocks, ctx.rests, out, lse, ctx.scale)
        key_grad, value_grad = (mine + summed for mine, summed in zip(local.gradients(), whole.gradients()))
        return query_grad.to(query.dtype), key_grad.to(key.dtype), value_grad.to(value.dtype), None, None, None, None


def context_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, group, layout
):
    """scaled_dot_product_attention for this rank's queries (its shard of the sequence, dim -2, laid out
    by `layout`) against the whole sequence's keys and values over `group` (ContextAttention)."""
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
    return ContextAttention.apply(query, key, value, is_causal, scale, group, layout)


class ContextParallelAttention(TorchFunctionMode):
    """Every `scaled_dot_product_attention` called inside it runs as `context_attention` over `group`, its
    sequences laid out by `layout` (a SequenceLayout)."""

    def __init__(self, group, layout):
        super().__init__()
        self.group, self.layout = group, layout
        self.calls = 0  # how many attention calls it took over

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.nn.functional as F

        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return context_attention(*args, **(kwargs or {}), group=self.group, layout=self.layout)
        return func(*args, **(kwargs or {}))
