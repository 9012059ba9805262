"""Pre-flight at any scale: what every rank of a world will hold and send, worked out in one CPU process.

The plan is applied to the model on the meta device in a simulated world (torch's fake process group,
standing for rank R of N), so the placements and rank R's local shapes are torch's own; every other
rank's share follows from the same placements (layouts.py). One training step then runs on fake tensors
under the fake process group to record each collective, its mesh dim and its size (stepping.py; a
pipelined plan's stage by stage, pipelined.py). Nothing is allocated: an 80-layer, 8192-wide model
explains at 1024 ranks in a few hundred MiB.

What one explain is asked travels as one record (options.ExplainOptions). The plan is linted once, on
the user's model, and that result handed to every application of it to a copy of that model (each pp
index of a pipeline); apply is told it runs in a simulated world (runtime.apply.SIMULATED).
"""

from __future__ import annotations

import copy
import warnings
import weakref

import attrs
import torch.distributed as dist
import torch.nn as nn
from attrs import frozen

from ..compiler.lint import Linted, lint
from ..frontend import ir
from ..frontend.diagnostics import PlanError
from ..runtime.apply import SIMULATED, apply_plan, import_uses, seeing_styles
from ..runtime.modelfile import ModelFile
from ..runtime.simulated import simulated_world
from ..runtime.torchcompat import fsdp_strided_shard
from .fakestep import Collective, Peak
from .layouts import RankBytes, TensorInfo, tensors_and_ranks
from .options import ExplainOptions
from .pipelined import PipelineReport, pipeline_report, pp_coordinates, pp_size
from .stepping import Stepper
from .timing import Fit, StepTime, step_time


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


def explain(
    plan: ir.Plan, model: nn.Module, options: ExplainOptions, model_file: ModelFile | None = None
) -> Explanation:
    """What `plan` gives every rank of a world of `options.world_size`, seen from `options.rank`. `model`
    should be on the meta device (it is copied, not changed). With a model file's `example_input`, also
    one training step (unless `options.step` is False): its collectives, its peak memory with
    `options.batch` (per data-parallel replica; default twice the TP size) and, on `options.hardware`, its
    estimated time; with `full_step`, never extrapolated from a few repeated blocks (stepping.Stepper);
    with `fit` (bytes), the largest batch whose peak fits. For the tensors a `blocks_for` pattern picks,
    every block and who holds it (ExplainOptions says each).
    PlanError if the plan does not fit the model at that world size.

    It simulates in this process (each simulated world starts with DTensor's sharding caches cleared,
    runtime.simulated), or in a fresh one inside a process group, which a simulated world cannot start in."""
    if dist.is_available() and dist.is_initialized():
        from ..launch.workers import in_fresh_process

        # A model from a model file loaded by path cannot be unpickled elsewhere: rebuild it there.
        rebuild = model_file is not None and (model_file.path or model_file.entry)
        return in_fresh_process(_explain_here, plan, None if rebuild else model, options, model_file)
    return _explain_here(plan, model, options, model_file)


def lint_once(plan: ir.Plan, model: nn.Module, world_size: int, order=None) -> Linted:
    """`plan` linted on `model` at `world_size` as apply lints it (what `use` styles place seen by running
    them), once for every application of one explain to that model's module tree: PlanError if it does not
    fit. SL301 (what the installed torch cannot run) is left out: it shows as a failed step. Linted on the
    plan's own meshes (a cpu and a cuda mesh on one module is SL208), not the ones put on the CPU."""
    sources = {plan.source.name: plan.source}
    linted = lint(plan, model, world_size, None, fsdp_strided_shard(), runs=False, order=order)
    if linted.ok:
        linted = seeing_styles(plan, model, world_size, import_uses(plan), linted, runs=False)
    if not linted.ok:
        raise PlanError(linted.diagnostics, sources)
    return linted


