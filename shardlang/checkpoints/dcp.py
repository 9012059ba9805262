"""Checkpoints that outlive a plan: save, load and convert model (and optimizer) state with
`torch.distributed.checkpoint` (DCP), whatever plan and world size wrote or reads them.

A checkpoint is a plain DCP directory: `{"model": <model state dict>, "optimizer": <optimizer state
dict>}`, the model's keyed as its `state_dict()` keys it (through its state-dict hooks, wrappers removed),
the optimizer's by parameter names (the FQNs `get_state_dict` gives), so DCP reshards
it onto any layout, and `dcp.load` reads it without shardlang. Beside DCP's files lies
`shardlang.json`, what wrote it (plan, world size, optimizer class); a DCP directory without one
(written by hand-written code) loads all the same, with the model state at the top level or under
`model`.

Nothing is lost on failure: a save writes into a hidden sibling directory and, once every rank has
finished, rank 0 swaps it into place in one rename, so an interrupted save leaves the previous
checkpoint whole. A load checks every key, shape and dtype against the model first and reads into new
tensors, copying them into the model only when all were read: a checkpoint that does not fit is an
error listing what does not fit (SL500), never a partial load.

Reading runs no code of the checkpoint's: DCP unpickles `.metadata` with plain `pickle.load` and the
objects stored as bytes with `torch.load(weights_only=False)`. Here `.metadata` is read by a restricted
unpickler that admits only the classes DCP metadata is made of (METADATA_GLOBALS) before DCP sees it, and
DCP is handed that metadata (`_Reader`) and a planner whose objects go through torch's weights-only
unpickler (`_Planner`), as DCP's own tensor reads already do. A damaged checkpoint (a data file deleted,
truncated or overwritten, a `shardlang.json` that is not an object) is SL501 naming the file.

One save at a time per directory: a save holds an flock on `.NAME.lock` beside it (the kernel releases
it when the process dies, so a killed save leaves no stale lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import os
import pickle
import re
import shutil
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from attrs import field, frozen
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .._version import __version__
from ..frontend.diagnostics import SL500, SL501, Code, Diagnostic, PlanError, few_lines

try:
    import fcntl
except ImportError:  # not POSIX: saves are not locked against each other
    fcntl = None  # type: ignore[assignment]

#: The file beside DCP's own that says what wrote a checkpoint.
INFO_FILE = "shardlang.json"
_INFO_LIMIT = 1 << 20  # bytes: shardlang writes a few hundred

#: Everything a DCP `.metadata` pickle may name, by module: read with any other global, it is refused
#: (SL501) before DCP opens it. Found by pickling the metadata of every kind of checkpoint this project
#: writes under torch 2.13 (tensor parallel, FSDP, HSDP, 2-D; SGD, Adam, AdamW state; bf16 and every
#: other dtype; converted from a .pt; a hand-written `dcp.save` with objects) and listing the globals
#: of each with pickletools. Each is inert to call with any arguments: DCP's metadata dataclasses and
#: enum, the file reader's per-item record, torch.Size, `torch.serialization._get_layout` (TensorProperties
#: pickles its layout through it: a lookup that returns only torch.layout objects), and the path
#: StorageMeta records as the checkpoint id. Besides these, `torch.<name>` where that is a torch.dtype.
METADATA_GLOBALS: Mapping[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath"}),
}


def _info_dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"Checkpoint.info must be a mapping, not {type(value).__name__}")
    return dict(value)


@frozen
class Checkpoint:
    """What a checkpoint directory holds, from its DCP metadata (no tensor data is read)."""

    path: Path
    model: Mapping[str, TensorStorageMetadata | BytesStorageMetadata] = field(repr=False)  # model key -> what is stored
    optimizer: Mapping[str, TensorStorageMetadata | BytesStorageMetadata] = field(
        repr=False
    )  # flattened optimizer key -> ...
    nested: bool  # True: {"model": ..., "optimizer": ...}; False: the model state dict at the top level
    # shardlang.json (always a dict: read_checkpoint refuses any other JSON), or {} for a checkpoint
    # written by other code
    info: dict[str, Any] = field(factory=dict, converter=_info_dict)
    # DCP key -> where it sits in {"model": {fqn: ...}, "optimizer": {...}}, with what is stored there
    locations: Mapping[str, tuple[tuple, TensorStorageMetadata | BytesStorageMetadata]] = field(
        factory=dict, repr=False
    )
    # The DCP metadata as read (safely) when this was made: loads hand it to DCP instead of letting it
    # unpickle .metadata itself. None: read again at load.
    metadata: Metadata | None = field(default=None, repr=False, eq=False)

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
    """The contents of the checkpoint at `path`, or PlanError(SL501) if it is not a readable one.

    Reads `.metadata` with the restricted unpickler (no code of the checkpoint's runs), checks that
    every data file it names is there and long enough, and that shardlang.json, if any, is an object."""
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
    metadata = read_metadata(path / ".metadata")
    problem = _missing_data(path, metadata.storage_data.values())
    if problem:
        raise _error(SL501, problem, _DAMAGED_HELP)
    return _contents(path, metadata, _read_info(path))


class _Refused(Exception):
    """What the metadata unpickler refused: a global it does not admit, or a change to one it does."""

    def __init__(self, name: str, changed: bool = False):
        super().__init__(name)
        self.name, self.changed = name, changed


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only METADATA_GLOBALS and torch dtypes: any other global (the
    callables a malicious pickle reduces to, os.system, builtins.eval, ...) stops it before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata has no persistent ids")

    def load(self) -> Any:
        """As pickle's, but a pickle that sets attributes of an admitted class or function (BUILD on a
        global, which pickle allows: `Metadata.x = ...`, `_get_layout.cache = ...`) is undone and refused,
        so reading a checkpoint cannot change how this process later behaves either."""
        watched = [(g, dict(vars(g))) for g in _admitted() if hasattr(g, "__dict__")]
        try:
            return super().load()
        finally:
            changed = [g for g, before in watched if not _same(vars(g), before)]
            for g, before in watched:
                _restore(g, before)
            if changed:
                raise _Refused(f"{changed[0].__module__}.{changed[0].__qualname__}", changed=True)


def _admitted() -> list[Any]:
    """The objects METADATA_GLOBALS names (those a metadata pickle can reach)."""
    import importlib

    return [getattr(importlib.import_module(m), n) for m, names in METADATA_GLOBALS.items() for n in names]


def _same(now: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    return now.keys() == before.keys() and all(now[k] is before[k] for k in before)


def _restore(obj: Any, before: Mapping[str, Any]) -> None:
    now = dict(vars(obj))
    if _same(now, before):
        return
    for key in now.keys() - before.keys():
        delattr(obj, key)
    for key, value in before.items():
        if now.get(key) is not value:
            setattr(obj, key, value)


def read_metadata(file: str | os.PathLike) -> Metadata:
    """A DCP `.metadata` file's Metadata, unpickled admitting only METADATA_GLOBALS and checked for the
    shape DCP gives it; PlanError(SL501) otherwise, before anything in it was called."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _error(
            SL501,
            f"refusing to unpickle {file}: it sets attributes of {e.name}, which DCP metadata never does"
            if e.changed
            else f"refusing to unpickle {e.name} from {file}: DCP metadata is not made of it, and unpickling "
            "it could run code",
            (
                "a checkpoint may have been crafted to run code when it is loaded; shardlang never unpickles "
                "what DCP metadata is not made of",
                f"if torch.distributed.checkpoint wrote it under another torch than {torch.__version__}, "
                "its metadata may use classes this torch does not: convert it to a .pt there",
            ),
        ) from None
    except Exception as e:  # a truncated or foreign .metadata: report it, do not crash
        raise _error(SL501, f"cannot read the checkpoint's metadata {file}: {_first_line(e)}") from None
    problem = _malformed(metadata)
    if problem:
        raise _error(SL501, f"{file} is not DCP metadata: {problem}")
    return metadata


