"""Where a failing training step first goes wrong: the first module whose output (or the gradient it
sends back to its inputs) disagrees with the unsharded model's although what it was given agrees, and
the plan statements that govern it.

The step is run once more with hooks on every module of the sharded model and of the two references
(the float64 truth and the one computing in the sharded model's precision). Each call of a module is
recorded at both ends, in both directions: in forward, the tensors it was given (before any hook of
its own, a style's included, touched them) and its output (after them all); in backward, the gradient
it was given (with respect to its output, as it arrived from later modules) and the gradient it sent
back to each input along its own path (through its hooks too). A style that reduces a gradient in a
hook of its module, wrongly, thus shows as that module's departure, not as the module before it. A
tensor on a tensor-parallel rank may be a DTensor (made whole with `full_tensor()`) or a local tensor
whose layout the hooks cannot see; a local tensor is gathered from the TP group and taken as it is,
summed (a partial result), or concatenated along any dim that gives the reference's shape, and it
agrees if any of these agrees. Each recorded tensor gets a ratio: its error over the gradients
check's tolerance (K times the reference's own rounding error).

A fault is evident in a direction when some record is CLEAR times over its tolerance. Errors grow as
they flow (a bf16 fault just over its tolerance becomes several times over two modules later), so
the first record over CLEAR need not be the fault's: named is the first module, in flow order up to
that record, that *departs*, its outgoing tensor over its tolerance and more than GROWTH times as far
over as what it was given (see `departs`). When no module departs (its inputs cannot be read), the
first record over CLEAR is named. Forward is looked at first, in the order modules finished; then
backward, in the order its gradients arrived. When every activation and activation gradient agrees,
the module holding the parameter with the worst gradient is named: its parameter's gradient is wrong
although everything flowing through it is right (a missing reduction).

Two findings name another module than the record's. Where the record named is an input made by code that
is no module's, cut from the output of a module a parallelize rule places that agrees gathered whole, the
model's own code split that output (a packed weight's `chunk` or `view`) and each rank's slice is not
the part the split expects: that rule's module is named, and `packed_colwise(parts=N)` suggested where a
replay with the output so laid out makes the input agree (`_split_after`). Under context parallelism,
where module outputs hold shards of the sequence and are not compared, a module outside the split
attention whose output at a position depends on others (compiler.rules.positions, on the truth) is
named before any parameter (`_mixing_positions`).

Calls inside experts that a rule splits are left out (`_inside_split_experts`): under expert parallelism a
module inside them runs on the rows sent to its rank's experts, which do not pair with the unsharded
model's; the experts module's own input and output, whole, are compared.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import layout as lay
from .recording import Recording, plain_name, record
from .reference import K, inputs_for
from .step import Step

__all__ = ["governing", "localise", "plain_name"]

#: How far beyond the gradients check's tolerance a record must be for a fault to be evident in its
#: direction: activations of a correct plan sit near the tolerance more often than parameters'
#: gradients do (a bf16 activation gradient passes through every later layer's rounding), and a fault
#: is off by far more.
CLEAR = 4.0
#: How many times further over its tolerance a module's outgoing tensor must be than what it was given,
#: for the module to have added an error of its own rather than passed one on (each tensor's tolerance
#: is its own reference's rounding, so an error a module merely carries keeps about its ratio).
GROWTH = 2.0
#: The part counts a packed output is tried with, when the model's own code splits a rule's output.
PARTS = (2, 3, 4)


def localise(ctx, references, inputs: tuple, where, args: dict, failing_params: list[str]) -> dict[str, Any] | None:
    """Run one step again with hooks; where the sharded model first disagrees, or None if it cannot say.
    A pipeline's stages run through their schedule, microbatch by microbatch, where module hooks cannot be
    paired with the unsharded model's: each rank names the module of its first failing parameter."""
    if ctx.pipeline is not None:
        return _by_parameter(ctx, failing_params)
    if ctx.plan.context_parallel is not None:
        # each rank's modules see its shard of the sequence, the reference's the whole: not comparable; a
        # module outside the split attention that mixes positions computes from part of the sequence
        mixing = _mixing_positions(ctx, references.truth, inputs)
        if mixing is not None:
            return mixing
        return _by_parameter(ctx, failing_params, "(context parallelism: module outputs hold shards of the sequence)")
    try:
        sharded = record(ctx.model, lambda m, stop: _sharded_step(ctx, m, inputs, where, args, stop))
        truth = record(references.truth, lambda m, stop: _reference_step(ctx, m, inputs, stop))
        same = record(references.same, lambda m, stop: _reference_step(ctx, m, inputs, stop))
    finally:
        ctx.model.zero_grad(set_to_none=True)
    group = _tp_group(ctx, where)
    hidden = _inside_split_experts(ctx, references.truth)
    for backward in (False, True):
        kind = "grads" if backward else "flows"
        want, rounding = dict(getattr(truth, kind)), dict(getattr(same, kind))
        # The records in the truth's order (backward may reach modules in another order on each rank),
        # every rank reading every record: the same collectives everywhere, in the same order.
        order = {key: i for i, (key, _) in enumerate(getattr(truth, kind))}
        mine = [r for r in getattr(sharded, kind) if not _under(r[0], hidden)]
        records = sorted(mine, key=lambda record: (order.get(record[0], len(order)), record[0]))
        if not _same_everywhere(len(records)):
            return None  # the ranks ran different modules: no record-by-record comparison is possible
        readings = _all_readings([got for _, got in records], group)
        ratios = _largest_anywhere(
            [_ratio(read, want.get(key), rounding.get(key), K) for (key, _), read in zip(records, readings)]
        )
        named = first_departure([key for key, _ in records], ratios, backward)
        if named is not None:
            key, ratio = named
            call, _, role = key.partition(" ")
            if not backward and role.startswith("in"):
                agreeing = {k for (k, _), r in zip(records, ratios) if r is not None and r <= 1.0}
                split = _split_after(ctx, sharded, key, agreeing, (want, rounding), (inputs, where, args, group))
                if split is not None:
                    return split
            what = _WHAT[backward, role.split()[0]]
            if backward and role == "out":
                # A gradient given wrong, that no module sent back wrong: the loss's (where it is the first
                # to arrive), to the innermost module whose output the outer ones passed on unchanged.
                call = sharded.innermost(call)
                from_loss = key == records[0][0]
                what += ", as the loss sent it back" if from_loss else ""
                if from_loss and ctx.plan.compile_loss is not None:
                    found = _found(ctx, call, what, ratio)
                    sent = _statement(ctx.plan, ctx.plan.compile_loss.span, "the compiled loss that sent it")
                    found["statements"].insert(0, sent)
                    return found
            return _found(ctx, call, what, ratio)
    return _by_parameter(
        ctx,
        failing_params,
        "(its output and the gradient reaching it agree: a reduction of this parameter's gradient is missing or wrong)",
    )


