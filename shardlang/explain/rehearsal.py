"""lint's simulated training step (SL220-SL222, and SL224 before it): the plan applied in a simulated world and one
forward, loss and backward run on fake tensors, as `explain` runs them, to find before any worker starts what
`apply` would hit, at the plan line of the rule governing the module where it happens.

- SL220: the step raises in a module (its forward, its hooks, or its backward): the module, what it
  received (each tensor argument's layout, and for a plain tensor the unsharded model's shape for it), the
  rule that governs it and what that rule takes.
- SL221: the loss is handed a plain tensor of another shape than the unsharded model's output (the last
  layer's output left sharded), or the loss raises.
- SL222: a module that no rule governs, with whole plain parameters, receives a piece of what the unsharded
  model hands it (a sequence or head shard): its parameters' gradients are each rank's share of a sum that
  nothing adds up. (A DTensor parameter's Partial gradient is not one: DTensor sums it where it is used. Nor
  is a cp rank's shard of the sequence under context_parallel where a fully_shard or replicate unit over the
  cp dim holds the module: it sums the shards' shares, SPEC §11; such a module is compared with what the
  unsharded model hands it on that shard.)
- SL224: under `init meta`, parameters that the model's initialisers, run on the meta model first, leave
  unwritten (compiler.rules.devices; explain.unwritten).

It runs in a forked child (runtime.simulated.in_fork: the command's process stays without a process group, and a
step that hangs costs its diagnostics, not the command), as rank 0 of the world, on the model cut to two blocks of
its longest stack of identical blocks (explain's cut) when it has one; a failure there is confirmed on the whole
model before it is reported. A pipelined plan is applied once per pp rank and stepped stage by stage from the meta
model, as explain steps it (SL220 only). The fake tensors hold no values: what depends on them (a label out of
range, a NaN) is left to apply's checks. What fake tensors cannot run is not the plan's fault: an op whose output
depends on values (transformers' experts loop, `nonzero`; a model's own `.item()`) and torch._grouped_mm in float32
run on stand-ins (fakestep.StandIns), said in the note; a failure after a stand-in gave a value the model may never
see is a note too, left to apply's checks.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import attrs
import torch
import torch.nn as nn
from attrs import frozen

from ..compiler.styles import DEFAULT_INPUTS as TAKES  # what a style takes where its rule gives no input=
from ..frontend import ir
from ..frontend.diagnostics import SL220, SL221, SL222, Diagnostic, PlanError, few
from ..launch import raised
from ..runtime.apply import SIMULATED, apply_plan
from ..runtime.modelfile import ModelFile
from ..runtime.simulated import in_fork, placed_as, simulated_world
from .fakestep import copy_model
from .mixing import with_context_mixing
from .simulate import named_mesh_dims, on_cpu
from .stepping import cut_stack, repeated_stack

#: How long the forked child may take to simulate the step (on the cut model and, after a failure, the whole one).
TIMEOUT_S = 120.0
#: Blocks of the longest repeated stack the step runs on: the first two, so that one block's output reaches
#: another (what two rules in a row do to each other shows).
BLOCKS = 2


@frozen
class Rehearsal:
    """What lint's simulated step found, and what it ran (or why it did not run), for a note."""

    diagnostics: tuple[Diagnostic, ...]
    note: str
    #: Whether the step ran through its backward, so that what SL210 guesses from the plan was seen instead.
    ran: bool = False
    #: The phases of the training step it ran (verification.step.Step.ran): those apply's checks run.
    phases: tuple[str, ...] = ()


def rehearse(
    plan: ir.Plan, model: nn.Module, model_file: ModelFile, world_size: int, resolution, timeout_s: float = TIMEOUT_S
) -> Rehearsal:
    """One training step of `plan` on `model` (on the meta device) in a simulated world of `world_size`,
    seen from rank 0, after `init meta`'s initialisers run on the meta model (SL224). `resolution` is lint's
    (for the cut). The plan must lint clean."""
    from ..compiler.rules.devices import unwritten_under_meta
    from .unwritten import left_unwritten

    unwritten = left_unwritten(model, plan.init.method) if plan.init.mode == "meta" else None
    found = unwritten_under_meta(plan, unwritten)
    stepped = _stepped(plan, model, model_file, world_size, resolution, timeout_s)
    return attrs.evolve(stepped, diagnostics=(*found, *stepped.diagnostics)) if found else stepped


