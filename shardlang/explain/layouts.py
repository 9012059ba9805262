"""What every rank holds: each parameter's and buffer's layout, and every rank's bytes, worked out at once.

The plan applied in a simulated world (explain.simulate) leaves rank R's DTensors; every other rank's share
follows from the same placements: torch's chunking done for all ranks at once with numpy (`local_blocks`),
torch's own arithmetic (torchcompat.local_shape_and_offset) for a placement beyond it. Parameters,
gradients, AdamW's states and the largest fully_shard unit while gathered, by rank.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
from attrs import frozen

from ..compiler.predict import enclosing, units_by_module
from ..frontend import ir
from ..runtime.simulated import placed_as
from ..runtime.torchcompat import local_shape_and_offset

#: Bytes per element of the optimizer states AdamW keeps for each parameter element (two fp32 states).
ADAMW_STATE_BYTES = 8


@frozen
class TensorInfo:
    """One parameter or buffer: its global shape and dtype, its layout, and rank R's share of it."""

    name: str
    kind: str  # "parameter" | "buffer"
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...]  # mesh dims of its DTensor; () for a plain tensor
    placements: tuple[str, ...]
    local_shape: tuple[int, ...]
    local_bytes: int
    unit: str | None  # the fully_shard unit that gathers it, if any
    #: For tensors picked with `blocks_for`: each distinct block as (offset, shape, ranks holding it).
    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def layout(self) -> str:
        if not self.dims:
            return "plain"
        return " ".join(f"{d}:{p}" for d, p in zip(self.dims, self.placements))


@frozen
class RankBytes:
    """What one rank holds for training: parameters, gradients, AdamW's states, and the largest
    fully_shard unit while it is gathered (unsharded, in the dtype it computes in)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    gathered: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered


def tensors_and_ranks(
    plan: ir.Plan, applied, world_size: int, blocks_for: str | None
) -> tuple[tuple[TensorInfo, ...], tuple[RankBytes, ...]]:
    """Every parameter and buffer of `applied` (rank R's) as a TensorInfo, with every block and its holders
    for those `blocks_for` picks; and what every rank of `world_size` holds for training (RankBytes)."""
    from ..frontend.patterns import pattern_regex

    wanted = pattern_regex(blocks_for) if blocks_for is not None else None
    model = applied.model
    resolution = applied.linted.resolution
    units = units_by_module(resolution)
    params = np.zeros(world_size, dtype=np.int64)
    optimizer = np.zeros(world_size, dtype=np.int64)
    gathered: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(world_size, dtype=np.int64))
    infos, seen = [], set()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            owner = name.rpartition(".")[0]
            unit = enclosing(owner, units) if kind == "parameter" else None
            fsdp = unit is not None and unit.kind(plan.units[unit.block]) == "fully_shard"
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            element = tensor.element_size()
            placements = tuple(getattr(tensor, "placements", ()))
            blocks = _blocks(tensor, world_size) if wanted is not None and wanted.fullmatch("." + name) else ()
            infos.append(
                TensorInfo(
                    name,
                    kind,
                    tuple(tensor.shape),
                    str(tensor.dtype).removeprefix("torch."),
                    placed_as(tensor).dims,
                    tuple(str(p) for p in placements),
                    tuple(local.shape),
                    local.numel() * element,
                    unit.name if fsdp else None,
                    blocks,
                )
            )
            if kind != "parameter":
                continue
            numel = _numel_per_rank(tensor, world_size)
            params += numel * element
            if tensor.requires_grad:
                optimizer += numel * ADAMW_STATE_BYTES
            if fsdp:
                compute = _compute_bytes(plan.units[unit.block], unit, element)
                gathered[unit.fqn] += (
                    _numel_per_rank(tensor, world_size, unsharded_dims=set(plan.units[unit.block].mesh.dims)) * compute
                )
    grads = params.copy()  # gradients share their parameters' layout and dtype
    peak = np.max(np.stack(list(gathered.values())), axis=0) if gathered else np.zeros(world_size, dtype=np.int64)
    ranks = tuple(
        RankBytes(r, int(params[r]), int(grads[r]), int(optimizer[r]), int(peak[r])) for r in range(world_size)
    )
    return tuple(infos), ranks


def _compute_bytes(units: ir.Units, unit, element: int) -> int:
    """Bytes per element of a unit's gathered parameters: the mixed precision param dtype, if any."""
    mp = unit.option(units, "mixed_precision")
    if mp is not None and mp.param is not None:
        return torch.empty((), dtype=getattr(torch, mp.param.name)).element_size()
    return element


def _numel_per_rank(tensor, world_size: int, unsharded_dims: set[str] = frozenset()) -> np.ndarray:
    """Elements of `tensor` each rank holds (a plain tensor: all of it on every rank); with
    `unsharded_dims`, as if it were not split along those mesh dims (FSDP's gathered copy)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return np.full(world_size, tensor.numel(), dtype=np.int64)
    mesh = tensor.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    placements = tuple(Replicate() if n in unsharded_dims else p for n, p in zip(names, tensor.placements))
    return _local_numels(tuple(tensor.shape), tuple(mesh.shape), placements, _coordinates(mesh))


def _coordinates(mesh) -> np.ndarray:
    """(world, ndim): each global rank's coordinate in `mesh` (-1 for ranks outside it)."""
    layout = mesh.mesh.cpu().numpy()
    world = dist.get_world_size()
    key = (layout.tobytes(), layout.shape, world)  # one process explains worlds of several sizes
    cached = _COORDINATES.get(key)
    if cached is None:
        cached = np.full((world, layout.ndim), -1, dtype=np.int64)
        cached[layout.reshape(-1)] = np.stack(np.unravel_index(np.arange(layout.size), layout.shape), axis=1)
        _COORDINATES[key] = cached
    return cached


#: Rank coordinates by mesh layout and world size, shared by the many tensors on one mesh.
_COORDINATES: dict = {}


def _local_numels(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray
) -> np.ndarray:
    """Local element counts for every rank at once (numpy, torch's chunking); torch's own function
    where a placement is beyond that arithmetic."""
    sizes = local_sizes(shape, mesh_shape, placements, coords)
    if sizes is None:
        return np.array(
            [
                math.prod(local_shape_and_offset(shape, mesh_shape, [int(c) for c in coordinate], placements)[0])
                if coordinate[0] >= 0
                else 0
                for coordinate in coords
            ],
            dtype=np.int64,
        )
    return np.prod(sizes, axis=1, dtype=np.int64) if sizes.shape[1] else np.ones(len(coords), dtype=np.int64)


def local_sizes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray
) -> np.ndarray | None:
    """(world, ndim) local shapes; see `local_blocks`."""
    blocks = local_blocks(shape, mesh_shape, placements, coords)
    return None if blocks is None else blocks[1]