#: Each record's key is `name#call role`: in forward, `in I` is the call's input I as it was given, `out`
#: its output; in backward, `out` is the gradient it was given (with respect to its output) and `in I`
#: the gradient it sent back to input I. What a named record is, as the diagnostic says it:
_WHAT = {
    (False, "out"): "output",
    (False, "in"): "input, made by code around it that is no module's (its output came out right)",
    (True, "out"): "gradient with respect to its output",
    (True, "in"): "gradient with respect to its input",
}


def first_departure(keys: list[str], ratios: list[float | None], backward: bool = False) -> tuple[str, float] | None:
    """Of one direction's records in flow order (`keys`, with their error / tolerance `ratios`), the one
    to name: None when none is CLEAR times over its tolerance (no fault evident in this direction); else
    the first outgoing record (forward: an output; backward: a gradient sent back to an input), up to the
    first one over CLEAR, whose module call departs from what it was given; else that first one over
    CLEAR itself.

    >>> keys = ["a#1 in 0", "a#1 out", "b#1 in 0", "b#1 out"]
    >>> first_departure(keys, [0.2, 2.0, 2.0, 5.0])  # a departs under CLEAR; b carries its error on
    ('a#1 out', 2.0)
    >>> first_departure(keys, [0.2, 1.5, 1.5, 0.9]) is None  # no fault evident: the parameters' turn
    True
    >>> first_departure(["b#1 out", "b#1 in 0", "a#1 out", "a#1 in 0"], [0.1, 9.0, 9.0, 9.5], backward=True)
    ('b#1 in 0', 9.0)
    """
    clear = next((i for i, r in enumerate(ratios) if r is not None and r > CLEAR), None)
    if clear is None:
        return None
    outgoing = "in" if backward else "out"
    given: dict[str, float] = {}
    for key, ratio in zip(keys, ratios):
        call, _, role = key.partition(" ")
        if ratio is not None and role.split()[0] != outgoing:
            given[call] = max(given.get(call, 0.0), ratio)
    for key, ratio in zip(keys[: clear + 1], ratios[: clear + 1]):
        call, _, role = key.partition(" ")
        if ratio is not None and role.split()[0] == outgoing and departs(ratio, given.get(call)):
            return key, ratio
    return keys[clear], ratios[clear]