def _stepped(plan, model, model_file, world_size, resolution, timeout_s) -> Rehearsal:
    if model_file.example_input is None:
        return Rehearsal((), f"the training step was not simulated: {model_file.origin} defines no example_input")
    stack = repeated_stack(model, resolution)
    order = resolution.order if resolution is not None else None
    status, result = in_fork(lambda: _rehearse_here(plan, model, model_file, world_size, stack, order), timeout_s)
    if status != "ok":
        return Rehearsal((), f"the training step could not be simulated: {result}")
    return with_context_mixing(result, plan, model, model_file, resolution, timeout_s)  # SL223


def _rehearse_here(plan, model, model_file, world_size, stack, order=None) -> Rehearsal:
    simulated = on_cpu(plan)
    whole = f"rank 0 of {world_size}"
    with simulated_world(world_size, 0), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plan.pipeline is not None:  # stepped as explain steps it: from the meta model, stage by stage
            return _pipelined(simulated, model, model_file, world_size, order)
        model = _as_apply_builds_it(plan, model, model_file)
        if stack is not None and len(stack[1]) > BLOCKS:
            path, keys = stack
            found, ran, notes, phases = _step(simulated, cut_stack(model, path, keys[:BLOCKS]), model_file)
            if not found:
                note = f"one training step simulated at {whole} on {BLOCKS} of the {len(keys)} blocks of `{path}`"
                return Rehearsal((), "; ".join((note, *notes)), ran, phases)
        # confirmed on the whole model
        found, ran, notes, phases = _step(simulated, copy_model(model), model_file)
    return Rehearsal(tuple(found), "; ".join((f"one training step simulated at {whole}", *notes)), ran, phases)


def _pipelined(plan: ir.Plan, model: nn.Module, model_file: ModelFile, world_size: int, order=None) -> Rehearsal:
    """A pipelined plan: applied once per pp rank, and its step run stage by stage as explain runs it (each
    stage's forward on what the one before sent, the loss on the last, the backward back); SL220 where it
    raises, at the rule governing the module of the stage that was running (at the pipeline where a stage
    cannot send what its blocks return). `order` (compiler.trace) places the modules outside the stack."""
    from ..runtime.pipeline import CONTRACT
    from ..verification import Context
    from .fakestep import StandIns
    from .pipelined import pipeline_report, pp_size
    from .timing import hardware

    pp = pp_size(plan, world_size)
    applied_by_rank, linted = {}, None
    for index in range(pp):
        try:  # a copy of one model each time: linted by the first application, handed on to the others
            mode = SIMULATED.at_pp_rank(index)
            applied_by_rank[index] = apply_plan(plan, copy_model(model), order, mode=mode, linted=linted)
        except PlanError as e:
            return Rehearsal(tuple(e.diagnostics), f"the plan could not be applied for pp rank {index}")
        linted = applied_by_rank[index].linted
    meshes = named_mesh_dims(plan, world_size)
    phases: list[str] = []
    stand_ins = StandIns()
    stand_ins.uncast_units = _uncast_units(Context(plan, applied_by_rank[0], model_file))
    with Watch([applied.model for applied in applied_by_rank.values()]) as watch:
        stand_ins.where = watch.running
        *_, failure = pipeline_report(
            plan, applied_by_rank, world_size, 0, model_file, None, hardware(), meshes, ran=phases, stand_ins=stand_ins
        )
    note = f"one training step simulated stage by stage, for each of the {pp} pp ranks"
    if failure is None:
        return Rehearsal((), "; ".join((note, *stand_ins.notes())), True, tuple(phases))
    if stand_ins.guessed:  # what raised may come of a value the model never sees
        return Rehearsal((), f"{note}; {stand_ins.after_guess(raised.summary(failure))}")
    read = raised.value_read(failure)
    if read is not None:  # a value fake tensors do not hold (Longformer's `.any().item()`): apply's checks decide
        return Rehearsal((), f"{note}; the step stopped: {raised.summary(read)} reads tensor values")
    refused = raised.cause_saying(failure, CONTRACT)  # the model's, not a module's: the pipeline's
    for applied in () if refused else applied_by_rank.values():
        found = raised.raising_module(applied.model, failure)
        if found is not None:
            ctx = Context(plan, applied, model_file)
            message = f"the simulated training step raises in {raised.module_text(found)}: {raised.summary(failure)}"
            return Rehearsal((raised.in_module(ctx, found, message, {}, SL220),), note)
    said = f"stops: {refused}" if refused else f"raises outside every module: {raised.summary(failure)}"
    message = f"the simulated training step of the pipeline {said}"
    return Rehearsal((Diagnostic(SL220, message, plan.pipeline.span),), note)


