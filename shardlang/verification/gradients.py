"""gradients: each part of a training step of the sharded model, checked on its own inputs against an
unsharded reference (docs/checks.md).

Per step, on every rank, for its own data-parallel replica:
1. the loss and every gradient (`full_tensor()`) against the unsharded model trained on every
   replica's inputs (its loss the mean of theirs, as FSDP and DDP average gradients);
2. the optimizer: a reference optimizer is handed *the sharded model's own full gradients* and
   steps; the updated parameters must match the sharded optimizer's. This tests the sharded
   optimizer (its states and their sharding) and nothing else: gradient rounding, which Adam
   amplifies where a gradient is near zero, cannot reach it.
Each step starts every reference from the sharded model's parameters, so rounding does not compound.

Tolerances come from the run (reference.py). The truth is the reference in float64, kernels without a
float64 version computed by float64 replacements (truth.py); where float64 still fails, it is float32,
with its own error `own` measured by a bfloat16 copy (0 for float64). A second reference computes in the
precision the sharded model does (its parameters' dtype, and each fully_shard unit's `mixed_precision`
emulated: parameters cast, inputs and outputs cast, and gradients summed over the replicas in the
`reduce` dtype, as FSDP does); its distance from the truth is the rounding error of that precision on
these very inputs. A sharded tensor passes when

    ||sharded - truth|| <= K * (||same precision - truth|| + own) + own + K * eps(float32) * scale * sqrt(n)

with K = 12 and `scale` the root-mean-square value of the truth's tensors of that kind in the step
(a floor for tensors whose true value is zero, where the reference's own error can be tiny by luck).
Every rank holds the same full gradients after the reductions: their spread over the ranks is allowed what
an error against the truth is, whole and slice by slice along each dim (reference.worst_slice), where a
fault confined to a few rows (a reduction missing for the rows of one head) hides in the whole tensor's
rounding. (Not against the truth slice by slice: a token that rounding routes to another expert moves a
slice of an expert's gradient by far more than its rounding, while ranks of one replica route alike.)
The report's `truth` says which truth was used, and why.
Each error is reported as a fraction of what was allowed: 1.0 is the limit. `rtol`/`atol` given in the
plan replace the rule with a fixed one: ||sharded - truth|| <= rtol ||truth|| + atol sqrt(n).

When a loss or a gradient fails, the step is run again with hooks on every module (localise.py) to
name the first module whose output, or whose gradient with respect to its output, disagrees, and the
plan statements that govern it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ..frontend import ir
from . import layout as lay
from . import localise, routing
from .outcome import FAIL, PASS, SKIPPED, Outcome
from .reference import (
    K,
    References,
    TruthUnavailable,
    allowed_error,
    full,
    rounding_error,
    shape_mismatch,
    worst_slice,
)

DEFAULTS = {"steps": 2, "batch": 4, "optimizer": "adam", "lr": 1e-2}
#: Optimizer updates are computed elementwise from identical gradients: they may differ by this fraction
#: of the largest update in the tensor, plus a few units in the last place of the parameter.
UPDATE_RTOL = 1e-3
LISTED = 5
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def run(ctx, check: ir.Check) -> Outcome:
    if ctx.model_file.example_input is None:
        return Outcome(SKIPPED, "not run: the model file defines no example_input(batch, generator)")
    args = {**DEFAULTS, **dict(check.args)}
    fixed = (args.get("rtol", 0.0), args.get("atol", 0.0)) if "rtol" in args or "atol" in args else None
    where = lay.layout(ctx)
    model = ctx.model
    mismatch = shape_mismatch(ctx)
    if mismatch:
        return Outcome(FAIL, f"the sharded model's full tensors do not fit the unsharded model: {mismatch}")
    references = References.build(ctx)
    make = OPTIMIZERS[args["optimizer"]]
    optim = make(model.parameters(), lr=args["lr"], **one_kind(model))
    ref_optim = make(references.optimizer.parameters(), lr=args["lr"])
    resumed = _resume(ctx, optim, references.optimizer, ref_optim)
    ctx.optimizer = optim
    lr = optim.param_groups[0]["lr"]  # the check's, or the checkpoint's when it resumed
    tally = Tally()
    localised = None
    replayable = routing.replayable(ctx.plan)
    notes: dict[str, str] = {}

    pipeline = ctx.pipeline
    pp_group = ctx.applied.mesh(ctx.plan.pipeline.mesh).get_group() if pipeline else None
    microbatches = pipeline.microbatches if pipeline else 1
    for step in range(args["steps"]):
        batches = [lay.replica_inputs(ctx, step, i, args["batch"]) for i in range(where.replicas)]
        unheld = references.start_from(model, pp_group)
        holders = "pipeline stage" if pipeline is not None else "rank"
        tally.failures += [f"step {step}: {name} is held by no {holders}" for name in unheld]
        optim.zero_grad(set_to_none=True)
        inputs = lay.local_inputs(batches[where.replica], where, args.get("input"))
        if pipeline is not None:
            # The schedule runs forward and backward on every microbatch; the last stage has the loss.
            sharded_loss = pipeline.step(*inputs)
        else:
            record = routing.Record()
            with record if replayable else contextlib.nullcontext():
                output = model(*inputs)
            if replayable:  # every rank: the choices are gathered
                references.replay.start(routing.by_replica(record.choices, where.replica), where.replica)
            whole = lay.full_output(ctx, where, output, args.get("output"))
            with lay.loss_context(ctx.plan):
                sharded_loss = lay.loss(ctx, whole, batches[where.replica], sharded=True)
                sharded_loss.backward()
        try:
            losses = references.forward_backward(ctx, batches, microbatches)
        except TruthUnavailable as error:
            optim.zero_grad(set_to_none=True)
            return Outcome(SKIPPED, f"not compared: {error}", {"truth": references.truth_dtype})
        grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

        failed_before = len(tally.failures)
        if replayable:
            judged = references.replay.judge(K)
            if judged.wrong:
                tally.failures.append(f"step {step}: {judged.failure()}")
                tally.worst[f"routing {judged.worst[0]}"] = (
                    judged.worst[1],
                    judged.worst[2],
                    judged.worst[1] / judged.worst[2],
                )
            elif judged.note():
                notes[f"step {step}"] = judged.note()
        truth, same = (torch.tensor([float(x[where.replica])], dtype=torch.float64) for x in losses)
        if sharded_loss is not None:  # (a pipeline's other stages have no loss)
            mine = torch.tensor([lay.value(sharded_loss)], dtype=torch.float64)
            # One number's rounding error can be small by luck: the loss may also be as far from the truth,
            # relatively, as the same-precision reference's gradients are (measured on all of them).
            floor = references.relative_rounding() * abs(float(truth))
            own = references.own_loss_error(where.replica)
            tally.compare(
                f"step {step}: loss", "loss", mine, truth, same, abs(float(truth)), fixed, floor=floor, own=own
            )
        scale = references.gradient_scale()
        for name, p in model.named_parameters():
            t, s = references.truth.get_parameter(name), references.same.get_parameter(name)
            if (p.grad is None) != (t.grad is None):
                tally.failures.append(
                    f"step {step}: gradient of {name} is {'missing' if p.grad is None else 'unexpected'}"
                )
                continue
            if p.grad is not None:
                tally.compare(
                    f"step {step}: gradient of {name}",
                    f"grad {name}",
                    grads[name],
                    t.grad,
                    s.grad,
                    scale,
                    fixed,
                    own=references.own_error(name),
                )
        if pipeline is None and fixed is None:
            spreads = _spreads(grads)
            for name, spread in spreads.items():
                t, sa = references.truth.get_parameter(name), references.same.get_parameter(name)
                tally.compare_ranks(
                    f"step {step}: gradient of {name}",
                    f"grad {name}",
                    spread,
                    t.grad,
                    sa.grad,
                    scale,
                    own=references.own_error(name),
                )
        if _anywhere(len(tally.failures) > failed_before):
            localised = localise.localise(ctx, references, batches[where.replica], where, args, tally.failing_params())
            break

        before = {}
        for name, p in references.optimizer.named_parameters():
            p.grad = grads[name].to(p.dtype) if name in grads else None
            before[name] = p.detach().clone()
        optim.step()
        ref_optim.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                ref = references.optimizer.get_parameter(name)
                what = f"step {step}: {name} after the optimizer step"
                tally.compare_update(what, f"update {name}", full(p.detach()), ref, before[name])
        if _anywhere(bool(tally.failures)):
            break

    optim.zero_grad(set_to_none=True)
    table = sorted(
        ({"tensor": k, "error": e, "allowed": a, "ratio": r} for k, (e, a, r) in tally.worst.items()),
        key=lambda row: -row["ratio"],
    )
    data = {
        "steps": args["steps"],
        "batch": args["batch"],
        "optimizer": args["optimizer"],
        "lr": lr,
        "precision": references.precision,
        "truth": references.truth_dtype,
        "rule": f"fixed: rtol {fixed[0]:g}, atol {fixed[1]:g}" if fixed else f"K={K:g} x the reference's rounding",
        "replicas": where.replicas,
        "resumed": resumed,
        "worst": table[:20],
        "failures": tally.failures[:20],
        "routing": notes,
    }
    top = table[0] if table else {"tensor": "-", "ratio": 0.0}
    if tally.failures:
        more = f" (and {len(tally.failures) - LISTED} more)" if len(tally.failures) > LISTED else ""
        if localised is not None:
            data["localised"] = localised
        # The table shows the worst error: say which it was, whichever failure comes first.
        worst = f"worst {top['ratio']:.3g} x the allowed error ({top['tensor']}): " if top["ratio"] > 1.0 else ""
        return Outcome(FAIL, worst + "; ".join(tally.failures[:LISTED]) + more, data, top["ratio"])
    replicas = f"{where.replicas} replica{'s' if where.replicas > 1 else ''}"
    return Outcome(
        PASS,
        f"{args['steps']} steps on {replicas} match the unsharded model: loss, every gradient and the "
        f"{args['optimizer']} update ({references.precision}, truth {data['truth']}, {data['rule']}); "
        f"worst {top['ratio']:.2f} of the "
        f"allowed error ({top['tensor']})" + (f"; {resumed}" if resumed else "") + _routing_note(notes),
        data,
        top["ratio"],
    )


def _routing_note(notes: dict[str, str]) -> str:
    """The replayed routing, for the message: the last step's note (each step's is in the data)."""
    return f"; {list(notes.items())[-1][1]}" if notes else ""


def one_kind(model) -> dict:
    """Optimizer options for `model`: torch's foreach kernels (its default on CUDA) refuse a list that mixes
    DTensors with plain tensors (a TP plan whose norms no unit shards), so such a model steps tensor by
    tensor, as it would on the CPU."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return {"foreach": False} if len(kinds) > 1 else {}