def departs(ratio: float, given: float | None) -> bool:
    """Whether a module call whose outgoing tensor is `ratio` times its tolerance added an error of its
    own: over its tolerance, and over GROWTH times as far over as what it was given (`given`: the largest
    ratio of the tensors it was given; None when none could be compared, as the model's own integer
    input, which is exact)."""
    return ratio > 1.0 and ratio > GROWTH * (given or 0.0)


def _inside_split_experts(ctx, truth) -> tuple[str, ...]:
    """The modules whose calls inside them do not pair with the unsharded model's: each module holding
    experts (stacked on dim 0, or the members of a ModuleList or ModuleDict, as the unsharded truth holds
    them) that a parallelize rule places. Under expert parallelism a module inside such experts runs on the
    rows sent to this rank's experts, in the order they arrived (transformers' `act_fn` on every received
    row, a ModuleList's member on its own), where the unsharded model's runs on every token's: their records
    differ for the layout's sake alone. The experts module's own input and output (before the dispatch and
    after the combine, whole) are compared, and name a fault in the dispatch or the experts."""
    from ..compiler.predict import expert_members, stacked_experts

    found = []
    for fqn in dict.fromkeys(m.fqn for m in ctx.applied.linted.resolution.rules):
        try:
            module = truth.get_submodule(fqn)
        except AttributeError:
            continue
        if stacked_experts(module) is not None or expert_members(module) is not None:
            found.append(fqn)
    return tuple(found)


def _under(key: str, modules: tuple[str, ...]) -> bool:
    """Whether record `key`'s module is strictly inside one of `modules` (the root's name is "")."""
    name = key.partition(" ")[0].rpartition("#")[0]
    return any(name.startswith(f"{m}.") if m else bool(name) for m in modules)


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


