"""The lowered program: an ordered list of plain torch calls, as data.

lower.py builds it; runtime.apply runs it step by step and emit.python prints it, both through the
one table of step types in runtime.steps, so the code a user pastes and the code shardlang runs are
the same program.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from ..frontend import ir
from ..frontend.source import Span
from .styles import Constructor


@frozen
class Matching:
    """The modules a target matches when the program runs: for a program lowered without a model.
    `target` is a pattern, `root` or `class NAME`; with `scope` it is relative to each scope match."""

    target: str
    scope: str | None = None


#: What a step acts on: a module FQN ("" the model), or the modules a target matches at run time.
Module = str | Matching


@frozen
class MakeMesh:
    name: str
    device: str  # cuda | cpu | auto
    shape: tuple[int | None, ...]  # None: `auto`, left to the world size at run time
    dims: tuple[str, ...]
    origin: Span | None = None


@frozen
class SplitStages:
    """Cut the model into this rank's pipeline stages (`blocks[s]`: stage s's blocks; `dropped[s]`: the
    (FQN, role) of the modules stage s replaces by pass-throughs; `ranks[s]`: its pp rank). Every later
    step then runs once per stage, on the modules that stage holds."""

    mesh: ir.MeshRef
    blocks: tuple[tuple[str, ...], ...]
    dropped: tuple[tuple[tuple[str, str], ...], ...]
    ranks: tuple[int, ...]
    origin: Span | None = None


@frozen
class Parallelize:
    """`parallelize_module(module, mesh, {relative fqn: style})`; the key "" is the module itself."""

    module: Module
    mesh: ir.MeshRef
    plan: tuple[tuple[str, Constructor], ...]
    origin: Span | None = None


@frozen
class Distribute:
    """`distribute_module` with DTensor inputs of `input` and local (`output` None) or `output` outputs."""

    module: Module
    mesh: ir.MeshRef
    input: Any
    output: Any
    origin: Span | None = None


@frozen
class UserStyle:
    """A `use` style: a ParallelStyle subclass or a callable (module, mesh, **kwargs)."""

    module: Module
    mesh: ir.MeshRef
    alias: str
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class Retie:
    """Re-share tied parameters that parallelize_module replaced one by one (`groups` None: the ties
    the model had before the program started, found when it runs)."""

    groups: tuple[tuple[str, ...], ...] | None
    origin: Span | None = None


@frozen
class Checkpoint:
    module: Module
    origin: Span | None = None


@frozen
class Compile:
    """torch.compile a module in place (`module.compile(**kwargs)`: its name and hooks stay; torchtitan's way)."""

    module: Module
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class ContextParallel:
    """`context_parallel(model, patterns, mesh, layout)` (runtime.context): the modules the patterns
    match attend over the whole sequence; the model's inputs are split (as the `load_balance` layout
    says) and its outputs gathered."""

    patterns: tuple[str, ...]
    mesh: ir.MeshRef
    load_balance: str
    origin: Span | None = None
    whole_output: bool = True


@frozen
class FullyShard:
    """`fully_shard(module, mesh=..., **kwargs)`. With `together` (a `unit` item), one unit over `module`
    and the modules of `also`, or, for targets, over every module they match: `fully_shard([a, b], ...)`."""

    module: Module
    mesh: ir.MeshRef
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None
    also: tuple[Module, ...] = ()
    together: bool = False
    #: Gradients divided by this mesh's size instead of the unit's own (set_gradient_divide_factor).
    divide_by: ir.MeshRef | None = None
    #: Why the lowering added this unit, which no statement wrote (compiler.float32): printed above it.
    why: str = ""


@frozen
class Replicate:
    """DDP-style composable replicate; a 2-D mesh is flattened to the 1-D mesh DDP needs."""

    module: Module
    mesh: ir.MeshRef
    kwargs: tuple[tuple[str, Any], ...]
    origin: Span | None = None


@frozen
class TakeRank0Values:
    """`init rank0`: rank 0 keeps its full model's values and shards a meta copy like every other rank."""

    origin: Span | None = None


@frozen
class InitOnMesh:
    """`init meta`: allocate the shards on the mesh device, then call `method` on every module that has it."""

    device: str
    method: str
    origin: Span | None = None


@frozen
class LoadFromRank0:
    device: str
    origin: Span | None = None


@frozen
class OffloadToCpu:
    """A fully_shard unit with `offload = cpu` after `init meta` or `init rank0` on a GPU: the parameters it
    manages were materialised on the GPU (to be initialised there); FSDP wants them on the CPU."""

    module: Module
    origin: Span | None = None


@frozen
class Sync:
    mesh: ir.MeshRef
    origin: Span | None = None


@frozen
class MoveToDevice:
    device: str
    origin: Span | None = None


Step = (
    MakeMesh
    | SplitStages
    | Parallelize
    | Distribute
    | UserStyle
    | Retie
    | ContextParallel
    | Checkpoint
    | Compile
    | FullyShard
    | Replicate
    | TakeRank0Values
    | InitOnMesh
    | LoadFromRank0
    | OffloadToCpu
    | Sync
    | MoveToDevice
)


@frozen
class Program:
    """A plan lowered for one model and world size (steps act on module FQNs), or for any model and
    world (`world_size` None; steps act on `Matching` targets)."""

    plan: ir.Plan
    world_size: int | None
    steps: tuple[Step, ...]

    @property
    def meshes(self) -> tuple[MakeMesh, ...]:
        return tuple(s for s in self.steps if isinstance(s, MakeMesh))
