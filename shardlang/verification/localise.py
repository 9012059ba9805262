"""Where a failing training step first goes wrong: the first module whose output, or whose gradient with
respect to its output, disagrees with the unsharded model's, and the plan statements that govern it.

The step is run once more with hooks on every module of the sharded model and of the two references
(the float64 truth and the one computing in the sharded model's precision). A module's output on a
tensor-parallel rank may be a DTensor (made whole with `full_tensor()`) or a local tensor whose layout
the hooks cannot see; a local tensor is gathered from the TP group and taken as it is, summed (a
partial result), or concatenated along any dim that gives the reference's shape, and it agrees if any
of these agrees. A module disagrees when no reading of its output is within the gradients check's
tolerance (K times the reference's own rounding error) by a clear margin (CLEAR times). Forward outputs are compared in the order the
modules finished; gradients in the order backward reached them. When every activation and activation
gradient agrees, the module holding the parameter with the worst gradient is named: its parameter's
gradient is wrong although everything flowing through it is right (a missing reduction).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import layout as lay
from .reference import K, inputs_for

#: How far beyond the gradients check's tolerance an activation must be to be named: activations of a
#: correct plan sit near the tolerance more often than parameters' gradients do (a bf16 activation
#: gradient passes through every later layer's rounding), and a fault is off by far more.
CLEAR = 4.0
#: Module names that wrappers insert and the unsharded model does not have.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def localise(ctx, references, inputs: tuple, where, args: dict, failing_params: list[str]) -> dict[str, Any] | None:
    """Run one step again with hooks; where the sharded model first disagrees, or None if it cannot say.
    A pipeline's stages run through their schedule, microbatch by microbatch, where module hooks cannot be
    paired with the unsharded model's: each rank names the module of its first failing parameter."""
    if ctx.pipeline is not None:
        return _by_parameter(ctx, failing_params)
    try:
        sharded = _record(ctx.model, lambda m, stop: _sharded_step(ctx, m, inputs, where, args, stop))
        truth = _record(references.truth, lambda m, stop: _reference_step(ctx, m, inputs, stop))
        same = _record(references.same, lambda m, stop: _reference_step(ctx, m, inputs, stop))
    finally:
        ctx.model.zero_grad(set_to_none=True)
    group = _tp_group(ctx, where)
    for kind, label in (("outputs", "output"), ("grads", "gradient with respect to its output")):
        want, rounding = dict(getattr(truth, kind)), dict(getattr(same, kind))
        # The records in the truth's order (backward may reach modules in another order on each rank),
        # every rank reading every record: the same collectives everywhere, in the same order.
        order = {key: i for i, (key, _) in enumerate(getattr(truth, kind))}
        records = sorted(getattr(sharded, kind), key=lambda record: (order.get(record[0], len(order)), record[0]))
        if not _same_everywhere(len(records)):
            return None  # the ranks ran different modules: no record-by-record comparison is possible
        readings = _all_readings([got for _, got in records], group)
        ratios = _largest_anywhere(
            [_ratio(read, want.get(key), rounding.get(key), K) for (key, _), read in zip(records, readings)]
        )
        first = next((i for i, ratio in enumerate(ratios) if ratio is not None and ratio > CLEAR), None)
        if first is not None:
            return _found(ctx, records[first][0], label, ratios[first])
    return _by_parameter(
        ctx,
        failing_params,
        "(its output and the gradient reaching it agree: a reduction of this parameter's gradient is missing or wrong)",
    )


def _by_parameter(ctx, failing_params: list[str], why: str = "") -> dict[str, Any] | None:
    if not failing_params:
        return None
    name = failing_params[0]
    found = _found(
        ctx, f"{name.rpartition('.')[0]}#1", f"gradient of its parameter {name.rpartition('.')[2]} {why}".rstrip(), None
    )
    stages = ctx.applied.linted.resolution.stages
    stage = stages.stage_of(name.rpartition(".")[0]) if stages is not None else None
    if stage is not None:
        found["what"] += f", in pipeline stage {stage}"
    return found