def _malformed(metadata: Any) -> str | None:
    """What in an unpickled `.metadata` is not as DCP writes it (everything later code relies on), or None."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not a Metadata"
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return "state_dict_metadata is not a dict"
    for key, stored in entries.items():
        if not isinstance(key, str):
            return f"key {key!r} is not a string"
        if isinstance(stored, TensorStorageMetadata):
            properties, size, chunks = (getattr(stored, a, None) for a in ("properties", "size", "chunks"))
            if not isinstance(properties, TensorProperties) or not isinstance(
                getattr(properties, "dtype", None), torch.dtype
            ):
                return f"{key}: no tensor dtype"
            if not isinstance(size, torch.Size) or not isinstance(chunks, list):
                return f"{key}: no tensor size and chunks"
            for chunk in chunks:
                if not isinstance(chunk, ChunkStorageMetadata) or not all(
                    isinstance(getattr(chunk, a, None), torch.Size) and len(getattr(chunk, a)) == len(size)
                    for a in ("offsets", "sizes")
                ):
                    return f"{key}: a chunk is not offsets and sizes of {len(size)} dims"
        elif not isinstance(stored, BytesStorageMetadata):
            return f"{key}: {type(stored).__name__} is neither tensor nor bytes storage"
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not (
        isinstance(planner_data, dict)
        and all(
            isinstance(path, (tuple, list))
            and path
            # a list index (param_groups) is below the number of entries: no list of 10**12 is built
            and all(isinstance(p, str) or (isinstance(p, int) and 0 <= p <= len(entries)) for p in path)
            for path in planner_data.values()
        )
    ):
        return "planner_data is not DCP's key -> nested path"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return "storage_data is not a dict"
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _plain_name(name):
            return f"data file {name!r} is not a file name in the checkpoint's directory"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(n, int) and n >= 0 for n in (offset, length)):
            return f"{name}: offset {offset!r} and length {length!r} are not sizes"
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            return f"{name}: transform descriptors are not strings"
    if getattr(metadata, "storage_meta", None) is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return "storage_meta is not a StorageMeta"
    return None


def _plain_name(name: str) -> bool:
    """A file directly in the checkpoint directory: no separators, no `..`, no NUL (DCP opens
    `directory / name`, where an absolute name or `..` would read any file)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


