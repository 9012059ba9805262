"""Checkpoints that outlive a plan: save, load and convert model (and optimizer) state with
`torch.distributed.checkpoint` (DCP), whatever plan and world size wrote or reads them.

A checkpoint is a plain DCP directory: `{"model": <model state dict>, "optimizer": <optimizer state
dict>}` keyed by parameter names (the FQNs `get_state_dict` gives, wrappers removed), so DCP reshards
it onto any layout, and `dcp.load` reads it without shardlang. Beside DCP's files lies
`shardlang.json`, what wrote it (plan, world size, optimizer class); a DCP directory without one
(written by hand-written code) loads all the same, with the model state at the top level or under
`model`.

Nothing is lost on failure: a save writes into a hidden sibling directory and, once every rank has
finished, rank 0 swaps it into place in one rename, so an interrupted save leaves the previous
checkpoint whole. A load checks every key, shape and dtype against the model first and reads into new
tensors, copying them into the model only when all were read: a checkpoint that does not fit is an
error listing what does not fit (SL500), never a partial load.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from attrs import field, frozen
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .._version import __version__
from ..frontend.diagnostics import SL500, SL501, Code, Diagnostic, PlanError, few_lines

#: The file beside DCP's own that says what wrote a checkpoint.
INFO_FILE = "shardlang.json"


@frozen
class Checkpoint:
    """What a checkpoint directory holds, from its DCP metadata (no tensor data is read)."""

    path: Path
    model: Mapping[str, TensorStorageMetadata | BytesStorageMetadata] = field(repr=False)  # model key -> what is stored
    optimizer: Mapping[str, TensorStorageMetadata | BytesStorageMetadata] = field(
        repr=False
    )  # flattened optimizer key -> ...
    nested: bool  # True: {"model": ..., "optimizer": ...}; False: the model state dict at the top level
    info: Mapping[str, Any] = field(factory=dict)  # shardlang.json, or {} for a checkpoint written by other code
    # DCP key -> where it sits in {"model": {fqn: ...}, "optimizer": {...}}, with what is stored there
    locations: Mapping[str, tuple[tuple, TensorStorageMetadata | BytesStorageMetadata]] = field(
        factory=dict, repr=False
    )

    @property
    def has_optimizer(self) -> bool:
        return bool(self.optimizer)

    @property
    def tensors(self) -> int:
        return sum(isinstance(m, TensorStorageMetadata) for m in self.model.values())

    @property
    def bytes(self) -> int:
        return sum(_nbytes(m) for m in (*self.model.values(), *self.optimizer.values()))


@frozen
class Transfer:
    """One save or load: where, how much and how long (every rank's tensors together)."""

    path: str
    tensors: int
    bytes: int
    seconds: float
    optimizer: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "optimizer": self.optimizer,
        }

    def describe(self) -> str:
        what = f"{self.tensors} tensors, {self.bytes / 1e6:.1f} MB" + (
            " with optimizer state" if self.optimizer else ""
        )
        return f"{what} in {self.seconds:.2f} s ({self.bytes / max(self.seconds, 1e-9) / 1e9:.3f} GB/s)"


# --- reading --------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The contents of the checkpoint at `path`, or PlanError(SL501) if it is not a readable one."""
    path = Path(path)
    if not path.exists():
        interrupted = _stale(path, "old")
        help_ = (
            (f"a save was interrupted while it swapped checkpoints: the previous one is whole at {interrupted[0]}",)
            if interrupted
            else ()
        )
        raise _error(SL501, f"no checkpoint at {path}: it does not exist", help_)
    if not (path / ".metadata").is_file():
        raise _error(
            SL501,
            f"{path} is not a checkpoint: it has no DCP .metadata file",
            ("a checkpoint is a directory written by `shardlang apply --save` or torch.distributed.checkpoint.save",),
        )
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: report it, do not crash
        raise _error(SL501, f"cannot read the checkpoint at {path}: {type(e).__name__}: {e}") from None
    info = {}
    if (path / INFO_FILE).is_file():
        try:
            info = json.loads((path / INFO_FILE).read_text())
        except (OSError, ValueError):
            info = {}
    return _contents(path, metadata, info)