def _split_after(ctx, sharded: Recording, key: str, agreeing: set[str], wanted, step) -> dict[str, Any] | None:
    """Where a module's input, made by code that is no module's, is the first record that disagrees, and
    that code made it from the output of a module a parallelize rule places, which agrees as a whole: the
    model's own code splits that output (a `chunk` of packed [gate; up], a `view` of packed [q; k; v]) and
    each rank's slice is not the part the split expects. That rule is named (not the module its pieces
    reach, whose own rules are not at fault), and `packed_colwise(parts=N)` suggested where replaying the
    forward with the output so laid out makes the input agree. None when no such rule made it."""
    resolution = ctx.applied.linted.resolution
    ruled = {m.fqn for m in resolution.rules}
    made_from = [c for c in sharded.sources(key) if c.rpartition("#")[0] in ruled and f"{c} out" in agreeing]
    if not made_from:
        return None
    call = made_from[-1]  # the nearest
    consumer = key.partition(" ")[0].rpartition("#")[0]
    what = (
        f"output, which agrees gathered whole, but which the model's own code splits before it reaches "
        f"'{consumer}', whose input disagrees: each rank's slice of it is not the part that split expects"
    )
    found = _found(ctx, call, what, None)
    parts = _packed_parts(ctx, call.rpartition("#")[0], key, wanted, step)
    found["help"] = [
        f"packed_colwise(parts={parts}) gives each rank its slice of every one of the {parts} parts: replayed "
        f"with its output so laid out, the input of '{consumer}' agrees"
        if parts is not None
        else f"laid out as packed_colwise(parts={', '.join(map(str, PARTS))}) lays it out, the input of '{consumer}' "
        "disagrees too: the code that splits it expects another layout of each rank's slice, or the whole output "
        "(a head count read from the model's config, say)"
    ]
    return found


def _packed_parts(ctx, fqn: str, key: str, wanted, step) -> int | None:
    """The part count N (of PARTS) for which the forward, replayed with module `fqn`'s output laid out as
    `packed_colwise(parts=N)` lays it out (each TP rank's slice of every part, from its output gathered),
    gives the input recorded as `key` that agrees with the truth; None if none does. Every rank replays."""
    inputs, where, args, group = step
    module = next((m for name, m in ctx.model.named_modules() if plain_name(name) == fqn), None)
    want, rounding = wanted
    if group is None or module is None or key not in want:
        return None
    for parts in PARTS:
        handle = module.register_forward_hook(lambda _m, _a, out, parts=parts: _as_packed(out, parts, group))
        try:
            replayed = record(ctx.model, lambda m, stop: _forward_only(ctx, m, inputs, where, args))
        finally:
            handle.remove()
        got = [t for k, t in replayed.flows if k == key]
        if not _same_everywhere(len(got)) or not got:
            return None
        (ratio,) = _largest_anywhere([_ratio(_all_readings(got, group)[0], want[key], rounding.get(key), K)])
        if ratio is not None and ratio <= 1.0:
            return parts
    return None