def _as_apply_builds_it(plan: ir.Plan, model: nn.Module, model_file: ModelFile) -> nn.Module:
    """The model as apply has it when the plan's styles run: on meta under `init meta` (materialised after
    them, as apply's program does), otherwise built on the CPU, here of fake tensors: a style that keeps a
    tensor of the module (a forward closing over its weight) sees the same one in the step. Where the model
    cannot be built of fake tensors (its construction reads values), the meta model is materialised instead."""
    from ..verification.comms import Calls
    from .fakestep import quiet, recording_fake_mode

    if plan.init.mode == "meta":
        return model
    try:
        with quiet("torch._subclasses.fake_tensor"), recording_fake_mode(Calls()), torch.device("cpu"):
            return model_file.build_model()
    except Exception:  # noqa: BLE001 - the meta model stands in
        return model


def _step(plan: ir.Plan, model: nn.Module, model_file: ModelFile) -> tuple[list[Diagnostic], bool, tuple, tuple]:
    """Apply `plan` to `model` and run one training step (verification.step.Step) on fake tensors: what went
    wrong, whether the backward ran, notes on what fake tensors could not run (StandIns), and the phases
    that ran."""
    from ..verification import Context
    from ..verification.comms import Calls
    from ..verification.step import Step, not_compiled
    from .fakestep import StandIns, idle_conversions, positions_as_on_real_tensors, quiet, recording_fake_mode

    reference = copy_model(model)
    try:
        applied = apply_plan(plan, model, mode=SIMULATED)
    except PlanError as e:  # what lint finds once `use` styles are run (SL203/SL204), or a step that fails
        return list(e.diagnostics), False, (), ()
    ctx = Context(plan, applied, model_file)
    _without_ddp(applied.model)
    stand_ins = StandIns()
    stand_ins.uncast_units = _uncast_units(ctx)
    step = Step.of(ctx, compile_with=not_compiled)  # a simulated world compiles nothing
    fake = recording_fake_mode(Calls(), stand_ins)
    with quiet("torch._subclasses.fake_tensor"), fake, idle_conversions(), positions_as_on_real_tensors():
        full = step.batch()
        expected, shapes, unsharded, unrun = _unsharded(ctx, reference, full)
        stand_ins.clear()  # the reference's own
        fake.redraw()  # the plan's model draws what the reference drew
        sharded = applied.model
        if _on_meta(sharded):
            sharded.to_empty(device="cpu")
        with Watch(sharded, unsharded, shapes) as watch:
            stand_ins.where = watch.running
            found, ran = _forward_backward(step, watch, full, expected)
    phases = tuple(step.ran)
    if found and stand_ins.guessed:  # what raised may come of a value the model never sees
        return [], False, (stand_ins.after_guess(found[0].message),), phases
    if found and unrun is not None:  # the model's own failure on these inputs, not the plan's
        return [], False, (f"the step stopped: {found[0].message}; the unsharded model raises too ({unrun})",), phases
    return (_partial_gradients(ctx, watch) if ran else found), ran, stand_ins.notes(), phases