def _contents(path: Path, metadata: Metadata, info: Mapping[str, Any]) -> Checkpoint:
    """Sort DCP's flat keys into model and optimizer entries by the nested paths DCP recorded for them
    (a checkpoint without a `model` level holds the model state dict at the top)."""
    paths = {
        key: tuple(metadata.planner_data.get(key, (key,))) if metadata.planner_data else (key,)
        for key in metadata.state_dict_metadata
    }
    nested = bool(paths) and any(p[0] == "model" and len(p) > 1 for p in paths.values())
    model, optimizer, locations = {}, {}, {}
    for key, stored in metadata.state_dict_metadata.items():
        p = paths[key]
        if nested and p[0] == "model" and len(p) > 1:
            fqn = ".".join(str(part) for part in p[1:])
            model[fqn], locations[key] = stored, (("model", fqn), stored)
        elif nested and p[0] == "optimizer":
            optimizer[key.removeprefix("optimizer.")], locations[key] = stored, (p, stored)
        elif not nested:
            model[key], locations[key] = stored, (("model", key), stored)
    return Checkpoint(path, model, optimizer, nested, info, locations)


def _nbytes(stored) -> int:
    if not isinstance(stored, TensorStorageMetadata):
        return 0
    return stored.size.numel() * torch.empty((), dtype=stored.properties.dtype).element_size()


# --- fitting ---------------------------------------------------------------------------------------


def misfits(checkpoint: Checkpoint, state: Mapping[str, Any], what: str = "model") -> list[str]:
    """Every way `state` (a model state dict, or a flattened optimizer one) and the checkpoint differ:
    keys on one side only, and tensors of another global shape or dtype. Works on meta tensors too."""
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
                f"{key}: dtype {_name(have.properties.dtype)} in the checkpoint, {_name(value.dtype)} in the {what}"
            )
    found += [f"checkpoint key {key} is not in the {what}" for key in stored if key not in state]
    return found


def check_fits(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """PlanError(SL500) listing every misfit between the checkpoint and `model` (any device, meta too)."""
    found = misfits(checkpoint, _model_state(model))
    if found:
        raise _misfit(checkpoint, "model", found)


def _misfit(checkpoint: Checkpoint, what: str, found: list[str]) -> PlanError:
    origin = checkpoint.info.get("plan")
    help_ = few_lines(found)
    if origin:
        help_ += (f"the checkpoint was saved by {origin} at world {checkpoint.info.get('world_size')}",)
    return _error(
        SL500,
        f"the checkpoint at {checkpoint.path} does not fit the {what}: {len(found)} mismatch{'es' if len(found) > 1 else ''}",
        help_,
    )


# --- loading ---------------------------------------------------------------------------------------


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
    state = _model_state(model)
    if model_state:
        found = misfits(checkpoint, state)
        if found:
            raise _misfit(checkpoint, "model", found)
    target: dict[str, Any] = {}
    if model_state:
        target["model"] = {k: _empty_like(v) for k, v in state.items()}
    before = None
    if optimizer is not None:
        if not checkpoint.has_optimizer:
            raise _error(
                SL500,
                f"the checkpoint at {checkpoint.path} holds no optimizer state",
                ("it was saved without optimizer state (no training step ran); load the model alone",),
            )
        saved_class = checkpoint.info.get("optimizer")
        if saved_class and saved_class != type(optimizer).__name__:
            raise _error(
                SL500,
                f"the checkpoint at {checkpoint.path} holds {saved_class} state, the optimizer is {type(optimizer).__name__}",
            )
        # The template needs the optimizer's state tensors, which torch creates with a zero-lr step:
        # undone if the checkpoint does not fit.
        before = optimizer.state_dict()
        optim_state = get_optimizer_state_dict(model, optimizer)
        found = misfits(checkpoint, _flatten(optim_state["state"], "state"), "optimizer")
        if found:
            optimizer.load_state_dict(before)
            raise _misfit(checkpoint, "optimizer", found)
        target["optimizer"] = _map_tensors(optim_state, _empty_like)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                target if checkpoint.nested else target.get("model", {}),
                checkpoint_id=str(checkpoint.path),
                no_dist=not _distributed(),
            )
    except Exception as e:
        if before is not None:
            optimizer.load_state_dict(before)
        raise _error(SL501, f"cannot read the checkpoint at {checkpoint.path}: {_first_line(e)}") from None
    if model_state:
        set_model_state_dict(model, target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optimizer"])
    nbytes = sum(_nbytes(m) for m in checkpoint.model.values()) if model_state else 0
    nbytes += sum(_nbytes(m) for m in checkpoint.optimizer.values()) if optimizer is not None else 0
    return Transfer(
        str(checkpoint.path), len(target.get("model", {})), nbytes, time.perf_counter() - start, optimizer is not None
    )


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    if any(p.is_meta for p in model.parameters()):
        return dict(model.state_dict())  # a meta model (the CLI's pre-check): plain names and global shapes
    return get_model_state_dict(model)


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


def _leaves(tree: Any):
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


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


# --- saving ----------------------------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    info: Mapping[str, Any] | None = None,
) -> Transfer:
    """Write `model`'s (and `optimizer`'s) state to `path` as a DCP checkpoint, replacing the one there
    only once every rank has written all of its part.

    Call it on every rank (or in one process, for an unsharded model). `path` must not be an existing
    directory that is not a checkpoint (SL501: it is never overwritten). `info` is added to
    shardlang.json."""
    start = time.perf_counter()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    written = _write(
        state,
        Path(path),
        {"optimizer": type(optimizer).__name__ if optimizer is not None else None, **(info or {})},
        distributed=_distributed(),
    )
    return Transfer(str(path), written.tensors, written.bytes, time.perf_counter() - start, optimizer is not None)