def _same_everywhere(count: int) -> bool:
    largest, negated = lay.largest_everywhere([count, -count])
    return int(largest) == -int(negated)


def _largest_anywhere(ratios: list[float | None]) -> list[float | None]:
    """Each record's ratio as the largest over every rank, so that every rank names the same module (a
    rank that returned early while another went on reading would leave it waiting forever)."""
    values = lay.largest_everywhere([-1.0 if r is None else min(r, 1e300) for r in ratios])
    return [None if v < 0 else v for v in values]


class _Recording:
    def __init__(self):
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self.grads: list[tuple[str, torch.Tensor]] = []
        self.forward = True


def _record(model, step) -> _Recording:
    """Run `step(model, stop)` with a forward hook on every module; `stop()` ends the forward phase."""
    recording = _Recording()
    calls: Counter = Counter()
    handles = [m.register_forward_hook(_hook(recording, plain_name(n), calls)) for n, m in model.named_modules()]
    try:
        step(model, lambda: setattr(recording, "forward", False))
    finally:
        for handle in handles:
            handle.remove()
    return recording


def _hook(recording: _Recording, name: str, calls: Counter):
    def hook(module, args, output):
        if not recording.forward:  # recomputation under activation checkpointing: already recorded
            return
        tensor = _first_tensor(output)
        if tensor is None:
            return
        calls[name] += 1
        key = f"{name}#{calls[name]}"
        recording.outputs.append((key, tensor.detach()))
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: recording.grads.append((key, grad.detach())))

    return hook


def _sharded_step(ctx, model, inputs, where, args, stop) -> None:
    output = model(*lay.local_inputs(inputs, where, args.get("input")))
    stop()
    whole = lay.full_output(ctx, where, output, args.get("output"))
    with lay.loss_context(ctx.plan):
        lay.loss(ctx, whole, inputs).backward()


def _reference_step(ctx, model, inputs, stop) -> None:
    model.zero_grad(set_to_none=True)
    output = model(*inputs_for(model, inputs))
    stop()
    lay.loss(ctx, output, inputs).backward()
    model.zero_grad(set_to_none=True)


def plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _first_tensor(value) -> torch.Tensor | None:
    """The first floating-point tensor of a module's output (a tensor, a tuple, a dict or a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _tp_group(ctx, where):
    mesh = lay.tp_mesh(ctx, where)
    if mesh is None:
        return None
    return mesh.get_group() if mesh.ndim == 1 else None


def _all_readings(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """For each of the sharded model's recorded tensors, the ways it can be read as a whole tensor. One
    all_gather_object over the TP group for all of them: every rank makes the same single call, whatever
    kind of tensor each record holds on it."""
    mine = [_portable(t) for t in tensors]
    if group is None or dist.get_world_size(group) == 1:
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    return [_readings(t, [theirs[i] for theirs in everyone]) for i, t in enumerate(tensors)]


def _portable(tensor: torch.Tensor) -> tuple:
    """A recorded tensor as plain data: its local values on the CPU, and a DTensor's placements."""
    if isinstance(tensor, DTensor):
        placements = tuple((type(p).__name__, getattr(p, "dim", None)) for p in tensor.placements)
        return tensor.to_local().detach().cpu(), placements
    return tensor.detach().cpu(), None


def _readings(tensor: torch.Tensor, pieces: list[tuple]) -> list[torch.Tensor]:
    """A DTensor on the TP mesh is assembled as its placement says; a local tensor is read as it is,
    summed over the TP group (a partial result), or concatenated along each dim."""
    device = tensor.device
    locals_ = [local.to(device) for local, _ in pieces]
    placements = pieces[0][1] if pieces else None
    if isinstance(tensor, DTensor):
        if placements is None or len(placements) != 1 or len(pieces) != tensor.device_mesh.size():
            return []  # a DTensor over several mesh dims: not read here
        kind, dim = placements[0]
        if kind == "Replicate":
            return [locals_[0]]
        if kind == "Partial":
            return [torch.stack(locals_).sum(0)]
        return [torch.cat(locals_, dim=dim)] if dim is not None else []
    readings = [tensor.detach()]
    if len(locals_) > 1:
        if all(p.shape == tensor.shape for p in locals_):
            readings.append(torch.stack(locals_).sum(0))
        if all(p.ndim == tensor.ndim for p in locals_):
            for dim in range(tensor.ndim):
                try:
                    readings.append(torch.cat(locals_, dim=dim))
                except RuntimeError:
                    continue
    return readings


