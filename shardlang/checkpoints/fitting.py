"""Whether a checkpoint fits a model (and its optimizer), from metadata alone: every key, global shape and
dtype compared, a misfit being SL500 listing all of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..frontend.diagnostics import SL500, PlanError, few_lines
from .common import dtype_name, plan_error
from .records import Checkpoint
from .state import model_state_dict


def misfits(
    checkpoint: Checkpoint, state: Mapping[str, Any], what: str = "model", elsewhere: tuple[str, ...] = ()
) -> list[str]:
    """Every way `state` (a model state dict, or a flattened optimizer one) and the checkpoint differ:
    keys on one side only, and tensors of another global shape or dtype. Works on meta tensors too.
    `elsewhere`: modules another pipeline stage holds, whose keys a stage loads nothing of."""
    stored = (
        checkpoint.model
        if what == "model"
        else {k: v for k, v in checkpoint.optimizer.items() if k.startswith("state.")}
    )
    found = []
    for key, value in state.items():
        if key not in stored:
            found.append(f"{what} key {key} is not in the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            continue
        have = stored[key]
        if not isinstance(have, TensorStorageMetadata):
            found.append(f"{key}: the checkpoint holds an object, the {what} a tensor")
        elif tuple(have.size) != tuple(value.shape):
            found.append(f"{key}: shape {tuple(have.size)} in the checkpoint, {tuple(value.shape)} in the {what}")
        elif have.properties.dtype != value.dtype:
            found.append(
                f"{key}: dtype {dtype_name(have.properties.dtype)} in the checkpoint, {dtype_name(value.dtype)} in the {what}"
            )
    prefixes = tuple(f"{m}." for m in elsewhere)
    found += [
        f"checkpoint key {key} is not in the {what}"
        for key in stored
        if key not in state and not key.removeprefix("state.").startswith(prefixes)
    ]
    return found


def elsewhere(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules other ranks hold: a pipeline stage's others (pass-throughs here), and the members of
    experts split by member (`expert_parallel` on a ModuleList or ModuleDict) that other ranks keep; ()
    for a whole model."""
    from ..runtime.pipeline import PassThrough

    stages = tuple(fqn for fqn, m in model.named_modules() if isinstance(m, PassThrough))
    members = tuple(
        f"{fqn}.{key}" if fqn else key
        for fqn, m in model.named_modules()
        for key in getattr(m, "experts_elsewhere", ())
    )
    return stages + members


def check_fits(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """PlanError(SL500) listing every misfit between the checkpoint and `model` (any device, meta too)."""
    found = misfits(checkpoint, model_state_dict(model), elsewhere=elsewhere(model))
    if found:
        raise misfit_error(checkpoint, "model", found)


def misfit_error(checkpoint: Checkpoint, what: str, found: list[str]) -> PlanError:
    """SL500 listing `found`, the misfits between the checkpoint and the `what` (model or optimizer), with
    the plan that saved it."""
    origin = checkpoint.info.get("plan")
    help_ = few_lines(found)
    if origin:
        help_ += (f"the checkpoint was saved by {origin} at world {checkpoint.info.get('world_size')}",)
    return plan_error(
        SL500,
        f"the checkpoint at {checkpoint.path} does not fit the {what}: {len(found)} mismatch{'es' if len(found) > 1 else ''}",
        help_,
    )
