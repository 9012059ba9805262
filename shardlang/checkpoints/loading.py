"""Loading a checkpoint into a model (and optimizer) on every rank, resharded to their layout, all or nothing.

A load checks every key, shape and dtype against the model first and reads into new tensors, copying them
into the model only when all were read: a checkpoint that does not fit is an error listing what does not
fit (SL500), never a partial load. DCP reads it through `_Reader`, handed the metadata reading.py read
safely, and `_Planner`, whose objects go through torch's weights-only unpickler.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ..frontend.diagnostics import SL500, SL501, PlanError
from .common import first_line, plan_error, process_group_up
from .fitting import elsewhere, misfit_error, misfits
from .reading import DAMAGED_HELP, missing_data, read_checkpoint, read_metadata
from .records import Checkpoint, Transfer, stored_bytes
from .state import load_model_state_dict, model_state_dict


def load_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike | Checkpoint,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_state: bool = True,
) -> Transfer:
    """Load the checkpoint at `path` (or one read_checkpoint read) into `model` (and `optimizer`),
    resharding it to their layout.

    Call it on every rank of the process group after the plan is applied (or in a single process, with
    no group, for an unsharded model). Raises PlanError with SL501 for a path that is not a checkpoint
    and SL500 listing every key, shape or dtype that does not fit; either way nothing was changed."""
    start = time.perf_counter()
    checkpoint = path if isinstance(path, Checkpoint) else read_checkpoint(path)
    state = model_state_dict(model)
    if model_state:
        found = misfits(checkpoint, state, elsewhere=elsewhere(model))
        if found:
            raise misfit_error(checkpoint, "model", found)
    target: dict[str, Any] = {}
    if model_state:
        target["model"] = {k: _empty_like(v) for k, v in state.items()}
    before = None
    if optimizer is not None:
        if not checkpoint.has_optimizer:
            raise plan_error(
                SL500,
                f"the checkpoint at {checkpoint.path} holds no optimizer state",
                ("it was saved without optimizer state (no training step ran); load the model alone",),
            )
        saved_class = checkpoint.info.get("optimizer")
        if saved_class and saved_class != type(optimizer).__name__:
            raise plan_error(
                SL500,
                f"the checkpoint at {checkpoint.path} holds {saved_class} state, the optimizer is {type(optimizer).__name__}",
            )
        # The template needs the optimizer's state tensors, which torch creates with a zero-lr step:
        # undone if the checkpoint does not fit.
        before = optimizer.state_dict()
        optim_state = get_optimizer_state_dict(model, optimizer)
        found = misfits(checkpoint, _flatten(optim_state["state"], "state"), "optimizer", elsewhere(model))
        if found:
            optimizer.load_state_dict(before)
            raise misfit_error(checkpoint, "optimizer", found)
        target["optimizer"] = _map_tensors(optim_state, _empty_like)
    try:
        dcp_load(target if checkpoint.nested else target.get("model", {}), checkpoint, distributed=process_group_up())
    except PlanError:
        if before is not None:
            optimizer.load_state_dict(before)
        raise
    if model_state:
        load_model_state_dict(model, target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optimizer"])
    nbytes = sum(stored_bytes(m) for m in checkpoint.model.values()) if model_state else 0
    nbytes += sum(stored_bytes(m) for m in checkpoint.optimizer.values()) if optimizer is not None else 0
    return Transfer(
        str(checkpoint.path), len(target.get("model", {})), nbytes, time.perf_counter() - start, optimizer is not None
    )


class _Unreadable(Exception):
    """A data file that cannot be read, by name; raised inside DCP's read step, so it crosses ranks
    (DCP gathers each rank's exception) and every rank reports the same file."""


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, handed the metadata read_metadata read: DCP's own `read_metadata` unpickles
    `.metadata` with plain pickle. Data files are checked to be there and long enough before they are
    read, and a failed read names its file.

    Tensors need nothing more: FileSystemReader.read_data reads each with `torch.load(weights_only=True)`
    (torch 2.13, filesystem.py), torch's own restricted unpickler. Objects stored as bytes do: see
    _Planner."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(str(path))
        self._metadata = metadata
        self._reading: str | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        directory = Path(self.path)
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        problem = missing_data(directory, infos)
        if problem:
            raise _Unreadable(problem)
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            # (_slice_file is private to torch: should it go, name the files this rank was reading)
            names = sorted({info.relative_path for info in infos})
            name = self._reading or (names[0] if len(names) == 1 else "{" + ",".join(names) + "}")
            raise _Unreadable(_data_error(directory / name, e)) from None


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner, except for objects stored as bytes (optimizer hyperparameters,
    anything not a tensor): DefaultLoadPlanner.load_bytes reads them with `torch.load(weights_only=False)`,
    which runs whatever the bytes reduce to. Here torch's weights-only unpickler reads them first (tensors,
    primitives, containers: all a state dict holds); what it returns is re-serialized by torch.save and
    handed to DCP's own load_bytes, so its bookkeeping stays DCP's and it only ever unpickles our bytes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def _data_error(file: Path, e: BaseException) -> str:
    """One line for a data file DCP could not read."""
    if isinstance(e, FileNotFoundError):
        return f"the checkpoint's data file {file} is missing"
    if isinstance(e, OSError):
        return f"cannot read the checkpoint's data file {file}: {e.strerror or e}"
    text = str(e)
    # torch's weights-only unpickler names the global it refused
    refused = re.search(r"\bGLOBAL ([\w.]+)", text) if isinstance(e, pickle.UnpicklingError) else None
    if refused:
        return (
            f"refusing to unpickle {refused.group(1)} from {file}: checkpoint data holds tensors and plain "
            "values, and unpickling this could run code"
        )
    detail = first_line(e)
    if text.startswith("Weights only load failed"):  # the cause follows torch's paragraph of advice
        cause = text.partition("WeightsUnpickler error:")[2] or text.partition("\n\n")[2]
        detail = next((line.strip() for line in cause.splitlines() if line.strip()), detail)
    return f"the checkpoint at {file.parent} is damaged: its data file {file} is not what DCP wrote ({detail})"


