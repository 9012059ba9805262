"""Pre-flight at any scale: what every rank of a world will hold and send, worked out in one CPU process.

The plan is applied to the model on the meta device in a simulated world (torch's fake process group,
standing for rank R of N), so the placements and rank R's local shapes are torch's own; every other
rank's share follows from the same placements (torchcompat.local_shape_and_offset, torch's sharding
arithmetic). One training step then runs on fake tensors under the fake process group to record each
collective, its mesh dim and its size. Nothing is allocated: an 80-layer, 8192-wide model explains at
1024 ranks in a few hundred MiB.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter, defaultdict

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from attrs import frozen

from ..compiler.lint import lint
from ..compiler.predict import enclosing, units_by_module
from ..frontend import ir
from ..frontend.diagnostics import PlanError
from ..runtime.apply import SIMULATED, apply_plan
from ..runtime.modelfile import ModelFile
from ..runtime.simulated import placed_as, simulated_world
from ..runtime.torchcompat import local_shape_and_offset
from .fakestep import Collective, Peak, by_key, count_tokens, group_names, quiet, recording_fake_mode, warm_adamw
from .pipelined import PipelineReport, pipeline_report, pp_coordinates, pp_size
from .timing import Fit, Hardware, StepTime, Tally, step_time

#: Activations by module: how many of the largest the report keeps.
TOP_MODULES = 10

#: Bytes per element of the optimizer states AdamW keeps for each parameter element (two fp32 states).
ADAMW_STATE_BYTES = 8


@frozen
class TensorInfo:
    """One parameter or buffer: its global shape and dtype, its layout, and rank R's share of it."""

    name: str
    kind: str  # "parameter" | "buffer"
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...]  # mesh dims of its DTensor; () for a plain tensor
    placements: tuple[str, ...]
    local_shape: tuple[int, ...]
    local_bytes: int
    unit: str | None  # the fully_shard unit that gathers it, if any
    #: For tensors picked with `blocks_for`: each distinct block as (offset, shape, ranks holding it).
    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def layout(self) -> str:
        if not self.dims:
            return "plain"
        return " ".join(f"{d}:{p}" for d, p in zip(self.dims, self.placements))


@frozen
class RankBytes:
    """What one rank holds for training: parameters, gradients, AdamW's states, and the largest
    fully_shard unit while it is gathered (unsharded, in the dtype it computes in)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    gathered: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered


@frozen
class Explanation:
    plan: str
    world_size: int
    rank: int
    meshes: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    tensors: tuple[TensorInfo, ...]
    ranks: tuple[RankBytes, ...]
    collectives: tuple[Collective, ...]
    notes: tuple[str, ...] = ()
    peak: Peak | None = None
    time: StepTime | None = None
    fit: Fit | None = None
    #: A pipelined plan's stages and pp ranks (None without a pipeline); `peak`, `time` and
    #: `collectives` are then rank R's over the whole pipelined step.
    pipeline: PipelineReport | None = None

    @property
    def this_rank(self) -> RankBytes:
        return self.ranks[self.rank]

    @property
    def largest(self) -> RankBytes:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def smallest(self) -> RankBytes:
        return min(self.ranks, key=lambda r: (r.total, r.rank))

    @property
    def spread(self) -> int:
        return self.largest.total - self.smallest.total


# --- the simulated world ---------------------------------------------------------------------


def on_cpu(plan: ir.Plan) -> ir.Plan:
    """The plan with every mesh on the CPU: a simulation needs no GPU and places tensors alike."""
    return attrs.evolve(plan, meshes=tuple(attrs.evolve(m, device="cpu") for m in plan.meshes))


def named_mesh_dims(plan: ir.Plan, world_size: int) -> tuple:
    """Each mesh of `plan` as (name, ((dim, size), ...)) at `world_size`: what reports and the step's timing name."""
    return tuple((m.name, tuple(zip(m.dim_names, m.shape(world_size)))) for m in plan.meshes)


#: Whether this process has simulated a world: torch's DTensor caches keep that world's meshes, so a
#: second simulation runs in a fresh process.
_simulated_before = False


