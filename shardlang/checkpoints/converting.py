"""Converting between a DCP checkpoint directory and a plain torch file, in one process."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..frontend.diagnostics import SL501
from .common import first_line, plan_error
from .loading import dcp_load
from .reading import read_checkpoint
from .records import Checkpoint, Transfer
from .saving import write_checkpoint


def convert_checkpoint(source: str | os.PathLike, target: str | os.PathLike, *, optimizer: bool = False) -> Transfer:
    """A DCP checkpoint directory to a plain torch file, or a torch file back to a checkpoint.

    Directory -> file: the model state dict, as `torch.save(model.state_dict())` writes it (loadable
    with `model.load_state_dict`); with `optimizer`, `{"model": ..., "optimizer": ...}` instead.
    File -> directory: a model state dict, or such a pair, becomes a checkpoint any plan can load.
    One process, no process group; the whole state is held in memory once."""
    start = time.perf_counter()
    source, target = Path(source), Path(target)
    if source.is_dir() and target.is_dir():
        raise plan_error(
            SL501, f"{target} is a directory: a checkpoint converts to a torch file (convert CHECKPOINT_DIR OUT.pt)"
        )
    if not target.absolute().parent.is_dir():
        raise plan_error(SL501, f"cannot write {target}: {target.absolute().parent} does not exist")
    if source.is_dir():
        checkpoint = read_checkpoint(source)
        if optimizer and not checkpoint.has_optimizer:
            raise plan_error(SL501, f"the checkpoint at {source} holds no optimizer state to convert")
        state = _read_all(checkpoint, optimizer)
        tmp = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}"
        try:
            torch.save(state if optimizer else state["model"], tmp)
            os.replace(tmp, target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise plan_error(SL501, f"cannot write {target}: {e.strerror or e}") from None
        tensors = len(state["model"])
    else:
        try:
            loaded = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise plan_error(SL501, f"no such file: {source}") from None
        except Exception as e:
            raise plan_error(SL501, f"{source} is not a torch state dict: {first_line(e)}") from None
        state = _as_checkpoint_state(loaded, source)
        write_checkpoint(state, target, {"optimizer": None, "converted_from": str(source)}, distributed=False)
        tensors = len(state["model"])
    nbytes = sum(v.numel() * v.element_size() for v in _leaves(state) if isinstance(v, torch.Tensor))
    return Transfer(str(target), tensors, nbytes, time.perf_counter() - start, "optimizer" in state)


def _read_all(checkpoint: Checkpoint, optimizer: bool) -> dict[str, Any]:
    """Every tensor and object of the checkpoint, as nested dicts, read in this one process."""
    tree: dict[str, Any] = {}
    for parts, stored in checkpoint.locations.values():
        if parts[0] == "optimizer" and not optimizer:
            continue
        try:
            value = (
                torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
                if isinstance(stored, TensorStorageMetadata)
                else None
            )
        except (RuntimeError, MemoryError) as e:  # a size no memory holds
            raise plan_error(SL501, f"cannot read the checkpoint at {checkpoint.path}: {first_line(e)}") from None
        try:
            _put(tree, parts, value)
        except (TypeError, AttributeError, IndexError):  # a list index and a key at one place
            raise plan_error(
                SL501, f"{checkpoint.path / '.metadata'} is not DCP metadata: its nested paths conflict"
            ) from None
    tree.setdefault("model", {})  # (a checkpoint of no tensors)
    dcp_load(tree if checkpoint.nested else tree["model"], checkpoint, distributed=False)
    return tree


def _put(tree: dict, parts: tuple, value: Any) -> None:
    """Set tree[p0][p1]...; integer parts index lists (DCP's param_groups)."""
    node = tree
    for part, following in zip(parts, parts[1:]):
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = [] if isinstance(following, int) else {}
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(following, int) else {})
    last = parts[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _as_checkpoint_state(loaded: Any, source: Path) -> dict[str, Any]:
    if (
        isinstance(loaded, Mapping)
        and isinstance(loaded.get("model"), Mapping)
        and set(loaded) <= {"model", "optimizer"}
    ):
        return dict(loaded)
    if (
        isinstance(loaded, Mapping)
        and loaded
        and all(isinstance(k, str) for k in loaded)
        and all(isinstance(v, torch.Tensor) for v in loaded.values())
    ):
        return {"model": dict(loaded)}
    raise plan_error(
        SL501, f"{source} is neither a state dict (names -> tensors) nor {{'model': ..., 'optimizer': ...}}"
    )


def _leaves(tree: Any):
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree
