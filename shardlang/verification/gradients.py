"""gradients: an unsharded reference, loaded from the sharded model's full state dict, trained on every
data-parallel replica's inputs (its loss the mean of theirs, as FSDP and DDP average gradients), gives
the same losses, full gradients and updated parameters at every step. SPEC §7. Each step starts the
reference from the sharded model's parameters, so rounding does not compound across steps.

When the model was loaded from a checkpoint that holds state of the same optimizer class, both the
sharded optimizer (resharded by DCP) and the reference's (from its full state dict) resume from it, so
the check also verifies that the saved optimizer state went on training as before.

Every rank builds the reference and compares its own replica's loss and every full tensor; the worst
error per parameter is kept for the report. Tolerances default by the dtype the model computes in. In
float32 every element must agree (|got - want| <= atol + rtol |want|). In bfloat16 and float16 (mixed
precision) elements drift by rounding, so each tensor must agree as a whole:
||got - want|| <= rtol ||want|| + atol sqrt(n); a wrong shard or a wrong sum is off by far more.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..frontend import ir
from . import Outcome
from . import layout as lay

#: (rtol, atol) by the dtype the sharded model computes in: elementwise for float32, per tensor (in norm)
#: for the low-precision dtypes.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (5e-2, 1e-3),
    torch.float16: (1e-2, 1e-4),
}
DEFAULTS = {"steps": 2, "batch": 4, "optimizer": "adam", "lr": 1e-2}
LISTED = 5


def compute_dtype(ctx) -> torch.dtype:
    """The lowest precision any fully_shard unit computes in (mixed precision), else the parameters'."""
    dtypes = [u.get("mixed_precision").param for b in ctx.plan.units for u in b.units if u.get("mixed_precision")]
    dtypes += [dict(b.options)["mixed_precision"].param for b in ctx.plan.units if "mixed_precision" in dict(b.options)]
    found = [getattr(torch, d.name) for d in dtypes if d is not None]
    if found:
        return min(found, key=lambda d: torch.finfo(d).bits)
    return next((p.dtype for p in ctx.model.parameters()), torch.float32)


