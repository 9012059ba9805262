"""Hugging Face weights: a directory of safetensors files (one `model.safetensors`, or several named by
`model.safetensors.index.json`), loaded into a sharded model with every rank reading only the blocks its
shards hold, and written from one by every rank at once.

Names are the model's state-dict keys (those of the `*ForCausalLM` class for transformers models); a
checkpoint of the base model (keys without the class's `base_model_prefix`, `model.`) or of a model with
that prefix loaded into the base model maps by adding or removing it. Other renamings (transformers'
checkpoint conversion mappings) are not guessed at: the keys that do not match are SL500. Tied tensors
(`lm_head.weight` and `model.embed_tokens.weight` with `tie_word_embeddings`) are stored once and
loaded once. Floating-point tensors are converted to the model's dtype, as `from_pretrained(dtype=...)`
converts them.

Reading: the headers alone (JSON at the start of each file) say every name, dtype and shape, so the
fit is checked before any tensor data is read, and on every rank again before anything is copied.
Each rank then reads, with safetensors' slice API, the block of each tensor its local shard holds
(`shard_block`: DTensor's and FSDP2's chunking, FSDP's `_StridedShard` included), into new memory;
only when every rank has read all of its blocks are they copied into the model.

Writing: torch.distributed.checkpoint's HuggingFaceStorageWriter, every rank writing its own shards
(replicated tensors once), then consolidated into whole tensors by rank 0, one tensor at a time, into
`model.safetensors` (or `model-0000K-of-0000N.safetensors` files and their index, past SHARD_BYTES),
beside the model's config.json: what `from_pretrained` reads.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from attrs import field, frozen
from torch.distributed.tensor import DTensor

from ..frontend.diagnostics import SL500, SL501, PlanError
from ..runtime.torchcompat import hf_storage_writer, strided_shard_class
from .common import dtype_name, first_line, is_plain_name, plan_error, process_group_up
from .records import Transfer
from .saving import check_save_target, write_staged

#: The index of a checkpoint of several files, and the one file of a small checkpoint.
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Where a saved checkpoint starts a new file (transformers 5's save_pretrained: 50 GB).
SHARD_BYTES = 50 * 10**9
#: safetensors' own limit on a header, and ours on an index (a few MB for the largest models).
_HEADER_LIMIT = 100 * 2**20
_INDEX_LIMIT = 64 * 2**20
#: What `--save-format hf` writes, and so may replace: nothing else in a directory is ever removed.
_OURS = re.compile(
    r"config\.json|generation_config\.json|model\.safetensors\.index\.json|model(-\d+-of-\d+)?\.safetensors"
)

#: safetensors' dtype names (the format's specification), as torch dtypes.
DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@frozen
class Stored:
    """One tensor of a safetensors file, from its header."""

    file: str  # its file's name in the directory
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@frozen
class HFWeights:
    """What a directory of Hugging Face safetensors holds, from the files' headers (no tensor data read).
    It stands where a DCP Checkpoint does for the checks: no optimizer state, no shardlang.json."""

    path: Path
    tensors: Mapping[str, Stored] = field(repr=False)  # checkpoint name -> where and what
    has_optimizer: bool = False
    info: dict[str, Any] = field(factory=dict)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({s.file for s in self.tensors.values()}))

    @property
    def bytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())


def is_hf_weights(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory of Hugging Face weights (safetensors files, or their index) rather
    than a DCP checkpoint (whose `.metadata` decides)."""
    path = Path(path)
    if not path.is_dir() or (path / ".metadata").exists():
        return False
    return (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))


# --- reading headers -------------------------------------------------------------------------------