class Tally:
    """Failures so far, and the worst (error, allowed, error / allowed) per tensor over the steps."""

    def __init__(self):
        self.failures: list[str] = []
        self.worst: dict[str, tuple[float, float, float]] = {}
        self._failing: list[str] = []

    def failing_params(self) -> list[str]:
        return list(self._failing)

    def _note(self, key: str, error: float, allowed: float) -> float:
        ratio = error / allowed if allowed > 0 else (0.0 if error == 0 else math.inf)
        if key not in self.worst or ratio > self.worst[key][2]:
            self.worst[key] = (error, allowed, ratio)
        return ratio

    def compare(self, what, key, got, truth, same, scale: float, fixed, floor: float = 0.0, own: float = 0.0) -> None:
        """A loss or a gradient: `got` against the truth, allowed K times the same-precision reference's
        error (or the fixed rule), plus `floor` (the loss: its relative share of the gradients' rounding);
        `own` is the truth's own measured error (a float32 truth's; 0 for float64)."""
        got, truth = got.detach().double(), truth.detach().to(got.device).double()
        if got.shape != truth.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}")
            self._note(key, math.inf, 1.0)
            return
        error = float((got - truth).norm())
        allowed = allowed_error(truth, same, scale, fixed, own) + (floor if fixed is None else 0.0)
        ratio = self._note(key, error, allowed)
        if not bool(torch.isfinite(got).all()):
            self.failures.append(f"{what}: not finite")
        elif ratio > 1.0:
            truths = f", the float32 truth's own {own:.3g}" if own else ""
            self.failures.append(
                f"{what}: error {error:.3g} is {ratio:.3g} x the allowed {allowed:.3g} "
                f"(the reference's own rounding error {rounding_error(truth, same):.3g}{truths})"
            )
        else:
            return
        if key.startswith("grad "):
            self._failing.append(key.removeprefix("grad "))

    def compare_ranks(self, what, key, spread, truth, same, scale: float, own: float = 0.0) -> None:
        """A gradient every rank holds alike (reduced, or made whole by `full`): its `spread` over the ranks
        (largest minus smallest value, elementwise), the whole tensor and slice by slice (a fault confined
        to a few rows hides in the whole tensor's rounding), against what it may differ from the truth by.
        Ranks of one replica route tokens alike, so unlike the truth this cannot differ by a token that
        rounding sent to another expert."""
        truth = truth.detach().to(spread.device).double()
        whole = float(spread.norm())
        allowed = allowed_error(truth, same, scale, None, own)
        part = worst_slice(spread, truth, same, scale, own)
        ratio = self._note(key, whole, allowed)
        if part is not None:
            self._note(key, part.error, part.allowed)
        if ratio > 1.0:
            found = f"by {whole:.3g}, {ratio:.3g} x the allowed {allowed:.3g}"
        elif part is not None and part.over:
            found = part.describe()
        else:
            return
        self.failures.append(
            f"{what}: the ranks hold different gradients ({found}), where every rank's should be the same "
            "after the reductions: a reduction over the ranks that replicate it is missing"
        )
        self._failing.append(key.removeprefix("grad "))

    def compare_update(self, what, key, got, want, before) -> None:
        """An updated parameter, elementwise: both optimizers stepped from the same gradients, so they may
        differ by UPDATE_RTOL of the tensor's largest update plus four units in the last place."""
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            self._note(key, math.inf, 1.0)
            return
        eps = torch.finfo(want.dtype).eps
        got, want = got.detach().double(), want.detach().to(got.device).double()
        step = float((want - before.to(want.device).double()).abs().max()) if want.numel() else 0.0
        allowed = (UPDATE_RTOL * step + 4 * eps * want.abs()).clamp_min(torch.finfo(torch.float64).tiny)
        diff = (got - want).abs()
        over = diff > allowed
        ratios = diff / allowed
        at = int(ratios.argmax()) if ratios.numel() else 0
        if ratios.numel():
            self._note(key, float(diff.flatten()[at]), float(allowed.flatten()[at]))
        if not bool(torch.isfinite(got).all()):
            self.failures.append(f"{what}: not finite")
        elif bool(over.any()):
            self.failures.append(
                f"{what}: {int(over.sum())} of {over.numel()} values differ from the reference optimizer's, "
                f"given the same gradients (max difference {float(diff.max()):.3g})"
            )


