"""Where this rank sits among the others, and the model's inputs and outputs as the checks see them.

The model runs as a group of tensor-parallel ranks (the dims parallelize blocks use) replicated over
the data-parallel dims (all the others). TP ranks of a group get the same input, or each their slice
of it (`input=shard(D)`); each data-parallel replica draws its own inputs. SPEC §7.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from attrs import frozen
from torch.distributed.tensor import DTensor

from ..frontend import ir
from ..frontend.desugar import borrowed_dims
from ..runtime.modelfile import ModelFileError, describe, user_code


@frozen
class Layout:
    """This rank's coordinates: its data-parallel replica and its place in the TP group."""

    mesh: str | None  # the plan mesh the checks reason about
    tp_dims: tuple[str, ...]
    replica: int  # which data-parallel replica this rank belongs to
    replicas: int
    tp_index: int
    tp_size: int
    pp_dim: str | None = None  # a pipeline's dim: its ranks hold different stages, not replicas
    pp_index: int = 0
    pp_size: int = 1


def main_mesh(plan: ir.Plan) -> str | None:
    """The mesh the plan shards over: that of its parallelize blocks, else of its units, else the first."""
    pipeline = [plan.pipeline.mesh] if plan.pipeline is not None else []
    for ref in [b.mesh for b in plan.parallelize] + [u.mesh for u in plan.units] + pipeline:
        return ref.mesh
    return plan.meshes[0].name if plan.meshes else None


def layout(ctx) -> Layout:
    plan, name = ctx.plan, main_mesh(ctx.plan)
    if name is None or name not in ctx.applied.meshes:
        return Layout(None, (), 0, 1, 0, 1)
    mesh = ctx.applied.meshes[name]
    dims = tuple(mesh.mesh_dim_names)
    # A dim a parallelize block splits holds one replica's shards, except an ep dim whose experts borrow
    # data-parallel ranks (`fully_shard on world[dp*ep]`): its ranks train on different data.
    borrowed = borrowed_dims(plan).get(name, set())
    # Context parallelism's ranks share their batch too: the model splits each sequence itself.
    shares = [b.mesh for b in plan.parallelize] + ([plan.context_parallel.mesh] if plan.context_parallel else [])
    tp_dims = tuple(d for d in dims if d not in borrowed and any(m.mesh == name and d in m.dims for m in shares))
    coordinate = mesh.get_coordinate()
    sizes = dict(zip(dims, mesh.shape))
    at = dict(zip(dims, coordinate))
    pipeline = plan.pipeline
    pp = pipeline.mesh.dims[0] if pipeline is not None and pipeline.mesh.mesh == name else None
    dp_dims = [d for d in dims if d not in tp_dims and d != pp]
    return Layout(
        name,
        tp_dims,
        _ravel([at[d] for d in dp_dims], [sizes[d] for d in dp_dims]),
        math.prod(sizes[d] for d in dp_dims),
        _ravel([at[d] for d in tp_dims], [sizes[d] for d in tp_dims]),
        math.prod(sizes[d] for d in tp_dims),
        pp,
        at[pp] if pp else 0,
        sizes[pp] if pp else 1,
    )