def _uncast_units(ctx) -> tuple[str, ...]:
    """The fully_shard blocks (their spans) with mixed_precision over a mesh of one rank or beside tensor
    parallelism on their mesh, where this torch's fake tensors do not cast their parameters as real ones do
    (torchcompat.fake_fsdp_casts_one_rank_units): the step cannot tell their products' dtypes, and says so
    rather than raise on what apply runs."""
    from ..runtime.torchcompat import fake_fsdp_casts_one_rank_units

    if fake_fsdp_casts_one_rank_units():
        return ()
    split = {block.mesh.mesh for block in ctx.plan.parallelize}
    return tuple(
        f"{block.span.file}:{block.span.line}"
        for block in ctx.plan.units
        if block.kind == "fully_shard"
        and (ctx.applied.mesh(block.mesh).size() == 1 or block.mesh.mesh in split)
        and (any(u.get("mixed_precision") for u in block.units) or bool(dict(block.options).get("mixed_precision")))
    )


def _without_ddp(model: nn.Module) -> None:
    """Take `replicate`'s (DDP's) hooks off every module: DDP is built in the first forward, and its checks
    and Reducer read the parameters' storage, which fake tensors have none of (every replicate plan was SL220).
    Its hooks change no shape, which is what the step looks at, and the reduction they run is what SL222 reads
    from the plan's units."""
    import sys

    import torch.distributed._composable.replicate  # noqa: F401 - the module, which its function shadows

    state = sys.modules["torch.distributed._composable.replicate"]._ReplicateState
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if isinstance(getattr(hook, "__self__", None), state)]:
                del hooks[key]


def _forward_backward(step, watch: Watch, full: tuple, expected: Any) -> tuple[list[Diagnostic], bool]:
    """The training step's phases on this rank's share of the whole inputs `full`, inside `watch`: what
    went wrong, and whether the backward ran."""
    ctx = step.ctx
    try:
        output = step.forward(ctx.model, full)
    except Exception as e:  # noqa: BLE001 - the step's failure is the finding
        return [_raised_in(ctx, watch, e, "forward")], False
    mismatch = _shard_of(output, expected)
    if mismatch is not None and not isinstance(step.output_layout, ir.Shard):
        return [_loss_diagnostic(ctx, watch, f"the loss is handed {mismatch}")], False
    try:
        loss = step.loss(step.whole(output), full)
    except Exception as e:  # noqa: BLE001
        return [_loss_diagnostic(ctx, watch, f"the loss raises: {raised.summary(e)}")], False
    try:
        step.backward(loss)
    except Exception as e:  # noqa: BLE001
        return [_raised_in(ctx, watch, e, "backward")], False
    return [], True


def _unsharded(
    ctx, reference: nn.Module, full: tuple
) -> tuple[Any, dict[str, tuple], dict[str, list[tuple]], str | None]:
    """The unsharded model's output, its parameters' shapes, what each of its modules received in each call, for what
    SL221 and SL222 compare with, and what it raised (None: nothing). Under context_parallel a module whose gradients a data-parallel block
    over the cp dim reduces is compared with what the unsharded model hands it on this rank's shard of the
    sequence (each cp rank's gradient is its shard's share, and that block sums the shares), any other with
    the whole sequence's; the output with the shard's under `output = local`."""
    if _on_meta(reference):
        reference.to_empty(device="cpu")
    try:
        with Watch(reference) as unsharded, torch.no_grad():
            expected = reference(*full)
        shapes = {n: tuple(t.shape) for n, t in reference.named_parameters()}
    except Exception as e:  # noqa: BLE001 - a model that fails on its example input unsharded, or under fake tensors
        return None, {}, {}, raised.summary(e)
    cp = ctx.plan.context_parallel
    if cp is None:
        return expected, shapes, unsharded.calls, None
    try:
        with Watch(reference) as sharded, torch.no_grad():
            on_shard = reference(*_sequence_shard(ctx, full))
    except Exception:  # noqa: BLE001 - compared with the whole sequence's, as without context_parallel
        return expected, shapes, unsharded.calls, None
    summed = _reduced_over(ctx, cp.mesh)
    received = {n: sharded.calls.get(n, got) if summed(n) else got for n, got in unsharded.calls.items()}
    return (expected if cp.whole_output else on_shard), shapes, received, None