def _spreads(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each full gradient's largest minus smallest value over the world's ranks, elementwise (two all_reduces
    of every gradient at once), for the gradients every rank has (a rank without a gradient another has
    fails on its own; an expert another rank holds is not this rank's to compare)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    names = lay.held_everywhere(sorted(grads))
    if not names:
        return {}
    device = next(iter(grads.values())).device
    flat = torch.cat([grads[n].detach().to(device, torch.float64).flatten() for n in names])
    low = flat.clone()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    spread = flat - low
    out, at = {}, 0
    for n in names:
        size = grads[n].numel()
        out[n] = spread[at : at + size].view(grads[n].shape)
        at += size
    return out


def _anywhere(flag: bool) -> bool:
    """True on every rank if it is true on any (every rank must take the same path: the next steps talk)."""
    return lay.largest_everywhere([float(flag)])[0] > 0


def _resume(ctx, optim, reference, ref_optim) -> str:
    """Load the checkpoint's optimizer state into both optimizers, if it holds state of their class; what
    was done, for the message ("" if the checkpoint holds none)."""
    from ..checkpoints.loading import load_checkpoint

    checkpoint = ctx.checkpoint
    if checkpoint is None or not checkpoint.has_optimizer:
        return ""
    kind = checkpoint.info.get("optimizer")  # a str or None: read_checkpoint checked shardlang.json
    if kind and kind != type(optim).__name__:
        return (
            f"optimizer state not resumed: the checkpoint holds {kind} state, the check trains with "
            f"{type(optim).__name__}"
        )
    load_checkpoint(ctx.model, checkpoint, optim, model_state=False)
    saved = get_optimizer_state_dict(ctx.model, optim)  # sharded: `full` makes each tensor whole below
    index = {name: i for i, (name, _) in enumerate(reference.named_parameters())}
    # Copies: the state dict hands back the optimizer's own plain tensors (Adam's `step`), which the two
    # optimizers would otherwise share and each advance.
    by_name = {
        k: {n: full(v).detach().clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in saved["state"].items()
    }

    def portable(s: dict) -> dict:
        return {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in s.items()}

    # Parameters other ranks hold (experts' members, pipeline stages): their state from those ranks.
    gathered = lay.from_holders(by_name, portable)
    state = {index[k]: s for k, s in (by_name if gathered is None else gathered).items()}
    # load_state_dict pairs saved parameters with the optimizer's by position: the reference's one group
    # (the check builds both optimizers so) lists every parameter of the unsharded model, in its order.
    groups = [{**saved["param_groups"][0], "params": sorted(index.values())}]
    ref_optim.load_state_dict({"state": state, "param_groups": groups})
    return f"resumed {type(optim).__name__} state from {checkpoint.path}"