def _ravel(index: list[int], shape: list[int]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def replica_inputs(ctx, step: int, replica: int, batch: int) -> tuple:
    """The full inputs of one data-parallel replica at one step, from the model file's example_input."""
    generator = torch.Generator().manual_seed(7919 * (step + 1) + replica)
    what = f"example_input({batch}, generator) from {ctx.model_file.origin}"
    with user_code(what):
        inputs = ctx.model_file.example_input(batch, generator)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if not any(isinstance(x, torch.Tensor) for x in inputs):
        got = describe(inputs[0]) if len(inputs) == 1 else "a tuple without a tensor"
        raise ModelFileError(f"{what} returned {got}: the model's inputs must be a tensor or a tuple of them")
    return tuple(x.to(ctx.device) if isinstance(x, torch.Tensor) else x for x in inputs)


def microbatches(inputs: tuple, n: int) -> list[tuple]:
    """A batch split into `n` microbatches along dim 0, as torch's pipeline schedules split it."""
    if n == 1:
        return [inputs]
    pieces = [x.tensor_split(n) if isinstance(x, torch.Tensor) else (x,) * n for x in inputs]
    return [tuple(p[i] for p in pieces) for i in range(n)]


def local_inputs(full: tuple, where: Layout, input_layout: Any) -> tuple:
    """This TP rank's inputs: the full ones (replicate) or each tensor's slice along D (shard(D))."""
    if not isinstance(input_layout, ir.Shard) or where.tp_size == 1:
        return full
    return tuple(
        x.tensor_split(where.tp_size, dim=input_layout.dim)[where.tp_index].contiguous()
        if isinstance(x, torch.Tensor)
        else x
        for x in full
    )


def tp_mesh(ctx, where: Layout):
    return ctx.applied.mesh(ir.MeshRef(where.mesh, where.tp_dims, None)) if where.tp_dims else None


def sequences_whole(ctx, output: Any, module) -> Any:
    """Under `context_parallel(output = local)`, the sequence shards `module` (the model, or a pipeline's
    last stage) returned, gathered whole as the model's own hook would (runtime.context.whole_sequences);
    any other output as it is."""
    cp = ctx.plan.context_parallel
    if cp is None or cp.whole_output:
        return output
    from ..runtime.context import context_state

    return context_state(module).whole(output)


def modules_eagerly(plan: ir.Plan):
    """Where the modules the plan compiles run eagerly (`torch.compiler.set_stance("force_eager")`): the
    same modules, hooks and collectives, for the checks that watch them with a dispatch mode or hooks,
    which cannot run inside compiled code. A compiled loss called outside it stays compiled."""
    if not plan.compiles:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def loss_context(plan: ir.Plan):
    if plan.loss_parallel is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def loss(ctx, output: Any, inputs: tuple, sharded: bool = False, compile_with=None) -> torch.Tensor:
    """The model file's loss(output, inputs), or the default: the sum of the whole output. On the sharded
    model's output (`sharded`), compiled where the plan says `compile loss`: by
    `compile_with(loss, **options)` (explain's model of it), by default torch.compile."""
    given = ctx.model_file.loss
    if given is None:
        return output.float().sum()
    if sharded and ctx.plan.compile_loss is not None:
        from ..runtime.compiled import compiled_loss

        given = (compile_with or compiled_loss)(given, **dict(ctx.plan.compile_loss.options))
    what = f"loss(output, inputs) from {ctx.model_file.origin}"
    with user_code(what):
        value = given(output, inputs if len(inputs) > 1 else inputs[0])
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else describe(value)
        raise ModelFileError(f"{what} returned {got}, not a scalar tensor")
    return value


def value(loss_tensor: torch.Tensor) -> float:
    return float((loss_tensor.full_tensor() if isinstance(loss_tensor, DTensor) else loss_tensor).detach())


def held_everywhere(names, group=None) -> list[str]:
    """`names` (in their order) that every rank of `group` (default: the world) holds too. The ranks of an
    expert-parallel dim hold different members of a ModuleList's or ModuleDict's experts, and a pipeline's
    ranks different stages: a comparison across ranks takes only what they share."""
    names = list(names)
    shared = set.intersection(*_names_of_each_rank(names, group))
    return [n for n in names if n in shared]


def from_holders(entries: dict, portable, group=None) -> dict | None:
    """`entries` (by name) with those that only some ranks of `group` hold gathered from the ranks holding
    them (`portable` makes a value fit to send: on the CPU); this rank's own kept as they are. None, with
    nothing more sent, when every rank holds the same names (every rank decides alike, from the same
    gathered names)."""
    each = _names_of_each_rank(list(entries), group)
    shared = set.intersection(*each)
    if shared == set.union(*each):
        return None
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, {k: portable(v) for k, v in entries.items() if k not in shared}, group=group)
    return {**{k: v for held in everyone for k, v in held.items()}, **entries}


def _names_of_each_rank(names: list[str], group=None) -> list[set[str]]:
    """The names every rank of `group` passed, one set per rank (this rank's alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [set(names)]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, names, group=group)
    return [set(n) for n in everyone]


def largest_everywhere(values: list[float]) -> list[float]:
    """Each value as the largest over every rank (one all_reduce): what lets every rank take the same
    path when the next steps talk to the others."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
