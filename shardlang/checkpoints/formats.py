"""`apply --load` and `--save` in either format: a DCP checkpoint or Hugging Face safetensors weights,
told apart by what the directory holds (DCP's `.metadata`, or `*.safetensors` files and their index)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..frontend.diagnostics import SL501
from .common import plan_error
from .fitting import check_fits
from .hf import (
    HFWeights,
    check_hf_fits,
    check_hf_save_target,
    is_hf_weights,
    load_hf_weights,
    read_hf_weights,
    save_hf_weights,
)
from .loading import load_checkpoint
from .reading import read_checkpoint
from .records import Checkpoint, Transfer
from .saving import check_save_target, save_checkpoint


def read_weights(path: str | os.PathLike) -> Checkpoint | HFWeights:
    """What the directory at `path` holds, from metadata and headers only; PlanError(SL501) if it is neither."""
    if is_hf_weights(path):
        return read_hf_weights(path)
    folder = Path(path)
    if folder.is_dir() and not (folder / ".metadata").exists() and any(folder.glob("pytorch_model*.bin")):
        raise plan_error(
            SL501,
            f"{folder} holds pickled PyTorch weights (pytorch_model*.bin), which shardlang does not read",
            ("save them as safetensors first: from_pretrained(DIR).save_pretrained(NEW_DIR)",),
        )
    return read_checkpoint(path)


def check_weights_fit(weights: Checkpoint | HFWeights, model: torch.nn.Module) -> None:
    """PlanError(SL500) listing every misfit between the weights and `model` (a meta model too)."""
    if isinstance(weights, HFWeights):
        check_hf_fits(weights, model)
    else:
        check_fits(weights, model)


def load_weights(model: torch.nn.Module, weights: Checkpoint | HFWeights) -> Transfer:
    """Load into the sharded `model`, on every rank; nothing is changed on a PlanError."""
    if isinstance(weights, HFWeights):
        return load_hf_weights(model, weights)
    return load_checkpoint(model, weights)


def check_target(path: str | os.PathLike, form: str) -> None:
    """PlanError(SL501) if a save in `form` must not replace `path`."""
    if form == "hf":
        check_hf_save_target(path)
    else:
        check_save_target(path)


def save_weights(model: torch.nn.Module, path: str | os.PathLike, form: str, optimizer=None, info=None) -> Transfer:
    """Save in `form`: a DCP checkpoint (with the optimizer's state) or Hugging Face weights (the model's)."""
    if form == "hf":
        return save_hf_weights(model, path)
    return save_checkpoint(model, path, optimizer, info=info)