def _sequence_shard(ctx, full: tuple) -> tuple:
    """This rank's shard of every sequence-shaped input, as context_parallel's hook cuts it."""
    from ..runtime.context_layout import along_sequence

    layout, rank = ctx.sequence_split()
    cut, _ = along_sequence(full, lambda x: layout.split(x, 1, rank))
    return cut


def _reduced_over(ctx, mesh: ir.MeshRef):
    """fqn -> whether the fully_shard or replicate unit holding module `fqn` reduces its gradients over the
    (one) dim of `mesh`."""
    from ..compiler.predict import enclosing, units_by_module

    units = units_by_module(ctx.applied.linted.resolution)

    def summed(fqn: str) -> bool:
        unit = enclosing(fqn, units)
        block = ctx.plan.units[unit.block].mesh if unit is not None else None
        return block is not None and block.mesh == mesh.mesh and mesh.dims[0] in block.dims

    return summed


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class Watch:
    """Hooks on every module of a model while a step runs: what each received (its tensor arguments, as
    `_describe` tells them, next to what `unsharded` received in the same call: the k-th call of a module
    called several times, such as Pegasus-X's projections of global and local tokens, next to the unsharded
    model's k-th), when each last finished its forward (for
    localise.governing), whose output's gradient arrived last (the module whose backward runs), and the
    modules whose whole plain parameters (the shapes of the unsharded model's, `shapes`) met a piece of
    what the unsharded model hands them (`split`, in the order they ran)."""

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        unsharded: dict[str, list[tuple]] | None = None,
        shapes: dict[str, tuple] | None = None,
    ):
        from ..verification.localise import plain_name

        models = model if isinstance(model, list) else [model]
        self.names = {id(m): plain_name(n) for model in models for n, m in model.named_modules()}
        self.unsharded = unsharded or {}
        self.shapes = shapes or {}
        self.received: dict[str, tuple] = {}  # each module's last call
        self.calls: dict[str, list[tuple]] = {}  # each module's calls, in order
        self.finished: dict[str, int] = {}
        self.backward: list[str] = []
        self.split: dict[str, tuple[str, ...]] = {}
        self._running: list[str] = []
        self._ticks = itertools.count()
        self._handles: list = []

    def __enter__(self) -> Watch:
        register = torch.nn.modules.module
        self._handles = [
            register.register_module_forward_pre_hook(self._before),
            register.register_module_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.received[name] = tuple(a for a in args if isinstance(a, torch.Tensor))
            self.calls.setdefault(name, []).append(self.received[name])
            self._running.append(name)

    def _after(self, module, args, output) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        if name in self._running:
            del self._running[len(self._running) - 1 - self._running[::-1].index(name) :]
        self.finished[name] = next(self._ticks)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, name=name: self.backward.append(name))
        # After the module's forward (and before its own hooks: FSDP's reshard) its parameters are whole.
        if self.shapes and name not in self.split and self._whole_plain(module, name) and self._pieces(name):
            self.split[name] = self._pieces(name)

    def _whole_plain(self, module: nn.Module, name: str) -> bool:
        """Whether `module` has trained parameters of its own, each a plain tensor of the unsharded shape."""
        from torch.distributed.tensor import DTensor

        own = [(k, p) for k, p in module._parameters.items() if p is not None and p.requires_grad]
        return bool(own) and all(
            not isinstance(p, DTensor) and tuple(p.shape) == self.shapes.get(f"{name}.{k}" if name else k)
            for k, p in own
        )

    def _pieces(self, fqn: str) -> tuple[str, ...]:
        """What module `fqn` received as a plain piece of what the unsharded model hands it."""
        from torch.distributed.tensor import DTensor

        got, want = self.received.get(fqn, ()), self._unsharded_call(fqn)
        return tuple(
            f"argument {i}: {_describe(t, w)}"
            for i, (t, w) in enumerate(zip(got, want))
            if not isinstance(t, DTensor) and _piece_of(tuple(t.shape), tuple(w.shape))
        )

    def _unsharded_call(self, fqn: str) -> tuple:
        """What the unsharded model handed module `fqn` in the call it is in now (its k-th): nothing where the
        unsharded model called it fewer times."""
        calls = self.unsharded.get(fqn, [])
        k = len(self.calls.get(fqn, ())) - 1
        return calls[k] if 0 <= k < len(calls) else ()

    def running(self) -> str | None:
        """The innermost module whose forward is running (None outside every module)."""
        return self._running[-1] if self._running else None

    def inputs(self, fqn: str) -> tuple[str, ...]:
        """What module `fqn` received, one line per tensor argument."""
        got, want = self.received.get(fqn, ()), self._unsharded_call(fqn)
        return tuple(f"argument {i}: {_describe(t, want[i] if i < len(want) else None)}" for i, t in enumerate(got))


