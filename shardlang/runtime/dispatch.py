"""Expert parallelism's exchange of rows, one for every form of experts: `dispatch` sends each row to the rank
holding its expert, `combine` brings each result back (torchtitan 0.3.0's token dispatcher: `dispatch` ->
`AllToAllDispatchMetadata` -> `combine`, here `Dispatched`).

The rows leave a rank grouped by expert, and so grouped by the rank holding their expert (contiguous blocks
of experts per rank): one all-to-all of each expert's count (the layer's one host sync) gives every rank
what it sends to and receives from each, one moves the rows, and one brings the results back. Each row's
expert needs no exchange of its own: the rows of a sender arrive grouped by expert, so the received counts
number them. A form of experts is then only what it computes on the rows it received:

- experts given their routing (transformers' stacked experts, members of a ModuleList or ModuleDict): the
  (token, choice) pairs are grouped by expert first (`pairs_by_expert`), and combine weights each result
  by its routing weight where the token is (so the router's gradient is there) and sums it into its token;
- experts given rows already grouped by expert with the counts (torchtitan's grouped experts): the rows go
  as they are and come back as rows, in the order they left (the caller weights and sums them).

Like runtime.experts, pasted by `compile --emit python`: each function imports what it needs.
"""

from __future__ import annotations

import torch

from .torchcompat import all_to_all_autograd, is_fake


def frozen_record(cls):
    """`cls` as a frozen attrs class. A function of this module rather than `@attrs.frozen`, so that the
    printed program, which pastes this module's source and names only torch's modules, defines it too."""
    import attrs

    return attrs.frozen(cls)


@frozen_record
class ExpertRanks:
    """How one module's `experts` are split over the `size` ranks of a 1-D mesh (its process `group`):
    rank r holds the r-th contiguous block of experts / size; this is rank `rank`."""

    group: object
    size: int
    rank: int
    experts: int

    @property
    def per_rank(self) -> int:
        return self.experts // self.size


@frozen_record
class Pairs:
    """A rank's (token, choice) pairs grouped by expert, those going to no expert last (torchtitan's local
    reorder): `order`, the pairs' flat indices into the [tokens, k] routing; `token_of`, each one's token;
    `counts`, how many go to each expert ([experts]; None in a simulated step, which has no routing to
    read); and what their results are weighted and summed with when they come back (`weights` [tokens, k],
    `hidden_states`)."""

    order: torch.Tensor
    token_of: torch.Tensor
    counts: torch.Tensor | None
    weights: torch.Tensor
    hidden_states: torch.Tensor


@frozen_record
class Dispatched:
    """What the results of the rows a rank sent need to come back: how many rows this rank sent to each rank and received from each
    (`send_sizes`, `receive_sizes`), how many of each of its experts' rows came from each rank (`received`
    and `received_counts`, rank-major [ranks x per_rank], as ints and as a tensor), and where the results go
    here: `pairs` (each sent row's token and routing weight) or, None, back as rows in the order they left."""

    ranks: ExpertRanks
    send_sizes: list
    receive_sizes: list
    received: list
    received_counts: torch.Tensor
    pairs: Pairs | None


def routing_choices(routing, experts: int):
    """Each (token, choice) pair's expert [tokens, k], `experts` where it goes to none. `routing` is the
    experts' numbers [tokens, k] (transformers' top_k_index; one out of range, as its padding expert
    `experts`, goes to none) or a one-hot mask [tokens, k, experts] (SwitchTransformers': a token over an
    expert's capacity has a row of zeros and goes to none)."""
    import torch

    if routing.dim() == 3 and routing.shape[-1] == experts:
        return torch.where(routing.sum(-1) > 0, routing.argmax(-1), experts)
    chosen = routing.clamp(max=experts)
    return chosen.masked_fill_(chosen < 0, experts)


