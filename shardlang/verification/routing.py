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

A router may also compare scores against a threshold (PhiMoE's sparsemixer masks every expert scored
further than a jitter below the best): a mask near its threshold flips with rounding as a choice does. And
a router may draw random numbers in training (the sparsemixer's Gumbel noise, `exponential_`, and its
`rand_like(...) > 0.75` for Heun's method), which the references would draw otherwise (their own place in
the generator's stream; float64's draws differ from bfloat16's even from one state). So the floating
comparisons (`>`, `<`, `>=`, `<=`) and the random draws made by a module that makes a choice are replayed
too, each by its module and its place among that module's replayed calls: a draw is the sharded run's, and
each flipped comparison is judged by the truth's margin (how far its two sides lie apart) against the
same-precision reference's rounding of it.
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
#: Comparisons a router may mask its scores with (PhiMoE's sparsemixer: `(best - scores) / factor > 2 eps`).
COMPARISONS = frozenset(
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in ("gt", "lt", "ge", "le", "greater", "less", "greater_equal", "less_equal")
) | frozenset({torch.Tensor.__gt__, torch.Tensor.__lt__, torch.Tensor.__ge__, torch.Tensor.__le__})


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


#: Random draws a router may make: tensors drawn anew, and tensors filled in place.
DRAWN = frozenset({torch.rand, torch.rand_like, torch.randn, torch.randn_like})
FILLED = frozenset({torch.Tensor.exponential_, torch.Tensor.uniform_, torch.Tensor.normal_})
DRAWS = DRAWN | FILLED


def _sides(func, args, kwargs, out) -> list | None:
    """A floating comparison's two sides, or None for any other call (a comparison of integers is exact:
    nothing to replay; one of DTensors is a shard's)."""
    if func not in COMPARISONS or not isinstance(out, torch.Tensor) or isinstance(out, DTensor) or out.dim() == 0:
        return None
    sides = [*args[:2], *(kwargs[k] for k in ("input", "other") if k in kwargs)][:2]
    if len(sides) != 2 or not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in sides):
        return None
    return None if any(isinstance(x, DTensor) for x in sides) else sides


def margin(sides: list, shape) -> torch.Tensor:
    """A comparison's margin, its left side less its right, in float64 on the CPU (the output's shape)."""
    left, right = (x.detach().double().cpu() if isinstance(x, torch.Tensor) else x for x in sides)
    return torch.broadcast_to(torch.as_tensor(left - right, dtype=torch.float64), tuple(shape))


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
    for a DTensor's: not replayed); and, by (module, place among its comparisons and draws), the floating
    comparisons and the random draws of the modules that make a choice (`routed()`). `model` names the
    modules as the references do."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.choices: list[torch.Tensor | None] = []
        self.stack = Stack({id(m): n for n, m in model.named_modules()} if model is not None else {})
        self.choosers: set[str] = set()
        self.compared: dict[tuple[str, int], torch.Tensor] = {}
        self.drawn: dict[tuple[str, int], torch.Tensor] = {}

    def __enter__(self):
        self.stack.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.stack.__exit__(*exc)

    def routed(self) -> Routed:
        """What the references replay: the choices, and the comparisons and draws of the modules that chose."""
        return Routed(self.choices, self._of_choosers(self.compared), self._of_choosers(self.drawn))

    def _of_choosers(self, made: dict) -> dict:
        return {key: tensor.cpu() for key, tensor in made.items() if key[0] in self.choosers}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = choice(func, args, kwargs)
        if made is not None:
            indices = made.indices(out)
            self.choices.append(None if isinstance(indices, DTensor) else indices.detach().cpu())
            self.choosers.add(self.stack.module)
        elif func in COMPARISONS:
            key = self.stack.place()
            if _sides(func, args, kwargs, out) is not None:
                self.compared[key] = out.detach()
        elif func in DRAWS:
            key = self.stack.place()
            if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
                self.drawn[key] = out.detach().clone()  # a later op may write into it
        return out


class Stack:
    """The module running (innermost; "" outside every module) while active, by global forward hooks, and
    each module's replayed calls (comparisons, draws) counted in call order."""

    def __init__(self, names: dict[int, str]):
        self.names, self.running, self.hooks = names, [], []
        self.counts: dict[str, int] = {}

    @property
    def module(self) -> str:
        return self.running[-1] if self.running else ""

    def place(self) -> tuple[str, int]:
        """The key of a comparison or draw made now: its module, and how many that module made before it."""
        module = self.module
        place = self.counts[module] = self.counts.get(module, -1) + 1
        return module, place

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module, args):
            self.running.append(self.names.get(id(module), type(module).__name__))

        def leave(module, args, output):
            if self.running:
                self.running.pop()

        self.hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