_DAMAGED_HELP = (
    "the checkpoint's files were changed after it was written (an interrupted copy, a full disk, a "
    "bad download): copy it again, or save a new one",
)


def _missing_data(directory: Path, infos: Iterable[Any]) -> str | None:
    """Why the data files `infos` name cannot all be read from `directory` (missing, not a file, shorter
    than the metadata says), or None."""
    needed: dict[str, int] = {}
    for info in infos:
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = directory / name
        try:
            found = file.stat()
        except FileNotFoundError:
            return f"the checkpoint at {directory} is damaged: its data file {file} is missing"
        except OSError as e:
            return f"cannot read the checkpoint's data file {file}: {e.strerror or e}"
        if not file.is_file():
            return f"the checkpoint at {directory} is damaged: its data file {file} is not a file"
        if found.st_size < end:
            return (
                f"the checkpoint at {directory} is damaged: its data file {file} is truncated "
                f"({found.st_size} bytes, its metadata needs {end})"
            )
    return None


_JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _read_info(path: Path) -> dict[str, Any]:
    """shardlang.json, which must be a JSON object with the keys shardlang reads of the right types;
    {} where there is none (a checkpoint written by other code)."""
    file = path / INFO_FILE
    if not file.exists() and not file.is_symlink():
        return {}
    help_ = (
        f"{INFO_FILE} is what shardlang writes beside a checkpoint; without it the checkpoint loads as "
        "one written by other code (remove it if it is not shardlang's)",
    )
    try:
        if file.stat().st_size > _INFO_LIMIT:
            raise _error(SL501, f"{file} is not shardlang's: larger than {_INFO_LIMIT >> 20} MiB", help_)
        info = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise _error(SL501, f"cannot read {file}: {e.strerror or e}", help_) from None
    except ValueError as e:  # invalid JSON, or not UTF-8
        raise _error(SL501, f"{file} is not valid JSON: {_first_line(e)}", help_) from None
    if not isinstance(info, dict):
        kind = "null" if info is None else _JSON_KINDS.get(type(info), type(info).__name__)
        raise _error(SL501, f"{file} holds {kind}, not a JSON object", help_)
    for key, kind, want in (("optimizer", str, "a string"), ("plan", str, "a string"), ("world_size", int, "a number")):
        value = info.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise _error(SL501, f"{file}: {key!r} is {_JSON_KINDS.get(type(value), 'an object')}, not {want}", help_)
    return info


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
    return Checkpoint(path, model, optimizer, nested, info, locations, metadata)


def _nbytes(stored) -> int:
    if not isinstance(stored, TensorStorageMetadata):
        return 0
    return stored.size.numel() * torch.empty((), dtype=stored.properties.dtype).element_size()


# --- fitting ---------------------------------------------------------------------------------------


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
                f"{key}: dtype {_name(have.properties.dtype)} in the checkpoint, {_name(value.dtype)} in the {what}"
            )
    prefixes = tuple(f"{m}." for m in elsewhere)
    found += [
        f"checkpoint key {key} is not in the {what}"
        for key in stored
        if key not in state and not key.removeprefix("state.").startswith(prefixes)
    ]
    return found


