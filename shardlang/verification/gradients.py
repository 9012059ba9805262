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
from ..frontend.patterns import starred
from . import layout as lay
from . import localise, routing
from .outcome import FAIL, PASS, SKIPPED, Outcome
from .reference import SLICE_VALUES, K, References, TruthUnavailable, full, rounding_error, shape_mismatch
from .step import Step
from .tally import Tally

DEFAULTS = {"steps": 2, "batch": 4, "optimizer": "adam", "lr": 1e-2}
LISTED = 5
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def run(ctx, check: ir.Check) -> Outcome:
    if ctx.model_file.example_input is None:
        return Outcome(SKIPPED, "not run: the model file defines no example_input(batch, generator)")
    mismatch = shape_mismatch(ctx)
    if mismatch:
        return Outcome(FAIL, f"the sharded model's full tensors do not fit the unsharded model: {mismatch}")
    training = Training(ctx, {**DEFAULTS, **dict(check.args)})
    try:
        for step in range(training.args["steps"]):
            if not training.step(step):
                break
    except TruthUnavailable as error:
        ctx.model.zero_grad(set_to_none=True)
        return Outcome(SKIPPED, f"not compared: {error}", {"truth": training.references.truth_dtype})
    ctx.model.zero_grad(set_to_none=True)
    return training.outcome()