def explain(
    plan: ir.Plan,
    model: nn.Module,
    world_size: int,
    rank: int = 0,
    model_file: ModelFile | None = None,
    blocks_for: str | None = None,
    step: bool = True,
    full_step: bool = False,
    batch: int | None = None,
    hardware: Hardware | None = None,
    fit: int | None = None,
) -> Explanation:
    """What `plan` gives every rank of a `world_size` world, seen from `rank`. `model` should be on the
    meta device (it is copied, not changed). With a model file's `example_input`, also one training
    step (unless `step` is False): its collectives, its peak memory with `batch` (per data-parallel
    replica; default twice the TP size) and, on `hardware` (default an H100), its estimated time; with
    `full_step`, never extrapolated from a few repeated blocks (see `_step`); with `fit` (bytes), the
    largest batch whose peak fits. For the tensors a `blocks_for` pattern picks, every block and who
    holds it.
    PlanError if the plan does not fit the model at that world size.

    The first call in a process simulates here; later ones (and any call inside a process group) in a
    fresh process, since torch's DTensor caches remember the meshes of a world that is gone."""
    arguments = (world_size, rank, model_file, blocks_for, step, full_step, batch, hardware, fit)
    if _simulated_before or (dist.is_available() and dist.is_initialized()):
        from ..launch.workers import in_fresh_process

        # A model from a model file loaded by path cannot be unpickled elsewhere: rebuild it there.
        rebuild = model_file is not None and (model_file.path or model_file.entry)
        return in_fresh_process(_explain_here, plan, None if rebuild else model, *arguments)
    return _explain_here(plan, model, *arguments)