@frozen
class Routed:
    """One replica's recorded routing: its choices in call order, and its routers' comparisons and random
    draws by key (module, place)."""

    choices: list
    masks: dict = field(factory=dict)
    draws: dict = field(factory=dict)


def by_replica(record: Record, replica: int, sequence: Sequence | None = None) -> dict[int, Routed]:
    """Every replica's recorded routing, from the first rank computing it (ranks of one replica route alike:
    their router's inputs are whole and equal after the reductions); under context parallelism (`sequence`)
    each choice and mask joined from the first rank holding each part of the sequence."""
    place = sequence.rank if sequence is not None else 0
    mine = (replica, place, record.routed())
    everyone: list = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    found: dict[int, dict[int, Routed]] = {}
    for r, at, routed in everyone:
        found.setdefault(r, {}).setdefault(at, routed)
    if sequence is None:
        return {r: parts[0] for r, parts in found.items()}
    return {r: _joined(parts, sequence) for r, parts in found.items()}


def _joined(parts: dict[int, Routed], sequence: Sequence) -> Routed:
    """Each choice and mask joined from the parts of the sequence (None for a call they do not make alike:
    not replayed)."""
    ranks = [parts.get(at, Routed([])) for at in range(sequence.layout.ranks)]
    calls = min(len(r.choices) for r in ranks)
    choices = [sequence.join([r.choices[call] for r in ranks]) for call in range(calls)]
    return Routed(
        choices, _joined_by_key([r.masks for r in ranks], sequence), _joined_by_key([r.draws for r in ranks], sequence)
    )