class Training:
    """The check's training run: the sharded model and its optimizer beside the references and theirs,
    step by step (`step`), then the verdict (`outcome`)."""

    def __init__(self, ctx, args: dict):
        self.ctx, self.args = ctx, args
        given = "rtol" in args or "atol" in args
        self.fixed = (args.get("rtol", 0.0), args.get("atol", 0.0)) if given else None
        self.runner = Step.of(ctx)
        self.where = self.runner.where
        self.references = References.build(ctx)
        make = OPTIMIZERS[args["optimizer"]]
        self.optim = make(ctx.model.parameters(), lr=args["lr"], **one_kind(ctx.model))
        self.ref_optim = make(self.references.optimizer.parameters(), lr=args["lr"])
        self.resumed = _resume(ctx, self.optim, self.references.optimizer, self.ref_optim)
        ctx.optimizer = self.optim
        self.lr = self.optim.param_groups[0]["lr"]  # the check's, or the checkpoint's when it resumed
        self.tally = Tally()
        self.localised = None
        self.replayable = routing.replayable(ctx.plan)
        self.notes: dict[str, str] = {}
        self.not_compared: set[str] = set()  # the unsharded model's own gradient is not finite
        self.compared = 0  # steps compared to the end
        self.stopped: str | None = None  # why it stopped before its last step

    def step(self, step: int) -> bool:
        """One training step, compared: whether to go on (every rank answers alike)."""
        ctx, where, references = self.ctx, self.where, self.references
        batches = [self.runner.batch(step, self.args["batch"], i) for i in range(where.replicas)]
        pipeline = ctx.pipeline
        pp_group = ctx.applied.mesh(ctx.plan.pipeline.mesh).get_group() if pipeline else None
        holders = "pipeline stage" if pipeline is not None else "rank"
        unheld = references.start_from(ctx.model, pp_group)
        self.tally.failures += [f"step {step}: {name} is held by no {holders}" for name in unheld]
        self.optim.zero_grad(set_to_none=True)
        sharded_loss = self._sharded(batches[where.replica])
        losses = references.forward_backward(ctx, batches, pipeline.microbatches if pipeline else 1)
        if not self._set_aside_not_finite(step, losses):
            self.ctx.model.zero_grad(set_to_none=True)
            return False
        grads = {n: full(p.grad) for n, p in ctx.model.named_parameters() if p.grad is not None}
        failed_before = len(self.tally.failures)
        self._judge_routing(step)
        self._compare_loss(step, sharded_loss, losses)
        self._compare_gradients(step, grads)
        if _anywhere(len(self.tally.failures) > failed_before):
            failing = self.tally.failing_params()
            self.localised = localise.localise(ctx, references, batches[where.replica], where, self.args, failing)
            return False
        self._compare_updates(step, grads)
        self.compared += 1
        return not _anywhere(bool(self.tally.failures))

    def _set_aside_not_finite(self, step: int, losses) -> bool:
        """The gradients the unsharded model itself computes not finite are not compared (said in the
        outcome). Where its loss or every gradient is not finite, nothing is: at the first step the check is
        skipped; at a later one (its parameters updated from such gradients) it stops after the steps it
        compared, saying so. Whether to compare this step."""
        unfinite = self.references.not_finite()
        held = {n for n, p in self.references.truth.named_parameters() if p.grad is not None}
        loss = losses[0][self.where.replica]
        if math.isfinite(loss) and not (held and unfinite >= held):
            self.not_compared |= unfinite
            return True
        what = f"its loss is {loss}" if not math.isfinite(loss) else "every gradient holds a NaN or an infinity"
        if step == 0:
            raise TruthUnavailable(
                f"the unsharded model's own step is not finite on the example input ({what}): there is "
                "nothing to compare the sharded model with; fix the model or its example_input"
            )
        self.stopped = f"stopped at step {step}: the unsharded model's own step is not finite ({what})"
        return False

    def _sharded(self, batch: tuple):
        """The sharded model's step on this replica's batch: its loss (None on a pipeline's other stages,
        which have none); the routing it chose handed to the references to replay."""
        ctx, runner = self.ctx, self.runner
        if ctx.pipeline is not None:  # the schedule runs forward and backward on every microbatch
            return runner.scheduled(lambda inputs: ctx.pipeline.step(*inputs), batch, ctx.pipeline.microbatches)
        record = routing.Record(ctx.model)
        with record if self.replayable else contextlib.nullcontext():
            output = runner.forward(ctx.model, batch)
        if self.replayable:  # every rank: the choices are gathered
            replica, sequence = self.where.replica, self._sequence(batch)
            choices = routing.by_replica(record, replica, sequence)
            self.references.replay.start(choices, replica, joined=sequence is not None)
        return runner.finish(output, batch)

    def _sequence(self, batch: tuple) -> routing.Sequence | None:
        """Under context parallelism, how this replica's sequences split over its cp ranks."""
        split = self.ctx.sequence_split()
        if split is None:
            return None
        first = next(x for x in batch if isinstance(x, torch.Tensor))
        return routing.Sequence(*split, first.shape[0])

    def _judge_routing(self, step: int) -> None:
        if not self.replayable:
            return
        judged = self.references.replay.judge(K)
        if judged.wrong:
            self.tally.failures.append(f"step {step}: {judged.failure()}")
            error, allowed = judged.worst[1], judged.worst[2]
            self.tally.worst[f"routing {judged.worst[0]}"] = (error, allowed, error / allowed)
        elif judged.note():
            self.notes[f"step {step}"] = judged.note()

    def _compare_loss(self, step: int, sharded_loss, losses) -> None:
        if sharded_loss is None:  # a pipeline's other stages have no loss
            return
        references, replica = self.references, self.where.replica
        truth, same = (torch.tensor([float(x[replica])], dtype=torch.float64) for x in losses)
        mine = torch.tensor([lay.value(sharded_loss)], dtype=torch.float64)
        # One number's rounding error can be small by luck: the loss may also be as far from the truth,
        # relatively, as the same-precision reference's gradients are (measured on all of them).
        floor = references.relative_rounding() * abs(float(truth))
        own = references.own_loss_error(replica)
        what = f"step {step}: loss"
        self.tally.compare(what, "loss", mine, truth, same, abs(float(truth)), self.fixed, floor=floor, own=own)

    def _compare_gradients(self, step: int, grads: dict) -> None:
        """Every gradient against the truth, then (without a pipeline or a fixed rule) the ranks' copies of
        each against one another."""
        references, tally = self.references, self.tally
        scale, floors = references.gradient_scale(), _few_values_floors(references)
        for name, p in self.ctx.model.named_parameters():
            if name in self.not_compared:
                continue
            t, s = references.truth.get_parameter(name), references.same.get_parameter(name)
            what = f"step {step}: gradient of {name}"
            if (p.grad is None) != (t.grad is None):
                tally.failures.append(f"{what} is {'missing' if p.grad is None else 'unexpected'}")
            elif p.grad is not None:
                own = references.own_error(name)
                floor = floors.get(name, 0.0)
                tally.compare(what, f"grad {name}", grads[name], t.grad, s.grad, scale, self.fixed, floor, own)
        if self.ctx.pipeline is not None or self.fixed is not None:
            return
        for name, spread in _spreads(grads).items():
            if name in self.not_compared:
                continue
            t, s = references.truth.get_parameter(name), references.same.get_parameter(name)
            what = f"step {step}: gradient of {name}"
            tally.compare_ranks(what, f"grad {name}", spread, t.grad, s.grad, scale, own=references.own_error(name))

    def _compare_updates(self, step: int, grads: dict) -> None:
        """Both optimizers step from the sharded model's own gradients; the updated parameters compared."""
        reference = self.references.optimizer
        before = {}
        for name, p in reference.named_parameters():
            p.grad = grads[name].to(p.dtype) if name in grads else None
            before[name] = p.detach().clone()
        self.optim.step()
        self.ref_optim.step()
        with torch.no_grad():
            for name, p in self.ctx.model.named_parameters():
                if name in self.not_compared:
                    continue
                what = f"step {step}: {name} after the optimizer step"
                ref = reference.get_parameter(name)
                self.tally.compare_update(what, f"update {name}", full(p.detach()), ref, before[name])

    def outcome(self) -> Outcome:
        args, tally, references = self.args, self.tally, self.references
        table = sorted(
            ({"tensor": k, "error": e, "allowed": a, "ratio": r} for k, (e, a, r) in tally.worst.items()),
            key=lambda row: -row["ratio"],
        )
        data = {
            "steps": args["steps"],
            "batch": args["batch"],
            "optimizer": args["optimizer"],
            "lr": self.lr,
            "precision": references.precision,
            "truth": references.truth_dtype,
            "rule": f"fixed: rtol {self.fixed[0]:g}, atol {self.fixed[1]:g}"
            if self.fixed
            else f"K={K:g} x the reference's rounding",
            "replicas": self.where.replicas,
            "resumed": self.resumed,
            "worst": table[:20],
            "failures": tally.failures[:20],
            "routing": self.notes,
            "step": phases_everywhere(self.runner),
            "loss_compiled_by": self.runner.compiled_by,
            "not_compared": sorted(self.not_compared),
            "stopped": self.stopped,
        }
        top = table[0] if table else {"tensor": "-", "ratio": 0.0}
        if tally.failures:
            more = f" (and {len(tally.failures) - LISTED} more)" if len(tally.failures) > LISTED else ""
            if self.localised is not None:
                data["localised"] = self.localised
            # The table shows the worst error: say which it was, whichever failure comes first.
            worst = f"worst {top['ratio']:.3g} x the allowed error ({top['tensor']}): " if top["ratio"] > 1.0 else ""
            return Outcome(FAIL, worst + "; ".join(tally.failures[:LISTED]) + more, data, top["ratio"])
        replicas = f"{self.where.replicas} replica{'s' if self.where.replicas > 1 else ''}"
        resumed = f"; {self.resumed}" if self.resumed else ""
        if self.stopped:
            resumed += f"; {self.stopped}"
        if self.not_compared:
            resumed += (
                f"; {len(self.not_compared)} gradients not compared, the unsharded model's own not finite "
                f"({', '.join(sorted(self.not_compared)[:3])}{', ...' if len(self.not_compared) > 3 else ''})"
            )
        return Outcome(
            PASS,
            f"{self.compared} step{'s' if self.compared != 1 else ''} on {replicas} match the unsharded model: loss, every gradient"
            f"{' compared' if self.not_compared else ''} and the "
            f"{args['optimizer']} update ({references.precision}, truth {data['truth']}, {data['rule']}); "
            f"worst {top['ratio']:.2f} of the allowed error ({top['tensor']})" + resumed + _routing_note(self.notes),
            data,
            top["ratio"],
        )


