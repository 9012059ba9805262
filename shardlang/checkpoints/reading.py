"""Reading what a checkpoint holds without running any of its code: `.metadata` through a restricted
unpickler, the data files it names checked to be there, shardlang.json checked to be an object.

Reading runs no code of the checkpoint's: DCP unpickles `.metadata` with plain `pickle.load` and the
objects stored as bytes with `torch.load(weights_only=False)`. Here `.metadata` is read by a restricted
unpickler that admits only the classes DCP metadata is made of (METADATA_GLOBALS) before DCP sees it, and
DCP is handed that metadata (loading.py's `_Reader`) and a planner whose objects go through torch's
weights-only unpickler (`_Planner`), as DCP's own tensor reads already do. A damaged checkpoint (a data
file deleted, truncated or overwritten, a `shardlang.json` that is not an object) is SL501 naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..frontend.diagnostics import SL501
from .common import first_line, is_plain_name, plan_error
from .records import INFO_FILE, Checkpoint, checkpoint_contents
from .saving import leftovers

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


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The contents of the checkpoint at `path`, or PlanError(SL501) if it is not a readable one.

    Reads `.metadata` with the restricted unpickler (no code of the checkpoint's runs), checks that
    every data file it names is there and long enough, and that shardlang.json, if any, is an object."""
    path = Path(path)
    if not path.exists():
        interrupted = leftovers(path, "old")
        help_ = (
            (f"a save was interrupted while it swapped checkpoints: the previous one is whole at {interrupted[0]}",)
            if interrupted
            else ()
        )
        raise plan_error(SL501, f"no checkpoint at {path}: it does not exist", help_)
    if not (path / ".metadata").is_file():
        raise plan_error(
            SL501,
            f"{path} is not a checkpoint: it has no DCP .metadata file",
            ("a checkpoint is a directory written by `shardlang apply --save` or torch.distributed.checkpoint.save",),
        )
    metadata = read_metadata(path / ".metadata")
    problem = missing_data(path, metadata.storage_data.values())
    if problem:
        raise plan_error(SL501, problem, DAMAGED_HELP)
    return checkpoint_contents(path, metadata, _read_info(path))


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
        raise plan_error(
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
        raise plan_error(SL501, f"cannot read the checkpoint's metadata {file}: {first_line(e)}") from None
    problem = _malformed(metadata)
    if problem:
        raise plan_error(SL501, f"{file} is not DCP metadata: {problem}")
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
        if not isinstance(name, str) or not is_plain_name(name):
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


DAMAGED_HELP = (
    "the checkpoint's files were changed after it was written (an interrupted copy, a full disk, a "
    "bad download): copy it again, or save a new one",
)


def missing_data(directory: Path, infos: Iterable[Any]) -> str | None:
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
            raise plan_error(SL501, f"{file} is not shardlang's: larger than {_INFO_LIMIT >> 20} MiB", help_)
        info = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise plan_error(SL501, f"cannot read {file}: {e.strerror or e}", help_) from None
    except ValueError as e:  # invalid JSON, or not UTF-8
        raise plan_error(SL501, f"{file} is not valid JSON: {first_line(e)}", help_) from None
    if not isinstance(info, dict):
        kind = "null" if info is None else _JSON_KINDS.get(type(info), type(info).__name__)
        raise plan_error(SL501, f"{file} holds {kind}, not a JSON object", help_)
    for key, kind, want in (("optimizer", str, "a string"), ("plan", str, "a string"), ("world_size", int, "a number")):
        value = info.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise plan_error(
                SL501, f"{file}: {key!r} is {_JSON_KINDS.get(type(value), 'an object')}, not {want}", help_
            )
    return info