def _write(state: dict[str, Any], path: Path, info: Mapping[str, Any], *, distributed: bool) -> Checkpoint:
    """Save `state` into a hidden sibling of `path`, then publish it there once every rank is done."""
    path = path.absolute()
    rank0 = not distributed or dist.get_rank() == 0
    problem, staging = None, None
    if rank0:
        problem = _unreplaceable(path)
        staging = str(path.parent / f".{path.name}.saving-{uuid.uuid4().hex[:12]}")
    if distributed and dist.get_world_size() > 1:
        shared = [problem, staging]
        dist.broadcast_object_list(shared, src=0)
        problem, staging = shared
    if problem:
        raise _error(SL501, problem)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), no_dist=not distributed)
    except Exception as e:
        kept = f"the previous checkpoint at {path} is untouched" if path.exists() else "nothing was published"
        raise _error(SL501, f"cannot write the checkpoint {path}: {_first_line(e)}", (kept,)) from None
    world = dist.get_world_size() if distributed else 1
    if rank0:
        _write_json(
            Path(staging) / INFO_FILE,
            {
                "format": 1,
                "shardlang": __version__,
                "torch": torch.__version__,
                "world_size": world,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **info,
            },
        )
    if distributed:
        dist.barrier()  # every rank's files are in place (DCP's own finish step ran on rank 0 already)
    if rank0:
        publish(Path(staging), path)
    if distributed:
        dist.barrier()  # no rank returns before the new checkpoint is visible
    return _contents(path, metadata, info)


def check_save_target(path: str | os.PathLike) -> None:
    """PlanError(SL501) if a checkpoint must not be saved at `path` (see save_checkpoint)."""
    problem = _unreplaceable(Path(path).absolute())
    if problem:
        raise _error(SL501, problem)


def _unreplaceable(path: Path) -> str | None:
    """Why `path` must not be replaced by a checkpoint, or None."""
    if path.exists() and not path.is_dir():
        return f"cannot save to {path}: it is a file, not a checkpoint directory"
    if path.is_dir() and any(path.iterdir()) and not (path / ".metadata").is_file():
        return f"cannot save to {path}: it is a directory with files but no checkpoint; shardlang replaces only checkpoints"
    if not path.parent.is_dir():
        return f"cannot save to {path}: {path.parent} does not exist"
    return None