def read_hf_weights(path: str | os.PathLike) -> HFWeights:
    """The tensors of the Hugging Face weights at `path`, from the safetensors headers alone; PlanError
    (SL501) naming the file if one is missing, not safetensors, or shorter than its header says.

    The files are those `model.safetensors.index.json` names, else `model.safetensors`, else every
    `*.safetensors` in the directory (a name in two of them is refused)."""
    path = Path(path)
    if not path.is_dir():
        raise plan_error(SL501, f"no Hugging Face weights at {path}: it is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        weight_map, files = None, sorted(f.name for f in path.glob("*.safetensors"))
        if not files:
            raise plan_error(SL501, f"no Hugging Face weights at {path}: no *.safetensors file and no {INDEX_FILE}")
    tensors: dict[str, Stored] = {}
    for name in files:
        for key, stored in _read_header(path / name).items():
            if key in tensors:
                raise plan_error(
                    SL501,
                    f"the weights at {path} hold {key} twice, in {tensors[key].file} and {name}",
                    (f"give the directory a {INDEX_FILE} naming the file of each tensor",),
                )
            tensors[key] = stored
    for key, name in (weight_map or {}).items():
        if key not in tensors or tensors[key].file != name:
            raise plan_error(
                SL501, f"the weights at {path} are damaged: {INDEX_FILE} puts {key} in {name}, which lacks it"
            )
    return HFWeights(path, tensors)


def _read_index(index: Path) -> dict[str, str]:
    try:
        if index.stat().st_size > _INDEX_LIMIT:
            raise plan_error(
                SL501, f"{index} is not an index of safetensors files: larger than {_INDEX_LIMIT >> 20} MiB"
            )
        data = json.loads(index.read_text(encoding="utf-8"))
    except OSError as e:
        raise plan_error(SL501, f"cannot read {index}: {e.strerror or e}") from None
    except ValueError as e:
        raise plan_error(SL501, f"{index} is not valid JSON: {first_line(e)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise plan_error(SL501, f"{index} has no weight_map of tensor names to file names")
    strange = next((v for v in weight_map.values() if not is_plain_name(v)), None)
    if strange is not None:
        raise plan_error(SL501, f"{index} names the file {strange!r}, which is not a file in its directory")
    return weight_map


def _read_header(file: Path) -> dict[str, Stored]:
    """Every tensor in a safetensors file's header, checked against the file's length."""
    damaged = f"the weights at {file.parent} are damaged: {file.name}"
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(_HEADER_LIMIT, size - 8):
                raise plan_error(SL501, f"{damaged} is not a safetensors file (no header)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise plan_error(SL501, f"the weights at {file.parent} are damaged: {file.name} is missing") from None
    except OSError as e:
        raise plan_error(SL501, f"cannot read {file}: {e.strerror or e}") from None
    except ValueError as e:
        raise plan_error(SL501, f"{damaged} has a header that is not JSON: {first_line(e)}") from None
    if not isinstance(header, dict):
        raise plan_error(SL501, f"{damaged} has a header that is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape, offsets = (entry.get(k) if isinstance(entry, dict) else None for k in ("shape", "data_offsets"))
        if dtype is None:
            kind = entry.get("dtype") if isinstance(entry, dict) else None
            raise plan_error(SL501, f"{file} holds {key} as {kind!r}, a dtype shardlang does not read")
        if not _sizes(shape) or not (_sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise plan_error(SL501, f"{damaged}: the header's entry for {key} is not a shape and data offsets")
        stored = Stored(file.name, dtype, tuple(shape))
        if offsets[1] - offsets[0] != stored.nbytes or offsets[1] > data_bytes:
            raise plan_error(
                SL501,
                f"{damaged} is truncated or altered: {key} should take bytes {offsets[0]}-{offsets[1]} "
                f"of {data_bytes}, {stored.nbytes} for its shape and dtype",
            )
        tensors[key] = stored
    return tensors


def _sizes(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


# --- fitting ---------------------------------------------------------------------------------------


def match(weights: HFWeights, model: torch.nn.Module) -> tuple[dict[str, str], list[str]]:
    """Which checkpoint tensor each of the model's state-dict tensors loads from (model key -> name, one
    key per group of tied tensors), and every misfit: model keys the checkpoint lacks, checkpoint names
    the model lacks, other global shapes, dtypes that are not converted. Works on a meta model too."""
    state = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or ""
    prefix = prefix + "." if isinstance(prefix, str) and prefix else ""
    # A checkpoint name claims its key exactly, or else with the base model's prefix added or removed.
    claims: dict[str, str] = {name: name for name in weights.tensors if name in state}
    unclaimed = []
    for name in weights.tensors:
        if name in claims:
            continue
        key = next(
            (
                k
                for k in (prefix + name, name.removeprefix(prefix) if name.startswith(prefix) else None)
                if prefix and k in state and k not in claims.values()
            ),
            None,
        )
        if key is None:
            unclaimed.append(name)
        else:
            claims[name] = key
    names_of: dict[str, list[str]] = {}
    for name, key in claims.items():
        names_of.setdefault(key, []).append(name)
    tied: dict[int, list[str]] = {}
    for key, value in state.items():
        tied.setdefault(id(value), []).append(key)
    pairs, found = {}, []
    for keys in tied.values():
        key = next((k for k in keys if k in names_of), None)
        if key is None:
            also = f" (nor {', '.join(keys[1:])}, tied to it)" if len(keys) > 1 else ""
            found.append(f"model key {keys[0]} is not in the checkpoint{also}")
            continue
        name = names_of[key][0]
        stored, value = weights.tensors[name], state[key]
        shown = key if key == name else f"{key} (stored as {name})"
        if tuple(stored.shape) != tuple(value.shape):
            found.append(f"{shown}: shape {tuple(stored.shape)} in the checkpoint, {tuple(value.shape)} in the model")
        elif stored.dtype != value.dtype and not (stored.dtype.is_floating_point and value.dtype.is_floating_point):
            found.append(
                f"{shown}: dtype {dtype_name(stored.dtype)} in the checkpoint, {dtype_name(value.dtype)} in the model "
                "(only floating-point tensors are converted)"
            )
        else:
            pairs[key] = name
    found += [f"checkpoint key {name} is not in the model" for name in unclaimed]
    return pairs, found


def check_hf_fits(weights: HFWeights, model: torch.nn.Module) -> dict[str, str]:
    """`match`'s pairs, or PlanError(SL500) listing every misfit."""
    pairs, found = match(weights, model)
    if found:
        help_ = tuple(found) + _conversion_note(model)  # every one: a misfit is fixed once, not six at a time
        raise plan_error(
            SL500,
            f"the Hugging Face weights at {weights.path} do not fit the model: "
            f"{len(found)} mismatch{'es' if len(found) > 1 else ''}",
            help_,
        )
    return pairs


def _conversion_note(model: torch.nn.Module) -> tuple[str, ...]:
    """A help line where transformers itself renames this model type's checkpoint keys when it loads them."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(model_type) if model_type else None
    except Exception:  # noqa: BLE001 - another transformers: no such table, no note
        mapping = None
    mapping = mapping or getattr(model, "_checkpoint_conversion_mapping", None)
    if not mapping:
        return ()
    return (
        f"transformers renames or fuses {model_type} checkpoint keys when it loads them (its checkpoint "
        "conversion mapping); shardlang maps names only by the base model's prefix and does not guess at "
        "the rest",
    )


# --- loading ---------------------------------------------------------------------------------------


def shard_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block of the global tensor this rank holds: offsets and sizes per dim.

    Each mesh dim that shards a tensor dim cuts what the dims before it left into torch.chunk's pieces
    (ceil(n / parts) each, the last short or empty), as DTensor's Shard and FSDP2 cut. A `_StridedShard`
    (FSDP2 over a dim tensor parallelism already shards) cuts after the mesh dims to its right that
    shard the same dim: FSDP's chunk of the TP shard, which is what FSDP2 holds also where the sizes are
    uneven. ValueError where the placements are beyond this (a Partial, another split factor)."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return (0,) * len(shape), shape
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return (0,) * len(shape), (0,) * len(shape)
    strided = strided_shard_class()
    offsets, sizes = [0] * len(shape), list(shape)
    order = sorted(range(len(placements)), key=lambda i: isinstance(placements[i], strided))
    for i in order:
        p = placements[i]
        if p.is_replicate():
            continue
        if not (isinstance(p, strided) or p.is_shard()):
            raise ValueError(f"placement {p} on mesh dim {i}")
        d = p.dim % len(shape)
        if isinstance(p, strided):
            later = math.prod(mesh.size(j) for j in range(i + 1, len(placements)) if _shards(placements[j], d))
            if p.split_factor != later:
                raise ValueError(f"{p} on mesh dim {i}, split factor {p.split_factor} where later dims cut {later}")
        parts = mesh.size(i)
        chunk = -(-sizes[d] // parts)
        start = min(coordinate[i] * chunk, sizes[d])
        offsets[d], sizes[d] = offsets[d] + start, max(0, min(chunk, sizes[d] - start))
    local = tuple(tensor.to_local().shape)
    if tuple(sizes) != local:
        raise ValueError(f"placements {placements} give a local shape {tuple(sizes)}, the shard is {local}")
    return tuple(offsets), tuple(sizes)


def _shards(placement, dim: int) -> bool:
    return (placement.is_shard() or isinstance(placement, strided_shard_class())) and placement.dim == dim


def load_hf_weights(model: torch.nn.Module, weights: str | os.PathLike | HFWeights) -> Transfer:
    """Load Hugging Face weights into `model` (sharded by a plan, or a plain one in one process).

    Call it on every rank after the plan is applied. Every rank checks the fit (SL500 listing every
    misfit), reads the block of each tensor its shard holds into new memory, and copies it into the model
    only when every rank has read all of its blocks; a file that cannot be read is SL501 on every rank.
    Either way nothing was changed."""
    start = time.perf_counter()
    weights = weights if isinstance(weights, HFWeights) else read_hf_weights(weights)
    pairs = check_hf_fits(weights, model)
    state = model.state_dict(keep_vars=True)
    blocks, problem = {}, None
    try:
        blocks = {key: shard_block(state[key]) for key in pairs}
    except ValueError as e:
        problem = plan_error(
            SL501, f"cannot load {weights.path}: a tensor's shards are laid out as shardlang cannot slice: {e}"
        )
    read: dict[str, torch.Tensor] = {}
    if problem is None:
        try:
            read = _read_blocks(weights, pairs, blocks, state)
        except PlanError as e:
            problem = e
    problem = _agree(problem)
    if problem is not None:
        raise problem
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    with torch.no_grad():
        for key, block in read.items():
            value = state[key]
            (value.to_local() if isinstance(value, DTensor) else value).copy_(block)
    # A key a state-dict hook made (torchtitan's fused QKV saves `wqkv` as `wq`, `wk`, `wv`) holds a tensor of
    # the hook's, not the model's: the model's load_state_dict hooks turn such keys back into its tensors.
    hooked = {key: state[key] for key in read if id(state[key]) not in own}
    if hooked:
        left = model.load_state_dict(hooked, strict=False).unexpected_keys
        if left:  # the model's load hooks do not take back what its save hooks give: nothing would load them
            raise plan_error(
                SL500,
                f"the model's state-dict hooks save {', '.join(left[:3])} but its load_state_dict does not take them",
            )
    return Transfer(
        str(weights.path),
        len(pairs),
        sum(weights.tensors[name].nbytes for name in pairs.values()),
        time.perf_counter() - start,
        False,
    )


def _read_blocks(weights: HFWeights, pairs: Mapping[str, str], blocks: Mapping, state: Mapping) -> dict:
    """This rank's block of every tensor, read file by file with safetensors' slice API, in the model's dtype."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise plan_error(SL501, "loading Hugging Face weights needs safetensors: pip install 'shardlang[hf]'") from None
    by_file: dict[str, list[str]] = {}
    for key, name in pairs.items():
        by_file.setdefault(weights.tensors[name].file, []).append(key)
    read = {}
    for file, keys in sorted(by_file.items()):
        try:
            with safe_open(str(weights.path / file), framework="pt", device="cpu") as f:
                for key in keys:
                    name, (offsets, sizes) = pairs[key], blocks[key]
                    stored, value = weights.tensors[name], state[key]
                    if 0 in sizes:  # an empty shard (uneven sizes) reads nothing
                        block = torch.empty(sizes, dtype=stored.dtype)
                    elif not sizes:
                        block = f.get_tensor(name)
                    else:
                        block = f.get_slice(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    read[key] = block.to(value.dtype)
        except (PlanError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' errors name no common class
            raise plan_error(SL501, f"cannot read {weights.path / file}: {first_line(e)}") from None
    return read


def _agree(problem: PlanError | None) -> PlanError | None:
    """The first rank's problem on every rank (so that every rank changes the model, or none does)."""
    if not process_group_up() or dist.get_world_size() == 1:
        return problem
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem.diagnostics if problem else None)
    first = next((d for d in everyone if d), None)
    return PlanError(list(first)) if first else None


# --- saving ----------------------------------------------------------------------------------------


def save_hf_weights(model: torch.nn.Module, path: str | os.PathLike, *, shard_bytes: int = SHARD_BYTES) -> Transfer:
    """Write `model`'s state dict at `path` as Hugging Face weights that `from_pretrained` reads: safetensors
    files (`model.safetensors`, or several and their index past `shard_bytes`) and the model's config.json.

    Call it on every rank (or in one process, for an unsharded model). Each rank writes its own shards
    (DCP's HuggingFaceStorageWriter), rank 0 joins them into whole tensors one at a time; tied tensors are
    written once. The directory is replaced only once all is written (as save_checkpoint does), and only
    if it holds nothing but what this writes (SL501)."""
    start = time.perf_counter()
    distributed = process_group_up()
    state: dict[str, torch.Tensor] = {}
    seen = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:  # a tied tensor under its first name only, as save_pretrained does
            seen.add(id(value))
            state[key] = value.detach()
    files: dict[str, int] = {}
    size = 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > shard_bytes:
            size, index = 0, max(files.values()) + 1
        else:
            index = max(files.values(), default=1)
        files[key], size = index, size + nbytes
    config = _config(model, state)

    def write(staging: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=hf_storage_writer(str(staging), files), no_dist=not distributed)
        if not distributed or dist.get_rank() == 0:
            _finish(staging, config)

    write_staged(Path(path), write, distributed=distributed, unreplaceable=_unreplaceable)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    return Transfer(str(path), len(state), nbytes, time.perf_counter() - start, False)


def _config(model: torch.nn.Module, state: Mapping[str, torch.Tensor]):
    """The model's transformers config (a copy) saying the saved dtype, or None for other models."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return None
    config = copy.deepcopy(config)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:  # what from_pretrained's dtype="auto" loads them as
        config.dtype = floats.pop()
    return config


def _finish(staging: Path, config) -> None:
    """After consolidation: the per-rank shards removed, one file named as save_pretrained names it, and
    config.json beside the weights."""
    shutil.rmtree(staging / "sharded", ignore_errors=True)
    written = sorted(staging.glob("model-*.safetensors"))
    if len(written) == 1:
        written[0].rename(staging / SINGLE_FILE)
        (staging / INDEX_FILE).unlink(missing_ok=True)
    if config is not None:
        config.save_pretrained(str(staging))


def _unreplaceable(path: Path) -> str | None:
    """Why `path` (symlinks resolved) must not be replaced by Hugging Face weights, or None: it holds files
    other than those a save writes (a tokenizer, a DCP checkpoint), which would be lost."""
    if path.exists() and not path.is_dir():
        return f"cannot save to {path}: it is a file, not a directory"
    if not path.parent.is_dir():
        return f"cannot save to {path}: {path.parent} does not exist"
    others = sorted(p.name for p in path.iterdir() if not _OURS.fullmatch(p.name)) if path.is_dir() else []
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return (
            f"cannot save to {path}: it holds files that are not Hugging Face weights ({shown}); shardlang "
            "replaces only the weights and config.json it writes"
        )
    return None


def check_hf_save_target(path: str | os.PathLike) -> None:
    """PlanError(SL501) if Hugging Face weights must not be saved at `path`, or another save to it is running."""
    check_save_target(path, _unreplaceable)