def _piece_of(shape: tuple, whole: tuple) -> bool:
    """Whether a tensor of `shape` is a piece of one of `whole`: as many dims, none larger, one smaller."""
    return len(shape) == len(whole) and shape != whole and all(g <= w for g, w in zip(shape, whole))


def _describe(tensor: torch.Tensor, unsharded: torch.Tensor | None, whose: str = "the unsharded model hands it") -> str:
    """A DTensor's shape and placements, or a plain tensor's shape and, where the unsharded model handed
    the module another shape, along which dims it is a piece of that."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        placed = placed_as(tensor)
        dims = placed.dims or tuple(f"dim {i}" for i in range(tensor.device_mesh.ndim))
        places = ", ".join(f"{p} over {d}" for p, d in zip(placed.placements, dims))
        return f"a DTensor of shape {tuple(tensor.shape)}, {places}"
    text = f"a plain tensor of shape {tuple(tensor.shape)}"
    if unsharded is None or tuple(unsharded.shape) == tuple(tensor.shape):
        return text
    split = [
        f"dim {d} ({w} -> {g})"
        for d, (g, w) in enumerate(zip(tensor.shape, unsharded.shape))
        if g != w and len(tensor.shape) == len(unsharded.shape)
    ]
    pieces = f": a shard along {', '.join(split)}" if split else ""
    return f"{text} where {whose} {tuple(unsharded.shape)}{pieces}"


def _takes(ctx, fqn: str) -> str | None:
    """What the built-in style of the rule on module `fqn` takes as its input, from the rule."""
    rule = next((r.rule for r in ctx.applied.linted.resolution.rules if r.fqn == fqn), None)
    if rule is None or rule.style.use is not None:
        return None
    given = rule.style.get("input")
    takes = given if given is not None else TAKES.get(rule.style.name)
    if takes is None:
        return None
    text = takes if isinstance(takes, str) else _layout_text(takes)
    return f"its rule `{rule.style.name}` takes its input as {text}"


def _layout_text(layout) -> str:
    if isinstance(layout, tuple):
        return f"({', '.join('_' if x is None else str(x) for x in layout)})"
    return str(layout)


def _raised_in(ctx, watch: Watch, error: Exception, phase: str) -> Diagnostic:
    """SL220 at the rule governing the module where the step raised: in the forward, the innermost module
    of the traceback; in the backward, the module whose output's gradient arrived last."""
    found = raised.raising_module(ctx.model, error)
    if found is None and phase == "backward" and watch.backward:
        fqn = watch.backward[-1]
        module = ctx.model.get_submodule(fqn)
        found = (fqn, module, None)
    what = raised.summary(error)
    if found is None:
        return Diagnostic(
            SL220,
            f"the simulated training step raises in its {phase}, outside every module of the model: {what}",
            None,
            ("run `shardlang apply` with --debug for the full traceback",),
        )
    fqn = found[0]
    given = watch.received.get(fqn, ())
    swapped = raised.swapped_pair(ctx, fqn, found[1], given[0] if given else None)
    detail = (*watch.inputs(fqn), *filter(None, [_takes(ctx, fqn), swapped]))
    place = raised.module_text(found) if phase == "forward" else f"module '{fqn or 'root'}', in its backward"
    return raised.in_module(
        ctx, found, f"the simulated training step raises in {place}: {what}", watch.finished, SL220, detail
    )