def phases_everywhere(step: Step) -> list[str]:
    """The phases every rank's step ran, in order, each once (a pipeline's loss runs on its last stage
    only): what the report's `step` lists."""
    mine = list(step.ran)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: list[str] = []
    for ran in everyone:
        for line in ran:
            if line not in merged:
                merged.append(line)
    return merged


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


def _few_values_floors(references) -> dict[str, float]:
    """For each gradient of fewer than SLICE_VALUES values, what it may differ from the truth by at the least:
    K times the largest rounding error of the same parameter in any block (`layers.*.mlp.gate.global_scale`).
    The reference's rounding of a few values is a draw or two, too often small by luck: Inkling's router
    scale, one value summed from terms that cancel, came 30 times closer to the truth in one layer than in
    the other, and a correct plan failed. Its terms, not its value, set its rounding, and the blocks' are
    alike; a reduction left out moves it by the order of its terms."""
    pairs = zip(references.truth.named_parameters(), references.same.parameters())
    unfinite = references.not_finite()
    few = {
        n: rounding_error(t.grad.double(), s.grad)
        for (n, t), s in pairs
        if t.grad is not None and s.grad is not None and t.grad.numel() < SLICE_VALUES and n not in unfinite
    }
    kind_of = {name: starred(name) for name in few}  # the same parameter in every block
    largest: dict[str, float] = {}
    for name, error in few.items():
        largest[kind_of[name]] = max(largest.get(kind_of[name], 0.0), error)
    return {name: K * largest[kind_of[name]] for name in few}