def elsewhere(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules of a pipeline stage that other stages hold (pass-throughs here); () for a whole model."""
    from ..runtime.pipeline import PassThrough

    return tuple(fqn for fqn, m in model.named_modules() if isinstance(m, PassThrough))


def check_fits(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """PlanError(SL500) listing every misfit between the checkpoint and `model` (any device, meta too)."""
    found = misfits(checkpoint, _model_state(model), elsewhere=elsewhere(model))
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
        found = misfits(checkpoint, state, elsewhere=elsewhere(model))
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
        found = misfits(checkpoint, _flatten(optim_state["state"], "state"), "optimizer", elsewhere(model))
        if found:
            optimizer.load_state_dict(before)
            raise _misfit(checkpoint, "optimizer", found)
        target["optimizer"] = _map_tensors(optim_state, _empty_like)
    try:
        _dcp_load(target if checkpoint.nested else target.get("model", {}), checkpoint, distributed=_distributed())
    except PlanError:
        if before is not None:
            optimizer.load_state_dict(before)
        raise
    if model_state:
        _load_model_state(model, target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optimizer"])
    nbytes = sum(_nbytes(m) for m in checkpoint.model.values()) if model_state else 0
    nbytes += sum(_nbytes(m) for m in checkpoint.optimizer.values()) if optimizer is not None else 0
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
        problem = _missing_data(directory, infos)
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
    detail = _first_line(e)
    if text.startswith("Weights only load failed"):  # the cause follows torch's paragraph of advice
        cause = text.partition("WeightsUnpickler error:")[2] or text.partition("\n\n")[2]
        detail = next((line.strip() for line in cause.splitlines() if line.strip()), detail)
    return f"the checkpoint at {file.parent} is damaged: its data file {file} is not what DCP wrote ({detail})"


def _dcp_load(state: dict[str, Any], checkpoint: Checkpoint, *, distributed: bool) -> None:
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
        return _error(SL501, str(e), () if str(e).startswith("refusing") else _DAMAGED_HELP)
    return _error(SL501, f"cannot read the checkpoint at {checkpoint.path}: {_first_line(e)}")


#: Module names that wrappers insert into state-dict keys (activation checkpointing's, FSDP1's,
#: torch.compile's): a checkpoint's keys leave them out, as torch's get_model_state_dict does.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def _plain_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state as a checkpoint holds it: `model.state_dict()`, through the model's own state-dict
    hooks (torchtitan's fused QKV saves `wqkv` as `wq`, `wk`, `wv`; torchtitan's checkpointer saves this
    dict with DCP), keys without wrapper segments. (torch's get_model_state_dict maps every key back to a
    parameter by attribute and fails on a key a hook made.) On a meta model too: global shapes."""
    return {_plain_key(key): value for key, value in model.state_dict().items()}


def _load_model_state(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Copy `state` (keyed as _model_state keys it) into the model through `load_state_dict`, whose hooks
    turn hooked keys back into the model's tensors (torchtitan's merges `wq`, `wk`, `wv` into `wqkv`)."""
    keys = {_plain_key(key): key for key in model.state_dict(keep_vars=True)}
    model.load_state_dict({keys.get(key, key): value for key, value in state.items()})


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
    state: dict[str, Any] = {"model": _model_state(model)}
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
    """Save `state` as a DCP checkpoint at `path` (see `write_staged`), with shardlang.json beside it."""
    world = dist.get_world_size() if distributed else 1

    def write(staging: Path) -> Metadata:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=not distributed)
        if not distributed or dist.get_rank() == 0:
            _write_json(
                staging / INFO_FILE,
                {
                    "format": 1,
                    "shardlang": __version__,
                    "torch": torch.__version__,
                    "world_size": world,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    **info,
                },
            )
        return metadata

    metadata, target = write_staged(path, write, distributed=distributed)
    return _contents(target, metadata, info)


def write_staged(
    path: Path,
    write: Callable[[Path], Any],
    *,
    distributed: bool,
    unreplaceable: Callable[[Path], str | None] | None = None,
) -> tuple[Any, Path]:
    """Run `write(staging)` on every rank into a hidden sibling of `path`, then publish it there once every
    rank is done; what rank 0's `write` returned (every rank's own, elsewhere) and the directory replaced.

    Rank 0 holds the save lock from before the staging directory exists until the new checkpoint is in
    place, so no other save removes it as a leftover. A failed save, on any rank, is SL501 on every rank
    and leaves what was at `path` as it was. `unreplaceable(target)` says why a directory must not be
    replaced (default: anything but a DCP checkpoint)."""
    rank0 = not distributed or dist.get_rank() == 0
    many = distributed and dist.get_world_size() > 1
    with contextlib.ExitStack() as held:
        problem, staging, target = None, None, None
        if rank0:
            try:
                target = _save_target(path, unreplaceable or _unreplaceable)
                held.enter_context(_save_lock(target, path))
                staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}"
            except PlanError as e:
                problem = e.diagnostics[0]
        if many:
            shared = [problem, staging, target]
            dist.broadcast_object_list(shared, src=0)
            problem, staging, target = shared
        if problem:
            raise PlanError([problem])
        failure = None
        try:
            result = write(staging)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, CheckpointException):
                causes = [e.failures[rank][0] for rank in sorted(e.failures)]
                e = next((c for c in causes if isinstance(c, Exception)), e)
            failure, result = _first_line(e), None
        if many:  # a step one rank took alone (rank 0's files beside DCP's) may have failed there only
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, failure)
            failure = next((f for f in failures if f is not None), None)
        if failure is not None:
            if not distributed:  # (with ranks, one may still be writing there: the next save clears it)
                shutil.rmtree(staging, ignore_errors=True)
            kept = f"the previous checkpoint at {path} is untouched" if target.exists() else "nothing was published"
            raise _error(SL501, f"cannot write the checkpoint {path}: {failure}", (kept,))
        if rank0:
            publish(staging, target)
    if distributed:
        dist.barrier()  # no rank returns before the new checkpoint is visible
    return result, target


def check_save_target(path: str | os.PathLike, unreplaceable: Callable[[Path], str | None] | None = None) -> None:
    """PlanError(SL501) if a checkpoint must not be saved at `path` (see save_checkpoint; `unreplaceable`
    as for write_staged), or another save to it is running now."""
    with _save_lock(_save_target(Path(path), unreplaceable or _unreplaceable), Path(path)):
        pass


def _save_target(path: Path, unreplaceable: Callable[[Path], str | None]) -> Path:
    """The directory a checkpoint saved at `path` replaces, or PlanError(SL501).

    A symlink is followed: the checkpoint is written where it points (beside that directory, so the swap
    is one rename on its file system) and the link is kept, as writing into a linked directory does."""
    try:
        target = path.absolute().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12, OSError after
        raise _error(SL501, f"cannot save to {path}: {e}") from None
    problem = unreplaceable(target)
    if problem:
        shown = f"{path} (a link to {target})" if path.is_symlink() else str(path)
        raise _error(SL501, problem.replace(str(target), shown, 1))
    return target


@contextlib.contextmanager
def _save_lock(target: Path, shown: Path | None = None) -> Iterator[None]:
    """Hold the lock of saves to `target`: an flock on `.NAME.lock` beside it, which says who holds it.

    PlanError(SL501) naming the holder if another process holds it. The kernel drops an flock when its
    process dies however it dies, so a lock file left by a killed save is simply taken over; the file is
    removed (while locked) on release, and one that was removed as it was taken is taken again."""
    if fcntl is None:
        yield
        return
    lock = target.parent / f".{target.name}.lock"
    while True:
        try:
            # O_NOFOLLOW: a `.NAME.lock` planted as a symlink must not make us truncate what it points to
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(lock, flags, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
        except OSError as e:
            raise _error(SL501, f"cannot save to {target}: cannot create its lock {lock}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _error(SL501, f"cannot save to {target}: cannot lock {lock}: {e.strerror or e}") from None
            raise _error(
                SL501,
                f"cannot save to {shown or target}: another save to it is running ({holder})",
                (f"wait for it to finish or save elsewhere; {lock} is its lock, released when it exits",),
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file that is there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _unreplaceable(path: Path) -> str | None:
    """Why `path` (symlinks resolved) must not be replaced by a checkpoint, or None."""
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
        try:
            value = (
                torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
                if isinstance(stored, TensorStorageMetadata)
                else None
            )
        except (RuntimeError, MemoryError) as e:  # a size no memory holds
            raise _error(SL501, f"cannot read the checkpoint at {checkpoint.path}: {_first_line(e)}") from None
        try:
            _put(tree, parts, value)
        except (TypeError, AttributeError, IndexError):  # a list index and a key at one place
            raise _error(
                SL501, f"{checkpoint.path / '.metadata'} is not DCP metadata: its nested paths conflict"
            ) from None
    tree.setdefault("model", {})  # (a checkpoint of no tensors)
    _dcp_load(tree if checkpoint.nested else tree["model"], checkpoint, distributed=False)
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