def _explain_here(
    plan, model, world_size, rank, model_file, blocks_for, step, full_step, batch, hardware, fit
) -> Explanation:
    global _simulated_before
    from .timing import hardware as default_hardware

    if model is None:
        model = model_file.build_on_meta()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    linted = lint(plan, model, world_size, runs=False)  # what torch cannot run shows as a failed step
    if not linted.ok:
        raise PlanError(linted.diagnostics, {plan.source.name: plan.source})
    simulated = on_cpu(plan)
    original, model = model, copy.deepcopy(model)
    hardware = hardware if hardware is not None else default_hardware()
    _simulated_before = True
    with simulated_world(world_size, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meshes = named_mesh_dims(plan, world_size)
        if plan.pipeline is not None:
            return _explain_pipelined(
                plan, simulated, original, world_size, rank, model_file, blocks_for, step, batch, hardware, fit, meshes
            )
        applied = apply_plan(simulated, model, mode=SIMULATED)
        tensors, ranks = _tensors_and_ranks(simulated, applied, world_size, blocks_for)
        collectives, notes, peak, timed, fitted = (), (), None, None, None
        if not step:
            notes = ("no collectives: the training step was not simulated (--no-step)",)
        elif model_file is not None and model_file.example_input is not None:
            stepper = _Stepper(simulated, original, applied, model_file, full_step)
            try:
                collectives, notes, peak, tally = stepper.run(batch)
                timed = step_time(tally, collectives, meshes, world_size, hardware, peak.tokens, peak.replicas)
                if fit is not None:
                    fitted = stepper.fit(fit, peak)
            except Exception as e:  # noqa: BLE001 - the layouts stand; the step is what fails
                notes = (_failed(e),)
        else:
            notes = ("no collectives: the model file defines no example_input",)
    return Explanation(
        plan.source.name, world_size, rank, meshes, tensors, ranks, collectives, notes, peak, timed, fitted
    )


def _failed(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"no collectives: a training step fails at this world size ({type(e).__name__}: {first})"


def _explain_pipelined(
    plan, simulated, original, world_size, rank, model_file, blocks_for, step, batch, hardware, fit, meshes
) -> Explanation:
    """A pipelined plan, applied once for each pp index (the ranks of one pp index differ from those of
    another only in the stages they hold): rank R's tensors, every rank's bytes (each from the
    application of its pp index, at its own place on the other dims), and the pipeline's report, with
    the step simulated stage by stage (pipelined.py)."""
    pp = pp_size(simulated, world_size)
    index, stride = pp_coordinates(simulated, world_size)
    applied_by_rank = {
        p: apply_plan(simulated, copy.deepcopy(original), mode=SIMULATED.at_pp_rank(p)) for p in range(pp)
    }
    tensors, ranks = _tensors_and_ranks(simulated, applied_by_rank[index[rank]], world_size, blocks_for)
    by_index = {
        p: ranks if p == index[rank] else _tensors_and_ranks(simulated, applied_by_rank[p], world_size, None)[1]
        for p in range(pp)
    }
    ranks = tuple(
        attrs.evolve(by_index[index[g]][g + (index[rank] - index[g]) * stride], rank=g) for g in range(world_size)
    )
    with_step = step and model_file is not None and model_file.example_input is not None
    report, collectives, peak, timed, failure = pipeline_report(
        simulated, applied_by_rank, world_size, rank, *((model_file, batch, hardware, meshes) if with_step else ())
    )
    notes: tuple[str, ...] = ()
    if not step:
        notes = ("no collectives: the training step was not simulated (--no-step)",)
    elif not with_step:
        notes = ("no collectives: the model file defines no example_input",)
    elif failure is not None:
        notes = (_failed(failure),)
    elif fit is not None:
        notes = ("--fit is not searched for a pipelined plan yet: give --batch instead",)
    return Explanation(
        plan.source.name, world_size, rank, meshes, tensors, ranks, collectives, notes, peak, timed, None, report
    )


# --- memory --------------------------------------------------------------------------------------


def _tensors_and_ranks(
    plan: ir.Plan, applied, world_size: int, blocks_for: str | None
) -> tuple[tuple[TensorInfo, ...], tuple[RankBytes, ...]]:
    from ..frontend.patterns import pattern_regex

    wanted = pattern_regex(blocks_for) if blocks_for is not None else None
    model = applied.model
    resolution = applied.linted.resolution
    units = units_by_module(resolution)
    params = np.zeros(world_size, dtype=np.int64)
    optimizer = np.zeros(world_size, dtype=np.int64)
    gathered: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(world_size, dtype=np.int64))
    infos, seen = [], set()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            owner = name.rpartition(".")[0]
            unit = enclosing(owner, units) if kind == "parameter" else None
            fsdp = unit is not None and unit.kind(plan.units[unit.block]) == "fully_shard"
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            element = tensor.element_size()
            placements = tuple(getattr(tensor, "placements", ()))
            blocks = _blocks(tensor, world_size) if wanted is not None and wanted.fullmatch("." + name) else ()
            infos.append(
                TensorInfo(
                    name,
                    kind,
                    tuple(tensor.shape),
                    str(tensor.dtype).removeprefix("torch."),
                    placed_as(tensor).dims,
                    tuple(str(p) for p in placements),
                    tuple(local.shape),
                    local.numel() * element,
                    (unit.fqn or "root") if fsdp else None,
                    blocks,
                )
            )
            if kind != "parameter":
                continue
            numel = _numel_per_rank(tensor, world_size)
            params += numel * element
            if tensor.requires_grad:
                optimizer += numel * ADAMW_STATE_BYTES
            if fsdp:
                compute = _compute_bytes(plan.units[unit.block], unit, element)
                gathered[unit.fqn] += (
                    _numel_per_rank(tensor, world_size, unsharded_dims=set(plan.units[unit.block].mesh.dims)) * compute
                )
    grads = params.copy()  # gradients share their parameters' layout and dtype
    peak = np.max(np.stack(list(gathered.values())), axis=0) if gathered else np.zeros(world_size, dtype=np.int64)
    ranks = tuple(
        RankBytes(r, int(params[r]), int(grads[r]), int(optimizer[r]), int(peak[r])) for r in range(world_size)
    )
    return tuple(infos), ranks


def _compute_bytes(units: ir.Units, unit, element: int) -> int:
    """Bytes per element of a unit's gathered parameters: the mixed precision param dtype, if any."""
    mp = unit.option(units, "mixed_precision")
    if mp is not None and mp.param is not None:
        return torch.empty((), dtype=getattr(torch, mp.param.name)).element_size()
    return element


def _numel_per_rank(tensor, world_size: int, unsharded_dims: set[str] = frozenset()) -> np.ndarray:
    """Elements of `tensor` each rank holds (a plain tensor: all of it on every rank); with
    `unsharded_dims`, as if it were not split along those mesh dims (FSDP's gathered copy)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return np.full(world_size, tensor.numel(), dtype=np.int64)
    mesh = tensor.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    placements = tuple(Replicate() if n in unsharded_dims else p for n, p in zip(names, tensor.placements))
    return _local_numels(tuple(tensor.shape), tuple(mesh.shape), placements, _coordinates(mesh))


def _coordinates(mesh) -> np.ndarray:
    """(world, ndim): each global rank's coordinate in `mesh` (-1 for ranks outside it)."""
    layout = mesh.mesh.cpu().numpy()
    key = (layout.tobytes(), layout.shape)
    cached = _COORDINATES.get(key)
    if cached is None:
        cached = np.full((dist.get_world_size(), layout.ndim), -1, dtype=np.int64)
        cached[layout.reshape(-1)] = np.stack(np.unravel_index(np.arange(layout.size), layout.shape), axis=1)
        _COORDINATES[key] = cached
    return cached


#: Rank coordinates by mesh layout, shared by the many tensors on one mesh.
_COORDINATES: dict = {}


def _local_numels(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray
) -> np.ndarray:
    """Local element counts for every rank at once (numpy, torch's chunking); torch's own function
    where a placement is beyond that arithmetic."""
    sizes = local_sizes(shape, mesh_shape, placements, coords)
    if sizes is None:
        return np.array(
            [
                math.prod(local_shape_and_offset(shape, mesh_shape, [int(c) for c in coordinate], placements)[0])
                if coordinate[0] >= 0
                else 0
                for coordinate in coords
            ],
            dtype=np.int64,
        )
    return np.prod(sizes, axis=1, dtype=np.int64) if sizes.shape[1] else np.ones(len(coords), dtype=np.int64)


def local_sizes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray
) -> np.ndarray | None:
    """(world, ndim) local shapes; see `local_blocks`."""
    blocks = local_blocks(shape, mesh_shape, placements, coords)
    return None if blocks is None else blocks[1]


