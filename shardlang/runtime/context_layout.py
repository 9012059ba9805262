"""Context parallelism's sequence layout: which positions of a sequence each rank of the cp dim holds (the
load balancer), and the blocks of attention that follow from it.

Split plainly (`Contiguous`), causal attention leaves the last rank with the most work (its queries see
every key) and the first with the least. Head-tail balancing (`HeadTail`: torch's `_HeadTailLoadBalancer`,
torchtitan's default) cuts the sequence into 2 x cp chunks and gives rank r chunks r and 2cp - 1 - r, so
every rank holds as many early tokens as late ones. A layout says only how many equal chunks the sequence
is cut into (`parts`) and which of them a rank holds (`chunks`); its positions, the split and the join of
a tensor, where a chunk lives, and the blocks of a rank's attention follow from those two. Another load
balancer is one more subclass here and its name in `LAYOUTS` (and in the DSL's `load_balance` choice,
frontend.schema). The classes are pasted into printed programs, which run with torch alone: hence a
dataclass, not attrs, and no ABC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One block of a rank's attention: its queries `first`..`end` (positions within its shard) against
    keys and values `key_first`..`key_end` of one key source (`keys`: "local", the rank's own shard, or
    "whole", the whole sequence in order), `causal` only for a square block of the shard's own keys."""

    first: int
    end: int
    keys: str
    key_first: int
    key_end: int
    causal: bool

    @property
    def queries(self) -> slice:
        return slice(self.first, self.end)


class SequenceLayout:
    """How a sequence splits over `ranks`: into `parts` equal chunks, each rank holding `chunks(rank)` of
    them (as many as every other rank, in sequence order), its shard being those chunks one after another.
    A subclass gives `name`, `parts`, `chunks` and `describe`."""

    #: The DSL's name of the layout (`load_balance = NAME`).
    name = ""

    def __init__(self, ranks: int):
        self.ranks = ranks
        #: chunk -> (the rank holding it, its place among that rank's chunks)
        self.homes = {c: (r, place) for r in range(ranks) for place, c in enumerate(self.chunks(r))}

    @property
    def parts(self) -> int:
        raise NotImplementedError

    def chunks(self, rank: int) -> tuple[int, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        """How the sequence is cut, for the error a length that does not divide raises."""
        raise NotImplementedError

    @property
    def per_rank(self) -> int:
        return self.parts // self.ranks

    def positions(self, length: int, rank: int, device=None) -> torch.Tensor:
        """The global positions (in order) that `rank` holds of a sequence of `length`."""
        if length % self.parts:
            raise ValueError(
                f"a sequence of {length} does not split into {self.parts} equal chunks ({self.describe()})"
            )
        chunk = length // self.parts
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks(rank)])

    def split(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """`rank`'s shard of `tensor` along its sequence dim `dim`."""
        return tensor.index_select(dim, self.positions(tensor.shape[dim], rank, tensor.device))

    def join(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's shard (in rank order) put back in sequence order."""
        whole = torch.cat(shards, dim=dim)
        length = whole.shape[dim]
        order = torch.cat([self.positions(length, r, whole.device) for r in range(self.ranks)])
        return whole.index_select(dim, torch.argsort(order))

    def places(self, first: int, end: int, chunk: int):
        """For each chunk of positions first..end (whole chunks of `chunk`), in order: the rank holding it
        and the slice of that rank's shard it is."""
        for n in range(first // chunk, end // chunk):
            rank, place = self.homes[n]
            yield rank, slice(place * chunk, (place + 1) * chunk)

    def blocks(self, rank: int, local: int, causal: bool) -> list[Block]:
        """The blocks of `rank`'s attention (its shard `local` long). Causal, each query sees its own
        shard's keys causally (one square block: the shard's chunks are in sequence order) and every
        earlier chunk another rank holds whole: the chunks between the rank's own, each range read by the
        queries of every own chunk after it (under head-tail rank r's chunks r and 2cp-1-r see chunks
        0..r-1, and chunk 2cp-1-r also r+1..2cp-2-r). Torch's ring computes the same blocks, a rank's keys
        at a time."""
        if not causal:
            return [Block(0, local, "whole", 0, local * self.ranks, False)]
        chunk = local // self.per_rank
        blocks = [Block(0, local, "local", 0, local, True)]
        after = 0  # the first chunk no earlier block reads
        for place, own in enumerate(self.chunks(rank)):
            if own > after:
                blocks.append(Block(place * chunk, local, "whole", after * chunk, own * chunk, False))
            after = own + 1
        return blocks


class Contiguous(SequenceLayout):
    """`load_balance = none`: rank r holds the r-th contiguous block of the sequence."""

    name = "none"

    @property
    def parts(self) -> int:
        return self.ranks

    def chunks(self, rank: int) -> tuple[int, ...]:
        return (rank,)

    def describe(self) -> str:
        return f"{self.ranks} ranks"


class HeadTail(SequenceLayout):
    """`load_balance = headtail` (the default): rank r holds chunks r and 2 x ranks - 1 - r of 2 x ranks."""

    name = "headtail"

    @property
    def parts(self) -> int:
        return 2 * self.ranks

    def chunks(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.ranks - 1 - rank)

    def describe(self) -> str:
        return f"2 x {self.ranks} ranks, head-tail"


#: The DSL's `load_balance` names -> their layouts.
LAYOUTS: dict[str, type[SequenceLayout]] = {kind.name: kind for kind in (HeadTail, Contiguous)}


def sequence_layout(name: str, ranks: int) -> SequenceLayout:
    """The layout `load_balance = NAME` gives a sequence split over `ranks`."""
    return LAYOUTS[name](ranks)


def along_sequence(values, fn):
    """`fn` applied to every tensor of `values` whose dim 1 is the sequence (as long as dim 1 of the first
    tensor of 2 dims or more), the rest as they are; and that first tensor (None if there is none)."""
    first = next((x for x in values if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
    if first is None:
        return tuple(values), None
    length = first.shape[1]
    mapped = tuple(fn(x) if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == length else x for x in values)
    return mapped, first