def _pipeline_order(plan: ir.Plan, model: nn.Module, model_file):
    """For a pipeline, the order the model's modules run in (compiler.trace), which places the modules outside
    its stack; None otherwise, or without an example input. Traced once a model (search explains many
    pipelined candidates of one)."""
    if plan.pipeline is None or model_file is None or model_file.example_input is None:
        return None
    if model not in _ORDERS:
        from ..compiler.trace import trace_order

        _ORDERS[model] = trace_order(model, model_file.example_input)
    return _ORDERS[model]


#: The traced order of each model explained with a pipeline (the models are explain's meta models).
_ORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _explain_here(plan: ir.Plan, model: nn.Module | None, options: ExplainOptions, model_file) -> Explanation:
    if model is None:
        model = model_file.build_on_meta()
    linted = lint_once(plan, model, options.world_size, _pipeline_order(plan, model, model_file))
    simulated = on_cpu(plan)
    world_size, rank = options.world_size, options.rank
    with simulated_world(world_size, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meshes = named_mesh_dims(plan, world_size)
        if plan.pipeline is not None:
            return _explain_pipelined(plan, simulated, model, model_file, options, linted, meshes)
        applied = apply_plan(simulated, copy.deepcopy(model), mode=SIMULATED, linted=linted)
        tensors, ranks = tensors_and_ranks(simulated, applied, world_size, options.blocks_for)
        collectives, notes, peak, timed, fitted = (), (), None, None, None
        if not options.step:
            notes = ("no collectives: the training step was not simulated (--no-step)",)
        elif model_file is not None and model_file.example_input is not None:
            stepper = Stepper(simulated, model, applied, model_file, options.full_step)
            try:
                collectives, notes, peak, tally = stepper.run(options.batch)
                units = tuple(b.mesh for b in plan.units)
                flat = tuple(m for m in units if m.flat)
                timed = step_time(
                    tally, collectives, meshes, world_size, options.hardware, peak.tokens, peak.replicas, flat, units
                )
                if options.fit is not None:
                    fitted = stepper.fit(options.fit, peak)
            except Exception as e:  # noqa: BLE001 - the layouts stand; the step is what fails
                notes = (_failed(e),)
        else:
            notes = ("no collectives: the model file defines no example_input",)
    notes += _routing_note(plan, peak) + _context_note(plan, peak, timed)
    return Explanation(
        plan.source.name, world_size, rank, meshes, tensors, ranks, collectives, notes, peak, timed, fitted
    )


def _failed(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "Expected inputs of BF16 type" in first:
        # torch._grouped_mm (transformers' default experts) on the fake step's meta kernel, which takes
        # what CUDA's takes: the model would fail so on GPUs too, at any world size
        return (
            f"no collectives: the training step fails ({type(e).__name__}: {first}): torch._grouped_mm, which "
            "transformers' experts run by default, takes only bf16 on GPUs (CUDA's kernel, and the meta kernel "
            "explain steps with); give the model bf16 parameters (mixed_precision(param=bf16) on the experts' "
            "units) or the experts an eager implementation (config._experts_implementation = 'eager')"
        )
    return f"no collectives: a training step fails at this world size ({type(e).__name__}: {first})"


def _explain_pipelined(
    plan: ir.Plan, simulated: ir.Plan, original: nn.Module, model_file, options: ExplainOptions, linted: Linted, meshes
) -> Explanation:
    """A pipelined plan, applied once for each pp index (the ranks of one pp index differ from those of
    another only in the stages they hold), each time to a copy of one model, so linted once (`linted`):
    rank R's tensors, every rank's bytes (each from the application of its pp index, at its own place on
    the other dims), and the pipeline's report, with the step simulated stage by stage (pipelined.py)."""
    world_size, rank = options.world_size, options.rank
    pp = pp_size(simulated, world_size)
    index, stride = pp_coordinates(simulated, world_size)
    applied_by_rank = {
        p: apply_plan(simulated, copy.deepcopy(original), mode=SIMULATED.at_pp_rank(p), linted=linted)
        for p in range(pp)
    }
    tensors, ranks = tensors_and_ranks(simulated, applied_by_rank[index[rank]], world_size, options.blocks_for)
    by_index = {
        p: ranks if p == index[rank] else tensors_and_ranks(simulated, applied_by_rank[p], world_size, None)[1]
        for p in range(pp)
    }
    ranks = tuple(
        attrs.evolve(by_index[index[g]][g + (index[rank] - index[g]) * stride], rank=g) for g in range(world_size)
    )
    with_step = options.step and model_file is not None and model_file.example_input is not None
    stepped = (model_file, options.batch, options.hardware, meshes) if with_step else ()
    report, collectives, peak, timed, failure = pipeline_report(simulated, applied_by_rank, world_size, rank, *stepped)
    notes: tuple[str, ...] = ()
    if not options.step:
        notes = ("no collectives: the training step was not simulated (--no-step)",)
    elif not with_step:
        notes = ("no collectives: the model file defines no example_input",)
    elif failure is not None:
        notes = (_failed(failure),)
    elif options.fit is not None:
        notes = ("--fit is not searched for a pipelined plan yet: give --batch instead",)
    notes += _compile_note(plan, peak)
    return Explanation(
        plan.source.name, world_size, rank, meshes, tensors, ranks, collectives, notes, peak, timed, None, report
    )


#: explain's note on a pipelined plan that compiles (search takes it for "not predicted").
PIPELINE_COMPILE = "compile is not modelled for a pipeline: the peak and the time are those of the stages run eager"


def _compile_note(plan: ir.Plan, peak) -> tuple[str, ...]:
    """What explain leaves out of a pipelined plan that compiles: it steps its stages eager."""
    if not (plan.compiles or plan.compile_loss) or peak is None:
        return ()
    return (PIPELINE_COMPILE,)


def _routing_note(plan: ir.Plan, peak) -> tuple[str, ...]:
    """What explain assumes of a plan that splits experts: no router runs on data in a simulated step."""
    if peak is None or not plan.has_style("expert_parallel"):
        return ()
    return (
        "expert_parallel: routing taken as uniform (every rank sends and receives as many tokens); the "
        "all-to-all bytes, the experts' activations and their time are those of an even load",
    )


def _context_note(plan: ir.Plan, peak, timed) -> tuple[str, ...]:
    """What context parallelism costs in the step: each rank's share of a sequence, and the attention's
    collectives over the cp dim (the functional ones there: no parallelize block splits that dim, SL219)."""
    cp = plan.context_parallel
    if cp is None or peak is None or timed is None:
        return ()
    dim = str(cp.mesh)
    ring = [d for d in timed.dims if d.mesh_dim == dim and not d.overlapped]
    if not ring:
        return ()
    ranks, sequence = ring[0].group, peak.tokens // max(peak.batch, 1)
    return (
        f"context_parallel on {dim}: each rank holds {sequence // ranks:,} of every sequence's {sequence:,} "
        f"tokens (the activations above are its shard's); its attention's all-gathers of keys and values "
        f"(forward, and again in the backward) and reduce-scatters of their gradients move "
        f"{sum(d.bytes for d in ring) / 2**30:.1f} GiB in {sum(d.seconds for d in ring) * 1e3:.1f} ms, counted as exposed "
        "(the rank's own block of attention computes while the first arrives)",
    )


def select(explanation: Explanation, pattern: str | None) -> tuple[TensorInfo, ...]:
    """The tensors whose names a pattern matches (the module pattern syntax, on parameter names)."""
    if pattern is None:
        return explanation.tensors
    from ..frontend.patterns import pattern_regex

    regex = pattern_regex(pattern)
    return tuple(t for t in explanation.tensors if regex.fullmatch("." + t.name))
