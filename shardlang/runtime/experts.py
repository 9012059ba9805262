"""Expert parallelism for a mixture of experts: each rank of a mesh dim keeps num_experts / ep experts, and
every token goes to the rank holding the expert its router chose and comes back (runtime.dispatch: one
all-to-all of the counts, one of the rows each way).

It works on the experts module every MoE family of transformers 5 shares (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2/V3, gpt-oss, ...): one module holding every expert's weights stacked along dim 0, with
`num_experts` and `forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights
[tokens, k]) -> [tokens, hidden]`; on torchtitan's grouped experts, whose forward takes the rows already
grouped by expert and each expert's count (`forward(x [rows, dim], num_tokens_per_expert [experts])`, the
routing weights applied by its token dispatcher outside; JetMoE's take the counts as a list of ints); and on experts held as the members of a
ModuleList or ModuleDict. The router, outside it, stays whole on every rank. The three share one dispatch
and one combine; each form here is only what it computes on the rows its rank received.

On each rank the module's own forward computes its experts (whatever implementation transformers picked:
a loop, a grouped matmul), on the rows it received, with its shard of the weights and a weight of one; the
routing weights are applied back on the rank the tokens came from, so their gradient reaches the router
there. The gradient of an expert's weights is the sum over every token routed to it from every rank of
the mesh dim: the ranks of an ep dim train on different data, as data-parallel ranks do.

Like runtime.tpstyles, the style is a ParallelStyle and each method imports what it needs, so that
`compile --emit python` can paste its source (and runtime.dispatch's, which it calls).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from ..compiler.predict import expert_members, expert_tensors, expert_tp_layout, stacked_experts, takes_expert_counts
from .dispatch import (
    ExpertRanks,
    by_local_expert,
    combine,
    dispatch,
    in_arrival_order,
    local_experts,
    local_sizes,
    pairs_by_expert,
)
from .torchcompat import strided_shard_class
from .tpstyles import SumGradOver


class ExpertParallel(ParallelStyle):
    """Split a stacked-experts module over a 1-D mesh: every parameter whose dim 0 is the number of experts
    becomes a DTensor sharded on dim 0 (contiguous blocks of experts per rank), and the forward sends each
    (token, choice) pair to the rank holding its expert and the result back.

    `shared_batch`: the ranks of the mesh hold the same tokens (a dim whose ranks share the batch, as
    tensor-parallel ranks do). Each then routes only its own contiguous slice of them, so that no token is
    computed twice, and the outputs are gathered back over the mesh (the gradients of the shared inputs
    gathered likewise). Without it each rank routes all of its own tokens: ranks that train on different
    data, as data-parallel ranks do."""

    def __init__(self, shared_batch: bool = True, src_data_rank: int | None = 0):
        super().__init__()
        self.shared_batch = shared_batch
        self.src_data_rank = src_data_rank

    def _apply(self, module, device_mesh):
        import types

        import torch.nn as nn
        from torch.distributed.tensor import Shard, distribute_tensor

        members = expert_members(module)
        if members is not None:
            return _split_members(module, members, device_mesh, self.shared_batch)
        experts = stacked_experts(module)
        if experts is None:
            raise ValueError("it holds no expert weights stacked on dim 0 (a router stays whole)")
        ep = device_mesh.size()
        if experts % ep:
            raise ValueError(f"{experts} experts do not split evenly over {ep} ranks")
        for name in expert_tensors(module):  # (a submodule's too: Ergo's per-expert norm scales)
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            param = owner._parameters[leaf]
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        ranks = ExpertRanks(device_mesh.get_group(), ep, device_mesh.get_local_rank(), experts)
        if takes_expert_counts(module):
            forward = _counted_forward(module.forward, ranks)
            if self.shared_batch:
                forward = _one_counted_slice_each(forward, device_mesh)
        else:
            forward = _routed_forward(module.forward, ranks)
            if self.shared_batch:
                forward = _one_slice_each(forward, device_mesh)
        module.forward = types.MethodType(forward, module)
        return module


def _split_members(module, members, mesh, shared_batch):
    """Expert parallelism over a ModuleList's or ModuleDict's experts: rank r keeps the r-th contiguous block
    of them, whole, under their own keys (the others are dropped from its module, which keeps its keys: a
    rank's `experts.3` is the model's `experts.3`); the forward sends each (token, choice) pair to the rank
    holding its expert, runs each kept member on its rows, and brings the results back."""
    import types

    ep = mesh.size()
    if len(members) % ep:
        raise ValueError(f"{len(members)} experts do not split evenly over {ep} ranks")
    per_rank = len(members) // ep
    rank = mesh.get_local_rank()
    mine = members[rank * per_rank : (rank + 1) * per_rank]
    for key in members:
        if key not in mine:
            del module._modules[key]  # (not ModuleList's __delitem__, which renumbers the rest)
    module.experts_elsewhere = tuple(key for key in members if key not in mine)  # (what checkpoints skip)
    forward = _member_forward(mine, ExpertRanks(mesh.get_group(), ep, rank, len(members)))
    if shared_batch:
        forward = _one_slice_each(forward, mesh)
    module.forward = types.MethodType(forward, module)
    return module


def _routed_forward(local_forward, ranks):
    """The forward of stacked experts given their routing (transformers'), around the module's own
    (`local_forward`, bound): on the rows its rank received, each with its local expert's number and a
    weight of one, with its shard of the experts."""

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        import torch

        pairs = pairs_by_expert(hidden_states, top_k_index, top_k_weights, ranks.experts)
        rows, sent = dispatch(hidden_states, pairs.counts, ranks, pairs)
        index = local_experts(sent)[:, None]
        ones = torch.ones(index.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = _on_local_experts(self, ranks.per_rank, rows, local_forward, index, ones, *args, **kwargs)
        return combine(out, sent)

    return forward


def _counted_forward(local_forward, ranks):
    """The forward of experts that take their rows already grouped by expert and each expert's count
    (torchtitan's grouped experts): forward(rows [rows, dim], counts [experts]) -> [rows, dim], in the order
    the rows came. The module's own forward computes the rows its rank received, regrouped by local expert,
    with the local counts; weighting by the router and the sum into each token stay with the caller
    (torchtitan's dispatcher)."""

    def forward(self, rows, counts, *args, **kwargs):
        import torch

        listed = isinstance(counts, (list, tuple))  # JetMoE's experts take a list of ints (its router's .tolist())
        counts = torch.as_tensor(counts, dtype=torch.long, device=rows.device) if listed else counts
        if counts.dim() != 1 or counts.shape[0] != ranks.experts:
            raise ValueError(
                f"expert_parallel: the experts' forward took rows grouped by expert and their counts, which must "
                f"be one per expert ({ranks.experts}); it was given counts of shape {list(counts.shape)}"
            )
        arrived, sent = dispatch(rows, counts, ranks)
        grouped, by_expert = by_local_expert(arrived, sent)
        local_counts = sent.received_counts.view(ranks.size, ranks.per_rank).sum(0)
        local_counts = local_counts.tolist() if listed else local_counts
        out = _on_local_experts(self, ranks.per_rank, grouped, local_forward, local_counts, *args, **kwargs)
        return combine(in_arrival_order(out, by_expert), sent)

    return forward


def _member_forward(mine, ranks):
    """The forward of a ModuleList's or ModuleDict's experts, each rank holding the members `mine` (in
    order): forward(hidden_states [tokens, hidden], routing, routing_weights [tokens, k]), the routing as
    dispatch.routing_choices reads it. Each member's own module computes the rows its expert received;
    every member runs, on no rows too, so that each has a gradient, zero where no token came."""

    def forward(self, hidden_states, routing, routing_weights, *args, **kwargs):
        import torch

        pairs = pairs_by_expert(hidden_states, routing, routing_weights, ranks.experts)
        arrived, sent = dispatch(hidden_states, pairs.counts, ranks, pairs)
        grouped, by_expert = by_local_expert(arrived, sent)
        chunks = grouped.split(local_sizes(sent))
        computed = torch.cat([self._modules[key](chunk) for key, chunk in zip(mine, chunks)])
        return combine(in_arrival_order(computed, by_expert), sent)

    return forward


def _one_slice_each(forward, mesh):
    """`forward` on this rank's contiguous slice of tokens that every rank of `mesh` holds alike; the outputs
    gathered back whole on every rank (an uneven or empty slice too). Plain autograd functions, as the
    hand-written baseline of benchmarks/ep_compare.py uses, rather than DTensor redistributions: the version
    built on those ran at 0.76 of that baseline's throughput (benchmarks/RESULTS.md)."""

    group, ranks, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def shared(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        sizes = _row_sizes(hidden_states.shape[0], ranks)
        mine = RowSlice.apply(sizes, rank, group, hidden_states, top_k_index, top_k_weights)
        out = forward(self, *mine, *args, **kwargs)
        return RowGather.apply(out, sizes, rank, group)

    return shared


def _row_sizes(rows: int, ranks: int) -> list[int]:
    """How many of `rows` each of `ranks` takes, in order: as even as can be, the first ones one more."""
    return [rows // ranks + (r < rows % ranks) for r in range(ranks)]


def _gather_rows(tensor, sizes, group):
    """Every rank's rows (`sizes[r]` from rank r) concatenated in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    most = max(sizes)
    everyone = tensor.new_empty((most * len(sizes), *tensor.shape[1:]))
    if min(sizes) == most:  # even: straight into the output
        dist.all_gather_into_tensor(everyone, tensor, group=group)
        return everyone
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    dist.all_gather_into_tensor(everyone, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(everyone.split(most), sizes)])


class RowSlice(torch.autograd.Function):
    """This rank's rows (`sizes[rank]` of them, after the lower ranks') of tensors every rank holds alike, in
    one node; each gradient, whole on every rank, gathered from each rank's rows."""

    @staticmethod
    def forward(ctx, sizes, rank, group, *tensors):
        ctx.sizes, ctx.group = sizes, group
        ctx.set_materialize_grads(False)
        start = sum(sizes[:rank])
        return tuple(t[start : start + sizes[rank]].contiguous() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        gathered = (None if g is None else _gather_rows(g.contiguous(), ctx.sizes, ctx.group) for g in grads)
        return None, None, None, *gathered


class RowGather(torch.autograd.Function):
    """Every rank's rows, whole on every rank; the gradient of this rank's (every rank computes the same
    loss from the whole, so the gradient arrives whole and each takes its own rows)."""

    @staticmethod
    def forward(ctx, tensor, sizes, rank, group):
        ctx.start, ctx.stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
        return _gather_rows(tensor.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.stop].contiguous(), None, None, None


def _on_local_experts(module, per_rank: int, rows, local_forward, *args, **kwargs):
    """The module's own forward (`local_forward`, bound) on `rows` (and the rest of its arguments) with its
    shard of the experts: its DTensor parameters swapped for their local tensors (one LocalViews node) and
    its `num_experts`, if it has one, for `per_rank` while it runs."""
    import torch
    from torch.distributed.tensor import DTensor

    kept = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    loose = _rebuilt_by_replicate(module)
    count = getattr(module, "num_experts", None)
    both = [*kept.values(), *loose.values()]
    local = dict(zip([*kept, *loose], LocalViews.apply(*both))) if both else {}
    try:
        module._parameters.update({name: local[name] for name in kept})
        module.__dict__.update({name: local[name] for name in loose})
        if count is not None:
            module.num_experts = per_rank
        out = local_forward(rows, *args, **kwargs)
    finally:
        module._parameters.update(kept)
        module.__dict__.update(loose)
        if count is not None:
            module.num_experts = count
    if not rows.shape[0] and torch.is_grad_enabled():
        # No row came here (no expert of this rank was chosen): the backward must still run both all-to-alls
        # on this rank, as on every other, and give its experts a zero gradient, not none (which FSDP and DDP
        # would reduce with the other ranks' real ones).
        out = out + rows.sum() * 0 + sum(p.sum() * 0 for p in local.values() if p.requires_grad)
    return out


def _rebuilt_by_replicate(module) -> dict:
    """The DTensors set as plain attributes of `module` in place of its parameters: DDP's replicate keeps
    DTensor parameters as local ones and, for each forward, sets DTensors rebuilt from them as attributes
    (torch.distributed.tensor.parallel.ddp), which the experts' own forward must see as their local shards."""
    from torch.distributed.tensor import DTensor

    return {name: t for name, t in vars(module).items() if isinstance(t, DTensor)}


def _one_counted_slice_each(forward, mesh):
    """`forward` (rows grouped by expert, each expert's count) on this rank's contiguous slice of rows that
    every rank of `mesh` holds alike, with the counts of that slice; the outputs gathered back whole on
    every rank, as _one_slice_each does for experts given their routing."""

    group, ranks, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def shared(self, rows, counts, *args, **kwargs):
        sizes = _row_sizes(rows.shape[0], ranks)
        start = sum(sizes[:rank])
        (mine,) = RowSlice.apply(sizes, rank, group, rows)
        ends = counts.cumsum(0)  # expert e's rows are [ends[e] - counts[e], ends[e])
        overlap = ends.clamp(max=start + sizes[rank]) - (ends - counts).clamp(min=start)
        out = forward(self, mine, overlap.clamp(min=0), *args, **kwargs)
        return RowGather.apply(out, sizes, rank, group)

    return shared


class LocalViews(torch.autograd.Function):
    """The local tensors of DTensor parameters, as `to_local()` gives each, in one autograd node whose
    backward wraps every gradient back into a DTensor of its parameter's spec. `to_local()` is a node per
    parameter whose backward builds that spec anew from the gradient: on a host-bound MoE step, 4x the host
    time of these views for the 32 expert tensors of a 16-layer model (benchmarks/RESULTS.md). A gradient
    strided unlike its parameter's local tensor is copied into its layout, which the spec describes."""

    @staticmethod
    def forward(ctx, *params):
        ctx.specs = [p._spec for p in params]
        ctx.layouts = [(p._local_tensor.shape, p._local_tensor.stride()) for p in params]
        views = tuple(p._local_tensor.view_as(p._local_tensor) for p in params)
        ctx.mark_non_differentiable(*(v for v, p in zip(views, params) if not p.requires_grad))
        return views

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed.tensor import DTensor

        wrapped = []
        for grad, spec, (shape, stride) in zip(grads, ctx.specs, ctx.layouts):
            if grad is not None:
                if grad.stride() != stride:
                    grad = grad.new_empty_strided(shape, stride).copy_(grad)
                grad = DTensor(grad, spec, requires_grad=grad.requires_grad)
            wrapped.append(grad)
        return tuple(wrapped)


class ExpertTensorParallel(ParallelStyle):
    """Split every expert of a stacked-experts module over a 1-D mesh by its intermediate width, as
    transformers' tp_plan does (`moe_tp_experts`, its tensors `packed_colwise` and `rowwise`): rank k holds
    the k-th slice of each expert's gate and up projections (gate_up_proj [experts, 2 x width, hidden] as
    `_StridedShard(1, split_factor=2)`, so its local [gate_k; up_k] chunks as the model's forward expects)
    and the matching columns of down_proj (Shard(2)). The ranks hold the same tokens (the router runs whole
    on each); each computes every expert on every token with its slices, and the partial outputs are
    summed over the mesh. The gradients of the inputs (the tokens, the routing weights) arrive partial
    and are summed likewise. A down_proj bias, added once, is split evenly across the ranks' sums."""

    def __init__(self, src_data_rank: int | None = 0):
        super().__init__()
        self.src_data_rank = src_data_rank

    def _apply(self, module, device_mesh):
        import types

        import torch.nn as nn
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        layout = expert_tp_layout(module, device_mesh.size())
        if isinstance(layout, str):
            raise ValueError(layout)
        for name, (dim, parts) in layout.items():
            param = module._parameters[name]
            if dim is None:
                placement = Replicate()
            else:
                placement = strided_shard_class()(dim, split_factor=parts) if parts > 1 else Shard(dim)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = types.MethodType(_expert_tensor_parallel_forward(module.forward, layout, device_mesh), module)
        return module


class SumOver(torch.autograd.Function):
    """Partial sums added up over a process group (all-reduce); the gradient, the same on every rank, as
    it is."""

    @staticmethod
    def forward(ctx, tensor, group):
        import torch.distributed as dist

        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _expert_tensor_parallel_forward(local_forward, layout, mesh):
    """The forward of an expert-tensor-parallel module, around the module's own (`local_forward`, bound)."""

    group, tp = mesh.get_group(), mesh.size()

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        kept = {name: p for name, p in self._parameters.items() if isinstance(p, DTensor)}
        local = dict(zip(kept, LocalViews.apply(*kept.values()))) if kept else {}
        for name, view in local.items():
            if layout[name][0] is None:  # whole on every rank, added once: a 1/tp share of it on each
                local[name] = SumGradOver.apply(view, group) / tp
        hidden_states, top_k_weights = (SumGradOver.apply(t, group) for t in (hidden_states, top_k_weights))
        try:
            self._parameters.update(local)
            out = local_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        finally:
            self._parameters.update(kept)
        return SumOver.apply(out, group)

    return forward
