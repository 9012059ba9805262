"""A pipeline schedule's timetable, played out: the order in which each pp rank runs its stages'
forwards and backwards, when each runs given their durations, how many microbatches each stage keeps in
flight, the memory that adds up to, and how long the ranks wait (the bubble). Plain data and arithmetic.

The order is torch's own. The multi-stage schedules (interleaved_1f1b, zero_bubble, zbv, dualpipe_v)
execute their `pipeline_order` tables, which torch builds for any pp size and microbatch count; the
single-stage ones (gpipe, 1f1b) run loops instead (their tables are only for display, and torch 2.13's
1F1B table numbers the last rank's microbatches from 1), so their order is those loops'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from attrs import frozen

from ..frontend import ir
from ..runtime.torchcompat import schedule_order

#: (stage, kind, microbatch); kind F (forward), B (full backward), I (backward for the inputs), W
#: (backward for the weights).
Action = tuple[int, str, int]
#: Bytes by explain's memory categories.
Bytes = dict[str, int]


def timetable(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[list[list[Action]], str]:
    """Each pp rank's compute actions in the order it runs them, and where that order comes from."""
    name, _ = ir.SCHEDULES[schedule]
    m = microbatches
    if schedule == "gpipe":
        order = [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(pp)]
        return order, f"{name}'s loop: every forward, then every backward"
    if schedule == "1f1b":
        order = []
        for r in range(pp):
            warmup = min(m, pp - r)  # Schedule1F1B: `num_stages - stage_index` forwards before the first backward
            actions = [(r, "F", i) for i in range(warmup)]
            for i in range(m):
                actions.append((r, "B", i))
                if warmup + i < m:
                    actions.append((r, "F", warmup + i))
            order.append(actions)
        return order, f"{name}'s loop: min(m, pp - r) forwards, then one backward and one forward"
    return schedule_order(name, pp, m, stages_per_rank), f"torch's {name}.pipeline_order"


