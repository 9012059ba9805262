"""The model's state as a checkpoint keys it, and back: `state_dict()` through the model's own state-dict
hooks, without the key segments that wrappers insert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..frontend.patterns import plain_name


def model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state as a checkpoint holds it: `model.state_dict()`, through the model's own state-dict
    hooks (torchtitan's fused QKV saves `wqkv` as `wq`, `wk`, `wv`; torchtitan's checkpointer saves this
    dict with DCP), keys without wrapper segments. (torch's get_model_state_dict maps every key back to a
    parameter by attribute and fails on a key a hook made.) On a meta model too: global shapes."""
    return {plain_name(key): value for key, value in model.state_dict().items()}


def load_model_state_dict(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Copy `state` (keyed as model_state_dict keys it) into the model through `load_state_dict`, whose hooks
    turn hooked keys back into the model's tensors (torchtitan's merges `wq`, `wk`, `wv` into `wqkv`)."""
    keys = {plain_name(key): key for key in model.state_dict(keep_vars=True)}
    model.load_state_dict({keys.get(key, key): value for key, value in state.items()})
