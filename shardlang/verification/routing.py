"""The gradients check's routing replay (docs/checks.md, "Mixtures of experts"): the references send each
token to the experts the sharded run sent it to, and a choice rounding cannot explain fails.

A mixture of experts picks each token's experts with torch.topk over its router's scores (Mixtral, OLMoE,
Qwen2-MoE, ERNIE-4.5-MoE, DeepSeek's two-stage group choice, torchtitan's), or with max along a dim
(PhiMoE's sparsemixer, one expert at a time): a choice, replayed alike. Where two experts' scores lie
within rounding of each other, the sharded run (bfloat16, each rank's partial sums rounded) and an unsharded
reference can choose differently, and a token sent to another expert moves whole rows of both experts'
gradients, and the router's, by far more than rounding: on 2 x H200, ERNIE-4.5-MoE's correct plan failed so.
So the check compares like with like: while the sharded model runs forward, each topk's indices are recorded
(each replica's by its ranks), and while a reference runs forward on that replica's inputs, each topk
returns those indices, its values gathered from the reference's own scores (gradients still flow through
the reference's own router). Under context parallelism each rank's router sees its part of the sequence:
the replica's choices are its ranks' joined back in sequence order (Sequence).

Replaying could hide a router that scores wrong, so each forced choice is judged against the truth's own:
where they differ, the truth scores its own choice above the forced one by `gap`. The sharded run's scores
may be K times as far from the truth's as the same-precision reference's are (the check's rule), and a
choice that far off can cost at most 2 k times that: a token whose gap is larger was routed wrong, and the
check fails naming the module that called topk. A topk whose shape differs from the recorded one (a
sequence split over ranks before the router) is not replayed, and the report says how many were not.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from attrs import define, field, frozen
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

TOPK = frozenset({torch.topk, torch.Tensor.topk})
#: max/min along a dim choose one index each (PhiMoE's sparsemixer routes by `scores.max(dim=-1)`).
EXTREMES = {torch.max: True, torch.Tensor.max: True, torch.min: False, torch.Tensor.min: False}


@frozen
class Choice:
    """A discrete choice along `dim` of `scores`: topk's, or max's or min's along a dim (one index each,
    `keepdim` as asked), with `largest` as asked."""

    scores: torch.Tensor
    dim: int
    largest: bool
    keepdim: bool = True

    def indices(self, out) -> torch.Tensor:
        """The call's indices with the choice's dim kept (k of them along it, 1 for max and min)."""
        return out[1] if self.keepdim else out[1].unsqueeze(self.dim)

    def forced(self, func, indices: torch.Tensor):
        """What the call returns choosing `indices` (dim kept): the scores there, and the indices."""
        values = torch.gather(self.scores, self.dim, indices)
        if func in TOPK:
            return torch.return_types.topk((values, indices))
        if not self.keepdim:
            values, indices = values.squeeze(self.dim), indices.squeeze(self.dim)
        kind = torch.return_types.max if EXTREMES[func] else torch.return_types.min
        return kind((values, indices))


def choice(func, args, kwargs) -> Choice | None:
    """The choice a call makes, or None for any other call (max of a whole tensor, or of two)."""
    if func in TOPK:
        scores = args[0] if args else kwargs["input"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        return Choice(scores, dim % scores.dim(), largest)
    if func in EXTREMES:
        scores = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(scores, torch.Tensor) or not isinstance(dim, int) or scores.dim() == 0:
            return None
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return Choice(scores, dim % scores.dim(), EXTREMES[func], bool(keepdim))
    return None


def replayable(plan) -> bool:
    """Whether the sharded run's choices can be paired with the references' call by call: not when ranks hold
    parts of the model (pipelines), nor under torch.compile (a mode over a compiled region changes what it
    compiles). Under context parallelism each rank's choices are its part of the sequence's, joined back
    (Sequence). The same on every rank: the plan decides."""
    return plan.pipeline is None and not plan.compiles


@frozen
class Sequence:
    """How the ranks of one replica split its sequences (context parallelism): the layout (runtime.
    context_layout), this rank's place in it, and the replica's batch size. A router sees its rank's tokens,
    [batch, shard, ...] or, flattened, [batch x shard, ...] (DeepSeek's group choice: [tokens, groups, k]);
    the references see the whole sequence's."""

    layout: object  # runtime.context_layout.SequenceLayout
    rank: int
    batch: int

    def join(self, shards: list) -> torch.Tensor | None:
        """One topk's indices from every rank of the layout (in rank order) in the order of the whole
        sequence; None where they are not its tokens' (a shape neither form above)."""
        if any(s is None for s in shards) or len({tuple(s.shape) for s in shards}) != 1:
            return None
        first = shards[0]
        if first.dim() >= 3 and first.shape[0] == self.batch:
            return self.layout.join(shards, 1)
        if first.dim() >= 1 and first.shape[0] % self.batch == 0:
            rows = [s.reshape(self.batch, -1, *s.shape[1:]) for s in shards]
            return self.layout.join(rows, 1).reshape(-1, *first.shape[1:])
        return None


class Record(TorchFunctionMode):
    """While active, the indices of every choice (topk's, max's or min's along a dim), in call order (None
    for a DTensor's: not replayed)."""

    def __init__(self):
        super().__init__()
        self.choices: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = choice(func, args, kwargs or {})
        if made is not None:
            indices = made.indices(out)
            self.choices.append(None if isinstance(indices, DTensor) else indices.detach().cpu())
        return out


def by_replica(choices: list, replica: int, sequence: Sequence | None = None) -> dict[int, list]:
    """Every replica's recorded choices, from the first rank computing it (ranks of one replica route alike:
    their router's inputs are whole and equal after the reductions); under context parallelism (`sequence`)
    each choice joined from the first rank holding each part of the sequence."""
    place = sequence.rank if sequence is not None else 0
    everyone: list = [(replica, place, choices)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (replica, place, choices))
    found: dict[int, dict[int, list]] = {}
    for r, at, c in everyone:
        found.setdefault(r, {}).setdefault(at, c)
    if sequence is None:
        return {r: parts[0] for r, parts in found.items()}
    return {r: _joined(parts, sequence) for r, parts in found.items()}


def _joined(parts: dict[int, list], sequence: Sequence) -> list:
    """Each topk call's choices joined from the parts of the sequence (None for a call they do not make
    alike: not replayed)."""
    ranks = [parts.get(at, []) for at in range(sequence.layout.ranks)]
    calls = min(len(r) for r in ranks)
    return [sequence.join([r[call] for r in ranks]) for call in range(calls)]


@frozen
class Seen:
    """One replayed topk in one reference: the module that called it, its scores (the topk's input, on the
    CPU), the forced indices and its own, along `dim`, `largest` as asked."""

    module: str
    scores: torch.Tensor
    forced: torch.Tensor
    own: torch.Tensor
    dim: int
    largest: bool


@frozen
class Judged:
    """A step's replayed routing against the truth's own: tokens routed otherwise (`flipped`), those past
    what rounding explains (`wrong`), the worst of those as (module, gap, allowed), and topk calls not
    replayed (`unmatched`)."""

    tokens: int
    flipped: int
    wrong: int
    worst: tuple[str, float, float] | None
    unmatched: int

    def failure(self) -> str:
        module, gap, allowed = self.worst
        return (
            f"{self.wrong} of {self.tokens} token routings (tokens x routers) wrong, worst by {module}: to experts "
            "the unsharded model scores "
            f"lower than its own choice by more than rounding explains (by {gap:.3g}, {gap / allowed:.3g} x the "
            f"allowed {allowed:.3g}): the router's inputs or its scores differ"
        )

    def note(self) -> str:
        """What the report says of a replay that passed ("" if every choice was the truth's own)."""
        parts = []
        if self.flipped:
            parts.append(
                f"{self.flipped} of {self.tokens} token routings (tokens x routers) otherwise than the truth's, "
                "within rounding of a tie, replayed in the references"
            )
        if self.unmatched:
            parts.append(
                f"{self.unmatched} topk calls not replayed (their shape differs from the sharded run's, or, joined "
                "from the parts of a sequence, most of their tokens chose otherwise)"
            )
        return "; ".join(parts)


@define
class Replay:
    """The sharded run's choices by replica, forced on the references' topk calls; what each reference saw."""

    choices: dict[int, list] = field(factory=dict)
    #: The replica whose inputs the references run on next (the check's loop sets it; localise runs this rank's).
    replica: int = 0
    seen: dict[tuple[str, int, int], Seen] = field(factory=dict)
    unmatched: int = 0
    #: The choices were joined from the parts of a sequence (context parallelism: Sequence).
    joined: bool = False

    def start(self, choices: dict[int, list], replica: int, joined: bool = False) -> None:
        self.choices, self.replica, self.seen, self.unmatched, self.joined = choices, replica, {}, 0, joined

    def forced(self, call: int) -> torch.Tensor | None:
        mine = self.choices.get(self.replica, [])
        return mine[call] if call < len(mine) else None

    def judge(self, k_times: float) -> Judged:
        """The truth's replayed choices, each against the truth's own and the same-precision reference's scores."""
        tokens = flipped = wrong = 0
        worst = None
        for (role, replica, call), truth in sorted(self.seen.items()):
            same = self.seen.get(("same", replica, call))
            if role != "truth" or same is None:
                continue
            t, s = _rows(truth.scores, truth.dim, truth.largest), _rows(same.scores, truth.dim, truth.largest)
            forced, own = _rows(truth.forced, truth.dim), _rows(truth.own, truth.dim)
            differs = (forced.sort(-1).values != own.sort(-1).values).any(-1)
            gap = t.gather(-1, own).sum(-1) - t.gather(-1, forced).sum(-1)
            eps = torch.finfo(torch.float32).eps
            allowed = 2 * forced.size(-1) * k_times * ((s - t).abs().amax(-1) + eps * t.abs().amax(-1))
            bad = differs & (gap > allowed)
            tokens, flipped, wrong = tokens + differs.numel(), flipped + int(differs.sum()), wrong + int(bad.sum())
            if bool(bad.any()):
                ratios = torch.where(bad, gap / allowed.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
                at = int(ratios.argmax())
                if worst is None or float(ratios[at]) > worst[1] / worst[2]:
                    worst = (truth.module, float(gap[at]), float(allowed[at]))
        return Judged(tokens, flipped, wrong, worst, self.unmatched)


def _rows(tensor: torch.Tensor, dim: int, largest: bool = True) -> torch.Tensor:
    """`tensor` with the topk's dim last and every other dim flattened into rows (scores as float64, negated
    for a smallest-k choice so that a larger score is always the better)."""
    rows = tensor.movedim(dim, -1).reshape(-1, tensor.size(dim))
    if rows.is_floating_point():
        rows = rows.double() if largest else -rows.double()
    return rows


class Forcing(TorchFunctionMode):
    """While a reference runs forward: each topk returns the recorded indices, its values gathered from the
    reference's own scores; what it saw is kept in the replay under `role`."""

    def __init__(self, replay: Replay, role: str, names: dict[int, str]):
        super().__init__()
        self.replay, self.role, self.names = replay, role, names
        self.calls = 0
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = choice(func, args, kwargs)
        if made is None:
            return out
        call, self.calls = self.calls, self.calls + 1
        forced, own = self.replay.forced(call), made.indices(out)
        if forced is None or tuple(forced.shape) != tuple(own.shape) or self._misjoined(forced, own, made.dim):
            # counted for topk's alone: a max along a dim is as often no routing (a shard's own reduction)
            self.replay.unmatched += self.role == "truth" and func in TOPK
            return out
        forced = forced.to(own.device)
        module = self.stack[-1] if self.stack else ""
        seen = Seen(module, made.scores.detach().cpu(), forced.cpu(), own.detach().cpu(), made.dim, made.largest)
        self.replay.seen[self.role, self.replay.replica, call] = seen
        return made.forced(func, forced)

    def _misjoined(self, forced: torch.Tensor, own: torch.Tensor, dim: int) -> bool:
        """Whether choices joined from the parts of a sequence (Sequence) differ from the reference's own on
        most tokens: rounding flips a few near-ties, so they are not these tokens' choices (the join read a
        layout the model does not have, such as [sequence, batch] rows) and are not replayed. A router
        scoring wrong still fails the gradients it moves."""
        if not self.replay.joined:
            return False
        forced, own = _rows(forced.to(own.device), dim), _rows(own, dim)
        return bool(((forced.sort(-1).values != own.sort(-1).values).any(-1)).double().mean() > 0.5)

    def enter(self, module, args) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def leave(self, module, args, output) -> None:
        if self.stack:
            self.stack.pop()


def replay_under(model: torch.nn.Module, replay: Replay, role: str) -> None:
    """Every call of `model` (its root forward) replays `replay`'s choices for its current replica, as `role`."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    forward = model.forward
    names = {id(m): n for n, m in model.named_modules()}

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not replay.choices:
            return forward(*args, **kwargs)
        mode = Forcing(replay, role, names)
        before, after = register_module_forward_pre_hook(mode.enter), register_module_forward_hook(mode.leave)
        try:
            with mode:
                return forward(*args, **kwargs)
        finally:
            before.remove()
            after.remove()

    model.forward = wrapped