def local_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray):
    """(offsets, sizes), each (world, ndim): where every rank's shard starts and how big it is, split
    like torch.chunk: each Shard(d) on mesh dim i cuts what is left of dim d into mesh_shape[i] chunks of
    ceil(size / n), in mesh order. A _StridedShard(d, sf) (FSDP over a dim TP already shards) is applied
    after the one later mesh dim that shards d, of size sf: FSDP chunks the TP shard. (For uneven sizes
    that is what FSDP holds, where DTensor's own arithmetic for _StridedShard differs.) None for any
    other placement (the caller asks torch)."""
    sizes = np.tile(np.asarray(shape, dtype=np.int64), (len(coords), 1))
    offsets = np.zeros_like(sizes)
    for d in range(len(shape)):
        order, deferred = [], []
        for i, p in enumerate(placements):
            if type(p).__name__ == "_StridedShard" and p.dim == d:
                later = [
                    j
                    for j in range(i + 1, len(placements))
                    if placements[j].is_shard() and getattr(placements[j], "dim", None) == d
                ]
                if len(later) != 1 or mesh_shape[later[0]] != p.split_factor:
                    return None
                deferred.insert(0, i)
            elif p.is_shard() and p.dim == d:
                order.append(i)
        for i in order + deferred:
            n = mesh_shape[i]
            chunk = -(-sizes[:, d] // n)
            start = np.minimum(coords[:, i] * chunk, sizes[:, d])
            offsets[:, d] += start
            sizes[:, d] = np.clip(sizes[:, d] - coords[:, i] * chunk, 0, chunk)
    return offsets, sizes


# --- one training step, recorded -------------------------------------------------------------


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


class _Stepper:
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

    def _step(self, applied, batch: int | None) -> _Measure:
        self.groups.update(group_names(applied))
        return _training_step(self.plan, applied, self.model_file, self.groups, batch)

    def _cut(self, depth: int):
        if depth not in self._cuts:
            path, keys = self.stack
            self._cuts[depth] = apply_plan(self.plan, cut_stack(self.model, path, keys[:depth]), mode=SIMULATED)
        return self._cuts[depth]

    def measure(self, batch: int | None) -> tuple[_Measure, str | None]:
        if self.stack is not None:
            path, keys = self.stack
            steps: dict[int, _Measure] = {}
            whole = None
            try:
                for depth in STEP_DEPTHS:
                    steps[depth] = self._step(self._cut(depth), batch)
                whole = _extrapolate(steps, STEP_DEPTHS[0], path, keys)
                if whole is None and len(keys) > STEP_DEPTHS[-1] + 1:
                    # The smallest cut may peak at another moment of the step than longer ones do (a
                    # unit gathered at its peak, say): one block more, and the three longest decide.
                    steps[STEP_DEPTHS[-1] + 1] = self._step(self._cut(STEP_DEPTHS[-1] + 1), batch)
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
        return self._step(self.applied, batch), None

    def run(self, batch: int | None):
        measured, note = self.measure(batch)
        return _collectives(measured.calls), (note,) if note else (), _peak(measured), _tally(measured.tally)

    def fit(self, limit: int, first: Peak) -> Fit:
        """The largest batch whose peak is at most `limit`, found by a bracketed search on the simulated
        step: the peak grows with the batch (about linearly), so each guess is where the line through the
        two nearest known points meets the limit, and its neighbour is simulated too; a guess that does
        not close the bracket is followed by a bisection step. It ends with batch b fitting and b + 1
        not, both simulated."""
        tried = {first.batch: first.bytes}

        def peak(batch: int) -> int:
            if batch not in tried:
                tried[batch] = self.measure(batch)[0].peak
            return tried[batch]

        def result(batch: int) -> Fit:
            return Fit(limit, batch, tried[batch] if batch else tried[1], tuple(sorted(tried.items())))

        if peak(1) > limit:
            return result(0)
        bisect = False
        while True:
            fits = sorted(b for b, n in tried.items() if n <= limit)
            over = sorted(b for b, n in tried.items() if n > limit)
            low, high = fits[-1], (over[0] if over else None)
            if high is not None and high - low <= 1:
                return result(low)
            if high is not None and bisect:
                peak((low + high) // 2)
                bisect = False
                continue
            near = fits[-2] if high is None and len(fits) > 1 else high
            if near is None or tried[near] == tried[low]:
                guess = low * 2 if high is None else (low + high) // 2
            else:
                slope = (tried[near] - tried[low]) / (near - low)
                guess = low + math.floor((limit - tried[low]) / slope) if slope > 0 else low * 2
            guess = max(guess, low + 1) if high is None else min(max(guess, low + 1), high - 1)
            guess = min(guess, 1 << 24)
            peak(guess)
            peak(guess + 1 if tried[guess] <= limit else guess - 1)
            bisect = high is not None
            if guess >= 1 << 24:
                return result(max(b for b, n in tried.items() if n <= limit))


def _peak(m: _Measure) -> Peak:
    modules = sorted(
        ((name or "(top level)", n) for name, n in m.modules.items() if n),
        key=lambda x: (-x[1], [int(p) if p.isdigit() else p for p in x[0].split(".")]),
    )
    host = tuple(m.host_categories.items()) if m.host else ()
    return Peak(
        m.peak, tuple(m.categories.items()), tuple(modules[:TOP_MODULES]), m.batch, m.tokens, m.replicas, m.host, host
    )


def _tally(tally: Counter) -> Tally:
    return tuple(sorted(tally.items()))


def _extrapolate(steps: dict[int, _Measure], k: int, path: str, keys: list[str]) -> _Measure | None:
    """The step of all len(keys) blocks from those of k, k + 1 and k + 2 blocks (`_Stepper`), or None if
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
    if second.peak - first.peak != third.peak - second.peak or second.host - first.host != third.host - second.host:
        return None
    categories, host_categories = {}, {}
    for whole, part in ((categories, "categories"), (host_categories, "host_categories")):
        one, two, three = getattr(first, part), getattr(second, part), getattr(third, part)
        for key in one:
            step = two[key] - one[key]
            if three[key] - two[key] != step:
                return None
            whole[key] = one[key] + more * step
    tally_block = _grown(third.tally, second.tally)
    if tally_block is None or tally_block != _grown(second.tally, first.tally):
        return None
    tally = Counter(first.tally)
    for key, count in tally_block.items():
        tally[key] += more * count
    modules = _modules_extrapolated(second.modules, third.modules, k + 2, path, keys, categories, third.categories)
    if modules is None:
        return None
    peak = first.peak + more * (second.peak - first.peak)
    host = first.host + more * (second.host - first.host)
    return _Measure(
        calls, peak, categories, modules, tally, first.batch, first.tokens, first.replicas, host, host_categories
    )


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
    units = tuple((u.block, inside(u.fqn), u.unit) for u in resolution.units if inside(u.fqn) is not None)
    checkpoint = tuple(inside(f) for f in resolution.checkpoint if inside(f) is not None)
    return structure, tensors, rules, units, checkpoint


def cut_stack(model: nn.Module, path: str, keep: list[str]) -> nn.Module:
    """A copy of `model` whose container at `path` holds only the children `keep`."""
    container = model.get_submodule(path)
    children = container._modules
    container._modules = {k: children[k] for k in keep}
    try:
        return copy.deepcopy(model)
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


def _training_step(
    plan: ir.Plan, applied, model_file: ModelFile, groups: dict[str, str], batch: int | None
) -> _Measure:
    """One forward, loss, backward and AdamW step on fake tensors, under torch's memory trackers
    (`memory`): the collectives of the forward, loss and backward, each group named as `groups` names
    it (process group name -> `mesh.dim`), the peak memory, and the ops' costs. The inputs and loss
    are those of the checks (SPEC §7); `batch` per data-parallel replica (default: twice the TP size)."""
    from ..verification import Context
    from ..verification import layout as lay
    from ..verification.comms import Calls
    from .memory import cuda_like_rms_norm, tracker

    recorder = Calls()
    ctx = Context(plan, applied, model_file)
    gradients = next((c for c in plan.checks if c.name == "gradients"), None)
    input_layout = gradients.get("input") if gradients is not None else None
    output_layout = gradients.get("output") if gradients is not None else None
    # A step that fails is reported in a note; fake tensors' own error log would repeat it at length.
    with quiet("torch._subclasses.fake_tensor"), recording_fake_mode(recorder):
        model = applied.model
        model.to_empty(device="cpu")
        where = lay.layout(ctx)
        batch = batch if batch is not None else 2 * max(where.tp_size, 1)
        full = lay.replica_inputs(ctx, -1, where.replica, batch)
        inputs = lay.local_inputs(full, where, input_layout)
        optimizer = warm_adamw(model)
        memory = tracker(model, optimizer)
        memory.track_inputs(inputs)
        recorder.calls.clear()
        with memory, cuda_like_rms_norm():
            output = model(*inputs)
            with recorder.paused():
                whole = lay.full_output(ctx, where, output, output_layout)
            with lay.loss_context(plan):
                lay.loss(ctx, whole, full).backward()
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
    )


def _blocks(tensor, world_size: int) -> tuple:
    """Each distinct block of a tensor, (offset, shape, ranks), ordered by offset."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (((0,) * tensor.ndim, tuple(tensor.shape), tuple(range(world_size))),)
    mesh = tensor.device_mesh
    coords = _coordinates(mesh)
    computed = local_blocks(tuple(tensor.shape), tuple(mesh.shape), tuple(tensor.placements), coords)
    holders: dict[tuple, list[int]] = defaultdict(list)
    for rank, coordinate in enumerate(coords):
        if coordinate[0] < 0:
            continue
        if computed is not None:
            offset, shape = computed[0][rank], computed[1][rank]
        else:
            shape, offset = local_shape_and_offset(
                tuple(tensor.shape), tuple(mesh.shape), [int(c) for c in coordinate], tensor.placements
            )
        holders[(tuple(int(o) for o in offset), tuple(int(x) for x in shape))].append(rank)
    return tuple(sorted((offset, shape, tuple(ranks)) for (offset, shape), ranks in holders.items()))


def select(explanation: Explanation, pattern: str | None) -> tuple[TensorInfo, ...]:
    """The tensors whose names a pattern matches (the module pattern syntax, on parameter names)."""
    if pattern is None:
        return explanation.tensors
    from ..frontend.patterns import pattern_regex

    regex = pattern_regex(pattern)
    return tuple(t for t in explanation.tensors if regex.fullmatch("." + t.name))