def publish(staging: Path, path: Path) -> None:
    """Put the finished checkpoint `staging` at `path`, replacing what is there in one step.

    On Linux, renameat2(RENAME_EXCHANGE) swaps the two directories atomically, so `path` is at every
    instant either the old checkpoint or the new one. Elsewhere the old one is first renamed aside
    (`.NAME.old-*`, which read_checkpoint points to should the process die in between), then removed."""
    _fsync_tree(staging)
    if not path.exists():
        os.rename(staging, path)
    elif _exchange(staging, path):
        shutil.rmtree(staging)
    else:
        aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        os.rename(staging, path)
        shutil.rmtree(aside)
    _fsync_dir(path.parent)
    for stale in _stale(path, "saving"):  # left by saves that were killed part way
        shutil.rmtree(stale, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), f"cannot swap {a} into {b}: {os.strerror(ctypes.get_errno())}")


def _stale(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*")) if path.parent.is_dir() else []


def _fsync_tree(root: Path) -> None:
    for file in root.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# --- converting ------------------------------------------------------------------------------------


def convert_checkpoint(source: str | os.PathLike, target: str | os.PathLike, *, optimizer: bool = False) -> Transfer:
    """A DCP checkpoint directory to a plain torch file, or a torch file back to a checkpoint.

    Directory -> file: the model state dict, as `torch.save(model.state_dict())` writes it (loadable
    with `model.load_state_dict`); with `optimizer`, `{"model": ..., "optimizer": ...}` instead.
    File -> directory: a model state dict, or such a pair, becomes a checkpoint any plan can load.
    One process, no process group; the whole state is held in memory once."""
    start = time.perf_counter()
    source, target = Path(source), Path(target)
    if source.is_dir() and target.is_dir():
        raise _error(
            SL501, f"{target} is a directory: a checkpoint converts to a torch file (convert CHECKPOINT_DIR OUT.pt)"
        )
    if not target.absolute().parent.is_dir():
        raise _error(SL501, f"cannot write {target}: {target.absolute().parent} does not exist")
    if source.is_dir():
        checkpoint = read_checkpoint(source)
        if optimizer and not checkpoint.has_optimizer:
            raise _error(SL501, f"the checkpoint at {source} holds no optimizer state to convert")
        state = _read_all(checkpoint, optimizer)
        tmp = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}"
        try:
            torch.save(state if optimizer else state["model"], tmp)
            os.replace(tmp, target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _error(SL501, f"cannot write {target}: {e.strerror or e}") from None
        tensors = len(state["model"])
    else:
        try:
            loaded = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise _error(SL501, f"no such file: {source}") from None
        except Exception as e:
            raise _error(SL501, f"{source} is not a torch state dict: {_first_line(e)}") from None
        state = _as_checkpoint_state(loaded, source)
        _write(state, target, {"optimizer": None, "converted_from": str(source)}, distributed=False)
        tensors = len(state["model"])
    nbytes = sum(v.numel() * v.element_size() for v in _leaves(state) if isinstance(v, torch.Tensor))
    return Transfer(str(target), tensors, nbytes, time.perf_counter() - start, "optimizer" in state)


def _read_all(checkpoint: Checkpoint, optimizer: bool) -> dict[str, Any]:
    """Every tensor and object of the checkpoint, as nested dicts, read in this one process."""
    tree: dict[str, Any] = {}
    for parts, stored in checkpoint.locations.values():
        if parts[0] == "optimizer" and not optimizer:
            continue
        value = (
            torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
            if isinstance(stored, TensorStorageMetadata)
            else None
        )
        _put(tree, parts, value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(tree if checkpoint.nested else tree["model"], checkpoint_id=str(checkpoint.path), no_dist=True)
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
    raise _error(SL501, f"{source} is neither a state dict (names -> tensors) nor {{'model': ..., 'optimizer': ...}}")


# --- process group ---------------------------------------------------------------------------------


def _distributed() -> bool:
    """A real process group to save and load over (the fake one of `explain` is none)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _error(code: Code, message: str, help_: tuple[str, ...] = ()) -> PlanError:
    return PlanError([Diagnostic(code, message, None, help_)])