def _joined_by_key(parts: list[dict], sequence: Sequence) -> dict:
    """The tensors every part holds under one key (a router's comparison or draw), joined by key."""
    keys = set.intersection(*(set(part) for part in parts))
    return {key: sequence.join([part[key] for part in parts]) for key in keys}


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
            "the unsharded model scores lower than its own choice, or past a threshold it compares them with "
            f"otherwise, by more than rounding explains (by {gap:.3g}, {gap / allowed:.3g} x the "
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
    """The sharded run's routing by replica, forced on the references' choices and their routers'
    comparisons; what each reference saw."""

    choices: dict[int, Routed] = field(factory=dict)
    #: The replica whose inputs the references run on next (the check's loop sets it; localise runs this rank's).
    replica: int = 0
    seen: dict[tuple[str, int, int], Seen] = field(factory=dict)
    #: The replayed comparisons, by (role, replica, (module, place)): each a Seen of margins and masks.
    seen_masks: dict[tuple[str, int, tuple[str, int]], Seen] = field(factory=dict)
    unmatched: int = 0
    #: The choices were joined from the parts of a sequence (context parallelism: Sequence).
    joined: bool = False

    def start(self, choices: dict[int, Routed], replica: int, joined: bool = False) -> None:
        self.choices, self.replica, self.joined = choices, replica, joined
        self.seen, self.seen_masks, self.unmatched = {}, {}, 0

    def forced(self, call: int) -> torch.Tensor | None:
        mine = self.choices.get(self.replica, Routed([])).choices
        return mine[call] if call < len(mine) else None

    def mask(self, key: tuple[str, int]) -> torch.Tensor | None:
        return self.choices.get(self.replica, Routed([])).masks.get(key)

    def draw(self, key: tuple[str, int]) -> torch.Tensor | None:
        return self.choices.get(self.replica, Routed([])).draws.get(key)

    def judge(self, k_times: float) -> Judged:
        """The truth's replayed choices, each against the truth's own and the same-precision reference's
        scores; its replayed comparisons, each flipped one against the same reference's rounding of its
        margin."""
        tokens = flipped = wrong = 0
        worst = None
        for seen, judge in ((self.seen, _judge_choice), (self.seen_masks, _judge_mask)):
            for (role, replica, call), truth in seen.items():
                same = seen.get(("same", replica, call))
                if role != "truth" or same is None:
                    continue
                differs, gap, allowed = judge(truth, same, k_times)
                bad = differs & (gap > allowed)
                tokens, flipped, wrong = tokens + differs.numel(), flipped + int(differs.sum()), wrong + int(bad.sum())
                if bool(bad.any()):
                    ratios = torch.where(bad, gap / allowed.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
                    at = int(ratios.argmax())
                    if worst is None or float(ratios[at]) > worst[1] / worst[2]:
                        worst = (truth.module, float(gap[at]), float(allowed[at]))
        return Judged(tokens, flipped, wrong, worst, self.unmatched)


EPS = torch.finfo(torch.float32).eps


def _judge_choice(truth: Seen, same: Seen, k_times: float):
    """Per token: whether the forced choice differs from the truth's own, by how much the truth scores its
    own above it, and how much rounding allows (2 k times K times the same reference's error)."""
    t, s = _rows(truth.scores, truth.dim, truth.largest), _rows(same.scores, truth.dim, truth.largest)
    forced, own = _rows(truth.forced, truth.dim), _rows(truth.own, truth.dim)
    differs = (forced.sort(-1).values != own.sort(-1).values).any(-1)
    gap = t.gather(-1, own).sum(-1) - t.gather(-1, forced).sum(-1)
    allowed = 2 * forced.size(-1) * k_times * ((s - t).abs().amax(-1) + EPS * t.abs().amax(-1))
    return differs, gap, allowed


def _judge_mask(truth: Seen, same: Seen, k_times: float):
    """Per row (a token's comparisons, along the last dim): whether a forced comparison differs from the
    truth's own, the largest truth's margin among those that differ, and how much rounding allows (2 K times
    the same reference's largest error of a margin in the row)."""
    t, s = _rows(truth.scores, -1), _rows(same.scores, -1)
    forced, own = _rows(truth.forced, -1), _rows(truth.own, -1)
    flips = forced != own
    error = (s - t).abs()
    error = torch.where(torch.isfinite(error), error, 0.0)
    finite = torch.where(torch.isfinite(t), t.abs(), 0.0)
    gap = torch.where(flips, t.abs(), 0.0).amax(-1)
    return flips.any(-1), gap, 2 * k_times * (error.amax(-1) + EPS * finite.amax(-1))


def _rows(tensor: torch.Tensor, dim: int, largest: bool = True) -> torch.Tensor:
    """`tensor` with the topk's dim last and every other dim flattened into rows (scores as float64, negated
    for a smallest-k choice so that a larger score is always the better)."""
    rows = tensor.movedim(dim, -1).reshape(-1, tensor.size(dim))
    if rows.is_floating_point():
        rows = rows.double() if largest else -rows.double()
    return rows


class Forcing(TorchFunctionMode):
    """While a reference runs forward: each topk returns the recorded indices, its values gathered from the
    reference's own scores, and each recorded comparison of a router returns the recorded mask; what it saw
    is kept in the replay under `role`. `stack` tells the module running."""

    def __init__(self, replay: Replay, role: str, stack: Stack):
        super().__init__()
        self.replay, self.role, self.stack = replay, role, stack
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in COMPARISONS:
            return self._compared(func, args, kwargs, out)
        if func in DRAWS:
            return self._drawn(func, out)
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
        module = self.stack.module
        seen = Seen(module, made.scores.detach().cpu(), forced.cpu(), own.detach().cpu(), made.dim, made.largest)
        self.replay.seen[self.role, self.replay.replica, call] = seen
        return made.forced(func, forced)

    def _drawn(self, func, out):
        """A random draw: the sharded run's where its router made this one (filled in place as asked), else
        the reference's own."""
        forced = self.replay.draw(self.stack.place())
        if forced is None or not isinstance(out, torch.Tensor) or tuple(forced.shape) != tuple(out.shape):
            return out
        forced = forced.to(device=out.device, dtype=out.dtype)
        if func in FILLED:
            with torch.no_grad():
                return out.copy_(forced)
        return forced.requires_grad_(out.requires_grad)

    def _compared(self, func, args, kwargs, out):
        """A comparison: the recorded mask where the sharded run's router made this one, else its own."""
        key = self.stack.place()
        forced, sides = self.replay.mask(key), _sides(func, args, kwargs, out)
        if forced is None or sides is None or tuple(forced.shape) != tuple(out.shape):
            return out
        own = out.detach().cpu()
        if self.replay.joined and (forced != own).any(-1).double().mean() > 0.5:  # as _misjoined, for masks
            return out
        seen = Seen(key[0], margin(sides, out.shape), forced.cpu(), own, -1, True)
        self.replay.seen_masks[self.role, self.replay.replica, key] = seen
        return forced.to(out.device)

    def _misjoined(self, forced: torch.Tensor, own: torch.Tensor, dim: int) -> bool:
        """Whether choices joined from the parts of a sequence (Sequence) differ from the reference's own on
        most tokens: rounding flips a few near-ties, so they are not these tokens' choices (the join read a
        layout the model does not have, such as [sequence, batch] rows) and are not replayed. A router
        scoring wrong still fails the gradients it moves."""
        if not self.replay.joined:
            return False
        forced, own = _rows(forced.to(own.device), dim), _rows(own, dim)
        return bool(((forced.sort(-1).values != own.sort(-1).values).any(-1)).double().mean() > 0.5)


def replay_under(model: torch.nn.Module, replay: Replay, role: str) -> None:
    """Every call of `model` (its root forward) replays `replay`'s choices for its current replica, as `role`."""
    forward = model.forward
    names = {id(m): n for n, m in model.named_modules()}

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not replay.choices:
            return forward(*args, **kwargs)
        with Stack(names) as stack, Forcing(replay, role, stack):
            return forward(*args, **kwargs)

    model.forward = wrapped