def _as_packed(output, parts: int, group):
    """A module's local output as `packed_colwise(parts)` would leave it on this rank: gathered whole over
    `group` (along its last dim) and cut into this rank's slice of each part; as it is where it cannot be."""
    ranks = dist.get_world_size(group)
    if isinstance(output, DTensor) or not isinstance(output, torch.Tensor):
        return output
    pieces = [torch.empty_like(output) for _ in range(ranks)]
    dist.all_gather(pieces, output.contiguous(), group=group)
    whole = torch.cat(pieces, dim=-1)
    if whole.shape[-1] % (parts * ranks):
        return output
    cut = whole.unflatten(-1, (parts, ranks, whole.shape[-1] // (parts * ranks)))
    return cut.select(-2, dist.get_rank(group)).flatten(-2)


def _forward_only(ctx, model, inputs, where, args) -> None:
    with torch.no_grad():
        Step(ctx, where, args.get("input"), eagerly=True).forward(model, inputs)


def _mixing_positions(ctx, truth, inputs: tuple) -> dict[str, Any] | None:
    """Under context parallelism, the first module outside the attention it splits whose output at a
    position depends on other positions (compiler.rules.positions, run on the truth: every rank finds the
    same), at the context_parallel statement and the rules governing it; None when there is none."""
    from ..compiler.rules.positions import position_mixers

    split = ctx.applied.linted.resolution.context
    try:  # no collectives inside: a rank whose forward raised here names a parameter, as before
        mixers = position_mixers(truth, inputs_for(truth, inputs), split)
    except Exception:  # noqa: BLE001 - the failing check's message stands without the finding
        return None
    if not mixers:
        return None
    what = (
        "output, which at each position depends on other positions of the sequence: context_parallel splits "
        "the sequence, and only the attention it names sees the whole of it"
    )
    found = _found(ctx, f"{mixers[0]}#1", what, None)
    cp = ctx.plan.context_parallel
    found["statements"].insert(
        0,
        _statement(
            ctx.plan,
            cp.span,
            f"context_parallel, which runs it on each rank's shard alone (it splits only {', '.join(split)})",
        ),
    )
    return found


def _same_everywhere(count: int) -> bool:
    largest, negated = lay.largest_everywhere([count, -count])
    return int(largest) == -int(negated)


def _largest_anywhere(ratios: list[float | None]) -> list[float | None]:
    """Each record's ratio as the largest over every rank, so that every rank names the same module (a
    rank that returned early while another went on reading would leave it waiting forever)."""
    values = lay.largest_everywhere([-1.0 if r is None else min(r, 1e300) for r in ratios])
    return [None if v < 0 else v for v in values]


def _sharded_step(ctx, model, inputs, where, args, stop) -> None:
    # Compiled modules run eagerly (their hooks could not run inside compiled code); the loss is the
    # check's, compiled where the plan compiles it.
    step = Step(ctx, where, args.get("input"), args.get("output"), eagerly=True)
    output = step.forward(model, inputs)
    stop()
    step.finish(output, inputs)


def _reference_step(ctx, model, inputs, stop) -> None:
    model.zero_grad(set_to_none=True)
    output = model(*inputs_for(model, inputs))
    stop()
    lay.loss(ctx, output, inputs).backward()
    model.zero_grad(set_to_none=True)


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
    summed over the TP group (a partial result, where the ranks hold different values), or concatenated
    along each dim."""
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
        # Equal on every rank is replicated, not partial: a gradient a style averaged over the TP group where
        # it should have summed is the same on every rank, and its sum would look right.
        if all(p.shape == tensor.shape for p in locals_) and not all(torch.equal(p, locals_[0]) for p in locals_):
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
    finite = t.isfinite()  # an additive attention mask holds -inf: those places agree where they are equal
    rms = float(t[finite].norm()) / math.sqrt(n)
    allowed = k * float(_difference(s, t).norm()) + k * torch.finfo(torch.float32).eps * rms * math.sqrt(n)
    best = None
    for reading in readings:
        if reading.shape != t.shape:
            continue
        error = float(_difference(reading.detach().to(t.device).double(), t).norm())
        ratio = math.inf if not math.isfinite(error) else error / allowed if allowed > 0 else (error > 0) * math.inf
        best = ratio if best is None else min(best, ratio)
    return best


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b, 0 where they are equal (infinities included: inf - inf would be nan)."""
    return torch.where(a == b, torch.zeros_like(a), a - b)


def _found(ctx, key: str, what: str, ratio: float | None) -> dict[str, Any]:
    fqn, _, call = key.rpartition("#") if "#" in key else (key, "", "1")
    module = ctx.model.get_submodule(fqn)
    return {
        "module": fqn or "root",
        "class": type(module).__name__.removeprefix("FSDP"),
        "call": int(call),
        "what": what,
        "ratio": ratio,
        # Rules inside it too: a module that departs while every module inside it agrees made its error
        # in its own code or hooks, from their outputs, whose layouts those rules set.
        "statements": governing(ctx, fqn, inside=bool(fqn)),
    }


def _statement(plan, span, what: str) -> dict[str, Any]:
    """A plan statement as a finding names it: where it is, its line, and what it has to do with it."""
    return {
        "file": span.file,
        "line": span.line,
        "col": span.col,
        "end_line": span.end_line,
        "end_col": span.end_col,
        "text": plan.source.line_text(span.line).strip(),
        "what": what,
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
            found.append(_statement(plan, span, what))

    cp = plan.context_parallel
    if cp is not None and (not fqn or fqn in resolution.context):
        # its modules, and the root, whose hooks split the inputs and gather the outputs
        add(cp.span, "context_parallel over it" if fqn else "context_parallel, whose hooks split the sequence")
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