def _shard_of(output: Any, expected: Any) -> str | None:
    """Where the sharded model's output is a plain tensor of another shape than the unsharded model's, what
    it is; None where it is not."""
    from torch.distributed.tensor import DTensor

    got, want = _first(output), _first(expected)
    if got is None or want is None or isinstance(got, DTensor) or tuple(got.shape) == tuple(want.shape):
        return None
    return _describe(got, want, "the unsharded model's output is")


def _first(value: Any) -> torch.Tensor | None:
    """The first tensor of an output (a tensor, or one inside tuples, lists, dicts, a ModelOutput)."""
    from torch.utils._pytree import tree_leaves

    return next((leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)


def _loss_diagnostic(ctx, watch: Watch, what: str) -> Diagnostic:
    """SL221 at the rule of the module that finished last among those a rule governs (the output layer),
    else at what governs the module that finished last."""
    latest = sorted(watch.finished, key=watch.finished.get, reverse=True)
    fqn = next((n for n in latest if n and _governed(ctx, n)), latest[0] if latest else None)
    help = (
        "the model file's loss reads the model's output as the unsharded model gives it: give the last layer's "
        "rule output=replicate (a colwise output layer), or declare loss_parallel and keep it a DTensor",
    )
    if fqn is None:
        return Diagnostic(SL221, f"the simulated training step: {what}", None, help)
    module = ctx.model.get_submodule(fqn)
    message = f"the simulated training step: {what} (the output of '{fqn}')"
    return raised.in_module(ctx, (fqn, module, None), message, watch.finished, SL221, help)


def _governed(ctx, fqn: str) -> bool:
    return any(r.fqn == fqn for r in ctx.applied.linted.resolution.rules)


def _partial_gradients(ctx, watch: Watch) -> list[Diagnostic]:
    """SL222 for the modules no rule governs whose whole plain parameters met a piece of their input, one
    diagnostic for the modules of one kind that met the same pieces (the norms of every block), in the order
    they ran."""
    kinds: dict[tuple, list[str]] = {}
    for fqn, pieces in watch.split.items():
        if _governed(ctx, fqn):
            continue  # its style decides what its parameters are and how their gradients are summed
        module = ctx.model.get_submodule(fqn)
        own = ", ".join(k for k, p in module._parameters.items() if p is not None and p.requires_grad)
        kinds.setdefault((type(module).__name__, own, pieces), []).append(fqn)
    found = []
    for (kind, own, pieces), names in kinds.items():
        first = names[0]
        others = f" (and {len(names) - 1} more like it: {few(names[1:], 3)})" if len(names) > 1 else ""
        message = (
            f"the simulated training step hands module '{first}' ({kind}){others}, whose parameters ({own}) are "
            "whole on every rank, a piece of its input: each rank's gradient of them is its piece's share, and "
            "nothing sums the shares"
        )
        help = (
            *pieces,
            "give it a rule that matches its input (sequence_parallel for a norm on sequence shards), or make its "
            "input whole before it (prepare_input on it or output=replicate on the rule before it)",
        )
        module = ctx.model.get_submodule(first) if first else ctx.model
        found.append(raised.in_module(ctx, (first, module, None), message, watch.finished, SL222, help))
    return found
