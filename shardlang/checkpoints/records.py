"""What a checkpoint is: the Checkpoint its DCP metadata describes, the file beside DCP's that says what
wrote it, and the Transfer a save, load or conversion reports.

A checkpoint is a plain DCP directory: `{"model": <model state dict>, "optimizer": <optimizer state
dict>}`, the model's keyed as its `state_dict()` keys it (through its state-dict hooks, wrappers removed),
the optimizer's by parameter names (the FQNs `get_state_dict` gives), so DCP reshards
it onto any layout, and `dcp.load` reads it without shardlang. Beside DCP's files lies
`shardlang.json`, what wrote it (plan, world size, optimizer class); a DCP directory without one
(written by hand-written code) loads all the same, with the model state at the top level or under
`model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

#: The file beside DCP's own that says what wrote a checkpoint.
INFO_FILE = "shardlang.json"


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
        return sum(stored_bytes(m) for m in (*self.model.values(), *self.optimizer.values()))


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


def checkpoint_contents(path: Path, metadata: Metadata, info: Mapping[str, Any]) -> Checkpoint:
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


def stored_bytes(stored) -> int:
    """The bytes a stored tensor takes; 0 for an object stored as bytes."""
    if not isinstance(stored, TensorStorageMetadata):
        return 0
    return stored.size.numel() * torch.empty((), dtype=stored.properties.dtype).element_size()