def pairs_by_expert(hidden_states, routing, routing_weights, experts: int) -> Pairs:
    """The (token, choice) pairs of `routing` (as routing_choices reads it) grouped by expert, stably (each
    expert's pairs in token order), those going to no expert last. The pairs are the [tokens, k] routing
    flattened, so a pair's token is its index // k."""
    import torch

    chosen = routing_choices(routing, experts)
    k = chosen.shape[1]
    chosen = chosen.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = None if is_fake(hidden_states) else torch.bincount(chosen, minlength=experts + 1)[:experts]
    return Pairs(order, order // k, counts, routing_weights, hidden_states)


def dispatch(rows, counts, ranks: ExpertRanks, pairs: Pairs | None = None):
    """Send each row to the rank holding its expert: `rows` grouped by expert with `counts` [experts] of
    each (None in a simulated step: as evenly over the experts as they go), or, with `pairs`, the rows of
    `pairs`' tokens in their order (`rows` their hidden states). Returns the rows received, rank by rank
    and each rank's by expert, and the Dispatched record combine takes."""
    pairs_count = rows.shape[0] if pairs is None else pairs.order.shape[0]
    received_counts, received, send_sizes, receive_sizes = _exchange_counts(
        None if is_fake(rows) else counts, pairs_count, ranks, rows.device
    )
    if pairs is not None:
        sent = sum(send_sizes)
        if sent < pairs_count:  # some pairs go to no expert: they are last
            pairs = Pairs(pairs.order[:sent], pairs.token_of[:sent], pairs.counts, pairs.weights, pairs.hidden_states)
        rows = rows[pairs.token_of]
    arrived = all_to_all_autograd(rows, receive_sizes, send_sizes, ranks.group)
    return arrived, Dispatched(ranks, send_sizes, receive_sizes, received, received_counts, pairs)


def combine(out, dispatched: Dispatched):
    """Each received row's result [rows, hidden] back to the rank it came from; there, with pairs, weighted
    by its (token, choice) pair's routing weight and summed into its token's output [tokens, hidden]."""
    import torch

    back = all_to_all_autograd(out, dispatched.send_sizes, dispatched.receive_sizes, dispatched.ranks.group)
    pairs = dispatched.pairs
    if pairs is None:
        return back
    weighted = back * pairs.weights.reshape(-1)[pairs.order, None].to(back.dtype)
    combined = torch.zeros_like(pairs.hidden_states, dtype=back.dtype).index_add(0, pairs.token_of, weighted)
    return combined.to(pairs.hidden_states.dtype)


def _exchange_counts(sent_counts, pairs: int, ranks: ExpertRanks, device):
    """How many rows of each expert this rank sends (`sent_counts` [experts]) and receives of its own experts
    from every rank (an all-to-all, and the layer's one host sync). `sent_counts` None (a simulated step,
    with no routing to read): its `pairs` rows as evenly over the experts as they go (uniform routing).
    Returns the received counts [ranks x per_rank, rank-major] as a tensor and as a list, and the rows sent
    to and received from each rank."""
    import torch
    import torch.distributed as dist

    per_rank, ep = ranks.per_rank, ranks.size
    if sent_counts is None:
        experts = ranks.experts
        send = [pairs // experts + (e < pairs % experts) for e in range(experts)]
        receive = [send[ranks.rank * per_rank + e] for _ in range(ep) for e in range(per_rank)]
        received_counts = torch.tensor(receive, device=device)
    else:
        received_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(received_counts, sent_counts, group=ranks.group)
        send, receive = torch.stack([sent_counts, received_counts]).tolist()
    send_sizes = [sum(send[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    receive_sizes = [sum(receive[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    return received_counts, receive, send_sizes, receive_sizes


def local_experts(dispatched: Dispatched):
    """Each received row's expert among this rank's (0 to per_rank - 1), in the order they arrived: rank by
    rank, each rank's by expert."""
    import torch

    ranks, counts = dispatched.ranks, dispatched.received_counts
    expert_of = torch.arange(ranks.size * ranks.per_rank, device=counts.device) % ranks.per_rank
    return expert_of.repeat_interleave(counts, output_size=sum(dispatched.receive_sizes))


def local_sizes(dispatched: Dispatched) -> list[int]:
    """How many rows each of this rank's experts received, from every rank together."""
    per_rank, received = dispatched.ranks.per_rank, dispatched.received
    return [sum(received[e::per_rank]) for e in range(per_rank)]


def by_local_expert(arrived, dispatched: Dispatched):
    """The received rows regrouped by local expert (each expert's rows in rank order: a stable sort), and
    the order that did it (undone once they are computed)."""
    import torch

    order = torch.argsort(local_experts(dispatched), stable=True)
    return arrived[order], order


def in_arrival_order(rows, by_expert):
    """`rows`, computed in the order `by_expert` (by_local_expert) gave them, put back in the order they
    arrived. An index assignment into a fresh tensor, whose backward keeps only the index: `index_copy`'s
    would keep `rows` themselves alive until the backward (its gradient formula reads their shape from the
    tensor), a [rows, hidden] activation a layer that nothing needs (benchmarks/RESULTS.md)."""
    out = rows.new_empty(rows.shape)
    out[by_expert] = rows
    return out
