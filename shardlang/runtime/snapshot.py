"""Snapshot and rollback: enough of a model's state to put it back exactly as it was after a failed apply."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .torchcompat import composable_state_mapping


class Snapshot:
    """Enough of a model's state to put it back after a failed apply: each module's class and attribute
    dict (one level of its dicts, sets and lists copied: parameters, buffers, submodules, hooks), each
    tensor's data, and the composable-API state torch keeps outside the modules."""

    def __init__(self, modules, tensors, composable):
        self.modules = modules
        self.tensors = tensors
        self.composable = composable

    @classmethod
    def take(cls, model: nn.Module) -> Snapshot:
        modules = []
        tensors = []
        for module in model.modules():
            saved = {k: _shallow(v) for k, v in module.__dict__.items()}
            modules.append((module, module.__class__, saved))
            for store in (module._parameters, module._buffers):
                tensors += [(t, t.data) for t in store.values() if t is not None]
        mapping = composable_state_mapping()
        composable = {m: mapping[m] for m, _, _ in modules if m in mapping} if mapping is not None else None
        return cls(modules, tensors, composable)

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, data in self.tensors:
                if tensor.data is not data:
                    tensor.data = data
        for module, cls, saved in self.modules:
            module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update({k: _shallow(v) for k, v in saved.items()})
        mapping = composable_state_mapping()
        if mapping is not None and self.composable is not None:
            for module, _, _ in self.modules:
                mapping.pop(module, None)
            mapping.update(self.composable)


def _shallow(value: Any) -> Any:
    """A copy of a dict, set or list (one level), so later in-place edits do not reach the snapshot."""
    return type(value)(value) if isinstance(value, (dict, set, list)) else value