def local_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coords: np.ndarray):
    """(offsets, sizes), each (world, ndim): where every rank's shard starts and how big it is, split
    like torch.chunk: each Shard(d) on mesh dim i cuts what is left of dim d into mesh_shape[i] chunks of
    ceil(size / n), in mesh order. A _StridedShard(d, sf) (FSDP over a dim TP already shards) is applied
    after the one later mesh dim that shards d, of size sf: FSDP chunks the TP shard. (For uneven sizes
    that is what FSDP holds, where DTensor's own arithmetic for _StridedShard differs.) None for any
    other placement (the caller asks torch)."""
    sizes = np.tile(np.asarray(shape, dtype=np.int64), (len(coords), 1))
    offsets = np.zeros_like(sizes)
    for d in range(len(shape)):
        order, deferred = [], []
        for i, p in enumerate(placements):
            if type(p).__name__ == "_StridedShard" and p.dim == d:
                later = [
                    j
                    for j in range(i + 1, len(placements))
                    if placements[j].is_shard() and getattr(placements[j], "dim", None) == d
                ]
                if len(later) != 1 or mesh_shape[later[0]] != p.split_factor:
                    return None
                deferred.insert(0, i)
            elif p.is_shard() and p.dim == d:
                order.append(i)
        for i in order + deferred:
            n = mesh_shape[i]
            chunk = -(-sizes[:, d] // n)
            start = np.minimum(coords[:, i] * chunk, sizes[:, d])
            offsets[:, d] += start
            sizes[:, d] = np.clip(sizes[:, d] - coords[:, i] * chunk, 0, chunk)
    return offsets, sizes


def _blocks(tensor, world_size: int) -> tuple:
    """Each distinct block of a tensor, (offset, shape, ranks), ordered by offset."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (((0,) * tensor.ndim, tuple(tensor.shape), tuple(range(world_size))),)
    mesh = tensor.device_mesh
    coords = _coordinates(mesh)
    computed = local_blocks(tuple(tensor.shape), tuple(mesh.shape), tuple(tensor.placements), coords)
    holders: dict[tuple, list[int]] = defaultdict(list)
    for rank, coordinate in enumerate(coords):
        if coordinate[0] < 0:
            continue
        if computed is not None:
            offset, shape = computed[0][rank], computed[1][rank]
        else:
            shape, offset = local_shape_and_offset(
                tuple(tensor.shape), tuple(mesh.shape), [int(c) for c in coordinate], tensor.placements
            )
        holders[(tuple(int(o) for o in offset), tuple(int(x) for x in shape))].append(rank)
    return tuple(sorted((offset, shape, tuple(ranks)) for (offset, shape), ranks in holders.items()))