def textbook_bubble(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """(pp - 1) / (v m + pp - 1): the idle fraction of a pipeline of equal stages whose backward takes
    twice its forward (v = 1: GPipe and 1F1B; v > 1: interleaved 1F1B)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@frozen
class Played:
    """A timetable run to the end: each action's start and end, and per rank its busy seconds and the
    time its last action ends."""

    start: dict
    end: dict
    busy: tuple[float, ...]
    finish: tuple[float, ...]

    @property
    def span(self) -> float:
        return max(self.finish, default=0.0)

    def bubble(self, rank: int) -> float:
        """The part of the pipeline's span rank `rank` waits."""
        return 1.0 - self.busy[rank] / self.span if self.span else 0.0

    @property
    def overall_bubble(self) -> float:
        """The part of all ranks' time over the span spent waiting."""
        return 1.0 - sum(self.busy) / (self.span * len(self.busy)) if self.span else 0.0


def play(
    order: Sequence[Sequence[Action]],
    rank_of: Sequence[int],
    duration: Callable[[int, str], float],
    transfer: Callable[[int], float] = lambda stage: 0.0,
) -> Played:
    """Run each rank's actions in order, each as soon as its rank is free and its inputs are there: a
    forward needs the previous stage's forward of its microbatch, a backward (B or I) the next stage's
    backward of it (the last stage: its own forward, which computes the loss), W its own I.
    `transfer(s)` is the time an activation (or its gradient) takes between stage s and s + 1 on
    different ranks. ValueError if the order can never finish."""
    last = len(rank_of) - 1
    start: dict = {}
    end: dict = {}
    clock = [0.0] * len(order)
    busy = [0.0] * len(order)
    at = [0] * len(order)

    def ready(action: Action) -> float | None:
        stage, kind, mb = action
        if kind == "F":
            if stage == 0:
                return 0.0
            found = end.get((stage - 1, "F", mb))
            if found is None:
                return None
            return found + (transfer(stage - 1) if rank_of[stage - 1] != rank_of[stage] else 0.0)
        if kind == "W":
            return end.get((stage, "I", mb))
        own = end.get((stage, "F", mb))
        if own is None:
            return None
        if stage == last:
            return own
        found = next((end[k] for k in ((stage + 1, "B", mb), (stage + 1, "I", mb)) if k in end), None)
        if found is None:
            return None
        return max(own, found + (transfer(stage) if rank_of[stage + 1] != rank_of[stage] else 0.0))

    left = sum(len(actions) for actions in order)
    while left:
        moved = False
        for r, actions in enumerate(order):
            while at[r] < len(actions):
                action = actions[at[r]]
                when = ready(action)
                if when is None:
                    break
                begin = max(clock[r], when)
                seconds = duration(action[0], action[1])
                start[action], end[action] = begin, begin + seconds
                clock[r] = begin + seconds
                busy[r] += seconds
                at[r] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [str(actions[at[r]]) for r, actions in enumerate(order) if at[r] < len(actions)]
            raise ValueError(f"the schedule's timetable cannot finish (waiting: {', '.join(stuck)})")
    return Played(start, end, tuple(busy), tuple(clock))


@frozen
class StageCost:
    """One stage's memory, measured one microbatch at a time (bytes by category): `steady`, live
    between microbatches once a backward has run (parameters, optimizer states, gradients being
    accumulated, units kept gathered); `activations`, what a forward adds and its backward frees;
    `kept`, what stays after the backward until the step ends (the last stage's outputs, which torch's
    schedules keep to return them); and the peaks over what is live before each phase: `forward`, the
    backward (`backward`), and the end of the step (`end`: gradient reduction and the optimizer step)."""

    steady: Bytes
    activations: Bytes
    kept: Bytes
    forward: Bytes
    backward: Bytes
    end: Bytes


def _plus(*parts: Bytes, times: int = 1) -> Bytes:
    total: Bytes = {}
    for part in parts:
        for k, n in part.items():
            total[k] = total.get(k, 0) + n * times
    return total


def _minus(a: Bytes, b: Bytes) -> Bytes:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys()}


@frozen
class Walked:
    """One rank's memory over its timetable: the peak, what is live at it by category, and per stage the
    most microbatches in flight at once and how many are at the peak."""

    peak: int
    categories: Bytes
    in_flight: dict[int, int]
    at_peak: dict[int, int]


def walk(actions: Sequence[Action], costs: dict[int, StageCost]) -> Walked:
    """Follow a rank's actions: a forward adds its stage's activations, a full backward (or, split, the
    weight backward W: the graph is kept from I to W) frees them, keeping `kept`; each action's own peak
    comes on top of what is live before it, and the end of the step (each stage's in turn) on what is
    left. Every microbatch is costed as a steady-state one."""
    live = _plus(*(costs[s].steady for s in costs))
    count = dict.fromkeys(costs, 0)
    most = dict.fromkeys(costs, 0)
    best: tuple[int, Bytes, dict[int, int]] = (sum(live.values()), live, dict(count))

    def consider(at: Bytes) -> None:
        nonlocal best
        if sum(at.values()) > best[0]:
            best = (sum(at.values()), at, dict(count))

    for stage, kind, _ in actions:
        cost = costs[stage]
        if kind == "F":
            consider(_plus(live, cost.forward))
            live = _plus(live, cost.activations)
            count[stage] += 1
            most[stage] = max(most[stage], count[stage])
        elif kind in ("B", "I"):
            consider(_plus(live, cost.backward))
            if kind == "B":
                live = _plus(_minus(live, cost.activations), cost.kept)
                count[stage] -= 1
        else:  # W: the graph kept since I goes
            live = _plus(_minus(live, cost.activations), cost.kept)
            count[stage] -= 1
    for stage in costs:
        consider(_plus(live, costs[stage].end))
    return Walked(best[0], best[1], most, best[2])