def run(ctx, check: ir.Check) -> Outcome:
    if ctx.model_file.example_input is None:
        return Outcome(None, "not run: the model file defines no example_input(batch, generator)")
    args = {**DEFAULTS, **dict(check.args)}
    dtype = compute_dtype(ctx)
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    rtol, atol = args.get("rtol", rtol), args.get("atol", atol)
    elementwise = dtype == torch.float32
    where = lay.layout(ctx)
    model = ctx.model
    reference = _reference(ctx)
    make = torch.optim.Adam if args["optimizer"] == "adam" else torch.optim.SGD
    optim, ref_optim = make(model.parameters(), lr=args["lr"]), make(reference.parameters(), lr=args["lr"])
    resumed = _resume(ctx, optim, reference, ref_optim)
    ctx.optimizer = optim
    lr = optim.param_groups[0]["lr"]  # the check's, or the checkpoint's when it resumed
    names = [n for n, _ in model.named_parameters()]
    worst: dict[str, list[float]] = {
        n: [0.0, 0.0] for n in ["loss", *(f"grad {n}" for n in names), *(f"param {n}" for n in names)]
    }
    failures: list[str] = []

    for step in range(args["steps"]):
        full = [lay.replica_inputs(ctx, step, i, args["batch"]) for i in range(where.replicas)]
        optim.zero_grad(set_to_none=True)
        output = model(*lay.local_inputs(full[where.replica], where, args.get("input")))
        whole = lay.full_output(ctx, where, output, args.get("output"))
        with lay.loss_context(ctx.plan):
            sharded_loss = lay.loss(ctx, whole, full[where.replica])
            sharded_loss.backward()
        ref_optim.zero_grad(set_to_none=True)
        ref_losses = [lay.loss(ctx, reference(*x), x) for x in full]
        torch.stack([loss.float() for loss in ref_losses]).mean().backward()

        compare = functools.partial(_compare, worst, failures, rtol=rtol, elementwise=elementwise)
        compare(
            f"step {step}: loss",
            "loss",
            torch.tensor([lay.value(sharded_loss)]),
            torch.tensor([float(ref_losses[where.replica].detach())]),
            atol=atol,
        )
        for name, p in model.named_parameters():
            ref = reference.get_parameter(name)
            if (p.grad is None) != (ref.grad is None):
                failures.append(f"step {step}: gradient of {name} is {'missing' if p.grad is None else 'unexpected'}")
                continue
            if p.grad is not None:
                compare(f"step {step}: gradient of {name}", f"grad {name}", _full(p.grad), ref.grad, atol=atol)
        optim.step()
        ref_optim.step()
        # Adam divides each gradient by its running magnitude, so where a gradient is near zero a rounding
        # difference moves the update by up to lr: parameters get 1% of lr on top of atol.
        param_atol = atol + (1e-2 * lr if args["optimizer"] == "adam" else 0.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                updated, ref = _full(p.detach()), reference.get_parameter(name)
                compare(
                    f"step {step}: {name} after the update", f"param {name}", updated, ref.detach(), atol=param_atol
                )
                # Each step starts the reference from the sharded model's parameters, so that rounding
                # differences do not compound from step to step and every step is checked on its own.
                ref.copy_(updated)

    optim.zero_grad(set_to_none=True)
    table = sorted(
        ({"tensor": k, "max_abs": a, "rel_norm": r} for k, (a, r) in worst.items()), key=lambda row: -row["rel_norm"]
    )
    data = {
        "steps": args["steps"],
        "batch": args["batch"],
        "optimizer": args["optimizer"],
        "lr": lr,
        "dtype": str(dtype).removeprefix("torch."),
        "rtol": rtol,
        "atol": atol,
        "replicas": where.replicas,
        "resumed": resumed,
        "worst": table[:20],
    }
    top = table[0] if table else {"tensor": "-", "max_abs": 0.0, "rel_norm": 0.0}
    if failures:
        more = f" (and {len(failures) - LISTED} more)" if len(failures) > LISTED else ""
        return Outcome(False, "; ".join(failures[:LISTED]) + more, data, top["rel_norm"])
    return Outcome(
        True,
        f"{args['steps']} steps on {where.replicas} replica{'s' if where.replicas > 1 else ''} match the "
        f"unsharded model ({data['dtype']}, rtol {rtol:g}, atol {atol:g}); worst relative error "
        f"{top['rel_norm']:.2e} ({top['tensor']})" + (f"; {resumed}" if resumed else ""),
        data,
        top["rel_norm"],
    )


def _resume(ctx, optim, reference, ref_optim) -> str:
    """Load the checkpoint's optimizer state into both optimizers, if it holds state of their class; what
    was done, for the message ("" if the checkpoint holds none)."""
    from ..checkpoints.dcp import load_checkpoint

    checkpoint = ctx.checkpoint
    if checkpoint is None or not checkpoint.has_optimizer:
        return ""
    saved = checkpoint.info.get("optimizer")
    if saved and saved != type(optim).__name__:
        return f"optimizer state not resumed: the checkpoint holds {saved} state, the check trains with {type(optim).__name__}"
    load_checkpoint(ctx.model, checkpoint, optim, model_state=False)
    full = get_optimizer_state_dict(ctx.model, optim, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(reference, ref_optim, full)
    return f"resumed {type(optim).__name__} state from {checkpoint.path}"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _reference(ctx) -> torch.nn.Module:
    """The unsharded model on this rank, loaded from the sharded model's full state dict."""
    state = get_model_state_dict(ctx.model, options=StateDictOptions(full_state_dict=True))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        reference = ctx.model_file.build_model()
    missing, unexpected = reference.load_state_dict({k: _full(v) for k, v in state.items()}, strict=False)
    if unexpected:
        raise ValueError(f"the sharded model's state dict has names the unsharded one lacks: {unexpected[:5]}")
    return (
        reference.float()
        if any(p.dtype != torch.float32 for p in reference.parameters() if p.is_floating_point())
        else reference
    )


def _compare(
    worst,
    failures,
    what: str,
    key: str,
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    elementwise: bool,
) -> None:
    """Record the largest absolute and relative error of `got` against `want`; a failure if they differ
    by more than the tolerance (elementwise, or for the tensor as a whole)."""
    # On the tensors' own device: a model of a billion parameters compares in seconds there, not minutes.
    got, want = got.detach().double(), want.detach().to(got.device).double()
    if got.shape != want.shape:
        failures.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        worst[key] = [math.inf, math.inf]
        return
    diff = (got - want).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    diff_norm, want_norm = (float(diff.norm()), float(want.norm())) if diff.numel() else (0.0, 0.0)
    norm_rel = diff_norm / max(want_norm, 1e-12)
    worst[key] = [max(worst[key][0], max_abs), max(worst[key][1], norm_rel)]
    if not bool(torch.isfinite(got).all()):
        failures.append(f"{what}: not finite")
    elif elementwise:
        bad = diff > atol + rtol * want.abs()
        if bool(bad.any()):
            failures.append(
                f"{what}: max error {max_abs:.3g} at {int(bad.sum())} of {bad.numel()} values (rtol {rtol:g}, atol {atol:g})"
            )
    elif diff_norm > rtol * want_norm + atol * math.sqrt(diff.numel()):
        failures.append(
            f"{what}: relative error {norm_rel:.3g} in norm, max error {max_abs:.3g} (rtol {rtol:g}, atol {atol:g})"
        )