def _ratio(readings, truth: torch.Tensor | None, same: torch.Tensor | None, k: float) -> float | None:
    """The smallest error / allowed over the readings whose shape is the reference's; None if none is."""
    if truth is None or same is None:
        return None
    t = truth.detach().double()
    s = same.detach().to(t.device).double()
    if s.shape != t.shape:
        return None
    n = max(t.numel(), 1)
    rms = float(t.norm()) / math.sqrt(n)
    allowed = k * float((s - t).norm()) + k * torch.finfo(torch.float32).eps * rms * math.sqrt(n)
    best = None
    for reading in readings:
        if reading.shape != t.shape:
            continue
        error = float((reading.detach().to(t.device).double() - t).norm())
        ratio = math.inf if not math.isfinite(error) else error / allowed if allowed > 0 else (error > 0) * math.inf
        best = ratio if best is None else min(best, ratio)
    return best


def _found(ctx, key: str, what: str, ratio: float | None) -> dict[str, Any]:
    fqn, _, call = key.rpartition("#") if "#" in key else (key, "", "1")
    module = ctx.model.get_submodule(fqn) if fqn else ctx.model
    return {
        "module": fqn or "root",
        "class": type(module).__name__.removeprefix("FSDP"),
        "call": int(call),
        "what": what,
        "ratio": ratio,
        "statements": governing(ctx, fqn),
    }


def governing(ctx, fqn: str, inside: bool = False, finished: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The plan statements that govern module `fqn`: parallelize rules on it, with `inside` those on its
    submodules (whose outputs its own code reads: a forward that raised), the one whose module finished
    last first (`finished`: when each module's forward last finished), then rules on its ancestors
    (nearest first), the fully_shard or replicate unit holding it, and activation checkpointing."""
    from ..compiler.predict import enclosing, units_by_module

    resolution = ctx.applied.linted.resolution
    plan = ctx.plan
    found = []

    def add(span, what: str) -> None:
        if span is not None and all((s["line"], s["col"]) != (span.line, span.col) for s in found):
            found.append(
                {
                    "file": span.file,
                    "line": span.line,
                    "col": span.col,
                    "end_line": span.end_line,
                    "end_col": span.end_col,
                    "text": plan.source.line_text(span.line).strip(),
                    "what": what,
                }
            )

    rules = [m for m in resolution.rules if m.fqn == fqn or fqn.startswith(m.fqn + ".") or not m.fqn]
    below = [m for m in resolution.rules if inside and m.fqn.startswith(fqn + "." if fqn else "")]
    below.sort(key=lambda m: -(finished or {}).get(m.fqn, -1))
    for match in [*(m for m in rules if m.fqn == fqn), *below, *sorted(rules, key=lambda m: -len(m.fqn))]:
        what = "the parallelize rule on it" if match.fqn == fqn else f"a rule on {match.fqn or 'root'}"
        add(match.rule.span, what if match in rules else f"a rule inside it, on {match.fqn}")
    unit = enclosing(fqn, units_by_module(resolution))
    if unit is not None:
        block = plan.units[unit.block]
        add(unit.unit.span if unit.unit is not None else block.span, f"the {unit.kind(block)} unit holding it")
    if any(fqn == c or fqn.startswith(c + ".") for c in resolution.checkpoint) and plan.checkpoint:
        add(plan.checkpoint[0].span, "activation checkpointing")
    stage = resolution.stages.stage_of(fqn) if resolution.stages is not None else None
    if stage is not None:
        add(plan.pipeline.split_span, f"the pipeline split that puts it in stage {stage}")
    return found
