"""Context parallelism on a model: a sequence split over the ranks of a mesh dim, attention computed on every
rank's queries against the whole sequence's keys and values.

`context_parallel` sets it up: the modules the plan names run their SDPA as context_attention.py's ring
blocks; a hook on the model cuts every sequence-shaped input to this rank's shard as the sequence layout
(context_layout.py, the load balancer) says, and another gathers the outputs back whole. What the hooks,
`Plan.context_shard` and the checks share is one `ContextState` on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..frontend.patterns import modules_matching
from .context_attention import ContextParallelAttention
from .context_layout import SequenceLayout, along_sequence


class GatherSequence(torch.autograd.Function):
    """Every cp rank's shard of a sequence (dim 1), whole and in order on every rank. Every rank computes
    the same loss from it, so the gradient arrives whole: each rank takes its own positions' rows, times
    the number of ranks, since the gradient reduction averages the cp ranks' gradients (each of which
    holds only its own tokens' part)."""

    @staticmethod
    def forward(ctx, tensor, group, layout):
        import torch.distributed as dist

        ctx.group, ctx.layout = group, layout
        shards = [torch.empty_like(tensor) for _ in range(layout.ranks)]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return layout.join(shards, 1)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        return ctx.layout.split(grad, 1, dist.get_rank(ctx.group)) * ctx.layout.ranks, None, None


def whole_sequences(output, local: int, group, layout):
    """Every sequence-shaped tensor of a model's output (dim 1 `local` long: a tensor, a tuple, or a
    transformers ModelOutput, in place) gathered whole over `group` (GatherSequence)."""

    def whole(x):
        if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == local:
            return GatherSequence.apply(x, group, layout)
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


def one_sequence():
    """While the model runs (until the returned undo is called): transformers reads no packed sequences in
    the position_ids context parallelism gives it. A head-tail shard's positions jump ([0..3, 12..15]), which
    transformers takes, where there is no cache (use_cache=False, as in training), for sequences packed
    side by side, and builds a mask keeping them apart, which no SDPA over the whole sequence can take;
    they are one sequence's, and SDPA keeps is_causal. A no-op where transformers is not imported."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return lambda: None
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None

    def undo():
        masking.find_packed_sequence_indices = found

    return undo


@dataclass
class ContextState:
    """What context parallelism set up on a model (or a pipeline stage) shares between its hooks and
    whoever takes its outputs or labels apart (`Plan.context_shard`, the checks under `output = local`):
    the cp group, this rank in it, the sequence layout, and this rank's length of the sequence the last
    forward took."""

    group: object
    rank: int
    layout: SequenceLayout
    #: this rank's shard's length of the last forward's sequence (None before one)
    local: int | None = None
    #: while the model runs on positions it was given here: what undoes `one_sequence` (None otherwise)
    unpacked: object = None

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of `tensor` along its sequence dim, as the inputs are split."""
        return self.layout.split(tensor, dim, self.rank)

    def whole(self, output):
        """The last forward's output (this rank's shards of the sequence) gathered whole."""
        return whole_sequences(output, self.local, self.group, self.layout)


def context_state(model) -> ContextState:
    """The ContextState `context_parallel` left on `model` (the model, or a pipeline stage)."""
    return model._shardlang_context


def context_shard(model, tensor, dim: int = 1):
    """This rank's shard of `tensor` along its sequence dim, as the model context_parallel set up splits
    its inputs: the labels a training loop takes the loss against under `output = local`."""
    return context_state(model).shard(tensor, dim)


def attending(module, name: str, group, layout) -> None:
    """`module`'s forward runs its SDPA over the whole sequence (ContextParallelAttention); one that calls
    none raises, naming it."""
    import functools

    forward = module.forward

    def attend(*args, **kwargs):
        with ContextParallelAttention(group, layout) as mode:
            out = forward(*args, **kwargs)
        if not mode.calls:
            raise RuntimeError(
                f"context_parallel: '{name}' called no scaled_dot_product_attention, which is what runs "
                "over the whole sequence: match the attention modules that call it (transformers' with "
                "attn_implementation='sdpa')"
            )
        return out

    module.forward = functools.wraps(forward)(attend)


def context_parallel(model, patterns, mesh, layout: type[SequenceLayout], whole_output=True):
    """Context parallelism over the 1-D `mesh`, the sequence laid out by `layout` (a SequenceLayout class:
    HeadTail, Contiguous): the modules `patterns` match run their SDPA over the whole sequence
    (`attending`); the model takes whole sequences as before: a hook on it cuts every sequence-shaped input
    (dim 1 as long as the first tensor's) to this rank's shard and gives transformers' models the shard's
    global `position_ids`; with `whole_output` another gathers every sequence-shaped output back
    (whole_sequences), else the outputs stay this rank's shard (`context_shard` cuts the labels alike)."""
    import inspect

    state = ContextState(mesh.get_group(), mesh.get_local_rank(), layout(mesh.size()))
    for pattern in patterns:
        for name in modules_matching(model, pattern):
            attending(model.get_submodule(name), name, state.group, state.layout)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def split(module, args, kwargs):
        cut, first = along_sequence((*args, *kwargs.values()), state.shard)
        if first is None:
            return args, kwargs
        length = first.shape[1]
        args, kwargs = cut[: len(args)], dict(zip(kwargs, cut[len(args) :]))
        if takes_positions and kwargs.get("position_ids") is None:
            positions = state.layout.positions(length, state.rank, first.device)
            kwargs["position_ids"] = positions.expand(first.shape[0], -1)
            state.unpacked = one_sequence()
        state.local = length // state.layout.ranks
        return args, kwargs

    def restore(module, args, output):
        if state.unpacked is not None:
            state.unpacked, undo = None, state.unpacked
            undo()

    def gather(module, args, output):
        if getattr(module, "shardlang_sends", False):  # a pipeline stage's activation for the next stage
            return output
        return state.whole(output)

    model._shardlang_context = state
    model.register_forward_pre_hook(split, with_kwargs=True)
    model.register_forward_hook(restore, always_call=True)
    if whole_output:
        model.register_forward_hook(gather)
    return model