def dcp_load(state: dict[str, Any], checkpoint: Checkpoint, *, distributed: bool) -> None:
    """dcp.load into `state` through _Reader and _Planner; PlanError(SL501) naming the file if a rank
    could not read its part (the same on every rank)."""
    metadata = checkpoint.metadata or read_metadata(checkpoint.path / ".metadata")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                state, storage_reader=_Reader(checkpoint.path, metadata), planner=_Planner(), no_dist=not distributed
            )
    except CheckpointException as e:  # a BaseException: every rank's failure, by rank
        failures = [e.failures[rank][0] for rank in sorted(e.failures)]
        cause = next((f for f in failures if isinstance(f, _Unreadable)), failures[0] if failures else e)
        if not isinstance(cause, Exception):
            raise  # KeyboardInterrupt, SystemExit
        raise _read_error(checkpoint, cause) from None
    except Exception as e:
        raise _read_error(checkpoint, e) from None


def _read_error(checkpoint: Checkpoint, e: Exception) -> PlanError:
    if isinstance(e, _Unreadable):
        return plan_error(SL501, str(e), () if str(e).startswith("refusing") else DAMAGED_HELP)
    return plan_error(SL501, f"cannot read the checkpoint at {checkpoint.path}: {first_line(e)}")


def _empty_like(value: Any) -> Any:
    """New memory of the same layout. A DTensor is built from its local shard: `torch.empty_like` on
    the DTensor would run sharding propagation, which costs more than the allocation."""
    if isinstance(value, DTensor) and value.to_local().device.type == value.device_mesh.device_type:
        local = torch.empty_like(value.to_local())
        return DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    # (an offloaded FSDP shard lives on the CPU of a cuda mesh, where from_local would move it to the GPU)
    return torch.empty_like(value) if isinstance(value, torch.Tensor) else value


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def _flatten(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """DCP's flattened keys for a nested dict's tensors: `state.<fqn>.exp_avg`."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat
