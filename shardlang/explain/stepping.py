"""One training step of an applied plan, recorded on fake tensors: its collectives, its peak memory and its
ops' costs, at any batch; on a model with a long stack of identical blocks, stepped on a few of them and
extrapolated exactly (`Stepper`), and the largest batch that fits a memory limit (`Stepper.fit`).
"""

from __future__ import annotations

import math
from collections import Counter

import attrs
import torch.nn as nn

from ..frontend import ir
from ..runtime.apply import SIMULATED, apply_plan
from ..runtime.context_layout import sequence_layout
from ..runtime.modelfile import ModelFile
from .fakestep import (
    Collective,
    Peak,
    by_key,
    copy_model,
    count_tokens,
    group_names,
    idle_conversions,
    positions_as_on_real_tensors,
    quiet,
    recording_fake_mode,
    warm_adamw,
)
from .timing import Fit, Tally

#: Activations by module: how many of the largest the report keeps.
TOP_MODULES = 10

#: The depths a repeated stack of blocks is cut to for the step: the first and the last block of a
#: stack can differ from the middle ones (FSDP's root unit, the last unit's reshard), so each of 2, 3
#: and 4 blocks has both ends, and 3 - 2 and 4 - 3 are two separate measurements of a middle block.
STEP_DEPTHS = (2, 3, 4)
#: A stack shorter than this runs whole: cutting it would save little.
EXTRAPOLATE_FROM = 8


@attrs.define
class _Measure:
    """One simulated step: its collectives ((op, mesh dim) -> (count, bytes)), its peak and what was
    live at it (by category, and activations by module), and its ops' costs."""

    calls: dict
    peak: int
    categories: dict
    modules: dict
    tally: Counter
    batch: int
    tokens: int
    replicas: int
    host: int = 0  # bytes in host memory at its most (offloading units), and by category
    host_categories: dict = attrs.Factory(dict)
    #: Compiled modules (and the loss) the step ran eager instead of as compiled, and why.
    eager: dict = attrs.Factory(dict)
    #: Each phase's peak, what was live at it by category, and the activations by module (explain.phases).
    phases: dict = attrs.Factory(dict)


class Stepper:
    """One training step on fake tensors, at any batch, on the whole model or extrapolated exactly.

    A step on fake tensors costs ~70 us per op in torch's FakeTensorMode (more with the memory
    trackers), so an 80-layer model takes seconds. When the model's largest stack of blocks (a
    ModuleList, ModuleDict or Sequential) holds identical blocks that the plan treats identically, the
    step runs on copies cut to 2, 3 and 4 blocks instead; if the 3rd and the 4th block each add exactly
    the same collectives (count and bytes per op and mesh dim), the same peak bytes in every category,
    the same ops' costs, and the 4-block step's middle blocks hold the same activations at its peak,
    every middle block does, and the step of N blocks is the 2-block step plus N - 2 times that. Any
    difference, any failure, or `full_step`: the whole model runs.
    """

    def __init__(self, plan: ir.Plan, model: nn.Module, applied, model_file: ModelFile, full_step: bool):
        self.plan, self.model, self.applied, self.model_file = plan, model, applied, model_file
        # DTensor's caches hand back the meshes of an earlier apply where a later one's are equal, so a
        # step may run on any of them: groups are named from every apply in this world.
        self.groups = group_names(applied)
        self.stack = None if full_step else repeated_stack(model, applied.linted.resolution)
        self._cuts: dict[int, object] = {}

    def _step(self, applied, batch: int | None, sequence: int | None, depth: int | None = None) -> _Measure:
        self.groups.update(group_names(applied))
        blocks = None if self.stack is None or depth is None else (self.stack[0], self.stack[1][:depth])
        return _training_step(self.plan, applied, self.model_file, self.groups, batch, sequence, blocks)

    def _cut(self, depth: int):
        if depth not in self._cuts:
            path, keys = self.stack
            self._cuts[depth] = apply_plan(self.plan, cut_stack(self.model, path, keys[:depth]), mode=SIMULATED)
        return self._cuts[depth]

    def measure(self, batch: int | None, sequence: int | None = None) -> tuple[_Measure, str | None]:
        """The step at `batch` per replica (default: the checks'), its inputs' sequences cut or repeated
        to `sequence` tokens where given."""
        if self.stack is not None:
            path, keys = self.stack
            steps: dict[int, _Measure] = {}
            whole = None
            try:
                for depth in STEP_DEPTHS:
                    steps[depth] = self._step(self._cut(depth), batch, sequence, depth)
                whole = _extrapolate(steps, STEP_DEPTHS[0], path, keys)
                if whole is None and len(keys) > STEP_DEPTHS[-1] + 1:
                    # The smallest cut may peak at another moment of the step than longer ones do (a
                    # unit gathered at its peak, say): one block more, and the three longest decide.
                    depth = STEP_DEPTHS[-1] + 1
                    steps[depth] = self._step(self._cut(depth), batch, sequence, depth)
                    whole = _extrapolate(steps, STEP_DEPTHS[1], path, keys)
            except Exception:  # noqa: BLE001 - a model that cannot run cut short runs whole
                whole = None
            if whole is not None:
                *fewer, most = map(str, sorted(steps))
                n = len(keys)
                note = (
                    f"the step was simulated on {', '.join(fewer)} and {most} of the {n} blocks of `{path}`: each block past "
                    f"the {'second' if len(steps) == 3 else 'third'} added the same collectives, memory and ops, so they are "
                    f"extrapolated to all {n} (--full-step simulates every block)"
                )
                return whole, note
            self.stack = None  # not linear here: no other batch will be either
        return self._step(self.applied, batch, sequence), None

    def run(self, batch: int | None):
        from .compiled import notes as compile_notes

        measured, note = self.measure(batch)
        notes = ((note,) if note else ()) + compile_notes(self.plan, measured.eager)
        return _collectives(measured.calls), notes, _peak(measured), _tally(measured.tally)

    def fit(self, limit: int, first: Peak) -> Fit:
        """The largest batch whose peak is at most `limit` (`largest_fitting`); under context parallelism,
        the longest sequence at the first step's batch instead, in steps of what splits over the cp ranks
        (the layout's chunks: 2 x cp head-tail, cp plainly), which is what context parallelism is for."""
        cp = self.plan.context_parallel
        if cp is None:
            tried = {first.batch: first.bytes}
            batch = largest_fitting(limit, tried, lambda b: self.measure(b)[0].peak)
            return Fit(limit, batch, tried[batch] if batch else tried[1], tuple(sorted(tried.items())))
        step = sequence_layout(cp.load_balance, self.applied.mesh(cp.mesh).size()).parts
        length = first.tokens // first.batch
        tried = {length // step: first.bytes}
        chunks = largest_fitting(limit, tried, lambda n: self.measure(first.batch, n * step)[0].peak)
        found = tuple(sorted((n * step, peak) for n, peak in tried.items()))
        return Fit(limit, first.batch, tried[chunks] if chunks else tried[1], found, chunks * step)


#: The largest batch (or count of sequence chunks) --fit tries: a fake-tensor step of 2^24 sequences still
#: simulates in a moment, and a plan that fits more than that per replica is not limited by memory.
FIT_CAP = 1 << 24


def largest_fitting(limit: int, tried: dict[int, int], peak_at) -> int:
    """The largest n in 1..FIT_CAP whose peak (`peak_at(n)`, noted in `tried`, which holds a first point)
    is at most `limit`, 0 if not even 1 fits, by a bracketed search: the peak grows with n (about
    linearly), so each guess is where the line through the two nearest known points meets the limit, and
    its neighbour is simulated too; a guess that does not close the bracket is followed by a bisection
    step. It ends with n fitting and n + 1 not, both simulated, or with n = FIT_CAP fitting (the caller
    says the search stopped there)."""

    def peak(n: int) -> int:
        if n not in tried:
            tried[n] = peak_at(n)
        return tried[n]

    if peak(1) > limit:
        return 0
    bisect = False
    while True:
        low = max(n for n, bytes_ in tried.items() if bytes_ <= limit and n <= FIT_CAP)
        high = min((n for n, bytes_ in tried.items() if bytes_ > limit and n > low), default=None)
        if high is not None and high - low <= 1 or high is None and low == FIT_CAP:
            return low
        if high is not None and bisect:
            peak((low + high) // 2)
            bisect = False
            continue
        guess = _guess(limit, tried, low, high)
        guess = min(max(guess, low + 1), FIT_CAP if high is None else high - 1)
        neighbour = guess + 1 if peak(guess) <= limit else guess - 1
        if neighbour <= FIT_CAP:
            peak(neighbour)
        bisect = high is not None


def _guess(limit: int, tried: dict[int, int], low: int, high: int | None) -> int:
    """Where the line through `low` (the largest n known to fit) and its nearest known neighbour (`high`,
    or the next largest that fits while nothing is known not to) meets `limit`; twice `low` (or the middle
    of the bracket) where the peak did not grow between them."""
    below = [n for n in tried if n < low and tried[n] <= limit]
    near = high if high is not None else (max(below) if below else None)
    if near is None or tried[near] == tried[low]:
        return low * 2 if high is None else (low + high) // 2
    slope = (tried[near] - tried[low]) / (near - low)
    if slope <= 0:
        return low * 2 if high is None else (low + high) // 2
    return low + math.floor((limit - tried[low]) / slope)


def _peak(m: _Measure) -> Peak:
    modules = sorted(
        ((name or "(top level)", n) for name, n in m.modules.items() if n),
        key=lambda x: (-x[1], [int(p) if p.isdigit() else p for p in x[0].split(".")]),
    )
    host = tuple(m.host_categories.items()) if m.host else ()
    phases = tuple((name, n, categories.get("gradients", 0)) for name, (n, categories, _) in m.phases.items())
    return Peak(
        m.peak,
        tuple(m.categories.items()),
        tuple(modules[:TOP_MODULES]),
        m.batch,
        m.tokens,
        m.replicas,
        m.host,
        host,
        phases,
    )


def _tally(tally: Counter) -> Tally:
    return tuple(sorted(tally.items()))


def _extrapolate(steps: dict[int, _Measure], k: int, path: str, keys: list[str]) -> _Measure | None:
    """The step of all len(keys) blocks from those of k, k + 1 and k + 2 blocks (`Stepper`), or None if
    they do not grow by exactly the same amounts."""
    first, second, third = steps[k], steps[k + 1], steps[k + 2]
    more = len(keys) - k
    block = _minus(second.calls, first.calls)
    if block is None or block != _minus(third.calls, second.calls):
        return None
    calls = {}
    zero = (0, 0)
    for key in first.calls.keys() | block.keys():
        (count, nbytes), (extra, extra_bytes) = first.calls.get(key, zero), block.get(key, zero)
        calls[key] = (count + more * extra, nbytes + more * extra_bytes)
    if second.host - first.host != third.host - second.host:
        return None
    phases = _phases_extrapolated(first, second, third, more)
    host_categories = _linear(first.host_categories, second.host_categories, third.host_categories, more)
    if phases is None or host_categories is None:
        return None
    # The highest moment of all the blocks, which need not be the highest of a few (explain.phases).
    phase = max(phases, key=lambda name: phases[name][0])
    peak, categories = phases[phase]
    tally_block = _grown(third.tally, second.tally)
    if tally_block is None or tally_block != _grown(second.tally, first.tally):
        return None
    tally = Counter(first.tally)
    for key, count in tally_block.items():
        tally[key] += more * count
    shorter, longest = second.phases[phase], third.phases[phase]
    modules = _modules_extrapolated(shorter[2], longest[2], k + 2, path, keys, categories, longest[1])
    if modules is None:
        return None
    host = first.host + more * (second.host - first.host)
    eager = {k: v for step in (first, second, third) for k, v in step.eager.items()}
    whole = {name: (n, grown, {}) for name, (n, grown) in phases.items()}
    return _Measure(
        calls,
        peak,
        categories,
        modules,
        tally,
        first.batch,
        first.tokens,
        first.replicas,
        host,
        host_categories,
        eager,
        whole,
    )


def _phases_extrapolated(first: _Measure, second: _Measure, third: _Measure, more: int) -> dict | None:
    """Each phase's peak and categories at all the blocks (`more` past the first step's), each from the
    three steps' growth, which must be the same twice (the middle blocks' phase, which a step of two blocks
    has not, from the two longer steps'). A phase that grows unevenly (FSDP's prefetch at a block's edge
    with offloading, say) is left out if, grown by its larger growth each block, it stays below the
    highest of the rest. None where it may not, or the phases do not account for each step's peak."""
    for step in (first, second, third):
        if max((peak for peak, _, _ in step.phases.values()), default=None) != step.peak:
            return None
    if not first.phases.keys() <= second.phases.keys() == third.phases.keys():
        return None
    whole, bounds = {}, []
    for name, (peak, categories, _) in third.phases.items():
        shorter = second.phases[name]
        if name not in first.phases:  # two points: the third step has more - 2 blocks fewer than all
            grown = {key: n + (more - 2) * (n - shorter[1][key]) for key, n in categories.items()}
            whole[name] = (peak + (more - 2) * (peak - shorter[0]), grown)
            continue
        shortest = first.phases[name]
        grown = _linear(shortest[1], shorter[1], categories, more)
        if shorter[0] - shortest[0] == peak - shorter[0] and grown is not None:
            whole[name] = (shortest[0] + more * (shorter[0] - shortest[0]), grown)
        else:
            bounds.append(peak + (more - 2) * max(shorter[0] - shortest[0], peak - shorter[0]))
    if not whole or max(bounds, default=0) >= max(peak for peak, _ in whole.values()):
        return None
    return whole


def _linear(one: dict, two: dict, three: dict, more: int) -> dict | None:
    """`one` grown `more` times by what each of `two` and `three` adds to the one before, if the same."""
    whole = {}
    for key in one:
        step = two[key] - one[key]
        if three[key] - two[key] != step:
            return None
        whole[key] = one[key] + more * step
    return whole


def _grown(more: Counter, fewer: Counter) -> Counter | None:
    if any(more[k] < count for k, count in fewer.items()):
        return None
    return Counter({k: count - fewer[k] for k, count in more.items() if count != fewer[k]})


def _modules_extrapolated(
    shorter: dict, longest: dict, depth: int, path: str, keys: list[str], whole: dict, at_longest: dict
):
    """Activations by module at the peak of all the blocks, from the `depth`-block step's: its first
    block and its last ones that differ from the middle as they are, each middle block as its 2nd (all
    its middle blocks must be equal), the rest as the step one block shorter had it. None unless that
    adds up to the extrapolated activations."""
    prefix = f"{path}." if path else ""

    def split(modules: dict, count: int) -> tuple[list[dict], dict]:
        blocks: list[dict] = [{} for _ in range(count)]
        outside = {}
        for name, n in modules.items():
            for i, key in enumerate(keys[:count]):
                head = f"{prefix}{key}"
                if name == head or name.startswith(head + "."):
                    blocks[i][name[len(head) :]] = n
                    break
            else:
                outside[name] = n
        return blocks, outside

    blocks, outside = split(longest, depth)
    # The last blocks may differ from the middle ones (at a peak in backward: the last freed, the one
    # before half-way); the middle blocks, 1 to depth - 1 - tail, must be equal.
    tail = 1
    while tail < depth - 2 and blocks[depth - 1 - tail] != blocks[1]:
        tail += 1
    if any(b != blocks[1] for b in blocks[1 : depth - tail]) or outside != split(shorter, depth - 1)[1]:
        return None
    n = len(keys)
    modules = dict(outside)
    for i, key in enumerate(keys):
        source = blocks[0] if i == 0 else blocks[depth - (n - i)] if i >= n - tail else blocks[1]
        for rest, count in source.items():
            modules[f"{prefix}{key}{rest}"] = count
    # The middle blocks' activations must be what the extrapolated step adds over the longest cut.
    if sum(modules.values()) - sum(longest.values()) != whole["activations"] - at_longest["activations"]:
        return None
    return modules


def repeated_stack(model: nn.Module, resolution) -> tuple[str, list[str]] | None:
    """The container of the most identical blocks, if it is long enough to be worth cutting:
    its path and its child names. Identical: same module types, parameter and buffer shapes and
    dtypes, and the same plan statements (styles, units and their options, checkpointing) on the
    same relative paths; no tensor shared between blocks."""
    best = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        keys = list(container._modules)
        blocks = [container._modules[k] for k in keys]
        if len(keys) < EXTRAPOLATE_FROM or None in blocks or len({id(b) for b in blocks}) < len(blocks):
            continue
        if best is not None and len(keys) <= len(best[1]):
            continue
        prefix = f"{path}." if path else ""
        signatures = {_signature(block, f"{prefix}{key}", resolution) for key, block in zip(keys, blocks)}
        tensors = [id(t) for b in blocks for t in (*b.parameters(), *b.buffers())]
        if len(signatures) == 1 and len(set(tensors)) == len(tensors):
            best = (path, keys)
    return best


def _signature(block: nn.Module, fqn: str, resolution) -> tuple:
    """What makes a block what it is, by paths relative to it: a hashable summary."""

    def inside(name: str) -> str | None:
        return name[len(fqn) :] if name == fqn or name.startswith(fqn + ".") else None

    structure = tuple((name, type(m)) for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in (*block.named_parameters(), *block.named_buffers()))
    rules = tuple(
        (r.block, inside(r.scope) if inside(r.scope) is not None else ("outside", r.scope), inside(r.fqn), r.rule)
        for r in resolution.rules
        if inside(r.fqn) is not None
    )
    units = tuple(
        (u.block, tuple(map(inside, u.fqns)), u.unit)
        for u in resolution.units
        if any(inside(f) is not None for f in u.fqns)
    )
    checkpoint = tuple(inside(f) for f in resolution.checkpoint if inside(f) is not None)
    return structure, tensors, rules, units, checkpoint


def cut_stack(model: nn.Module, path: str, keep: list[str]) -> nn.Module:
    """A copy of `model` whose container at `path` holds only the children `keep`."""
    container = model.get_submodule(path)
    children = container._modules
    container._modules = {k: children[k] for k in keep}
    try:
        return copy_model(model)
    finally:
        container._modules = children


def _minus(more: dict, fewer: dict) -> dict | None:
    """What `more` has beyond `fewer`, per key; None if it has less of anything."""
    difference = {}
    for key in more.keys() | fewer.keys():
        (c1, b1), (c0, b0) = more.get(key, (0, 0)), fewer.get(key, (0, 0))
        if c1 < c0 or b1 < b0:
            return None
        if (c1, b1) != (c0, b0):
            difference[key] = (c1 - c0, b1 - b0)
    return difference


def _collectives(tally: dict[tuple[str, str], tuple[int, int]]) -> tuple[Collective, ...]:
    return tuple(Collective(op, dim, n, b) for (op, dim), (n, b) in sorted(tally.items()))


def _resized(inputs: tuple, length: int) -> tuple:
    """The inputs with every tensor whose dim 1 is as long as the first's (the sequence) cut, or repeated,
    to `length` (the step needs their shapes, not their values)."""
    from ..runtime.context import along_sequence

    def resized(x):
        sequence = x.shape[1]
        return x.repeat_interleave(-(-length // sequence), dim=1)[:, :length] if length > sequence else x[:, :length]

    return along_sequence(inputs, resized)[0]


def _training_step(
    plan: ir.Plan,
    applied,
    model_file: ModelFile,
    groups: dict[str, str],
    batch: int | None,
    sequence: int | None,
    blocks: tuple[str, list[str]] | None = None,
) -> _Measure:
    """One forward, loss, backward and AdamW step on fake tensors, under torch's memory trackers
    (`memory`): the collectives of the forward, loss and backward, each group named as `groups` names
    it (process group name -> `mesh.dim`), the peak memory, and the ops' costs. The inputs and loss
    are those of the checks (SPEC §7); `batch` per data-parallel replica (default: twice the TP size)."""
    from ..verification import Context
    from ..verification.comms import Calls
    from ..verification.step import Step
    from . import compiled
    from .fusednorm import cuda_like_rms_norm
    from .memory import tracker

    recorder = Calls()
    ctx = Context(plan, applied, model_file)
    # The step as the checks run it, but its loss taken as a training loop takes it (on each rank's shard
    # of the sequence under context_parallel(output = local)), and the compiler modelled, not run.
    step = Step.of(ctx, loss_on_shards=True)
    # A step that fails is reported in a note; fake tensors' own error log would repeat it at length.
    with quiet("torch._subclasses.fake_tensor"), recording_fake_mode(recorder):
        model = applied.model
        model.to_empty(device="cpu")
        where = step.where
        batch = batch if batch is not None else 2 * max(where.tp_size, 1)
        full = step.batch(size=batch)
        full = full if sequence is None else _resized(full, sequence)
        inputs = step.share(full)
        optimizer = warm_adamw(model)
        memory = tracker(model, optimizer, blocks)
        memory.track_inputs(inputs)
        recorder.calls.clear()
        modelled = compiled.Modelled(memory, plan)
        step.compile_with = modelled.loss
        modules = compiled.compiled_modules(model, applied.linted.resolution.compiled, modelled)
        with memory, cuda_like_rms_norm(), modules, idle_conversions(), positions_as_on_real_tensors():
            output = step.forward(model, full)
            with recorder.paused():
                whole = step.whole(output)
            step.backward(step.loss(whole, full))
            del output, whole
            with recorder.paused():
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        del optimizer
    peak, categories = memory.peak()
    host, host_categories = memory.host_peak()
    tokens = count_tokens(full, batch)
    calls = by_key(recorder.calls, groups)
    return _Measure(
        calls,
        peak,
        categories,
        memory.peak_by_module,
        memory.costs,
        batch,
        tokens,
        where.replicas,
        host,
        host_categories,
        dict(modelled.eager),
        memory.phase_peaks(),
    )
